"""The documentation site stays true to the code: generated reference pages, a strict build, runnable examples.

* **Reference pages**: ``docs/reference/cli.md`` and ``docs/reference/settings.md`` equal what
  ``scripts/docs_reference.py`` generates from the code now, and the CLI page is what ``bitune ... --help`` prints.
* **Build**: ``mkdocs build --strict`` succeeds (no broken link, missing page or API docstring warning).
* **Doc blocks**: every fenced ``python`` and ``bash`` block of ``README.md`` and ``docs/**/*.md`` (but the
  generated ``docs/reference/cli.md``) runs, one test per block with the id ``path:line`` (the line of its
  opening fence). The info string says how (superfences + attr_list syntax; GitHub highlights by the first
  word):

  - ``python`` / ``bash``: run by default (tiny models) and under ``-m integration`` (real models);
  - ``bash {norun="reason"}``: never run; the reason is required and shown as the skip reason;
  - ``python {run="integration"}``: run only under ``-m integration`` (the real models);
  - ``.name`` beside them is a CSS class of the block (``{.wrap norun="..."}``: long lines wrap on the site).

  Any other attribute, an empty reason, both attributes, a brace glued to the language (superfences then
  renders no code block) or ``py``/``sh``/``shell`` (which would escape these tests) fails the block's test.
  Other languages (``json``, ``yaml``, ``text``, ``console``, none) are not run.

  The blocks of one file run in order in ONE working directory per file (a later block may use what an earlier
  one wrote, e.g. a checkpoint); a block selected alone (``-k``, ``--lf``) first runs the earlier blocks of its
  file. That directory holds copies of the repository's ``configs/``, ``examples/`` and ``scripts/``, a
  symlink to ``.venv/``, and ``results/`` as a symlink to a copy made once per session (``bitune report
  results/...`` writes next to the runs), so no block writes into the repository. Each block runs in its own process (python: ``python -c``
  executing the block's file; bash: ``bash -eo pipefail``) with ``.venv/bin`` first on ``PATH``,
  ``OMP_NUM_THREADS=1``, no stdin, and a timeout (:data:`BLOCK_TIMEOUT`); a failure shows the block, its exit
  status, stdout and stderr. Processes a block leaves in the background (``bitune serve ... &``) live until
  the last block of the file has run.

  By default the built-in model names are tiny random models: ``BITUNE_CACHE`` points at a temporary offline
  store whose ``models/<name>/`` folders hold a tiny Llama / Gemma 3 / Qwen2 with a character-level tokenizer
  (printable ASCII) and a chat template, each with a valid manifest of the store's own, and whose ``data/`` is
  the real cache's (datasets are downloaded once, as in normal use). No product hook is involved: this is the
  folder the store would have built. Under ``-m integration`` the blocks run again, ``run="integration"`` ones
  included, with the real cache (``BITUNE_CACHE`` as set, else ``~/.cache/bitune``).
* **Browser** (``-m integration``): the built site served over HTTP in headless Chromium at 1280 px: on every
  page images load, scripts and styles come from the site itself (KaTeX is vendored under ``docs/assets/``), the
  navigation holds every page of ``mkdocs.yml``, and no code block, table or formula is wider than its column;
  the method page's formulas are rendered, a click on the navigation navigates, and the search finds "mixing"
  and ``BituneTrainer``.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from helpers.scripts import load_script

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
BIN = ROOT / ".venv" / "bin" if (ROOT / ".venv" / "bin" / "python").exists() else Path(sys.executable).parent
PYTHON = BIN / "python"
BLOCK_TIMEOUT = {"tiny": 300, "integration": 1800}
"""Seconds a doc block may run, per mode; ``BITUNE_DOC_BLOCK_TIMEOUT`` overrides both."""
COPIED = ("configs", "examples", "scripts")
"""Repository folders copied into each file's working directory (a block may write into them)."""
LINKED = (".venv",)
"""Repository folders a block sees as symlinks (``.venv/bin/bitune`` as the README writes it)."""
RUN_LANGS = ("python", "bash")
ALIAS_LANGS = {"py": "python", "python3": "python", "sh": "bash", "shell": "bash", "zsh": "bash"}
"""Languages that would be highlighted as code but are not run: refused, so no example escapes the tests."""
TINY_MODELS = {"smollm2-135m": "llama", "gemma3-270m": "gemma3", "qwen2.5-0.5b": "qwen2"}
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}</s>\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant: {% endif %}")
CHROMIUM, CHROMEDRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")
CHROME_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--window-size=1280,1000")


def _mkdocs_env() -> dict[str, str]:
    return {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # Material's banner about its successor, on every build


# --- generated reference pages ------------------------------------------------------------------------------

def _generator():
    return load_script("docs_reference")


def test_reference_pages_current():
    pages = _generator().pages()
    problems = []
    for path, text in pages.items():
        rel = path.relative_to(ROOT)
        if not path.is_file():
            problems.append(f"{rel} is missing")
        elif path.read_text(encoding="utf-8") != text:
            diff = difflib.unified_diff(path.read_text(encoding="utf-8").splitlines(), text.splitlines(), f"{rel} (on disk)",
                                        f"{rel} (from the code)", lineterm="", n=1)
            problems.append("\n".join(list(diff)[:40]))
    assert not problems, ("the generated reference pages are stale: run python scripts/docs_reference.py\n"
                          + "\n".join(problems))


def test_cli_reference_is_the_real_help(monkeypatch, capsys):
    """Each section of cli.md is exactly what ``bitune ... --help`` prints at the same width."""
    from bitune import cli

    sections = _generator().help_sections()
    assert [c for c, _ in sections][:3] == ["bitune", "bitune quickstart", "bitune train"]
    assert {"bitune bench serve", "bitune plot attention"} <= {c for c, _ in sections}
    monkeypatch.setattr(sys, "argv", list(sys.argv))  # cli.main rewrites it
    monkeypatch.setenv("COLUMNS", str(_generator().HELP_WIDTH))
    for command, text in sections:
        with pytest.raises(SystemExit) as exit_:
            cli.main([*command.split()[1:], "--help"])
        assert exit_.value.code in (0, None)
        assert capsys.readouterr().out == text, f"{command} --help differs from the generated reference"


def test_cli_reference_ignores_terminal_and_machine(monkeypatch):
    """The pages do not depend on the terminal width or the machine's core count."""
    reference = _generator()
    expected = reference.cli_page()
    monkeypatch.setenv("COLUMNS", "47")
    monkeypatch.setattr(os, "cpu_count", lambda: 97)
    assert reference.cli_page() == expected
    assert os.environ["COLUMNS"] == "47"  # restored


# --- the site builds ----------------------------------------------------------------------------------------

def test_mkdocs_build_strict(tmp_path):
    proc = subprocess.run([str(PYTHON), "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True, env=_mkdocs_env(), timeout=900)
    assert proc.returncode == 0, f"mkdocs build --strict failed (exit {proc.returncode}):\n{proc.stdout}{proc.stderr}"
    site = tmp_path / "site"
    assert not (site / "hooks.py").exists()  # the build's own code is no page or file of the site
    assert "generate_texts" in (site / "reference" / "api" / "index.html").read_text(encoding="utf-8")


def test_what_the_getting_started_page_makes_in_a_clone_is_ignored_by_git():
    """A newcomer following the pages in a clone keeps a clean ``git status``: the built site, the example
    checkpoint and the chat file are ignored."""
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    made = ["site/index.html", "my-bitune/README.md", "my_chats.jsonl"]
    proc = subprocess.run(["git", "check-ignore", "--no-index", *made], cwd=ROOT, capture_output=True, text=True)
    assert sorted(proc.stdout.split()) == sorted(made)


def test_every_page_opens_with_a_summary():
    """A reader learns what a page is for before its first section: a paragraph between the title and the first
    ``##`` heading (not only a code block or a table)."""
    missing = []
    for page in sorted(DOCS.rglob("*.md")):
        if page.relative_to(DOCS).parts[0] == "assets":
            continue
        text = re.sub(r"<!--.*?-->", "", page.read_text(encoding="utf-8"), flags=re.S).lstrip()
        head = re.match(r"# [^\n]*\n(.*?)(?=^## |\Z)", text, re.S | re.M)
        body = re.sub(r"```.*?```", "", head.group(1), flags=re.S) if head else ""
        if not [p for p in body.split("\n\n") if p.strip() and not p.strip().startswith(("|", "!["))]:
            missing.append(str(page.relative_to(ROOT)))
    assert not missing, f"pages without an opening summary: {missing}"


# --- doc blocks ---------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Block:
    """One fenced code block to run (or refuse)."""

    path: str
    """File, relative to the repository root."""
    line: int
    """1-based line of the opening fence."""
    lang: str
    code: str
    mode: str
    """``run`` (default), ``norun`` or ``integration`` (only under ``-m integration``)."""
    reason: str = ""
    """Why a ``norun`` block is not run."""
    error: str = ""
    """What is wrong with the info string, if anything (the block's test then fails)."""

    @property
    def id(self) -> str:
        return f"{self.path}:{self.line}"


FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<info>.*)$")
INFO = re.compile(r"^(?P<lang>[\w#.+-]*)(?:[ \t]+\{(?P<attrs>[^\n]*)\})?[ \t]*$")
ATTR = re.compile(r"""\s*(?P<key>[^\s=]+)(?:=(?:"(?P<dq>[^"]*)"|'(?P<sq>[^']*)'|(?P<bare>[^\s"']+)))?\s*""")


def _info(info: str) -> tuple[str, str, str, str]:
    """``(lang, mode, reason, error)`` of a fence's info string (see the module docstring for the grammar)."""
    first = re.match(r"[\w#.+-]*", info).group()
    match = INFO.match(info)
    lang = first.lower()
    if lang in ALIAS_LANGS:
        return lang, "run", "", (f"```{first}: write ```{ALIAS_LANGS[lang]} so the block is run by the tests "
                                 f"(or mark it {{norun=\"reason\"}})")
    if not first and re.match(r"\{[^}]*\.(python|bash|py|sh|shell)\b", info):
        return lang, "run", "", f"info string {info!r}: write ```python or ```bash first, then the attributes"
    if lang not in RUN_LANGS:
        return lang, "ignored", "", ""
    if match is None:
        return lang, "run", "", (f"info string {info!r} is not one superfences reads as a {lang} block; write "
                                 f"```{lang}, ```{lang} {{norun=\"reason\"}} or ```{lang} {{run=\"integration\"}}")
    attrs: dict[str, str | None] = {}
    text = match.group("attrs")
    pos = 0
    while text is not None and pos < len(text):
        m = ATTR.match(text, pos)
        if m is None or m.end() == pos:
            return lang, "run", "", f"cannot read the attributes {{{text}}}"
        value = next((v for v in (m.group("dq"), m.group("sq"), m.group("bare")) if v is not None), None)
        attrs[m.group("key")] = value
        pos = m.end()
    unknown = sorted(k for k in set(attrs) - {"norun", "run"} if not k.startswith("."))  # .name: a CSS class
    if unknown:
        return lang, "run", "", (f"unknown attribute(s) {unknown} in {{{text}}}: only norun=\"reason\" or "
                                 "run=\"integration\"")
    if "norun" in attrs and "run" in attrs:
        return lang, "run", "", "norun and run together: choose one"
    if "norun" in attrs:
        reason = (attrs["norun"] or "").strip()
        if not reason:
            return lang, "run", "", 'norun needs a reason: {norun="why this block is not run"}'
        return lang, "norun", reason, ""
    if "run" in attrs:
        if attrs["run"] != "integration":
            return lang, "run", "", f'run={attrs["run"]!r}: the only value is run="integration"'
        return lang, "integration", "", ""
    return lang, "run", "", ""


def parse_blocks(text: str, path: str) -> list[Block]:
    """The python and bash blocks of a Markdown text, in order (fences nested in lists or admonitions included;
    a fence inside another fence is content)."""
    blocks = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if m is None:
            i += 1
            continue
        indent, fence, info = len(m.group("indent").expandtabs()), m.group("fence"), m.group("info").strip()
        close = re.compile(rf"^[ \t]*{re.escape(fence[0])}{{{len(fence)},}}[ \t]*$")
        body = []
        j = i + 1
        while j < len(lines) and not close.match(lines[j]):
            body.append(lines[j][indent:] if lines[j][:indent].strip() == "" else lines[j].lstrip())
            j += 1
        if fence[0] == "`" and "`" in info:  # not a fence (inline code at a line start)
            i += 1
            continue
        lang, mode, reason, error = _info(info)
        if mode != "ignored":
            blocks.append(Block(path, i + 1, lang, "\n".join(_snippets(body)) + "\n", mode, reason, error))
        i = j + 1
    return blocks


SNIPPET = re.compile(r"""^\s*-+8<-+\s+(?P<q>["'])(?P<path>[^"']+)(?P=q)\s*$""")


def _snippets(lines: list[str]) -> list[str]:
    """The block as the site shows it: a ``--8<-- "path"`` line (pymdownx.snippets, base path: the repository
    root) replaced by that file's lines."""
    out = []
    for line in lines:
        m = SNIPPET.match(line)
        path = ROOT / m.group("path") if m else None
        out += path.read_text(encoding="utf-8").splitlines() if path and path.is_file() else [line]
    return out


def doc_files() -> list[Path]:
    files = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    return [f for f in files if f.is_file() and f != ROOT / "docs" / "reference" / "cli.md"]


def collect_blocks() -> dict[str, list[Block]]:
    """Every file's runnable-language blocks, by file (relative path)."""
    return {str(f.relative_to(ROOT)): parse_blocks(f.read_text(encoding="utf-8"), str(f.relative_to(ROOT)))
            for f in doc_files()}


BLOCKS = collect_blocks()


def _params(integration: bool) -> list:
    params = []
    for blocks in BLOCKS.values():
        for b in blocks:
            marks = []
            if not b.error and b.mode == "norun":
                marks.append(pytest.mark.skip(reason=f"{b.id} norun: {b.reason}"))
            elif not b.error and b.mode == "integration" and not integration:
                marks.append(pytest.mark.skip(reason=f'{b.id} run="integration": runs under -m integration only'))
            params.append(pytest.param(b, id=b.id, marks=marks))
    return params


def _runs_in(block: Block, mode: str) -> bool:
    return not block.error and (block.mode == "run" or (block.mode == "integration" and mode == "integration"))


@dataclasses.dataclass
class FileRun:
    """The state of one file's blocks in one mode: its working directory and each block's outcome."""

    workdir: Path
    scratch: Path
    outcomes: dict[int, str] = dataclasses.field(default_factory=dict)
    """Block line -> ``passed`` or the failure text."""
    groups: list[int] = dataclasses.field(default_factory=list)
    """Process groups of the blocks run so far (killed after the file's last block)."""


class DocRunner:
    """Runs doc blocks per file and mode, in order, in one working directory per file."""

    def __init__(self, factory: pytest.TempPathFactory):
        self.factory = factory
        self.files: dict[tuple[str, str], FileRun] = {}
        self._results: Path | None = None
        self._tiny_cache: Path | None = None

    def results_copy(self) -> Path:
        if self._results is None:
            self._results = self.factory.mktemp("docs-results") / "results"
            shutil.copytree(ROOT / "results", self._results, symlinks=True)
        return self._results

    def tiny_cache(self) -> Path:
        if self._tiny_cache is None:
            self._tiny_cache = build_tiny_cache(self.factory.mktemp("docs-bitune-cache"))
        return self._tiny_cache

    def env(self, mode: str) -> dict[str, str]:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
               "MPLBACKEND": "Agg", "PYTHONUNBUFFERED": "1"}
        if mode == "tiny":
            env["BITUNE_CACHE"] = str(self.tiny_cache())
        return env

    def file_run(self, path: str, mode: str) -> FileRun:
        key = (path, mode)
        if key not in self.files:
            slug = re.sub(r"[^\w.-]", "_", path)
            workdir = self.factory.mktemp(f"doc-{mode}-{slug}", numbered=True)
            for name in COPIED:
                if (ROOT / name).exists():
                    shutil.copytree(ROOT / name, workdir / name, symlinks=True,
                                    ignore=shutil.ignore_patterns("__pycache__"))
            for name in LINKED:
                if (ROOT / name).exists():
                    (workdir / name).symlink_to(ROOT / name)
            (workdir / "results").symlink_to(self.results_copy())
            self.files[key] = FileRun(workdir, self.factory.mktemp(f"doc-{mode}-{slug}-blocks"))
        return self.files[key]

    def run(self, block: Block, mode: str) -> None:
        """Run ``block`` (after the earlier blocks of its file, if they have not run); fail with its output."""
        if block.error:
            pytest.fail(f"{block.id}: {block.error}", pytrace=False)
        state = self.file_run(block.path, mode)
        runnable = [b for b in BLOCKS[block.path] if _runs_in(b, mode)]
        for earlier in runnable[:runnable.index(block)]:
            if earlier.line not in state.outcomes:
                self._run_one(earlier, mode, state)
            if state.outcomes[earlier.line] != "passed":
                pytest.skip(f"an earlier block of {block.path} failed ({earlier.id}); this one depends on it")
        self._run_one(block, mode, state)
        if block == runnable[-1] or state.outcomes[block.line] != "passed":
            self.stop(state)
        if state.outcomes[block.line] != "passed":
            pytest.fail(state.outcomes[block.line], pytrace=False)

    def _run_one(self, block: Block, mode: str, state: FileRun) -> None:
        stem = f"L{block.line}"
        script = state.scratch / f"{stem}.{'py' if block.lang == 'python' else 'sh'}"
        script.write_text(block.code, encoding="utf-8")
        if block.lang == "python":
            cmd = [str(PYTHON), "-c", f"exec(compile(open({str(script)!r}, encoding='utf-8').read(), "
                                      f"{str(script)!r}, 'exec'))"]
        else:
            cmd = ["bash", "-eo", "pipefail", str(script)]
        out, err = state.scratch / f"{stem}.out", state.scratch / f"{stem}.err"
        timeout = float(os.environ.get("BITUNE_DOC_BLOCK_TIMEOUT") or BLOCK_TIMEOUT[mode])
        start = time.monotonic()
        with out.open("wb") as fout, err.open("wb") as ferr:
            proc = subprocess.Popen(cmd, cwd=state.workdir, env=self.env(mode), stdin=subprocess.DEVNULL,
                                    stdout=fout, stderr=ferr, start_new_session=True)
            state.groups.append(proc.pid)
            try:
                code = proc.wait(timeout=timeout)
                status = f"exit status {code}"
            except subprocess.TimeoutExpired:
                _kill_group(proc.pid)
                proc.wait()
                code, status = -1, f"timed out after {timeout:.0f} s"
        took = time.monotonic() - start
        if code == 0:
            state.outcomes[block.line] = "passed"
            return
        state.outcomes[block.line] = (
            f"{block.id}: the {block.lang} block failed ({status}, {took:.0f} s) in {state.workdir} "
            f"({mode} models)\n--- block ---\n{block.code}--- stdout ---\n{_tail(out)}\n--- stderr ---\n{_tail(err)}")

    def stop(self, state: FileRun) -> None:
        for group in state.groups:
            _kill_group(group)
        state.groups.clear()

    def close(self) -> None:
        for state in self.files.values():
            self.stop(state)


def _tail(path: Path, limit: int = 8000) -> str:
    text = path.read_text(encoding="utf-8", errors="replace")
    return text if len(text) <= limit else f"[... {len(text) - limit} characters cut ...]\n{text[-limit:]}"


def _kill_group(pgid: int) -> None:
    """End a block's process group (what it left in the background too): TERM, then KILL after 5 s."""
    for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 2.0)):
        if not _group_alive(pgid):
            return
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and _group_alive(pgid):
            time.sleep(0.1)


def _stat(path: Path) -> list[str] | None:
    """The fields of a ``/proc/PID/stat`` after the command name: state, ppid, process group, ..."""
    try:
        return path.read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _group_alive(pgid: int) -> bool:
    """Whether a process of group ``pgid`` still runs (a zombie does not count: this container's init may never
    reap the orphans it adopts)."""
    if not Path("/proc").is_dir():
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        return True
    return any((f := _stat(stat)) is not None and int(f[2]) == pgid and f[0] != "Z"
               for stat in Path("/proc").glob("[0-9]*/stat"))


def tiny_tokenizer():
    """Character-level: <pad> </s> <s> <unk>, then printable ASCII, newline and tab; with a chat template."""
    import string

    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    chars = sorted(set(string.printable) - set("\r\x0b\x0c"))
    vocab = {"<pad>": 0, "</s>": 1, "<s>": 2, "<unk>": 3, **{c: 4 + i for i, c in enumerate(chars)}}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", bos_token="<s>",
                                        unk_token="<unk>")
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def tiny_model(arch: str, vocab_size: int):
    """A tiny random causal LM of ``arch``; rotary positions, so a long context costs nothing."""
    import torch
    from transformers import AutoModelForCausalLM, Gemma3TextConfig, LlamaConfig, Qwen2Config

    common = dict(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, eos_token_id=1, bos_token_id=2,
                  max_position_embeddings=4096)
    config = {"llama": lambda: LlamaConfig(**common),
              "qwen2": lambda: Qwen2Config(**common),
              "gemma3": lambda: Gemma3TextConfig(head_dim=8, sliding_window=4,
                                                 layer_types=["sliding_attention", "full_attention"], **common)}[arch]()
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def build_tiny_cache(root: Path) -> Path:
    """An offline store under ``root`` whose built-in models are tiny, each folder with the store's manifest,
    and whose ``data/`` is the real cache's."""
    from bitune.store import cache_root, verify_manifest, write_manifest

    real_data = cache_root() / "data"
    real_data.mkdir(parents=True, exist_ok=True)
    (root / "data").symlink_to(real_data)
    tokenizer = tiny_tokenizer()
    for name, arch in TINY_MODELS.items():
        folder = root / "models" / name
        tiny_model(arch, len(tokenizer)).save_pretrained(folder, safe_serialization=True)
        tokenizer.save_pretrained(folder)
        write_manifest(folder, name=name, note=f"a tiny random {arch} for the documentation tests")
        verify_manifest(folder)
    return root


@pytest.fixture(scope="session")
def doc_runner(tmp_path_factory):
    runner = DocRunner(tmp_path_factory)
    yield runner
    runner.close()


@pytest.mark.slow
@pytest.mark.parametrize("block", _params(integration=False))
def test_doc_block(block: Block, doc_runner: DocRunner):
    """A README/docs block runs with the built-in models as tiny random ones."""
    doc_runner.run(block, "tiny")


@pytest.mark.slow
def test_getting_started_python_writes_a_card_that_names_its_base_model(doc_runner: DocRunner):
    """The "From Python" example's checkpoint card gives the base model and its licence, not placeholders."""
    path = "docs/getting-started.md"
    block = next(b for b in BLOCKS[path] if "save_pretrained" in b.code)
    doc_runner.run(block, "tiny")
    card = (doc_runner.file_run(path, "tiny").workdir / "my-bitune" / "README.md").read_text(encoding="utf-8")
    assert "base_model: HuggingFaceTB/SmolLM2-135M-Instruct" in card and "license: apache-2.0" in card
    assert "BASE_MODEL" not in card and "license: other" not in card


@pytest.mark.integration
@pytest.mark.parametrize("block", _params(integration=True))
def test_doc_block_integration(block: Block, doc_runner: DocRunner):
    """A README/docs block runs with the real built-in models (``run="integration"`` blocks included)."""
    doc_runner.run(block, "integration")


def test_block_grammar():
    """The info-string grammar, on a scratch page (no block is run)."""
    page = "\n".join([
        "```python", "print(1)", "```",
        '```bash {norun="needs a GPU"}', "nvidia-smi", "```",
        '```python {run="integration"}', "x = 1", "```",
        "```json", "{}", "```", "```", "plain", "```", "```console", "$ ls", "```",
        '```bash {norun=""}', "a", "```",
        '```bash {norun="x" color="red"}', "b", "```",
        '```bash{norun="glued"}', "c", "```",
        "```sh", "d", "```",
        '```python {run="always"}', "e", "```",
        "````markdown", "```python", "not a block: inside another fence", "```", "````",
        "- a list item:", "", "    ```bash", "    echo indented", "    ```",
    ])
    blocks = parse_blocks(page, "page.md")
    got = [(b.line, b.lang, b.mode, b.reason, bool(b.error)) for b in blocks]
    assert got == [(1, "python", "run", "", False), (4, "bash", "norun", "needs a GPU", False),
                   (7, "python", "integration", "", False), (19, "bash", "run", "", True),
                   (22, "bash", "run", "", True), (25, "bash", "run", "", True), (28, "sh", "run", "", True),
                   (31, "python", "run", "", True), (41, "bash", "run", "", False)]
    assert blocks[-1].code == "echo indented\n"
    assert "unknown attribute" in blocks[4].error and "reason" in blocks[3].error


def test_doc_runner_shares_a_folder_per_file(tmp_path_factory, monkeypatch):
    """Blocks of a file share one working directory and run in order; a failure shows its output; a block
    selected alone runs its file's earlier blocks first. Scratch page, bash only (no model)."""
    page = "\n".join(["```bash", "echo made > made.txt; test -f configs/quickstart.yaml; test -L .venv; test -d results/bench-cpu", "```",
                      "```python", "print(open('made.txt').read().strip() + ' again')", "```",
                      "```bash", "echo to-stderr >&2; false", "```",
                      "```bash", "echo never", "```"])
    blocks = parse_blocks(page, "scratch.md")
    monkeypatch.setitem(BLOCKS, "scratch.md", blocks)
    runner = DocRunner(tmp_path_factory)
    monkeypatch.setattr(runner, "results_copy", lambda: ROOT / "results")  # read only here: no copy needed
    try:
        runner.run(blocks[1], "integration")  # runs blocks[0] first
        state = runner.files[("scratch.md", "integration")]
        assert state.outcomes == {1: "passed", 4: "passed"}
        assert (state.workdir / "made.txt").read_text() == "made\n"
        assert (state.scratch / "L4.out").read_text() == "made again\n"
        with pytest.raises(pytest.fail.Exception) as failed:
            runner.run(blocks[2], "integration")
        assert "scratch.md:7" in str(failed.value) and "to-stderr" in str(failed.value)
        assert "exit status 1" in str(failed.value)
        with pytest.raises(pytest.skip.Exception, match="scratch.md:7"):
            runner.run(blocks[3], "integration")
    finally:
        runner.close()


def test_doc_runner_background_and_timeout(tmp_path_factory, monkeypatch):
    """A process a block leaves in the background lives for the file's later blocks and ends after its last;
    a block past its timeout fails with its output and leaves nothing running."""
    page = "\n".join(["```bash", "sleep 120 & echo $! > server.pid", "```",
                      "```bash", "kill -0 $(cat server.pid)", "```"])
    slow = "\n".join(["```bash", "sleep 120 & echo $! > sleeper.pid; echo waiting; sleep 120", "```"])
    monkeypatch.setitem(BLOCKS, "bg.md", parse_blocks(page, "bg.md"))
    monkeypatch.setitem(BLOCKS, "slow.md", parse_blocks(slow, "slow.md"))
    if not Path("/proc").is_dir():
        pytest.skip("reads process states from /proc")
    runner = DocRunner(tmp_path_factory)
    monkeypatch.setattr(runner, "results_copy", lambda: ROOT / "results")

    def alive(pid_file: Path) -> bool:
        fields = _stat(Path("/proc") / pid_file.read_text().strip() / "stat")
        return fields is not None and fields[0] != "Z"

    try:
        runner.run(BLOCKS["bg.md"][0], "integration")
        workdir = runner.files[("bg.md", "integration")].workdir
        assert alive(workdir / "server.pid")
        runner.run(BLOCKS["bg.md"][1], "integration")  # the file's last block: its background ends after it
        assert not alive(workdir / "server.pid")
        monkeypatch.setenv("BITUNE_DOC_BLOCK_TIMEOUT", "2")
        with pytest.raises(pytest.fail.Exception, match=r"(?s)timed out after 2 s.*waiting"):
            runner.run(BLOCKS["slow.md"][0], "integration")
        assert not alive(runner.files[("slow.md", "integration")].workdir / "sleeper.pid")
    finally:
        runner.close()


def test_tiny_cache_serves_builtin_names(tmp_path_factory, monkeypatch):
    """The tiny store resolves the built-in names through the product's own code path (manifest checked)."""
    from bitune.hub import load_model

    cache = build_tiny_cache(tmp_path_factory.mktemp("tiny-cache"))
    monkeypatch.setenv("BITUNE_CACHE", str(cache))
    model, tokenizer = load_model("smollm2-135m")
    assert model.config.hidden_size == 32 and tokenizer.padding_side == "left"
    assert tokenizer.decode(tokenizer("Paris? {x}").input_ids) == "Paris? {x}"
    assert "assistant: " in tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                                          add_generation_prompt=True)


# --- the site in a browser ----------------------------------------------------------------------------------

def _nav_titles(nav) -> list[str]:
    """Page titles of an mkdocs ``nav`` (sections' own titles are labels, not links)."""
    titles = []
    for item in nav:
        for title, value in (item.items() if isinstance(item, dict) else [(None, item)]):
            if isinstance(value, list):
                titles += _nav_titles(value)
            elif title is not None:
                titles.append(title)
    return titles


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


VIEWPORT = (1280, 1000)
"""The browser's viewport (CSS px): a laptop screen, where Material shows the navigation and the table of contents."""
ALLOWED_SCROLL = "scroll-ok"
"""A class (``<div class="scroll-ok" markdown>``) around a table that may scroll sideways on purpose."""
OVERFLOW_JS = """
const out = [], counts = {code: 0, table: 0, math: 0, unmeasured: 0};
const where = el => (el.closest('[id]') || {}).id || '';
const text = el => (el.textContent || '').trim().split('\\n')[0].slice(0, 80);
for (const code of document.querySelectorAll('.md-content pre > code')) {
  const pre = code.parentElement, box = pre.parentElement;
  if (!code.clientWidth) { counts.unmeasured++; continue; }
  counts.code++;
  if (code.scrollWidth > code.clientWidth + 1 || pre.scrollWidth > box.clientWidth + 1)
    out.push(['code block', code.scrollWidth, Math.min(code.clientWidth, box.clientWidth), where(code), text(code)]);
}
for (const table of document.querySelectorAll('.md-content table')) {
  if (!table.clientWidth) { counts.unmeasured++; continue; }
  counts.table++;
  if (table.closest('.ALLOWED')) continue;
  const box = table.closest('.md-typeset__scrollwrap') || table.parentElement;
  if (table.scrollWidth > box.clientWidth + 1)
    out.push(['table', table.scrollWidth, box.clientWidth, where(table), text(table)]);
}
for (const math of document.querySelectorAll('.md-content .katex-display')) {
  counts.math++;
  if (math.scrollWidth > math.clientWidth + 1)
    out.push(['formula', math.scrollWidth, math.clientWidth, where(math), text(math)]);
}
return [out, counts];
""".replace("ALLOWED", ALLOWED_SCROLL)


def site_pages(site: Path) -> list[str]:
    """Every page of a built site, as the path a browser asks for (``""``, ``method/``, ...)."""
    pages = []
    for index in sorted(site.rglob("index.html")):
        rel = index.parent.relative_to(site).as_posix()
        if not rel.startswith(("assets", "search")):
            pages.append("" if rel == "." else rel + "/")
    return pages


def check_site_in_browser(site: Path, titles: list[str], shots: Path, pages: list[str] | None = None,
                          click: str = "The method", words: tuple[str, ...] = ("mixing", "BituneTrainer"),
                          math_page: str = "method/") -> dict[str, dict[str, int]]:
    """Serve ``site`` on a free port and check it in headless Chromium at :data:`VIEWPORT`; screenshots go to
    ``shots``. On every page (default: all of them): images load, scripts and styles come from the site itself,
    the navigation holds ``titles`` and its links are served, and no code block, table or formula is wider than
    the column that holds it (a table inside :data:`ALLOWED_SCROLL` excepted). Then formulas on ``math_page`` are
    rendered by KaTeX, a click on ``click`` navigates, and the search finds each of ``words``.

    Returns:
        What was measured per page: ``{page: {"code": n, "table": n, "math": n, "unmeasured": n}}``.
    """
    from selenium import webdriver
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    pages = site_pages(site) if pages is None else pages
    port = _free_port()
    server = subprocess.Popen([str(PYTHON), "-m", "http.server", "--bind", "127.0.0.1", str(port), "--directory",
                               str(site)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}/"
    driver = None
    measured: dict[str, dict[str, int]] = {}
    try:
        for _ in range(100):
            try:
                urllib.request.urlopen(base, timeout=1).close()
                break
            except OSError:
                time.sleep(0.1)
        options = webdriver.ChromeOptions()
        options.binary_location = str(CHROMIUM)
        for flag in (*CHROME_FLAGS, f"--user-data-dir={shots.parent / 'chromium-profile'}"):
            options.add_argument(flag)
        driver = webdriver.Chrome(options=options, service=Service(executable_path=str(CHROMEDRIVER)))
        driver.set_page_load_timeout(60)
        width, height = VIEWPORT
        driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride",
                               {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False})
        wait = WebDriverWait(driver, 30)
        shots.mkdir(parents=True, exist_ok=True)
        overflows = []
        for page in pages:
            driver.get(base + page)
            wait.until(lambda d: d.execute_script("return document.readyState") == "complete")
            assert driver.execute_script("return window.innerWidth") == width
            wait.until(lambda d: d.execute_script("return Array.from(document.images).every(i => i.complete)"))
            broken = driver.execute_script(
                "return Array.from(document.images).filter(i => !(i.naturalWidth > 0)).map(i => i.src)")
            assert not broken, f"{page}: images that did not load: {broken}"
            foreign = driver.execute_script(
                "return [...document.querySelectorAll('script[src], link[rel=stylesheet]')]"
                ".map(e => e.src || e.href).filter(u => !u.startsWith(arguments[0]))", base)
            assert not foreign, f"{page}: scripts or styles from outside the site (offline they fail): {foreign}"
            links = driver.find_elements(By.CSS_SELECTOR, "nav.md-nav--primary a.md-nav__link")
            texts = {" ".join((a.get_attribute("textContent") or "").split()) for a in links}
            missing = [t for t in titles if t not in texts]
            assert not missing, f"{page}: navigation has no link for {missing} (has {sorted(texts)})"
            for a in links:  # every navigation target is served
                href = a.get_attribute("href")
                if href and href.startswith(base) and "#" not in href:
                    urllib.request.urlopen(href, timeout=10).close()
            found, counts = driver.execute_script(OVERFLOW_JS)
            measured[page or "index"] = counts
            overflows += [f"{page or 'index'}: {kind} {wide} px in {room} px (near #{anchor}): {first!r}"
                          for kind, wide, room, anchor, first in found]
            driver.save_screenshot(str(shots / ((page.strip("/").replace("/", "_") or "index") + ".png")))
        assert not overflows, (f"{len(overflows)} block(s) cut off at {width} px (wrap the line, narrow the "
                               "table, or put a table that may scroll in <div class=\"scroll-ok\" markdown>):\n"
                               + "\n".join(overflows))
        if math_page is not None:
            driver.get(base + math_page)
            wait.until(lambda d: d.execute_script("return document.querySelectorAll('.arithmatex .katex').length"))
            raw = driver.execute_script("return [...document.querySelectorAll('.arithmatex')]"
                                        ".filter(e => !e.querySelector('.katex')).map(e => e.textContent)")
            assert not raw, f"{math_page}: formulas KaTeX did not render: {raw}"
        driver.get(base + "index.html")
        wait.until(lambda d: d.execute_script("return document.readyState") == "complete")
        target = next(a for a in driver.find_elements(By.CSS_SELECTOR, "nav.md-nav--primary a.md-nav__link")
                      if " ".join((a.get_attribute("textContent") or "").split()) == click and a.is_displayed())
        href = target.get_attribute("href")
        target.click()
        wait.until(lambda d: d.current_url == href)
        assert driver.find_element(By.TAG_NAME, "h1").text, f"clicking {click!r} gave a page without a title"
        driver.save_screenshot(str(shots / "clicked.png"))
        for word in words:
            box = driver.find_element(By.CSS_SELECTOR, "input.md-search__input")
            if not box.is_displayed():
                driver.find_element(By.CSS_SELECTOR, "label.md-header__button[for='__search']").click()
            box.click()
            box.clear()
            box.send_keys(word)
            results = "ol.md-search-result__list > li"
            try:
                wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, results))
            except TimeoutException:
                driver.save_screenshot(str(shots / f"search-{word}.png"))
                raise AssertionError(f"searching {word!r} showed no results within 30 s (screenshot: {shots})") \
                    from None
            found = driver.find_elements(By.CSS_SELECTOR, results)
            assert word.lower() in found[0].get_attribute("textContent").lower(), \
                f"first search result for {word!r}: {found[0].get_attribute('textContent')!r}"
            driver.save_screenshot(str(shots / f"search-{word}.png"))
        return measured
    finally:
        if driver is not None:
            driver.quit()
        server.terminate()
        server.wait(timeout=10)


@pytest.mark.integration
def test_site_in_browser(tmp_path):
    """The built site in headless Chromium at 1280 px: on every page images load, nothing comes from outside the
    site, navigation is complete and works, and no code block or table is cut off; formulas render; search finds."""
    import yaml

    pytest.importorskip("selenium", reason="pip install -e '.[docs]'")
    if not (CHROMIUM.exists() and CHROMEDRIVER.exists()):
        pytest.skip("needs Debian's Chromium: apt-get install -y chromium chromium-driver")
    site = tmp_path / "site"
    proc = subprocess.run([str(PYTHON), "-m", "mkdocs", "build", "--no-strict", "--site-dir", str(site)], cwd=ROOT,
                          capture_output=True, text=True, env=_mkdocs_env(), timeout=900)
    assert proc.returncode == 0, f"mkdocs build failed:\n{proc.stdout}{proc.stderr}"
    titles = _nav_titles(yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"])
    shots = tmp_path / "screenshots"
    print(f"screenshots: {shots}")
    measured = check_site_in_browser(site, titles, shots)
    print(f"{len(measured)} pages at {VIEWPORT[0]} px: "
          + ", ".join(f"{k} {sum(m[k] for m in measured.values())}" for k in ("code", "table", "math", "unmeasured")))
    assert len(measured) >= len(titles), f"pages checked: {sorted(measured)}; the navigation has {titles}"
    assert all(m["unmeasured"] == 0 for m in measured.values()), f"blocks with no width (hidden?): {measured}"
