"""MkDocs hooks: the Results page shows the committed study reports themselves, not copies.

Each study's ``report.md`` and ``report.png`` live next to the runs they were made from (one source: the files
``bitune report`` wrote and ``tests/test_results.py`` checks). ``on_files`` publishes each ``report.png`` at
``results/<study>/report.png``; ``on_page_markdown`` replaces a line ``<!-- report: <study> -->`` in a page with
that study's ``report.md``, its headings moved down two levels so they sit under the page's own.

The docstrings use Sphinx's roles (``:meth:`merge```, ``:class:`~bitune.passes.Prefill```), which read well in
the source and in ``help()``; ``on_page_content`` shows them as plain code names (``~`` keeping the last part).
"""

from __future__ import annotations

import re
from pathlib import Path

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parent.parent
STUDIES = ("smollm2-csqa-piqa-siqa", "smollm2-arc-csqa", "gemma3-csqa")


def on_files(files: Files, config) -> Files:
    for study in STUDIES:
        figure = ROOT / "results" / study / "report.png"
        if figure.exists():
            files.append(File(f"results/{study}/report.png", str(ROOT), config["site_dir"],
                              config["use_directory_urls"]))
    return files


MARKER = re.compile(r"^<!-- report: ([\w.-]+) -->$", re.MULTILINE)


def _report(match: re.Match) -> str:
    study = match.group(1)
    if study not in STUDIES:
        raise ValueError(f"docs: unknown study {study!r} in a report marker; known: {STUDIES}")
    text = (ROOT / "results" / study / "report.md").read_text(encoding="utf-8")
    return re.sub(r"^(#+) ", lambda h: "#" * min(len(h.group(1)) + 2, 6) + " ", text, flags=re.MULTILINE)


def on_page_markdown(markdown: str, page, config, files) -> str:
    return MARKER.sub(_report, markdown)


ROLE = re.compile(r":(?:meth|func|class|mod|attr|data|exc|obj):<code>(~?)([^<]*)</code>")


def _code_name(match: re.Match) -> str:
    name = match.group(2).split(".")[-1] if match.group(1) else match.group(2)
    return f"<code>{name}</code>"


def on_page_content(html: str, page, config, files) -> str:
    return ROLE.sub(_code_name, html)
