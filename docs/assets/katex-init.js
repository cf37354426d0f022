// Renders the formulas pymdownx.arithmatex (generic mode) wraps in <span class="arithmatex"> / <div class="arithmatex">,
// with the KaTeX the site serves itself (docs/assets/katex/); also after Material's instant navigation.
(function () {
  function render() {
    document.querySelectorAll(".arithmatex").forEach(function (el) {
      renderMathInElement(el, {
        delimiters: [
          { left: "\\(", right: "\\)", display: false },
          { left: "\\[", right: "\\]", display: true }
        ],
        throwOnError: false
      });
    });
  }
  if (typeof document$ !== "undefined") {
    document$.subscribe(render);
  } else {
    document.addEventListener("DOMContentLoaded", render);
  }
})();
