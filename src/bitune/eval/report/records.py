"""Finding and loading ``bitune eval`` results (``eval.json``) and checking them: well-formed files, per-question
tables that match their own summaries, one split per task, one setting (base model, template, ``--limit``) per
report; and the per-question correctness of every run, aligned question by question (:func:`collect_runs`)."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ...errors import BituneError
from ...files import check_named
from ...records import record_splits
from .. import RESULT_FILE, SCHEMA
from .settings import SETTINGS_FILE, ReportSettings, read_settings

TASK_ORDER = ("piqa", "arc_challenge", "arc_easy", "csqa", "siqa", "mmlu", "gsm8k")
TASK_TITLES = {"piqa": "PIQA", "arc_challenge": "ARC-C", "arc_easy": "ARC-E", "csqa": "CSQA", "siqa": "SIQA",
               "mmlu": "MMLU", "gsm8k": "GSM8K"}


def task_title(task: str) -> str:
    """The name a report gives a task (``ARC-C`` for ``arc_challenge``; an unknown task by its own name)."""
    return TASK_TITLES.get(task, task)
def results_below(folder: Path) -> list[Path]:
    """Every ``eval.json`` below ``folder`` (sorted per searched folder; linked folders followed), or, where it
    holds a ``report.yaml`` whose ``runs`` names its report's folders, below those only; none found is an empty
    list.

    Raises:
        BituneError: ``runs`` names a folder that does not exist (its methods would be missing from the report
            without a word).
    """
    runs = read_settings(folder / SETTINGS_FILE).runs if (folder / SETTINGS_FILE).is_file() else None
    missing = [run for run in runs or () if not (folder / run).is_dir()]
    if missing:
        raise BituneError(f"{folder / SETTINGS_FILE}: runs names {missing[0]!r}, but {folder / missing[0]} is not a "
                          "folder; make it, or take it out of runs")
    searched = [folder] if runs is None else [folder / run for run in runs]
    return [f for d in searched for f in sorted(_eval_files(d))]


def _eval_files(folder: Path) -> list[Path]:
    """Every ``eval.json`` below ``folder``, through linked folders too (a study may link the runs of an earlier
    study it is compared with: they keep their own commit and batch digests), each real folder read once."""
    seen: set[str] = set()
    found = []
    for root, dirs, files in os.walk(folder, followlinks=True):
        real = os.path.realpath(root)
        if real in seen:  # a link back up, or two links to one run
            dirs[:] = []
            continue
        seen.add(real)
        dirs.sort()  # the first link to a run, by name, is the one read
        if RESULT_FILE in files:
            found.append(Path(root) / RESULT_FILE)
    return found


def find_results(paths: list[str]) -> list[Path]:
    """Eval JSON files: given files, plus every ``eval.json`` below given folders (:func:`results_below`)."""
    files: list[Path] = []
    for p in (Path(check_named(p, "RUN")) for p in paths):  # "" would search the current folder
        if p.is_file():
            files.append(p)
        elif p.is_dir():
            files += results_below(p)
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


def _other_questions(run: str, doc_ids: list[int], entry: TaskRuns) -> str:
    """How ``run``'s questions differ from those of the runs before it: their number (another ``--limit``) or,
    as many, which ones (another split or sample)."""
    label, first = next(((m, runs.seeds[0]) for m, runs in entry.methods.items()), ("?", None))
    if len(doc_ids) != len(entry.doc_ids):
        return (f"run {run} was evaluated on {len(doc_ids)} questions, run {label} (seed {first}) on "
                f"{len(entry.doc_ids)} (different --limit?)")
    here, there = next((a, b) for a, b in zip(doc_ids, entry.doc_ids) if a != b)
    return (f"runs {run} and {label} (seed {first}) were evaluated on as many ({len(doc_ids)}) but other "
            f"questions (doc_id {here} in one, doc_id {there} in the other: another split, data version or sample)")


def collect_runs(records: list[dict], metric: str = "acc", gsm8k_metric: str = "exact_match_strict",
                 settings: ReportSettings | None = None) -> tuple[dict[str, TaskRuns], list[str]]:
    """Per task, each method's per-question correctness (from the eval JSONs' ``samples``).

    Args:
        records: the runs' evaluation records (:func:`load_records`), one per method, seed and task set.
        metric: the multiple-choice metric whose per-question values are read, ``acc`` or ``acc_norm``.
        gsm8k_metric: GSM8K's metric.
        settings: the study's method order (:class:`ReportSettings`; default: by name).

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
            run = f"{r['label']} (seed {seed})"
            if doc_ids != entry.doc_ids:
                raise BituneError(f"task {task}: {_other_questions(run, doc_ids, entry)}; paired statistics need "
                                  "the same questions")
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
    key = (settings or ReportSettings()).method_key
    for tr in ordered.values():
        tr.methods = {m: tr.methods[m] for m in sorted(tr.methods, key=key)}
    return ordered, skipped
