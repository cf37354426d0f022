"""``bitune bench train``: training step time and peak memory of Bitune against the LoRA baseline.

Times full optimizer steps of Bitune (fused, batched and sequential passes) and the LoRA baseline on the same
model, random batch and lengths, interleaving them step by step so machine drift hits all alike, and prints each
ratio next to the FLOP ratio (2P + A) / (P + A), the floor of a perfect implementation (paper A.4).
Peak memory is each model's parameters + gradients + Adam moments, plus what a step adds: on CUDA the
allocator's peak above the memory allocated before the step, on CPU the tensors autograd saves for backward
(counted by storage), the part that differs between methods.
"""

from __future__ import annotations

import statistics
import time

import torch
from rich.console import Console
from rich.table import Table

from .helpers import build, count_saved, device_dtype, random_batch, shown, sync

PATHS = ("fused", "batched", "sequential")
"""The ways a Bitune model can run its passes (``prompt_passes``), each timed."""


def step(model, opt, batch, device) -> tuple[float, int]:
    """One optimizer step; returns (seconds, peak bytes of this model's training).

    Peak bytes = weights + gradients + Adam moments of this model, plus what the step adds on top: on CUDA the
    allocator's peak above what was allocated before the step (so other models kept on the device for the
    side-by-side comparison do not count), on CPU the storages autograd saves for backward.
    """
    sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    start = time.perf_counter()
    with count_saved() as saved:
        loss = model(*batch).loss
    loss.backward()
    torch.nn.utils.clip_grad_norm_(list(model.trainable_parameters().values()), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=False)
    sync(device)
    seconds = time.perf_counter() - start
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    trainable = sum(p.numel() * p.element_size() for p in model.trainable_parameters().values())
    added = torch.cuda.max_memory_allocated() - before if device.type == "cuda" else saved.total
    return seconds, params + 3 * trainable + added


def _lengths(text: str) -> list[tuple[int, int]]:
    try:
        lengths = [(int(p), int(a)) for p, a in (pair.split(":") for pair in text.split(","))]
    except ValueError:
        raise ValueError(f"--lengths {text!r}: expected PROMPT:ANSWER pairs, e.g. 64:64,256:64") from None
    if any(p < 2 or a < 1 for p, a in lengths):
        raise ValueError(f"--lengths {text!r}: prompts need >= 2 tokens and answers >= 1")
    return lengths


def bench_train(args) -> dict:
    """``bitune bench train``: measure (:func:`measure`), print (:func:`render`), return the record."""
    return shown(measure(args), render)


def measure(args) -> dict:
    """Time ``args.steps`` optimizer steps (after one warm-up) of LoRA and of Bitune's three paths at each
    ``--lengths`` pair; return the record."""
    if args.steps < 1 or args.batch_size < 1:
        raise ValueError("bench train needs --steps >= 1 and --batch-size >= 1")
    lengths = _lengths(args.lengths)
    device, dtype = device_dtype(args.dtype)
    lora = build(args.model, "lora", device, dtype)[0]
    positions = lora.text_config.max_position_embeddings
    if any(p + a > positions for p, a in lengths):
        raise ValueError(f"--lengths {args.lengths!r}: prompt + answer must fit the model's {positions} positions")
    bitune = build(args.model, "bitune", device, dtype)[0]  # one model, its passes run each of the three ways
    default = f"bitune_{bitune.forward_path()}"  # what prompt_passes="auto" trains with
    runs = {"lora": (lora, None), **{f"bitune_{p}": (bitune, p) for p in PATHS}}
    opts = {id(m): torch.optim.AdamW(m.trainable_parameters().values(), lr=1e-4) for m in (lora, bitune)}
    vocab = lora.text_config.vocab_size
    rows = []
    for P, A in lengths:
        batch = random_batch(vocab, args.batch_size, P, A, device)
        times = {name: [] for name in runs}
        peak = {name: 0 for name in runs}
        for i in range(args.steps + 1):
            for name, (model, passes) in runs.items():  # interleaved: drift hits every method alike
                if passes:
                    model.prompt_passes = passes
                seconds, mem = step(model, opts[id(model)], batch, device)
                if i:
                    times[name].append(seconds)
                peak[name] = max(peak[name], mem)
        med = {name: statistics.median(t) for name, t in times.items()}
        row = {"prompt": P, "answer": A, "flop_ratio": (2 * P + A) / (P + A),
               **{f"{n}_s": med[n] for n in runs}, **{f"{n}_peak_mb": peak[n] / 2**20 for n in runs}}
        for p in PATHS:
            row[f"time_ratio_{p}"] = med[f"bitune_{p}"] / med["lora"]
            row[f"memory_ratio_{p}"] = peak[f"bitune_{p}"] / peak["lora"]
        row["time_ratio"] = med[default] / med["lora"]
        row["memory_ratio"] = peak[default] / peak["lora"]
        rows.append(row)
    return {"device": str(device), "dtype": str(dtype), "model": args.model, "batch_size": args.batch_size,
            "steps": args.steps, "threads": torch.get_num_threads(), "default": default.removeprefix("bitune_"),
            "rows": rows}


def render(result: dict) -> None:
    """Print a :func:`measure` record as a table (the targets are stated in docs/benchmarks.md)."""
    default = result["default"]
    table = Table(title=f"Training step, {result['model']}, {result['device']} "
                        f"{result['dtype'].removeprefix('torch.')}, batch {result['batch_size']}, median of "
                        f"{result['steps']} (default path: {default})")
    for col in ("P", "A", "path", "s / step", "/ LoRA", "FLOP ratio", "/ FLOP ratio", "memory / LoRA"):
        table.add_column(col, justify="right")
    for r in result["rows"]:
        table.add_row(str(r["prompt"]), str(r["answer"]), "LoRA", f"{r['lora_s']:.3f}", "1", "", "", "1")
        for p in PATHS:
            ratio = r[f"time_ratio_{p}"]
            table.add_row("", "", p + (" *" if p == default else ""), f"{r[f'bitune_{p}_s']:.3f}", f"{ratio:.2f}",
                          f"{r['flop_ratio']:.2f}", f"{ratio / r['flop_ratio']:.2f}", f"{r[f'memory_ratio_{p}']:.2f}")
    Console().print(table)
    Console().print("* what prompt_passes='auto' trains with.")
