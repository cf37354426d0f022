"""The evaluation results a model card shows: the ``eval.json`` of ``bitune eval`` that belongs to a checkpoint,
found beside it and read into :class:`Evaluation` (a file that is not such a result is ignored: a card never stops
a save)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..records import RESULT_FILE as EVAL_FILE
from ..records import SCHEMA as EVAL_SCHEMA

GSM8K_METRIC = "exact_match_strict"
"""The metric reported for gsm8k (``acc`` for every other task), as ``bitune report`` does."""

@dataclass(frozen=True)
class Score:
    """One task's result in an ``eval.json``."""

    task: str
    metric: str
    value: float
    n: int | None
    low: float | None
    """Lower end of the 95% interval (None: the file holds nothing to compute it from)."""
    high: float | None
    interval: str
    """How the interval was computed: ``bootstrap`` over the questions (as ``bitune report``), ``normal``
    (value +- 1.96 stderr), or ``none``."""

@dataclass(frozen=True)
class Evaluation:
    """The results of one ``eval.json`` beside a checkpoint."""

    source: str
    """Where the file lies, relative to the checkpoint folder (``eval.json`` or ``../eval.json``)."""
    scores: list[Score] = field(default_factory=list)
    limit: int | None = None
    """``bitune eval --limit`` (questions per task; None: whole splits)."""
    created: str | None = None
    """When the evaluation was written (ISO 8601)."""
    template: str | None = None
    """The prompt template the evaluation used."""

def find_evaluation(directory: str | Path, own: bool = True) -> Evaluation | None:
    """The results of the ``eval.json`` that belongs to the checkpoint ``directory``, if any.

    ``directory/eval.json`` belongs to it; so does ``directory/../eval.json`` (where ``bitune eval`` writes the
    result of a run's ``final/``) when the checkpoint it records has this folder's name. A file that is not a
    ``bitune eval`` result is ignored: a card never stops a save.

    Args:
        own: also look in ``directory`` itself (False: a save is about to replace the folder, its files with it).
    """
    directory = Path(directory)
    found = [(directory / EVAL_FILE, EVAL_FILE)] if own else []
    for path, source in [*found, (directory.parent / EVAL_FILE, f"../{EVAL_FILE}")]:
        record = _read_eval(path)
        if record is None:
            continue
        checkpoint = record["config"].get("checkpoint")
        if source != EVAL_FILE and (not isinstance(checkpoint, str) or Path(checkpoint).name != directory.name):
            continue
        evaluation = _evaluation_of(record, source)
        return evaluation if evaluation.scores else None
    return None

def _read_eval(path: Path) -> dict | None:
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or record.get("schema") != EVAL_SCHEMA or not isinstance(record.get("tasks"), dict):
        return None
    if not isinstance(record.get("config"), dict):
        record["config"] = {}
    return record

def _evaluation_of(record: dict, source: str) -> Evaluation:
    config, samples = record["config"], record.get("samples") or {}
    scores = []
    for task, metrics in record["tasks"].items():
        metric = GSM8K_METRIC if task == "gsm8k" else "acc"
        value = metrics.get(metric) if isinstance(metrics, dict) else None
        if not _number(value):
            continue
        n = metrics.get("n") if isinstance(metrics.get("n"), int) else None
        low = high = None
        how = "none"
        table = samples.get(task) if isinstance(samples, dict) else None
        column = table.get(metric) if isinstance(table, dict) else None
        if isinstance(column, list) and column and all(_number(v) for v in column):
            from ..stats import bootstrap_mean

            ci = bootstrap_mean(column)
            low, high, how = ci.low, ci.high, "bootstrap"
            n = n if n is not None else len(column)
        elif _number(metrics.get(f"{metric}_stderr")):
            half = 1.96 * metrics[f"{metric}_stderr"]
            low, high, how = max(0.0, value - half), min(1.0, value + half), "normal"
        scores.append(Score(task, metric, float(value), n, low, high, how))
    limit = config.get("limit") if isinstance(config.get("limit"), int) else None
    created = record.get("created") if isinstance(record.get("created"), str) else None
    template = config.get("template") if isinstance(config.get("template"), str) else None
    return Evaluation(source, scores, limit, created, template)

def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
