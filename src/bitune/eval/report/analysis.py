"""What a report shows, computed (on :mod:`bitune.stats`): the table over seeds (:func:`aggregate`), each method
against each baseline paired question by question (:class:`Comparison`), the same pooled over tasks
(:class:`Pooled`), the trivial baselines (:func:`trivial_baselines`) and Holm's adjustment of the seed-aware
p-values (:func:`bitune.stats.seed_aware_test`: a t over seed pairs with S - 1 degrees of freedom that covers
training seeds and questions) over all comparisons (:func:`analyse`). Which methods are paired: every method with
each ``--baselines`` entry, each of the paper's ablations with ``bitune``, and ``bitune`` with the study's fair
baselines (:class:`ReportSettings`)."""

from __future__ import annotations

import csv
import io
import math
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from ...config import VARIANTS
from ...errors import BituneError
from ...stats import (
    Interval,
    SeedTest,
    holm,
    pooled_seed_aware_test,
    pooled_sign_flip_test,
    pooled_two_level_bootstrap,
)
from .records import TASK_ORDER, TaskRuns, check_comparable, collect_runs, metric_of, task_title
from .settings import ReportSettings

AVERAGE = "avg"


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
        return ["method", "seeds", *(task_title(t) for t in self.tasks), "Avg"]

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


def aggregate(records: list[dict], metric: str = "acc", gsm8k_metric: str = "exact_match_strict",
              settings: ReportSettings | None = None) -> Report:
    """Group eval records by ``label`` and aggregate each task (and the per-run average) over the runs.

    A run is one method and training seed: records of the same label and seed on different tasks (a study that
    trains per task) are one run, so the average column averages a seed's tasks, and ``seeds`` counts runs. Rows
    follow the study's method order (``settings``; default: by name).
    """
    if not records:
        raise BituneError("no eval results to report")
    check_comparable(records)
    seen = {t for r in records for t in r["tasks"]}
    tasks = [t for t in TASK_ORDER if t in seen] + sorted(seen - set(TASK_ORDER))
    per_run: dict[tuple, dict[str, float]] = {}  # (label, seed, n) -> {task: value}
    for r in records:
        run = f"run {r['label']} (seed {r['config'].get('train_seed')})"
        values = {t: metric_of(t, m, metric, gsm8k_metric, run) for t, m in r["tasks"].items()}
        key = (r["label"], r["config"].get("train_seed"), 0)
        while key in per_run and set(per_run[key]) & set(values):  # the same task twice: another run
            key = (*key[:2], key[2] + 1)
        per_run.setdefault(key, {}).update(values)
    cells: dict[str, dict[str, Cell]] = {}
    for (label, _, _), values in per_run.items():
        row = cells.setdefault(label, {t: Cell() for t in [*tasks, AVERAGE]})
        for t, v in values.items():
            row[t].values.append(v)
        if set(values) == set(tasks):  # the average only over runs that cover every task
            row[AVERAGE].values.append(sum(values.values()) / len(values))
    cells = {m: cells[m] for m in sorted(cells, key=(settings or ReportSettings()).method_key)}
    runs = {m: max(len(c.values) for t, c in row.items() if t != AVERAGE) for m, row in cells.items()}
    return Report(tasks, cells, runs)


# ------------------------------------------------------------------------------------------ paired statistics
class Tested:
    """The tests of a comparison made of per-task :attr:`parts` (one for a single task), each computed once: on one
    task the pooled functions are the single-task ones (:func:`~bitune.stats.pooled_seed_aware_test` of one task is
    :func:`~bitune.stats.seed_aware_test`, and likewise the sign-flip test and the two-level bootstrap)."""

    parts: list[Comparison]

    @cached_property
    def test(self) -> SeedTest:
        """The seed-aware t-test and interval of the (task-averaged) difference: what "resolved" is decided by."""
        return pooled_seed_aware_test([c.pair_differences for c in self.parts])

    @property
    def p(self) -> float:
        """The seed-aware p-value (what Holm's adjustment takes)."""
        return self.test.p

    @cached_property
    def question_p(self) -> float:
        """The (weighted) sign-flip p-value over questions, given these trained models."""
        return pooled_sign_flip_test([c.diff for c in self.parts])

    @cached_property
    def interval(self) -> Interval:
        """The two-level bootstrap interval (per task: seed pairs, then questions) of the difference."""
        return pooled_two_level_bootstrap([c.pair_differences for c in self.parts])


@dataclass
class Comparison(Tested):
    """A method against a baseline on one task, paired question by question over their common seeds."""

    task: str
    n: int
    method: str
    baseline: str
    pairs: list[tuple[int | None, np.ndarray, np.ndarray]]
    """Per seed pair: the seed, the method's (n,) correctness, the baseline's (n,) correctness."""
    diff: np.ndarray
    """(n,) the method's correctness averaged over its seeds minus the baseline's (over the same seeds)."""

    @property
    def pair_differences(self) -> np.ndarray:
        """(seed pairs, n): per seed pair and question, method minus baseline."""
        return np.stack([a - b for _, a, b in self.pairs])

    @property
    def parts(self) -> list[Comparison]:
        """The per-task comparisons this one is made of: itself (as :attr:`Pooled.parts`)."""
        return [self]

    @property
    def where(self) -> str:
        return task_title(self.task)


def compare(task: str, tr: TaskRuns, method: str, baseline: str) -> Comparison | None:
    """``method`` against ``baseline`` on one task, question by question: seed s of the one against seed s of the
    other, or every seed against the one run of an untrained side. None when both are trained and share no seed
    (no run of the one can be paired with a run of the other)."""
    runs, ref = tr.methods[method], tr.methods[baseline]
    if ref.seeds == [None]:  # an untrained baseline: every seed against its one run
        pairs = [(s, runs.of_seeds([s])[0], ref.correct[0]) for s in runs.seeds]
        diff = runs.averaged - ref.correct[0]
    elif runs.seeds == [None]:  # an untrained method: its one run against every seed of the baseline
        pairs = [(s, runs.correct[0], ref.of_seeds([s])[0]) for s in ref.seeds]
        diff = runs.correct[0] - ref.averaged
    else:
        common = [s for s in runs.seeds if s in ref.seeds]
        if not common:
            return None
        pairs = [(s, runs.of_seeds([s])[0], ref.of_seeds([s])[0]) for s in common]
        diff = runs.of_seeds(common).mean(axis=0) - ref.of_seeds(common).mean(axis=0)
    return Comparison(task, len(tr.doc_ids), method, baseline, pairs, diff)


@dataclass(frozen=True)
class Unpaired:
    """A comparison the report means to show and cannot: the two methods ran on the task with no seed in common."""

    task: str
    method: str
    baseline: str
    method_seeds: list[int | None]
    baseline_seeds: list[int | None]

    def text(self) -> str:
        seeds = (f"{self.method} seeds {', '.join(map(str, self.method_seeds))}; {self.baseline} seeds "
                 f"{', '.join(map(str, self.baseline_seeds))}")
        return f"{self.method} vs {self.baseline} on {task_title(self.task)} ({seeds})"


def planned(labels: list[str], baselines: list[str], settings: ReportSettings) -> list[tuple[str, str]]:
    """The ``(method, baseline)`` pairs a report shows, in order: every method against each baseline, each of the
    paper's ablations against ``bitune``, ``bitune`` against the study's fair baselines (default: every other
    method that is neither a baseline nor an ablation), then the study's further ``pairs``."""
    pairs = [(m, b) for b in baselines for m in labels if m != b]
    if "bitune" not in baselines:
        pairs += [(m, "bitune") for m in labels if m in ABLATIONS]
        fair = settings.fair_baselines
        if fair is None:
            fair = tuple(m for m in labels if m not in ABLATIONS and m != "bitune")
        pairs += [("bitune", b) for b in fair if b not in baselines and b != "bitune"]
    return pairs + list(settings.pairs)  # a pair named twice is made once (paired)


def paired(tasks: dict[str, TaskRuns], pairs: list[tuple[str, str]]) -> tuple[list[Comparison], list[Unpaired]]:
    """Each pair on every task where both methods ran, task by task; a pair planned both ways is made once, against
    the untrained side (else as first planned).

    Returns:
        found: The comparisons made.
        unpaired: The comparisons that cannot be made (:class:`Unpaired`).
    """
    found: list[Comparison] = []
    unpaired: list[Unpaired] = []
    for task, tr in tasks.items():
        here = [(m, b) for m, b in dict.fromkeys(pairs) if m in tr.methods and b in tr.methods]
        for m, b in here:
            if _made_the_other_way(tr, here, m, b):
                continue
            c = compare(task, tr, m, b)
            if c is None:
                unpaired.append(Unpaired(task, m, b, tr.methods[m].seeds, tr.methods[b].seeds))
            else:
                found.append(c)
    return found, unpaired


def _made_the_other_way(tr: TaskRuns, here: list[tuple[str, str]], method: str, baseline: str) -> bool:
    """Whether a pair planned both ways is made as ``(baseline, method)``: against the untrained side when one side
    is untrained, else as first planned."""
    if (baseline, method) not in here:
        return False
    untrained = tr.methods[method].seeds == [None], tr.methods[baseline].seeds == [None]
    if untrained[0] != untrained[1]:
        return untrained[0]
    return here.index((baseline, method)) < here.index((method, baseline))


def comparisons(tasks: dict[str, TaskRuns], baselines: list[str], methods: set[str] | None = None) -> list[Comparison]:
    """Every method (or only ``methods``) against each baseline, per task (:func:`compare`); pairs without a
    common seed left out."""
    labels = list(dict.fromkeys(m for tr in tasks.values() for m in tr.methods))
    return paired(tasks, [(m, b) for b in baselines for m in labels
                          if m != b and (methods is None or m in methods)])[0]


@dataclass
class Pooled(Tested):
    """A method against a baseline over several tasks: the mean over tasks of the per-task paired differences."""

    method: str
    baseline: str
    parts: list[Comparison]

    @property
    def where(self) -> str:
        return "pooled: " + " + ".join(c.where for c in self.parts)


def pooled(found: list[Comparison]) -> list[Pooled]:
    """Each method-baseline pair compared on 2 or more tasks, pooled over those tasks (in report order)."""
    groups: dict[tuple[str, str], list[Comparison]] = {}
    for c in found:
        groups.setdefault((c.method, c.baseline), []).append(c)
    return [Pooled(m, b, parts) for (m, b), parts in groups.items() if len(parts) >= 2]


@dataclass(frozen=True)
class Trivial:
    """The answers a model that reads nothing can give on one task."""

    always: list[float]
    """Accuracy of always picking choice k (k from 0) over all questions (wrong where a question has fewer)."""

    @property
    def best(self) -> tuple[int, float]:
        """The best constant choice ``(k, accuracy)``: the majority answer position of this split."""
        k = int(np.argmax(self.always))
        return k, self.always[k]


def trivial_baselines(tr: TaskRuns) -> Trivial | None:
    """Always-choice-k accuracies of a multiple-choice task: what a model that reads nothing scores.

    Args:
        tr: one task's runs (:func:`collect_runs`), with the correct answers and the number of choices the runs
            stored.

    Returns:
        The accuracy of always answering choice k, for k from 0 to the most choices a question has (wrong where
            a question has fewer), and the best such k (the split's majority answer position); None when the
            runs stored no correct answers or choice counts, or the answers are not choice indices (generation
            tasks).
    """
    if tr.gold is None or tr.choices is None or not all(isinstance(g, int) for g in tr.gold[1]):
        return None
    gold, choices = np.asarray(tr.gold[1]), np.asarray(tr.choices)
    return Trivial([float(np.mean(gold == k)) for k in range(int(choices.max()))])


ABLATIONS = {v for v in VARIANTS if v not in ("bitune", "lora", "pretrained")}
"""The paper's ablations (section 3.3), each compared with ``bitune`` as well as with the baselines."""

@dataclass
class Analysis:
    """Everything a report shows, computed once: the table over seeds, the per-question runs, the comparisons
    (per task, then pooled over tasks) and their Holm-adjusted p-values (one family: all of them)."""

    report: Report
    tasks: dict[str, TaskRuns]
    skipped: list[str]
    found: list[Comparison]
    pools: list[Pooled]
    adjusted: list[float]
    """Holm p of ``found`` then ``pools``, in that order, from their seed-aware p-values."""
    unpaired: list[Unpaired] = field(default_factory=list)
    """The comparisons planned and not made: the two methods share no training seed on that task."""
    settings: ReportSettings = field(default_factory=ReportSettings)
    """The study's method order and fair baselines."""


def analyse(records: list[dict], metric: str = "acc", gsm8k_metric: str = "exact_match_strict",
            baselines: tuple[str, ...] = ("lora", "pretrained"), settings: ReportSettings | None = None) -> Analysis:
    """Aggregate the records and make every comparison the report shows (:func:`planned`): each method against each
    baseline, each ablation against ``bitune``, ``bitune`` against the study's fair baselines, per task and pooled
    over the tasks where a pair ran on 2 or more.

    Args:
        records: the runs' evaluation records (:func:`~bitune.eval.report.records.load_records`).
        metric: the multiple-choice metric, ``acc`` or ``acc_norm``.
        gsm8k_metric: GSM8K's metric.
        baselines: methods every other method is compared with. Default LoRA and the pretrained model.
        settings: the study's method order and fair baselines (default: :class:`ReportSettings`).
    """
    settings = settings or ReportSettings()
    report = aggregate(records, metric, gsm8k_metric, settings)
    tasks, skipped = collect_runs(records, metric, gsm8k_metric, settings)
    labels = sorted({m for tr in tasks.values() for m in tr.methods}, key=settings.method_key)
    found, unpaired = paired(tasks, planned(labels, list(baselines), settings))
    pools = pooled(found)
    return Analysis(report, tasks, skipped, found, pools, holm([c.p for c in [*found, *pools]]), unpaired, settings)
