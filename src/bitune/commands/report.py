"""``bitune report``: aggregate ``bitune eval`` results over seeds into the paper's table, accuracy intervals and
paired differences (:mod:`bitune.eval.report`), written as Markdown, CSV and a figure."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from ..errors import BituneError, did_you_mean
from ..eval.report import (
    EMBED_BEGIN,
    EMBED_END,
    SUMMARY_BEGIN,
    SUMMARY_END,
    analyse,
    build_markdown,
    build_summary,
    check_embed,
    embed_report,
    find_results,
    find_settings,
    load_records,
    plot_accuracy,
    print_report,
    results_below,
    title_of,
    write_report,
)
from ..files import check_named, check_output_dir, check_output_file, check_replaces_own, is_figure

HELP = "aggregate evaluation runs over seeds into the paper's table"
DEFAULT_BASELINES = "lora,pretrained"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.description = ("Aggregate eval JSONs (written by 'bitune eval' / 'bitune sweep') over seeds:\n"
                          "  - mean ± sample std (ddof=1) per method and task, in percent, and the average;\n"
                          "  - each accuracy with a 95% bootstrap interval over questions;\n"
                          "  - each method's paired per-question difference to the baselines (bootstrap\n"
                          "    interval, exact McNemar p per seed); n and --limit in every table;\n"
                          "  - a figure (report.png): accuracy per method with intervals, seeds as points.\n"
                          "A study's report.yaml (in the runs' folder or above it) names its methods' order\n"
                          "and the baselines bitune is matched against (default: by name; every method),\n"
                          "may add further [method, baseline] comparisons ('pairs') and may name the\n"
                          "folders ('runs') a report on the study's folder reads.\n"
                          "Example:\n  bitune report runs/sweep   (finds every eval.json below; writes there)")
    parser.add_argument("runs", nargs="+", metavar="RUN", help="eval JSON files or folders searched for eval.json")
    parser.add_argument("--metric", default="acc", choices=("acc", "acc_norm"),
                        help="multiple-choice metric to tabulate")
    parser.add_argument("--gsm8k-metric", default="exact_match_strict",
                        choices=("exact_match_strict", "exact_match_flexible"), help="GSM8K metric to tabulate")
    parser.add_argument("--output", metavar="DIR",
                        help="folder for report.md, report.csv and report.png (default: the one folder given)")
    parser.add_argument("--baselines", default=DEFAULT_BASELINES,
                        help="comma-separated methods every other method is compared with, question by question")
    parser.add_argument("--no-figure", action="store_true", help="do not write report.png")
    parser.add_argument("--embed", action="append", default=[], metavar="FILE.md",
                        help="also write the report into this Markdown file, between its 'bitune report: begin' "
                             "and 'end' marker lines (repeatable)")
    parser.add_argument("--embed-summary", action="append", default=[], metavar="FILE.md",
                        help="write a short form (accuracies with intervals next to the best trivial baseline, "
                             "Bitune minus each baseline with its two-level interval and Holm p) into this Markdown "
                             "file, between its 'bitune report summary: begin' and 'end' marker lines (repeatable)")



OUTPUTS = {"report.md": ("a report written by bitune report", "text",
                         # sweeps of bitune before the report verb wrote their report (a pinned study's tree still
                         # does) began with the table itself
                         lambda text: text.startswith(("# Report: ", "| method | seeds |"))),
           "report.csv": ("a table written by bitune report", "text", lambda text: text.startswith("method,seeds,")),
           "report.png": ("a figure written by bitune report", "bytes", is_figure)}
"""The files a report writes into its folder: what an earlier one of each is (the kind, how it is read, the test);
any other file of that name is the user's and is never replaced."""


def check_outputs(output: Path, what: str, figure: bool = True) -> list[Path]:
    """The report's files in ``output``, checked before any work: each writable and, where one exists, an earlier
    report's (:func:`bitune.files.check_replaces_own`). ``sweep`` calls it before its first run trains.

    Raises:
        BituneError: naming ``what`` (the option that gave the folder), the file and the problem.
    """
    files = []
    for name, (kind, form, earlier) in OUTPUTS.items():
        if name == "report.png" and not figure:
            continue
        files.append(check_output_file(output / name, what))
        check_replaces_own(output / name, what, kind, earlier, form=form)
    return files


def default_output(paths: list[str]) -> Path:
    """Next to the runs: the one folder given, or the folder of the one file; several inputs need ``--output``."""
    if len(paths) == 1:
        p = Path(paths[0])
        return p if p.is_dir() else p.parent
    raise BituneError("several inputs: name the folder for report.md/report.csv/report.png with --output")


def check_baselines(text: str, labels: set[str]) -> tuple[str, ...]:
    """The ``--baselines`` names; each one given (other than the default's) must be a method of the runs, else
    the comparisons with it would be missing from the report without a word.

    Raises:
        BituneError: the list is empty, or names a method no run has (with the closest one).
    """
    baselines = tuple(b.strip() for b in text.split(",") if b.strip())
    if not baselines:
        raise BituneError(f"--baselines is empty: name the methods to compare with, or leave it out for "
                          f"{DEFAULT_BASELINES}")
    if text != DEFAULT_BASELINES:
        unknown = [b for b in baselines if b not in labels]
        if unknown:
            raise BituneError(f"--baselines: no run is labelled {unknown[0]!r}{did_you_mean(unknown[0], labels)}; "
                              f"the runs' methods: {', '.join(sorted(labels))}")
    return baselines


def run(args: argparse.Namespace) -> int:
    output = (check_output_dir(args.output, "--output") if args.output is not None
              else check_output_dir(default_output(args.runs), "output folder"))
    records = load_records(find_results(args.runs))
    settings, settings_file = find_settings(args.runs)
    limits = {r["config"].get("limit") for r in records}
    if len(limits) > 1:
        print(f"bitune report: warning: runs used different --limit values {sorted(map(str, limits))}")
    labels = {r["label"] for r in records}
    if settings_file is not None:  # checked against the whole study's runs: a report of one of its folders reads
        study = load_records(results_below(settings_file.parent))
        settings.check_names(labels | {r["label"] for r in study}, settings_file)
    baselines = check_baselines(args.baselines, labels)
    analysis = analyse(records, args.metric, args.gsm8k_metric, baselines, settings)
    report, markdown, tasks = build_markdown(records, args.metric, args.gsm8k_metric, baselines, analysis)
    embeds = [(Path(check_named(d, "--embed")), markdown, EMBED_BEGIN, EMBED_END, "--embed") for d in args.embed]
    for d in args.embed_summary:  # the full report linked relative to the document that shows the summary
        document = Path(check_named(d, "--embed-summary"))
        full = Path(os.path.relpath(output / "report.md", document.resolve().parent)).as_posix()
        summary = build_summary(analysis, args.metric, args.gsm8k_metric, source=f"[{full}]({full})")
        embeds.append((document, summary, SUMMARY_BEGIN, SUMMARY_END, "--embed-summary"))
    figure = tasks and not args.no_figure
    written = {p.resolve() for p in check_outputs(output, "--output" if args.output is not None else
                                                  "the report's folder", figure)}  # every target checked first
    for document, _, begin, end, option in embeds:
        if document.expanduser().resolve() in written:
            raise BituneError(f"{option} {document} is a file the report itself writes into {output}: embed into "
                              "another document")
        check_embed(document, begin, end, option)
    if settings_file is not None:
        print(f"bitune report: method order and fair baselines from {settings_file}")
    print_report(report, f"{title_of(report.tasks, args.metric, args.gsm8k_metric)}, mean ± std over seeds, %")
    paired = markdown.find("\n## ", markdown.find("## ") + 3)
    if paired >= 0:
        print(markdown[paired + 1:])
    for u in analysis.unpaired:
        print(f"bitune report: warning: not compared, no training seed in common: {u.text()}", file=sys.stderr)
    md, cs = write_report(report, output, markdown)
    print(f"bitune report: wrote {md} and {cs}")
    for document, text, begin, end, option in embeds:
        embed_report(document, text, begin, end, option)
        print(f"bitune report: updated the {'summary' if option == '--embed-summary' else 'report'} in {document}")
    if figure:
        path = plot_accuracy(tasks, args.metric, output / "report.png")
        if path is not None:
            print(f"bitune report: wrote {path}")
    return 0
