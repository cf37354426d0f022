"""Aggregating ``bitune eval`` results over seeds (what ``bitune report`` writes): the paper's table plus paired
statistics.

1. **The paper's table** (Table 1/2 shape): rows are methods (the ``label`` of each eval JSON), columns the tasks
   and their average. A cell is ``mean ± std`` in percent over the runs (seeds) of that method. The std is the
   sample standard deviation (ddof=1); with one run it is undefined and shown as ``-``. The average column
   averages the tasks within each run first, then takes the mean and std of those per-run averages over seeds.
2. **Accuracy with a 95% interval** per task and method: the per-question correctness averaged over the
   method's seeds, its mean, and a bootstrap interval over questions (:mod:`bitune.stats`); each seed's
   accuracy is listed next to it.
3. **Paired differences** against each baseline (``--baselines``, default LoRA and the pretrained model): per
   question, the method's correctness averaged over seeds minus the baseline's (over the same seeds when the
   baseline has them), its mean with a bootstrap interval over questions, and per seed the discordant counts and
   the exact McNemar p-value (seed s of the method against seed s of the baseline, or against its one run).
   With 2 or more seed pairs, a t-test of the per-seed differences (the seeds as the unit: training
   randomness), a two-level bootstrap interval (seed pairs, then questions) and a sign-flip permutation p-value over
   questions. The paper's ablations (``shared_weights``, ``naive_bidir``, ...) are also compared with ``bitune``,
   and ``bitune`` with the fair baselines ``lora16`` (its parameter count), ``lora_compute`` (its compute, on new
   examples) and ``lora_repeat`` (its compute, on the examples Bitune saw). Every comparison's sign-flip p-value
   is adjusted by Holm's method over the family of all comparisons the report shows.
4. **Trivial baselines** per multiple-choice task: the accuracy of always answering the k-th choice, and the best
   such k (the split's majority answer position); the accuracy table marks a method below it.
5. **Pooled over tasks**: each comparison made on 2 or more tasks, as the mean over tasks of the per-task paired
   differences, with a two-level interval (seed pairs, then questions, resampled within each task) and a
   weighted sign-flip p-value (in the Holm family too).

Sections 2-5 need the per-question results that ``bitune eval`` stores (``samples``). Every table states the
number of questions ``n`` and the ``--limit`` the runs were evaluated with. A figure (``report.png``: per task,
accuracy per method with its interval and the seeds as points) is written when matplotlib is installed.
"""

from __future__ import annotations

import csv
import io
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from ..config import VARIANTS
from ..errors import BituneError
from ..files import check_input_file, check_named, read_text, write_text_atomic
from ..records import record_splits
from ..stats import (
    BOOTSTRAP,
    bootstrap_mean,
    holm,
    mcnemar_exact,
    pooled_sign_flip_test,
    pooled_two_level_bootstrap,
    seed_t_test,
    sign_flip_test,
    two_level_bootstrap,
)
from . import RESULT_FILE, SCHEMA

TASK_ORDER = ("piqa", "arc_challenge", "arc_easy", "csqa", "siqa", "mmlu", "gsm8k")
TASK_TITLES = {"piqa": "PIQA", "arc_challenge": "ARC-C", "arc_easy": "ARC-E", "csqa": "CSQA", "siqa": "SIQA",
               "mmlu": "MMLU", "gsm8k": "GSM8K"}
AVERAGE = "avg"
METHOD_ORDER = ("pretrained", "lora", "lora16", "lora_compute", "lora_repeat", "bitune")
"""Rows in this order first (the paper's), then any other method by name."""


def method_key(label: str) -> tuple[int, str]:
    return (METHOD_ORDER.index(label), "") if label in METHOD_ORDER else (len(METHOD_ORDER), label)


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


def metric_of(task: str, metrics: dict, metric: str = "acc", gsm8k_metric: str = "exact_match_strict",
              run: str = "") -> float:
    """The reported metric of one task (``gsm8k_metric`` for gsm8k); ``run`` names the run in errors."""
    name, where = gsm8k_metric if task == "gsm8k" else metric, f"{run}: " if run else ""
    if name not in metrics:
        raise BituneError(f"{where}task {task}: metric {name!r} missing (has {sorted(metrics)})")
    value = metrics[name]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise BituneError(f"{where}task {task}: metric {name!r} is {value!r}, not a number")
    return float(value)


COMPARABLE = (("model", "base model"), ("template", "prompt template"), ("limit", "--limit"))
"""What every run of one report must share (config key, name in errors): runs of different base models, prompt
templates or question cuts are not seeds of one experiment and must not be averaged or paired."""


def check_comparable(records: list[dict]) -> None:
    """Refuse a report over runs that disagree on what makes them comparable (:data:`COMPARABLE`).

    Raises:
        BituneError: naming the setting, each value and a run that has it.
    """
    for key, what in COMPARABLE:
        seen: dict[str, str] = {}
        for r in records:
            value = r["config"].get(key)
            if key == "template" and value is None:
                continue  # older records did not store it
            seen.setdefault(repr(value), f"{r['label']} (seed {r['config'].get('train_seed')})")
        if len(seen) > 1:
            listed = "; ".join(f"{v} in {run}" for v, run in seen.items())
            raise BituneError(f"these runs differ in {what}: {listed}; a report pairs and averages runs of one "
                              "setting only: report each setting's runs apart")


def aggregate(records: list[dict], metric: str = "acc", gsm8k_metric: str = "exact_match_strict") -> Report:
    """Group eval records by ``label`` and aggregate each task (and the per-run average) over the runs.

    A run is one method and training seed: records of the same label and seed on different tasks (a study that
    trains per task) are one run, so the average column averages a seed's tasks, and ``seeds`` counts runs.
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
    cells = {m: cells[m] for m in sorted(cells, key=method_key)}
    runs = {m: max(len(c.values) for t, c in row.items() if t != AVERAGE) for m, row in cells.items()}
    return Report(tasks, cells, runs)


# ------------------------------------------------------------------------------------------ paired statistics
@dataclass
class Runs:
    """Every run of one method on one task, aligned question by question."""

    seeds: list[int | None]
    """Training seed of each run (None: untrained)."""
    correct: np.ndarray
    """(runs, n) 0/1 correctness of each run on each question."""

    @property
    def averaged(self) -> np.ndarray:
        """(n,) correctness averaged over the runs."""
        return self.correct.mean(axis=0)

    def of_seeds(self, seeds: list[int | None]) -> np.ndarray:
        return self.correct[[self.seeds.index(s) for s in seeds]]


@dataclass
class TaskRuns:
    """One task: its questions, the ``--limit`` they were cut to, and each method's runs."""

    doc_ids: list[int]
    limit: int | None
    methods: dict[str, Runs]
    gold: tuple[str, list] | None = None
    """The run that first stored the correct answers, and those answers (every other run must agree)."""
    choices: list[int] | None = None
    """Number of answer choices of each question (from the stored log-likelihoods), when known."""


def collect_runs(records: list[dict], metric: str = "acc",
                 gsm8k_metric: str = "exact_match_strict") -> tuple[dict[str, TaskRuns], list[str]]:
    """Per task, each method's per-question correctness (from the eval JSONs' ``samples``).

    Args:
        records: the runs' evaluation records (:func:`load_records`), one per method, seed and task set.
        metric: the multiple-choice metric whose per-question values are read, ``acc`` or ``acc_norm``.
        gsm8k_metric: GSM8K's metric.

    Returns:
        tasks: The tasks in report order, each with its questions (sorted by ``doc_id``) and, per method in
            report order, each run's seed and (runs, n) 0/1 correctness.
        skipped: The ``label/task`` of runs without per-question data.

    Raises:
        BituneError: two runs of a task cover different questions (another ``--limit``) or disagree on a
            correct answer, or a run repeats a method's seed.
    """
    tasks: dict[str, TaskRuns] = {}
    skipped: list[str] = []
    for r in records:
        samples = r.get("samples") or {}
        for task in r["tasks"]:
            table, name = samples.get(task), gsm8k_metric if task == "gsm8k" else metric
            if not isinstance(table, dict) or name not in table or "doc_id" not in table:
                skipped.append(f"{r['label']}/{task}")
                continue
            order = np.argsort(table["doc_id"], kind="stable")
            doc_ids = [int(table["doc_id"][i]) for i in order]
            correct = np.asarray(table[name], dtype=np.float64)[order]  # (n,)
            limit = r["config"].get("limit")
            entry = tasks.setdefault(task, TaskRuns(doc_ids, limit, {}))
            seed = r["config"].get("train_seed")
            if doc_ids != entry.doc_ids:
                raise BituneError(f"task {task}: run {r['label']} (seed {seed}) was evaluated on {len(doc_ids)} "
                                  f"questions, other runs on {len(entry.doc_ids)} (different --limit?); paired "
                                  "statistics need the same questions")
            run = f"{r['label']} (seed {seed})"
            gold = [table["gold"][i] for i in order] if "gold" in table else None
            if gold is not None and entry.gold is not None and gold != entry.gold[1]:
                first, differ = entry.gold[0], [d for d, a, b in zip(doc_ids, gold, entry.gold[1]) if a != b]
                raise BituneError(f"task {task}: runs {first} and {run} disagree on the correct answer of "
                                  f"{len(differ)} questions (the first: doc_id {differ[0]}): not the same questions "
                                  "(another dataset version, or an edited file)")
            if entry.gold is None and gold is not None:
                entry.gold = (run, gold)
            if entry.choices is None and isinstance(table.get("loglik"), list) \
                    and all(isinstance(x, list) for x in table["loglik"]):
                entry.choices = [len(table["loglik"][i]) for i in order]
            runs = entry.methods.setdefault(r["label"], Runs([], np.zeros((0, len(doc_ids)))))
            if seed in runs.seeds:
                raise BituneError(f"task {task}: method {r['label']} has two runs with seed {seed}")
            runs.seeds.append(seed)
            runs.correct = np.vstack([runs.correct, correct[None]])
    ordered = {t: tasks[t] for t in [*TASK_ORDER, *sorted(set(tasks) - set(TASK_ORDER))] if t in tasks}
    for tr in ordered.values():
        tr.methods = {m: tr.methods[m] for m in sorted(tr.methods, key=method_key)}
    return ordered, skipped


def _limit_text(limit: int | None) -> str:
    return "none (full split)" if limit is None else str(limit)


def _seed_text(seed: int | None) -> str:
    return "-" if seed is None else str(seed)


def accuracy_rows(tasks: dict[str, TaskRuns]) -> list[list[str]]:
    """Rows: task, n, limit, method, runs, accuracy with 95% interval (%), each seed's accuracy (%), and the
    difference from the task's best trivial baseline (points; ``below`` marks a method under it)."""
    rows = []
    for task, tr in tasks.items():
        trivial = trivial_baselines(tr)
        for label, runs in tr.methods.items():
            ci = bootstrap_mean(runs.averaged)
            per_seed = ", ".join(f"{_seed_text(s)}: {100 * c.mean():.1f}" for s, c in zip(runs.seeds, runs.correct))
            versus = "-"
            if trivial is not None:
                gap = 100 * (ci.value - trivial.best[1])
                versus = f"{gap:+.1f}" + (" **below**" if gap < 0 else "")
            rows.append([TASK_TITLES.get(task, task), str(len(tr.doc_ids)), _limit_text(tr.limit), label,
                         str(len(runs.seeds)), ci.text(), per_seed, versus])
    return rows


def trivial_rows(tasks: dict[str, TaskRuns]) -> list[list[str]]:
    """Rows: task, n, choices, each always-choice-k accuracy (%), the best k and its accuracy (%)."""
    rows = []
    for task, tr in tasks.items():
        trivial = trivial_baselines(tr)
        if trivial is None:
            continue
        counts = sorted(set(tr.choices))
        k, best = trivial.best
        rows.append([TASK_TITLES.get(task, task), str(len(tr.doc_ids)),
                     "/".join(map(str, counts)), ", ".join(f"{j}: {100 * a:.2f}" for j, a in enumerate(trivial.always)),
                     f"always {k}: {100 * best:.2f}"])
    return rows


@dataclass
class Comparison:
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
    def p(self) -> float:
        """The sign-flip p-value over questions (what Holm's adjustment takes)."""
        if not hasattr(self, "_p"):
            self._p = sign_flip_test(self.diff)
        return self._p

    @property
    def interval(self):
        """The two-level bootstrap interval (seed pairs, then questions) of the difference, computed once."""
        if not hasattr(self, "_interval"):
            self._interval = two_level_bootstrap(self.pair_differences)
        return self._interval

    @property
    def parts(self) -> list[Comparison]:
        """The per-task comparisons this one is made of: itself (as :attr:`Pooled.parts`)."""
        return [self]

    @property
    def where(self) -> str:
        return TASK_TITLES.get(self.task, self.task)

    def row(self) -> list[str]:
        """task, n, method, baseline, seed pairs, Δ with its question-level and two-level intervals, sign-flip p,
        per seed: Δ, discordant counts and McNemar p; the t-test over seeds."""
        ci, two_level = bootstrap_mean(self.diff), self.interval
        per_seed, tests = [], []
        for seed, a, b in self.pairs:
            only_a, only_b, p = mcnemar_exact(a, b)
            per_seed.append(f"{_seed_text(seed)}: {100 * (a.mean() - b.mean()):+.1f}")
            tests.append(f"{only_a}/{only_b}, p={p:.3g}")
        t_p = seed_t_test([a.mean() - b.mean() for _, a, b in self.pairs])
        return [self.where, str(self.n), self.method, self.baseline, str(len(self.pairs)),
                _points(ci), _points(two_level), f"{self.p:.3g}", "; ".join(per_seed), "; ".join(tests),
                "-" if t_p is None else f"{t_p:.3g}"]


def comparisons(tasks: dict[str, TaskRuns], baselines: list[str], methods: set[str] | None = None) -> list[Comparison]:
    """Every method (or only ``methods``) against each baseline, per task: seed s of the method against seed s of
    the baseline, or against the baseline's one run when it is untrained."""
    found = []
    for task, tr in tasks.items():
        for base in baselines:
            if base not in tr.methods:
                continue
            ref = tr.methods[base]
            for label, runs in tr.methods.items():
                if label == base or (methods is not None and label not in methods):
                    continue
                if ref.seeds == [None]:  # an untrained baseline: every seed against its one run
                    pairs = [(s, runs.of_seeds([s])[0], ref.correct[0]) for s in runs.seeds]
                    diff = runs.averaged - ref.correct[0]
                else:
                    common = [s for s in runs.seeds if s in ref.seeds]
                    if not common:
                        continue
                    pairs = [(s, runs.of_seeds([s])[0], ref.of_seeds([s])[0]) for s in common]
                    diff = runs.of_seeds(common).mean(axis=0) - ref.of_seeds(common).mean(axis=0)
                found.append(Comparison(task, len(tr.doc_ids), label, base, pairs, diff))
    return found


def difference_rows(tasks: dict[str, TaskRuns], baselines: list[str],
                    methods: set[str] | None = None) -> list[list[str]]:
    """Rows (:meth:`Comparison.row`) of every method (or only ``methods``) against each baseline, per task."""
    return [c.row() for c in comparisons(tasks, baselines, methods)]


@dataclass
class Pooled:
    """A method against a baseline over several tasks: the mean over tasks of the per-task paired differences."""

    method: str
    baseline: str
    parts: list[Comparison]

    @property
    def p(self) -> float:
        if not hasattr(self, "_p"):
            self._p = pooled_sign_flip_test([c.diff for c in self.parts])
        return self._p

    @property
    def interval(self):
        """The two-level bootstrap interval of the task-averaged difference, computed once."""
        if not hasattr(self, "_interval"):
            self._interval = pooled_two_level_bootstrap([c.pair_differences for c in self.parts])
        return self._interval

    @property
    def where(self) -> str:
        return "pooled: " + " + ".join(c.where for c in self.parts)

    def row(self) -> list[str]:
        """tasks, method, baseline, seed pairs per task, the task-averaged Δ with the per-task Δs, its two-level
        interval, the sign-flip p."""
        ci = self.interval
        each = "; ".join(f"{c.where} {100 * c.diff.mean():+.1f}" for c in self.parts)
        return [" + ".join(c.where for c in self.parts), self.method, self.baseline,
                "/".join(str(len(c.pairs)) for c in self.parts), f"{100 * ci.value:+.1f}", each, _points(ci),
                f"{self.p:.3g}"]


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


def _points(ci) -> str:
    return f"{100 * ci.value:+.1f} [{100 * ci.low:+.1f}, {100 * ci.high:+.1f}]"


ABLATIONS = {v for v in VARIANTS if v not in ("bitune", "lora", "pretrained")}
"""The paper's ablations (section 3.3), each compared with ``bitune`` as well as with the baselines."""

FAIR_BASELINES = ("lora16", "lora_compute", "lora_repeat")
"""Baselines that match Bitune's trainable parameters (LoRA r16) or its training compute (LoRA r8 given more
steps: on new examples, ``lora_compute``, or on the examples Bitune saw, repeated, ``lora_repeat``); ``bitune`` is
paired against each as well."""

ACCURACY_HEADER = ["task", "n", "limit", "method", "seeds", "acc % [95% CI]", "per seed (%)",
                   "vs best trivial (points)"]
TRIVIAL_HEADER = ["task", "n", "choices", "always choice k: acc %", "best trivial (majority answer position)"]
DIFFERENCE_HEADER = ["task", "n", "method", "vs", "seed pairs", "Δ points [95% CI]", "two-level 95% CI",
                     "sign-flip p", "Δ per seed",
                     "only method / only baseline right, McNemar p (per seed)", "t-test over seeds, p", "Holm p"]
POOLED_HEADER = ["tasks", "method", "vs", "seed pairs per task", "Δ points, task mean", "Δ per task",
                 "two-level 95% CI", "sign-flip p", "Holm p"]


def markdown_table(header: list[str], rows: list[list[str]], left: int = 1) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---"] * left + ["---:"] * (len(header) - left)) + "|"]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows]) + "\n"


def plot_accuracy(tasks: dict[str, TaskRuns], metric: str, path: Path) -> Path | None:
    """Per task, each method's seed-averaged accuracy with its 95% interval and each seed as a point (PNG)."""
    try:
        import matplotlib
    except ImportError:
        print("bitune report: matplotlib is not installed (pip install 'bitune[plot]'); no figure written")
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(tasks), figsize=(4.2 * len(tasks), 3.6), squeeze=False)
    for ax, (task, tr) in zip(axes[0], tasks.items()):
        for x, (label, runs) in enumerate(tr.methods.items()):
            ci = bootstrap_mean(runs.averaged)
            ax.errorbar([x], [100 * ci.value], yerr=[[100 * (ci.value - ci.low)], [100 * (ci.high - ci.value)]],
                        fmt="o", color="black", capsize=5, markersize=7, zorder=3)
            seeds = 100 * runs.correct.mean(axis=1)  # (runs,)
            offsets = np.linspace(-0.12, 0.12, len(seeds)) if len(seeds) > 1 else np.zeros(1)
            ax.scatter(x + 0.25 + offsets, seeds, s=18, color="tab:blue", alpha=0.8, zorder=2,
                       label="seeds" if x == 0 else None)
        ax.set_xticks(range(len(tr.methods)), list(tr.methods), rotation=20, ha="right")
        ax.set_title(f"{TASK_TITLES.get(task, task)} (n = {len(tr.doc_ids)})")
        ax.set_ylabel(f"{metric} (%)")
        ax.grid(axis="y", alpha=0.3)
    axes[0][0].legend(loc="best", fontsize=8)
    fig.suptitle(f"{metric}: mean over seeds, 95% CI over questions; dots: seeds", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=120)
    plt.close(fig)
    tmp.replace(path)
    return path


def find_results(paths: list[str]) -> list[Path]:
    """Eval JSON files: given files, plus every ``eval.json`` below given folders (sorted)."""
    files: list[Path] = []
    for p in (Path(check_named(p, "RUN")) for p in paths):  # "" would search the current folder
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
    """Read and check eval JSONs (``schema``, ``label``, ``tasks`` and ``config`` present and well-formed)."""
    records = []
    for f in files:
        try:
            record = json.loads(f.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise BituneError(f"{f}: not valid JSON ({e})") from e
        if not isinstance(record, dict) or record.get("schema") != SCHEMA:
            raise BituneError(f"{f}: not a 'bitune eval' result (schema {SCHEMA})")
        for key, kind in (("label", str), ("tasks", dict), ("config", dict)):
            if not isinstance(record.get(key), kind):
                raise BituneError(f"{f}: field {key!r} is missing or not a {kind.__name__} (a 'bitune eval' "
                                  "result has label, tasks, config)")
        for task, metrics in record["tasks"].items():
            if not isinstance(metrics, dict):
                raise BituneError(f"{f}: tasks.{task} is not a mapping of metrics")
        if record.get("samples") is not None and not isinstance(record["samples"], dict):
            raise BituneError(f"{f}: field 'samples' is not a mapping of tasks")
        for task, table in (record.get("samples") or {}).items():
            _check_samples(f, task, table, record["tasks"].get(task, {}))
        train_s = _train_seconds(f.parent / "log.jsonl")
        if train_s is not None:
            record.setdefault("timing", {})["train_s"] = train_s
        records.append(record)
    check_splits(records, [str(f) for f in files])
    return records


def check_splits(records: list[dict], names: list[str] | None = None) -> dict[str, str | None]:
    """``{task: split}`` over the records; a task evaluated on two splits (a learning-rate sweep's tuning split
    beside the reported one) is an error: their scores are not comparable and a report must not pool them."""
    seen: dict[str, tuple[str | None, str]] = {}
    for r, name in zip(records, names or [r["label"] for r in records]):
        for task, split in record_splits(r).items():
            first = seen.setdefault(task, (split, name))
            if first[0] != split:
                raise BituneError(f"task {task}: {first[1]} was evaluated on its {first[0]} split, {name} on "
                                  f"{split}; report each split's runs apart")
    return {task: split for task, (split, _) in seen.items()}


def _check_samples(f: Path, task: str, table, metrics: dict) -> None:
    """One task's per-question table: parallel lists, distinct integer ``doc_id``s, 0/1 correctness whose mean is
    the task's stored metric. A file cut, reordered or edited by hand fails here, with the place named, instead of
    pairing the wrong questions silently."""
    where = f"{f}: samples.{task}"
    if not isinstance(table, dict) or not all(isinstance(v, list) for v in table.values()):
        raise BituneError(f"{where} is not a mapping of per-question lists")
    lengths = {k: len(v) for k, v in table.items()}
    if len(set(lengths.values())) > 1:
        raise BituneError(f"{where}: its lists differ in length ({', '.join(f'{k} {n}' for k, n in lengths.items())})")
    ids = table.get("doc_id", [])
    if any(isinstance(i, bool) or not isinstance(i, int) for i in ids):
        raise BituneError(f"{where}.doc_id holds a value that is not an integer")
    if len(set(ids)) != len(ids):
        raise BituneError(f"{where}: doc_id {next(i for i in ids if ids.count(i) > 1)} appears more than once")
    if isinstance(metrics.get("n"), int) and metrics["n"] != len(ids):
        raise BituneError(f"{where}: {len(ids)} questions, but tasks.{task}.n is {metrics['n']}")
    for name, stored in metrics.items():
        if name == "n" or name not in table or not table[name]:
            continue
        values = table[name]
        bad = next((i for i, v in enumerate(values) if v not in (0, 1)), None)
        if bad is not None:
            raise BituneError(f"{where}.{name}[{bad}] is {values[bad]!r}: per-question correctness is 0 or 1")
        mean = sum(values) / len(values)
        if isinstance(stored, (int, float)) and not isinstance(stored, bool) and abs(mean - stored) > 1e-6:
            raise BituneError(f"{where}.{name}: its mean {mean:.6f} is not tasks.{task}.{name} ({stored}); the file "
                              "was cut or edited")


def _train_seconds(log: Path) -> float | None:
    """The training wall time ``train_runtime`` from a run folder's ``log.jsonl`` (the last one: a resumed run logs its own)."""
    if not log.is_file():
        return None
    found = None
    for line in log.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            item = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(item, dict) and isinstance(item.get("train_runtime"), (int, float)):
            found = float(item["train_runtime"])
    return found


def timing_rows(records: list[dict]) -> list[list[str]]:
    """Rows: tasks, method, runs, mean training and evaluation wall time per run (minutes), total (minutes)."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in records:
        tasks = "+".join(TASK_TITLES.get(t, t) for t in r["tasks"])
        groups.setdefault((tasks, r["label"]), []).append(r.get("timing") or {})
    rows = []
    for (tasks, label), timings in sorted(groups.items(), key=lambda kv: (kv[0][0], method_key(kv[0][1]))):
        train = [t["train_s"] for t in timings if isinstance(t.get("train_s"), (int, float))]
        evals = [t["eval_s"] for t in timings if isinstance(t.get("eval_s"), (int, float))]
        total = sum(train) + sum(evals)
        rows.append([tasks, label, str(len(timings)), f"{sum(train) / len(train) / 60:.1f}" if train else "-",
                     f"{sum(evals) / len(evals) / 60:.1f}" if evals else "-", f"{total / 60:.1f}"])
    return rows


TIMING_HEADER = ["task", "method", "runs", "train min/run", "eval min/run", "total min"]


def title_of(tasks: list[str], metric: str, gsm8k_metric: str) -> str:
    names = ", ".join(TASK_TITLES.get(t, t) for t in tasks)
    gsm = f"; GSM8K: {gsm8k_metric}" if "gsm8k" in tasks else ""
    return f"{names}: {metric}{gsm}"


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
    """Holm p of ``found`` then ``pools``, in that order."""


def analyse(records: list[dict], metric: str = "acc", gsm8k_metric: str = "exact_match_strict",
            baselines: tuple[str, ...] = ("lora", "pretrained")) -> Analysis:
    """Aggregate the records and make every comparison the report shows: each method against each baseline, each
    ablation against ``bitune``, ``bitune`` against the matched baselines (:data:`FAIR_BASELINES`), per task and
    pooled over the tasks where a pair ran on 2 or more."""
    report = aggregate(records, metric, gsm8k_metric)
    tasks, skipped = collect_runs(records, metric, gsm8k_metric)
    found: list[Comparison] = []
    if tasks:
        found = comparisons(tasks, list(baselines))
        if "bitune" not in baselines:  # each ablation also against the method it ablates
            found += comparisons(tasks, ["bitune"], methods=ABLATIONS)
        found += comparisons(tasks, [b for b in FAIR_BASELINES if b not in baselines], methods={"bitune"})
        found.sort(key=lambda c: list(tasks).index(c.task))  # every comparison of a task together
    pools = pooled(found)
    return Analysis(report, tasks, skipped, found, pools, holm([c.p for c in [*found, *pools]]))


def build_markdown(records: list[dict], metric: str = "acc", gsm8k_metric: str = "exact_match_strict",
                   baselines: tuple[str, ...] = ("lora", "pretrained"),
                   analysis: Analysis | None = None) -> tuple[Report, str, dict[str, TaskRuns]]:
    """The whole report as Markdown: the paper's table over seeds, accuracy intervals, trivial baselines, paired
    differences (per task and pooled over tasks, Holm-adjusted) and wall times.

    The accuracy intervals, trivial baselines, paired differences and pooled comparisons need the runs'
    per-question data (``samples``): runs without it appear in the table over seeds only, listed at the end.

    Args:
        records: the runs' evaluation records (:func:`load_records`): ``label``, ``tasks`` (metrics per task),
            ``config`` (``train_seed``, ``limit``, ``model``, ``template``) and optionally ``samples``.
        metric: the multiple-choice metric, ``acc`` or ``acc_norm``.
        gsm8k_metric: GSM8K's metric.
        baselines: methods every other method is compared with, question by question. Default LoRA and the
            pretrained model.
        analysis: :func:`analyse` of the same records, when already computed (then ``metric``, ``gsm8k_metric``
            and ``baselines`` are not used for the statistics).

    Returns:
        report: The table over seeds.
        markdown: The report as Markdown.
        tasks: The per-question runs per task (:func:`collect_runs`).

    Raises:
        BituneError: no records; the runs differ in base model, prompt template or ``--limit``; a run lacks
            the metric or it is not a number; runs of a task cover different questions or disagree on a correct
            answer; a method has two runs with one seed.
    """
    a = analysis or analyse(records, metric, gsm8k_metric, baselines)
    report, tasks, skipped = a.report, a.tasks, a.skipped
    n_text = ", ".join(f"{TASK_TITLES.get(t, t)} {len(tr.doc_ids)}" for t, tr in tasks.items())
    limits = sorted({_limit_text(r["config"].get("limit")) for r in records})
    parts = [f"# Report: {title_of(report.tasks, metric, gsm8k_metric)}\n",
             f"{len(records)} runs. Questions per task (n): {n_text or 'no per-question data'}; "
             f"--limit: {', '.join(limits)}.\n",
             f"## {metric} (%), mean ± sample std over seeds\n", report.markdown()]
    if tasks:
        parts += [f"\n## {metric} (%) with a 95% bootstrap interval over questions\n",
                  "Seed-averaged per-question correctness, resampled over questions "
                  f"({BOOTSTRAP} resamples, fixed seed); each seed's accuracy after it; the last column is the "
                  "accuracy minus the task's best trivial baseline (**below**: under it).\n",
                  markdown_table(ACCURACY_HEADER, accuracy_rows(tasks), left=5)]
        trivial = trivial_rows(tasks)
        if trivial:
            parts += ["\n## Trivial baselines\n",
                      "What a model that reads nothing scores on these questions: always the k-th choice (k from "
                      "0; wrong on a question with fewer choices). The best k is the majority answer position of the "
                      "split (chosen with the answers known, so an upper bound for a constant guess); a method "
                      "below it has learnt nothing usable about the task.\n",
                      markdown_table(TRIVIAL_HEADER, trivial, left=3)]
        found, pools, adjusted = a.found, a.pools, a.adjusted
        if found:
            parts += ["\n## Paired differences (percentage points)\n",
                      "Per question: the method's correctness averaged over seeds minus the baseline's (over the "
                      "same seeds; an untrained baseline has one run), mean with a 95% bootstrap interval over "
                      "questions. Per seed: the difference, the questions only the method / only the baseline "
                      "gets right, and the exact McNemar p-value. Over seeds (2 or more): a t-test of the per-seed "
                      "differences, the seeds as the unit (training randomness, on these questions). Two-level: "
                      "a bootstrap that resamples seed pairs, then questions within them (covers other training "
                      "seeds as well as other questions; with one seed pair it is the question-level interval). "
                      "Sign-flip p: a permutation test over questions (the per-question differences' signs "
                      f"flipped at random, {BOOTSTRAP} draws). Holm p: the sign-flip p adjusted by Holm's method "
                      f"over the family of all {len(adjusted)} comparisons of this report (this table"
                      f"{' and the pooled one' if pools else ''}); a comparison is resolved at 5% when it is "
                      "below 0.05.\n",
                      markdown_table(DIFFERENCE_HEADER, [[*c.row(), f"{p:.3g}"] for c, p in zip(found, adjusted)],
                                     left=5)]
        if pools:
            parts += ["\n## Pooled over tasks (percentage points)\n",
                      "A method against a baseline on every task where both ran: the mean over tasks of the "
                      "per-task paired differences (each task weighs the same). Two-level 95% interval: per "
                      "task, seed pairs then questions are resampled, and the tasks' means averaged. Sign-flip p: "
                      "the per-question differences' signs flipped at random, each question weighted by "
                      "1 / (tasks x its task's questions). Holm p: over the same family as above.\n",
                      markdown_table(POOLED_HEADER, [[*q.row(), f"{p:.3g}"]
                                                     for q, p in zip(pools, adjusted[len(found):])], left=4)]
    timing = timing_rows(records)
    if any(r[3] != "-" or r[4] != "-" for r in timing):
        total = sum(float(r[5]) for r in timing)
        parts += ["\n## Wall time\n", f"Training (train_runtime in each run's log.jsonl) and evaluation "
                  f"(lm-eval) per run, as recorded on the machine that ran them; {total / 60:.1f} h in all.\n",
                  markdown_table(TIMING_HEADER, timing, left=2)]
    if skipped:
        parts.append(f"\nNo per-question data (re-run 'bitune eval' to include them): {', '.join(skipped)}.\n")
    return report, "\n".join(parts), tasks


SUMMARY_BEGIN = "<!-- bitune report summary: begin (generated by 'bitune report --embed-summary'; do not edit) -->"
SUMMARY_END = "<!-- bitune report summary: end -->"


def build_summary(a: Analysis, metric: str = "acc", gsm8k_metric: str = "exact_match_strict",
                  source: str | None = None) -> str:
    """A short form of the report for a README: per task each method's accuracy with its interval next to the best
    trivial baseline, then Bitune minus each baseline (two-level interval, Holm p over the whole report's family).

    Args:
        a: the analysis (:func:`analyse`).
        metric: the multiple-choice metric tabulated.
        gsm8k_metric: GSM8K's metric.
        source: where the full report is (a path or link), named under the tables.
    """
    if not a.tasks:
        raise BituneError("a summary needs per-question results; these runs have none")
    methods = sorted({m for tr in a.tasks.values() for m in tr.methods}, key=method_key)
    seeds = sorted({len(r.seeds) for tr in a.tasks.values() for r in tr.methods.values() if r.seeds != [None]})
    header = ["task", "n", "best trivial", *methods]
    rows = []
    for task, tr in a.tasks.items():
        trivial = trivial_baselines(tr)
        best = "-" if trivial is None else f"{100 * trivial.best[1]:.1f}"
        cells = []
        for m in methods:
            if m not in tr.methods:
                cells.append("")
                continue
            ci = bootstrap_mean(tr.methods[m].averaged)
            cells.append(ci.text() + (" (below)" if trivial is not None and ci.value < trivial.best[1] else ""))
        rows.append([TASK_TITLES.get(task, task), str(len(tr.doc_ids)), best, *cells])
    parts = [f"# Summary: {title_of(a.report.tasks, metric, gsm8k_metric)}\n",
             f"{metric} % with a 95% bootstrap interval over questions, seed-averaged "
             f"({'/'.join(map(str, seeds)) or '-'} seeds per trained method); best trivial: always the "
             "majority answer position; (below): under it.\n",
             markdown_table(header, rows, left=1)]
    mine = [(c, p) for c, p in zip(a.found, a.adjusted) if c.method == "bitune"]
    mine += [(q, p) for q, p in zip(a.pools, a.adjusted[len(a.found):]) if q.method == "bitune"]
    if mine:
        versus = [b for b in sorted({c.baseline for c, _ in mine}, key=method_key)]
        table: dict[str, dict[str, str]] = {}
        for c, p in mine:
            single = [x.where for x in c.parts if len(x.pairs) == 1]
            mark = ""
            if single:  # one training run per method there: the interval does not cover training seeds
                mark = f" (1 seed pair on {', '.join(single)})" if len(c.parts) > 1 else " (1 seed pair)"
            table.setdefault(c.where, {})[c.baseline] = f"{_points(c.interval)}, Holm p {p:.2g}{mark}"
        parts += ["\n# Bitune minus each baseline (points)\n",
                  "Per question, paired on the same questions and seeds; 95% two-level interval (seed pairs, then "
                  f"questions); Holm p over all {len(a.adjusted)} comparisons of the full report (resolved at 5% "
                  "below 0.05). (1 seed pair): one training run per method, so the interval covers other questions "
                  "but not other training seeds; read it as provisional.\n",
                  markdown_table(["", *(f"vs {b}" for b in versus)],
                                 [[w, *(cells.get(b, "") for b in versus)] for w, cells in table.items()])]
    if source:
        parts.append(f"\nThe full report (every comparison, per seed, McNemar, wall time): {source}.\n")
    return "\n".join(parts)


def print_report(report: Report, title: str) -> None:
    table = Table(title=title)
    for i, col in enumerate(report.header()):
        table.add_column(col, justify="left" if i == 0 else "right")
    for row in report.rows():
        table.add_row(*row)
    Console().print(table)


def write_report(report: Report, output: Path, markdown: str | None = None) -> tuple[Path, Path]:
    output.mkdir(parents=True, exist_ok=True)
    md, cs = output / "report.md", output / "report.csv"
    write_text_atomic(md, markdown if markdown is not None else report.markdown())
    write_text_atomic(cs, report.csv())
    return md, cs


EMBED_BEGIN = "<!-- bitune report: begin (generated by 'bitune report --embed'; do not edit) -->"
EMBED_END = "<!-- bitune report: end -->"


def embedded(markdown: str) -> str:
    """The report as it appears inside another document: every heading two levels deeper."""
    return "\n".join("##" + line if line.startswith("#") else line for line in markdown.splitlines()) + "\n"


def embed_report(document: Path, markdown: str, begin_marker: str = EMBED_BEGIN, end_marker: str = EMBED_END,
                 option: str = "--embed") -> None:
    """Replace the block between ``begin_marker`` and ``end_marker`` in ``document`` with the report.

    Raises:
        BituneError: the document is missing or lacks the markers (nothing is written).
    """
    text = read_text(check_input_file(document, option), option)
    begin, end = text.find(begin_marker), text.find(end_marker)
    if begin < 0 or end < begin:
        raise BituneError(f"{option} {document}: add the lines {begin_marker!r} and {end_marker!r} where the "
                          "report goes")
    head, tail = text[:begin + len(begin_marker)], text[end:]
    write_text_atomic(document, f"{head}\n{embedded(markdown)}{tail}")
