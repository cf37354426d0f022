"""Evaluating a model on the paper's benchmarks with lm-evaluation-harness, and the result record ``bitune eval``
writes: per-task metrics (``acc``/``acc_norm`` with standard errors for multiple choice,
``exact_match_strict``/``exact_match_flexible`` for GSM8K, and the number of questions), per-question samples, the
run's config (Bitune config, base model, checkpoint, training seed when the run folder records it, limit, batch
size, package versions) and timing. ``bitune report`` aggregates these records over seeds.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import lm_eval
import torch
import yaml
from lm_eval import evaluator
from lm_eval.tasks import TaskManager
from rich.console import Console
from rich.table import Table

from ..errors import BituneError
from ..files import read_text, write_text_atomic
from ..generation import pick_template
from ..loading import load_bitune
from ..processes import world_size
from ..provenance import source_commit, versions
from . import RESULT_FILE, SCHEMA
from .lm import BituneLM
from .tasks import PREFIX, make_tasks, task_split

__all__ = ["RESULT_FILE", "SCHEMA", "evaluate", "evaluate_run", "quiet_lm_eval", "task_metrics", "task_samples"]


def default_label(config) -> str:
    """Method name for tables: ``pretrained``, ``lora``, ``lora16``, ``bitune``, ``dora_bitune``, ..."""
    name = config.variant
    if config.variant != "pretrained":
        if config.rank != 8 and config.method in ("lora", "dora"):
            name += str(config.rank)
        if config.method != "lora":
            name = f"{config.method}_{name}"
    return name


def _train_seed(checkpoint: Path) -> int | None:
    """The training seed from the run folder's ``settings.yaml`` (written by ``bitune train``), if any.

    Raises:
        BituneError: that file is not UTF-8, not YAML, not a mapping, or its seed is not a whole number (the
            report pairs runs by it: a wrong one would pair the wrong runs).
    """
    for folder in (checkpoint, checkpoint.parent):
        path = folder / "settings.yaml"
        if path.is_file():
            try:
                data = yaml.safe_load(read_text(path, "run settings")) or {}
            except yaml.YAMLError as e:
                raise BituneError(f"{path}: not valid YAML ({' '.join(str(e).split())}); the training seed is read "
                                  "from it") from e
            seed = data.get("seed") if isinstance(data, dict) else None
            if not isinstance(data, dict) or not (seed is None or type(seed) is int):
                raise BituneError(f"{path}: not the settings of a 'bitune train' run (a mapping with an integer "
                                  "seed); the training seed is read from it")
            return seed
    return None


def task_metrics(results: dict) -> dict[str, dict[str, float]]:
    """lm-eval's ``results`` -> ``{benchmark: {metric: value}}`` with ``,none`` filter suffixes removed."""
    out = {}
    for task, metrics in results["results"].items():
        clean = {k.split(",")[0]: v for k, v in metrics.items()
                 if k not in ("alias", "sample_len") and isinstance(v, (int, float))}
        n = results.get("n-samples", {}).get(task, {})
        clean["n"] = n.get("effective", n.get("original"))
        out[task.removeprefix(PREFIX)] = clean
    return out


def task_samples(results: dict) -> dict[str, dict[str, list]]:
    """lm-eval's logged samples -> per benchmark, parallel lists over its questions in doc order: ``doc_id``,
    ``gold`` (the target), every per-question metric (``acc``, ``acc_norm`` or ``exact_match_*``: 0/1) and, for
    multiple choice, ``loglik`` (the log-likelihood of each choice). This is what paired comparisons need."""
    out = {}
    for task, samples in (results.get("samples") or {}).items():
        rows = sorted(samples, key=lambda s: s["doc_id"])
        names = [m for m in (rows[0].get("metrics") or []) if m in rows[0]] if rows else []
        table: dict[str, list] = {"doc_id": [s["doc_id"] for s in rows],
                                  "gold": [s.get("target") for s in rows]}
        for name in names:
            table[name] = [float(s[name]) for s in rows]
        resps = [s.get("filtered_resps") for s in rows]
        if rows and all(isinstance(r, list) and r and isinstance(r[0], (list, tuple)) for r in resps):
            table["loglik"] = [[round(float(c[0]), 6) for c in r] for r in resps]
        out[task.removeprefix(PREFIX)] = table
    return out


def evaluate(lm, tasks: list[str] | str, limit: int | None = None, seed: int = 1234,
             max_new_tokens: int | None = None, template: str = "paper",
             split: str | None = None) -> tuple[dict, dict, dict] | None:
    """Run lm-eval on a model instance; returns ``(per-task metrics, timing, per-question samples)`` (None on
    the ranks other than 0 of a multi-process evaluation, where lm-eval gathers everything on rank 0).

    Args:
        lm: an lm-eval ``LM`` (e.g. :class:`bitune.eval.lm.BituneLM`).
        tasks: benchmark names (``piqa`` or ``bitune_piqa``), a list or comma-separated.
        limit: first N questions per task (None: all).
        seed: lm-eval's python/numpy/torch seed.
        max_new_tokens: overrides the generative tasks' ``max_gen_toks`` (None: the task's own).
        template: ``"paper"`` (the tasks' prompts as they are) or ``"chat"`` (lm-eval's ``apply_chat_template``:
            each prompt a user turn of the chat template).
        split: the split of every task: None or ``"reported"`` (the paper's), ``"tuning"`` or a split name
            (:func:`bitune.data.datasets.resolve_split`).
    """
    start = time.perf_counter()
    with quiet_lm_eval():
        task_objs = make_tasks(tasks, split)
    loaded = time.perf_counter()
    gen_kwargs = None if max_new_tokens is None else {"max_gen_toks": max_new_tokens}  # None: the task's own
    with quiet_lm_eval():
        # Our tasks are Task objects: lm-eval's default TaskManager would first index its ~10k bundled YAML
        # files (18 s on a 2-core machine, every call) to resolve names nobody asks for.
        results = lm_eval.simple_evaluate(model=lm, tasks=task_objs, limit=limit, random_seed=seed,
                                          numpy_random_seed=seed, torch_random_seed=seed,
                                          fewshot_random_seed=seed, bootstrap_iters=1000, log_samples=True,
                                          task_manager=TaskManager(include_defaults=False),
                                          apply_chat_template=template == "chat",
                                          gen_kwargs=gen_kwargs)
    done = time.perf_counter()
    if results is None:
        return None
    timing = {"data_s": round(loaded - start, 3), "eval_s": round(done - loaded, 3)}
    return task_metrics(results), timing, task_samples(results)


class _DropNotOurs(logging.Filter):
    """Drops lm-eval's advice about its own CLI (``--metadata``), which does not apply to ``bitune eval``."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Custom kwargs can be passed to `--metadata`" not in record.getMessage()


@contextlib.contextmanager
def quiet_lm_eval():
    """Silence lm-eval's output that is not ours: its ``--metadata`` advice and the "fatal: not a git repository"
    its git-hash lookup lets git print outside a git checkout (the hash is still recorded when there is one)."""
    def git_hash() -> str | None:
        done = subprocess.run(["git", "describe", "--always"], capture_output=True, text=True)
        return done.stdout.strip() or None if done.returncode == 0 else None

    task_logger = logging.getLogger("lm_eval.api.task")
    drop = _DropNotOurs()
    task_logger.addFilter(drop)
    patch = hasattr(evaluator, "get_git_commit_hash")
    original = getattr(evaluator, "get_git_commit_hash", None)
    if patch:
        evaluator.get_git_commit_hash = git_hash
    try:
        yield
    finally:
        task_logger.removeFilter(drop)
        if patch:
            evaluator.get_git_commit_hash = original


def check_eval_options(limit: int | None = None, batch_size: int = 8, max_new_tokens: int | None = None,
                       seed: int = 1234, label: str | None = None) -> None:
    """The numbers an evaluation is given, checked before anything loads (``bitune eval`` and ``bitune sweep``,
    which checks them before it trains); a BituneError names the option."""
    if limit is not None and not 1 <= limit <= sys.maxsize:
        raise BituneError(f"--limit must be a number of questions >= 1, got {limit}")
    if batch_size < 1:
        raise BituneError(f"--batch-size must be >= 1, got {batch_size}")
    if max_new_tokens is not None and max_new_tokens < 1:
        raise BituneError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
    if not 0 <= seed < 2**32:
        raise BituneError(f"--seed must be in [0, 2**32), got {seed}")
    if label is not None and not label.strip():
        raise BituneError("--label is empty: name the run, or leave --label out for the default")


def evaluate_run(checkpoint: str | None = None, model_name: str | None = None, base: str | None = None,
                 tasks: str = "piqa", limit: int | None = None, batch_size: int = 8, device: str | None = None,
                 dtype: str = "float32", seed: int = 1234, label: str | None = None,
                 max_new_tokens: int | None = None, output: Path | None = None, template: str | None = None,
                 prompt_passes: str = "auto", merge: bool = True, split: str | None = None) -> dict | None:
    """Load a checkpoint (or base model), evaluate it on ``split`` of each task (see :func:`evaluate`), print the
    table and write the result JSON to ``output`` (``config.splits`` records each task's split).

    Under a launcher of N processes (``WORLD_SIZE`` > 1) each process scores every N-th question and rank 0
    gathers, prints and writes the whole record; the other ranks return None.

    Returns:
        The result record (see the module docstring); ``output`` is written as JSON when given.
    """
    check_eval_options(limit, batch_size, max_new_tokens, seed, label)
    with quiet_lm_eval():
        splits = {t.config.task.removeprefix(PREFIX): task_split(t) for t in make_tasks(tasks, split)}
    train_seed = _train_seed(Path(checkpoint)) if checkpoint else None  # a damaged settings.yaml too
    if template not in (None, "paper", "chat"):
        raise BituneError(f"template={template!r} is not one of 'paper', 'chat' (or None: the recorded one)")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and world_size() > 1:  # one GPU per launched process
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
    t0 = time.perf_counter()
    model, tokenizer = load_bitune(checkpoint, model_name, base, dtype, device, prompt_passes, merge=merge)
    if template is None and model.config.variant == "pretrained":
        template, why = "paper", "a base model is scored on the tasks' own prompts, the paper's protocol"
    else:
        template, why = pick_template(model, tokenizer, template)
    if template == "none":
        template, why = "paper", "trained on verbatim prompts: the tasks' prompts as they are"
    if template == "chat" and not getattr(tokenizer, "chat_template", None):
        raise BituneError(f"template 'chat': tokenizer {tokenizer.name_or_path!r} has no chat template")
    print(f"bitune eval: {template} template ({why})", file=sys.stderr)
    lm = BituneLM(model=model, tokenizer=tokenizer, batch_size=batch_size)
    load_s = time.perf_counter() - t0
    evaluated = evaluate(lm, tasks, limit, seed, max_new_tokens, template, split)
    if evaluated is None:  # a process other than rank 0 of a multi-process evaluation
        return None
    metrics, timing, samples = evaluated
    config = model.config
    record = {
        "schema": SCHEMA,
        "label": label or default_label(config),
        "tasks": metrics,
        "config": {
            "checkpoint": str(Path(checkpoint).resolve()) if checkpoint else None,
            "model": config.base_model or model_name, "bitune": config.to_dict(),
            "train_seed": train_seed, "splits": splits,
            "eval_seed": seed, "limit": limit, "batch_size": batch_size, "device": device, "template": template,
            "prompt_passes": model.prefill_path(),
            "dtype": dtype, "num_fewshot": 0, "max_new_tokens": max_new_tokens, "processes": lm.world_size,
            "versions": versions(), "commit": source_commit(),
        },
        "timing": {"load_s": round(load_s, 3), **timing, "total_s": round(time.perf_counter() - t0, 3),
                   "torch_threads": torch.get_num_threads()},
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "samples": samples,
    }
    _print(record)
    if output is not None:
        write_text_atomic(output, json.dumps(record, indent=2) + "\n")
        print(f"bitune eval: wrote {output}")
    return record


def _print(record: dict) -> None:
    table = Table(title=f"{record['label']} ({record['config']['model']})")
    for col in ("task", "metric", "value", "stderr", "n"):
        table.add_column(col)
    for task, metrics in record["tasks"].items():
        for name, value in metrics.items():
            if name.endswith("_stderr") or name == "n":
                continue
            err = metrics.get(f"{name}_stderr")
            table.add_row(task, name, f"{100 * value:.2f}",
                          f"{100 * err:.2f}" if isinstance(err, (int, float)) else "", str(metrics.get("n", "")))
    Console().print(table)
