"""``bitune eval``: evaluate a checkpoint or a base model on the paper's benchmarks with lm-evaluation-harness.

Writes one JSON per run: per-task metrics (``acc``/``acc_norm`` with standard errors for multiple choice,
``exact_match_strict``/``exact_match_flexible`` for GSM8K, and the number of questions), the run's config (Bitune
config, base model, checkpoint, training seed when the run folder records it, limit, batch size, package
versions) and timing. ``bitune report`` aggregates these files over seeds.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import platform
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from ..errors import BituneError
from ..cli import add_prompt_passes_option, add_threads_option
from ..files import check_output_file, write_text_atomic

HELP = "evaluate a checkpoint or base model with lm-evaluation-harness"
RESULT_FILE = "eval.json"
"""Name of the result file written into an output folder (and looked for by ``bitune report``)."""
SCHEMA = "bitune-eval/1"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.description = ("Evaluate a Bitune checkpoint (any variant) or a base model (as the 'pretrained' "
                          "baseline), zero-shot, on the paper's benchmarks read offline. Example:\n"
                          "  bitune eval --checkpoint runs/piqa-42/final --tasks piqa,arc_challenge --limit 100")
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", metavar="DIR", help="a Bitune checkpoint folder (e.g. a run's final/)")
    src.add_argument("--model", metavar="NAME", help="a base model name or folder, evaluated untrained")
    parser.add_argument("--base", metavar="NAME", help="with --checkpoint: base model to load instead of the "
                        "one the checkpoint records")
    parser.add_argument("--tasks", default="piqa,arc_challenge,csqa,siqa,mmlu",
                        help="comma-separated: piqa, arc_challenge, arc_easy, csqa, siqa, mmlu, gsm8k")
    parser.add_argument("--template", choices=("paper", "chat"), default=None,
                        help="paper: the tasks' prompts as they are (the paper's templates); chat: each prompt as a "
                             "user turn of the tokenizer's chat template, the choice right after the generation "
                             "prompt. Default: the template the checkpoint was trained with; paper for a base model "
                             "(--model), as the paper scores the pretrained baseline")
    parser.add_argument("--limit", type=int, help="evaluate only the first N questions of each task")
    parser.add_argument("--batch-size", type=int, default=8, help="rows per forward pass")
    parser.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    parser.add_argument("--dtype", default="float32", help="parameter dtype: float32, bfloat16 or float16")
    add_prompt_passes_option(parser)
    parser.add_argument("--seed", type=int, default=1234, help="lm-eval's random seeds (sampling only)")
    parser.add_argument("--max-new-tokens", type=int,
                        help="GSM8K: cap on generated tokens (default: the task's 256, as in the paper's setup)")
    parser.add_argument("--label", help="method name in reports (default: derived from the Bitune config)")
    parser.add_argument("--output", metavar="FILE|DIR",
                        help=f"result JSON file, or a folder to write {RESULT_FILE} into (default: next to the "
                             "checkpoint's final/ folder, i.e. the run folder; with --model: print only)")
    add_threads_option(parser)


def default_label(config) -> str:
    """Method name for tables: ``pretrained``, ``lora``, ``lora16``, ``bitune``, ``dora_bitune``, ..."""
    name = config.variant
    if config.variant != "pretrained":
        if config.rank != 8 and config.method in ("lora", "dora"):
            name += str(config.rank)
        if config.method != "lora":
            name = f"{config.method}_{name}"
    return name


def versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for pkg in ("bitune", "torch", "transformers", "peft", "lm_eval"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = "not installed"
    return out


def _train_seed(checkpoint: Path) -> int | None:
    """The training seed from the run folder's ``settings.yaml`` (written by ``bitune train``), if any."""
    import yaml

    for folder in (checkpoint, checkpoint.parent):
        path = folder / "settings.yaml"
        if path.is_file():
            data = yaml.safe_load(path.read_text()) or {}
            return data.get("seed")
    return None


def task_metrics(results: dict) -> dict[str, dict[str, float]]:
    """lm-eval's ``results`` -> ``{benchmark: {metric: value}}`` with ``,none`` filter suffixes removed."""
    from .tasks import PREFIX

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
    from .tasks import PREFIX

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
             max_new_tokens: int | None = None, template: str = "paper") -> tuple[dict, dict, dict]:
    """Run lm-eval on a model instance; returns ``(per-task metrics, timing, per-question samples)``.

    Args:
        lm: an lm-eval ``LM`` (e.g. :class:`bitune.eval.lm.BituneLM`).
        tasks: benchmark names (``piqa`` or ``bitune_piqa``), a list or comma-separated.
        limit: first N questions per task (None: all).
        seed: lm-eval's python/numpy/torch seed.
        max_new_tokens: overrides the generative tasks' ``max_gen_toks`` (None: the task's own).
        template: ``"paper"`` (the tasks' prompts as they are) or ``"chat"`` (lm-eval's ``apply_chat_template``:
            each prompt a user turn of the chat template).
    """
    import lm_eval
    from lm_eval.tasks import TaskManager

    from .tasks import make_tasks

    start = time.perf_counter()
    with quiet_lm_eval():
        task_objs = make_tasks(tasks)
    loaded = time.perf_counter()
    with quiet_lm_eval():
        # Our tasks are Task objects: lm-eval's default TaskManager would first index its ~10k bundled YAML
        # files (18 s on a 2-core machine, every call) to resolve names nobody asks for.
        results = lm_eval.simple_evaluate(model=lm, tasks=task_objs, limit=limit, random_seed=seed,
                                          numpy_random_seed=seed, torch_random_seed=seed,
                                          fewshot_random_seed=seed, bootstrap_iters=1000, log_samples=True,
                                          task_manager=TaskManager(include_defaults=False),
                                          apply_chat_template=template == "chat",
                                          gen_kwargs={"max_gen_toks": max_new_tokens} if max_new_tokens else None)
    done = time.perf_counter()
    timing = {"data_s": round(loaded - start, 3), "eval_s": round(done - loaded, 3)}
    return task_metrics(results), timing, task_samples(results)


def output_path(args: argparse.Namespace) -> Path | None:
    if args.output:
        out = Path(args.output)
        return out if out.suffix == ".json" else out / RESULT_FILE
    if args.checkpoint:
        ckpt = Path(args.checkpoint).resolve()
        return (ckpt.parent if ckpt.name == "final" else ckpt) / RESULT_FILE
    return None


class _DropNotOurs(logging.Filter):
    """Drops lm-eval's advice about its own CLI (``--metadata``), which does not apply to ``bitune eval``."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Custom kwargs can be passed to `--metadata`" not in record.getMessage()


@contextlib.contextmanager
def quiet_lm_eval():
    """Silence lm-eval's output that is not ours: its ``--metadata`` advice and the "fatal: not a git repository"
    its git-hash lookup lets git print outside a git checkout (the hash is still recorded when there is one)."""
    import subprocess

    from lm_eval import evaluator

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


def run(args: argparse.Namespace) -> int:
    if args.limit is not None and args.limit < 1:
        raise BituneError(f"--limit must be >= 1, got {args.limit}")
    if args.batch_size < 1:
        raise BituneError(f"--batch-size must be >= 1, got {args.batch_size}")
    if output_path(args) is not None:
        check_output_file(output_path(args), "--output")  # before the evaluation, not after it
    evaluate_run(checkpoint=args.checkpoint, model_name=args.model, base=args.base, tasks=args.tasks,
                 limit=args.limit, batch_size=args.batch_size, device=args.device, dtype=args.dtype,
                 seed=args.seed, label=args.label, max_new_tokens=args.max_new_tokens, output=output_path(args),
                 template=args.template, prompt_passes=args.prompt_passes)
    return 0


def evaluate_run(checkpoint: str | None = None, model_name: str | None = None, base: str | None = None,
                 tasks: str = "piqa", limit: int | None = None, batch_size: int = 8, device: str | None = None,
                 dtype: str = "float32", seed: int = 1234, label: str | None = None,
                 max_new_tokens: int | None = None, output: Path | None = None, template: str | None = None,
                 prompt_passes: str = "auto") -> dict:
    """Load a checkpoint (or base model), evaluate it, print the table and write the result JSON to ``output``.

    Returns:
        The result record (see the module docstring).
    """
    import torch

    from ..generate import pick_template
    from ..checkpoint import load_bitune
    from .lm import BituneLM
    from .tasks import make_tasks

    with quiet_lm_eval():
        make_tasks(tasks)  # unknown task names fail before the model loads
    if template not in (None, "paper", "chat"):
        raise BituneError(f"template={template!r} is not one of 'paper', 'chat' (or None: the recorded one)")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    t0 = time.perf_counter()
    model, tokenizer = load_bitune(checkpoint, model_name, base, dtype, device, prompt_passes)
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
    metrics, timing, samples = evaluate(lm, tasks, limit, seed, max_new_tokens, template)
    config = model.config
    record = {
        "schema": SCHEMA,
        "label": label or default_label(config),
        "tasks": metrics,
        "config": {
            "checkpoint": str(Path(checkpoint).resolve()) if checkpoint else None,
            "model": config.base_model or model_name, "bitune": config.to_dict(),
            "train_seed": _train_seed(Path(checkpoint)) if checkpoint else None,
            "eval_seed": seed, "limit": limit, "batch_size": batch_size, "device": device, "template": template,
            "prompt_passes": model.execution(answer=False),
            "dtype": dtype, "num_fewshot": 0, "max_new_tokens": max_new_tokens, "versions": versions(),
        },
        "timing": {"load_s": round(load_s, 3), **timing, "total_s": round(time.perf_counter() - t0, 3)},
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "samples": samples,
    }
    _print(record)
    if output is not None:
        write_text_atomic(output, json.dumps(record, indent=2) + "\n")
        print(f"bitune eval: wrote {output}")
    return record


def _print(record: dict) -> None:
    from rich.console import Console
    from rich.table import Table

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
