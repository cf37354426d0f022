"""``bitune report``: aggregate ``bitune eval`` results over seeds into a table shaped like the paper's Table 1.

Rows are methods (the ``label`` of each eval JSON), columns the tasks and their average. A cell is
``mean ± std`` in percent over the runs (seeds) of that method. The std is the sample standard deviation
(ddof=1, the unbiased variance estimate over seeds, as numpy's ``std(ddof=1)``); with one run it is undefined and
shown as ``-``. The average column averages the tasks within each run first, then takes the mean and std of those
per-run averages over seeds, so its std reflects seed-to-seed variation of the average itself.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import BituneError
from ..files import write_text_atomic

HELP = "aggregate evaluation runs over seeds into the paper's table"
TASK_ORDER = ("piqa", "arc_challenge", "arc_easy", "csqa", "siqa", "mmlu", "gsm8k")
TASK_TITLES = {"piqa": "PIQA", "arc_challenge": "ARC-C", "arc_easy": "ARC-E", "csqa": "CSQA", "siqa": "SIQA",
               "mmlu": "MMLU", "gsm8k": "GSM8K"}
AVERAGE = "avg"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.description = ("Aggregate eval JSONs (written by 'bitune eval') over seeds: mean ± sample std (ddof=1) "
                          "per method and task, in percent, plus the average over tasks. Example:\n"
                          "  bitune report runs/sweep   (finds every eval.json below)")
    parser.add_argument("runs", nargs="+", metavar="RUN", help="eval JSON files or folders searched for eval.json")
    parser.add_argument("--metric", default="acc", choices=("acc", "acc_norm"),
                        help="multiple-choice metric to tabulate")
    parser.add_argument("--gsm8k-metric", default="exact_match_strict",
                        choices=("exact_match_strict", "exact_match_flexible"), help="GSM8K metric to tabulate")
    parser.add_argument("--output", metavar="DIR", default=".", help="folder for report.md and report.csv")


@dataclass
class Cell:
    """One method x task entry."""

    values: list[float] = field(default_factory=list)
    """The metric of each run (seed), as a fraction."""

    @property
    def mean(self) -> float:
        return sum(self.values) / len(self.values)

    @property
    def std(self) -> float:
        """Sample standard deviation (ddof=1); nan for a single run."""
        n = len(self.values)
        if n < 2:
            return math.nan
        m = self.mean
        return math.sqrt(sum((v - m) ** 2 for v in self.values) / (n - 1))

    def text(self) -> str:
        if not self.values:
            return ""
        std = self.std
        return f"{100 * self.mean:.2f} ± {100 * std:.2f}" if not math.isnan(std) else f"{100 * self.mean:.2f} ± -"


@dataclass
class Report:
    """The aggregated table: ``cells[method][task]``, tasks in column order, ``avg`` last."""

    tasks: list[str]
    cells: dict[str, dict[str, Cell]]
    runs: dict[str, int]
    """Number of runs (seeds) per method."""

    def rows(self) -> list[list[str]]:
        return [[m, str(self.runs[m]), *(self.cells[m][t].text() for t in [*self.tasks, AVERAGE])]
                for m in self.cells]

    def header(self) -> list[str]:
        return ["method", "seeds", *(TASK_TITLES.get(t, t) for t in self.tasks), "Avg"]

    def markdown(self) -> str:
        head = self.header()
        lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] * 2 + ["---:"] * (len(head) - 2)) + "|"]
        lines += ["| " + " | ".join(r) + " |" for r in self.rows()]
        return "\n".join(lines) + "\n"

    def csv(self) -> str:
        """Machine-readable: mean and std (percent) in separate columns."""
        out = io.StringIO()
        writer = csv.writer(out)
        writer.writerow(["method", "seeds", *(f"{t}_{s}" for t in [*self.tasks, AVERAGE] for s in ("mean", "std"))])
        for m, cells in self.cells.items():
            row = [m, self.runs[m]]
            for t in [*self.tasks, AVERAGE]:
                c = cells[t]
                row += [f"{100 * c.mean:.4f}", "" if math.isnan(c.std) else f"{100 * c.std:.4f}"] if c.values \
                    else ["", ""]
            writer.writerow(row)
        return out.getvalue()


def metric_of(task: str, metrics: dict, metric: str = "acc", gsm8k_metric: str = "exact_match_strict") -> float:
    name = gsm8k_metric if task == "gsm8k" else metric
    if name not in metrics:
        raise BituneError(f"task {task}: metric {name!r} missing (has {sorted(metrics)})")
    return float(metrics[name])


def aggregate(records: list[dict], metric: str = "acc", gsm8k_metric: str = "exact_match_strict") -> Report:
    """Group eval records by ``label`` and aggregate each task (and the per-run average) over the runs."""
    if not records:
        raise BituneError("no eval results to report")
    seen = {t for r in records for t in r["tasks"]}
    tasks = [t for t in TASK_ORDER if t in seen] + sorted(seen - set(TASK_ORDER))
    cells: dict[str, dict[str, Cell]] = {}
    runs: dict[str, int] = {}
    for r in records:
        row = cells.setdefault(r["label"], {t: Cell() for t in [*tasks, AVERAGE]})
        runs[r["label"]] = runs.get(r["label"], 0) + 1
        values = {t: metric_of(t, m, metric, gsm8k_metric) for t, m in r["tasks"].items()}
        for t, v in values.items():
            row[t].values.append(v)
        if set(values) == set(tasks):  # the average only over runs that cover every task
            row[AVERAGE].values.append(sum(values.values()) / len(values))
    return Report(tasks, cells, runs)


def find_results(paths: list[str]) -> list[Path]:
    """Eval JSON files: given files, plus every ``eval.json`` below given folders (sorted)."""
    from .cli import RESULT_FILE

    files: list[Path] = []
    for p in map(Path, paths):
        if p.is_file():
            files.append(p)
        elif p.is_dir():
            files += sorted(p.rglob(RESULT_FILE))
        else:
            raise BituneError(f"{p} is neither an eval JSON nor a folder")
    if not files:
        raise BituneError(f"no eval results found in {', '.join(paths)} (run 'bitune eval' first)")
    return files


def load_records(files: list[Path]) -> list[dict]:
    from .cli import SCHEMA

    records = []
    for f in files:
        try:
            record = json.loads(f.read_text())
        except json.JSONDecodeError as e:
            raise BituneError(f"{f}: not valid JSON ({e})") from e
        if not isinstance(record, dict) or record.get("schema") != SCHEMA:
            raise BituneError(f"{f}: not a 'bitune eval' result (schema {SCHEMA})")
        records.append(record)
    return records


def print_report(report: Report, title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for i, col in enumerate(report.header()):
        table.add_column(col, justify="left" if i == 0 else "right")
    for row in report.rows():
        table.add_row(*row)
    Console().print(table)


def write_report(report: Report, output: Path) -> tuple[Path, Path]:
    output.mkdir(parents=True, exist_ok=True)
    md, cs = output / "report.md", output / "report.csv"
    write_text_atomic(md, report.markdown())
    write_text_atomic(cs, report.csv())
    return md, cs


def run(args: argparse.Namespace) -> int:
    records = load_records(find_results(args.runs))
    limits = {r["config"].get("limit") for r in records}
    if len(limits) > 1:
        print(f"bitune report: warning: runs used different --limit values {sorted(map(str, limits))}")
    report = aggregate(records, args.metric, args.gsm8k_metric)
    print_report(report, f"{args.metric} (GSM8K: {args.gsm8k_metric}), mean ± std over seeds, %")
    md, cs = write_report(report, Path(args.output))
    print(f"bitune report: wrote {md} and {cs}")
    return 0
