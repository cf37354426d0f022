"""MkDocs hooks: the site links the committed results themselves, not copies.

Each study's report (``report.md``, ``report.png``, ``report.csv``) lives next to the runs it was made from (one
source: the files ``bitune report`` wrote and ``tests/test_results.py`` checks), and each benchmark's JSON in
``results/bench-cpu/``. ``on_files`` publishes them at the same paths under the site, so a page links
``results/<study>/report.md`` or ``results/bench-cpu/generate.json`` as it would in the repository: a study's
``report.md`` becomes a page of its own (outside the navigation, ``not_in_nav``; its wide tables in a
sideways-scrolling ``scroll-ok`` box), the other files are served as they are.

The docstrings use Sphinx's roles (``:meth:`merge```, ``:class:`~bitune.passes.Prefill```), which read well in
the source and in ``help()``; ``on_page_content`` shows them as plain code names (``~`` keeping the last part).
"""

from __future__ import annotations

import re
from pathlib import Path

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parent.parent
STUDIES = ("qwen2.5-bitune-recipe", "qwen2.5-arc-easy-csqa", "smollm2-csqa-piqa-siqa", "smollm2-arc-csqa", "gemma3-csqa")
STUDY_FILES = ("report.png", "report.csv")
"""A study's files served as they are, beside its report page."""
BENCH = "results/bench-cpu"


def _static(path: str, config) -> File:
    return File(path, str(ROOT), config["site_dir"], config["use_directory_urls"])


def report_page(study: str) -> str:
    """A study's ``report.md`` as a page: where it comes from, then the report, each table in a ``scroll-ok`` box
    (a report's tables are as wide as the study has methods)."""
    text = (ROOT / "results" / study / "report.md").read_text(encoding="utf-8")
    lines, out, in_table = text.splitlines(), [], False
    for line in lines:
        starts = line.startswith("|")
        if starts and not in_table:
            out += ['<div class="scroll-ok" markdown>', ""]
        elif not starts and in_table:
            out += ["", "</div>"]
        in_table = starts
        out.append(line)
    if in_table:
        out += ["", "</div>"]
    head, _, rest = "\n".join(out).partition("\n")
    note = (f"The report of `results/{study}/`, as `bitune report` wrote it from the runs' `eval.json` files "
            f"([report.csv](report.csv) holds its numbers); the reading is in [Results](../../results.md).")
    return f"{head}\n\n{note}\n{rest}\n"


def on_files(files: Files, config) -> Files:
    for study in STUDIES:
        folder = ROOT / "results" / study
        for name in STUDY_FILES:
            if (folder / name).exists():
                files.append(_static(f"results/{study}/{name}", config))
        if (folder / "report.md").exists():
            files.append(File.generated(config, f"results/{study}/report.md", content=report_page(study)))
        for figure in sorted(folder.rglob("training.png")):  # scripts/study_figures.py, one per task folder
            files.append(_static(figure.relative_to(ROOT).as_posix(), config))
        for table in sorted(folder.rglob("training.md")):  # its numbers, per run
            files.append(File.generated(config, table.relative_to(ROOT).as_posix(),
                                        content=table.read_text(encoding="utf-8")))
    for path in sorted((ROOT / BENCH).glob("*.json")):
        files.append(_static(f"{BENCH}/{path.name}", config))
    return files


ROLE = re.compile(r":(?:meth|func|class|mod|attr|data|exc|obj):<code>(~?)([^<]*)</code>")


def _code_name(match: re.Match) -> str:
    name = match.group(2).split(".")[-1] if match.group(1) else match.group(2)
    return f"<code>{name}</code>"


def on_page_content(html: str, page, config, files) -> str:
    return ROLE.sub(_code_name, html)
