"""``bitune bench prefill``: reading prompts with both passes batched into one forward vs one forward per pass.

By prompt length and batch size, interleaved with the base model's own forward over the same prompts; names the
path ``prompt_passes="auto"`` picks for each, so its threshold can be checked against the measurements.
"""

from __future__ import annotations

import statistics

import torch
from rich.console import Console
from rich.table import Table

from ..hub import load_model
from .helpers import build, device_dtype, int_list, random_prompts, shown, timed


def bench_prefill(args) -> dict:
    """``bitune bench prefill``: measure (:func:`measure`), print (:func:`render`), return the record."""
    return shown(measure(args), render)


@torch.no_grad()
def measure(args) -> dict:
    """Read random prompts of each length and batch size with a merged Bitune model (fresh adapters: the same
    compute as trained ones), both prompt passes batched into one forward over 2B rows vs one forward per pass,
    interleaved round by round with the base model's own forward over the same prompts; reports the medians,
    the ratios and the path ``prompt_passes="auto"`` picks."""
    if args.rounds < 1:
        raise ValueError("bench prefill needs --rounds >= 1")
    lengths = int_list(args.lengths, "--lengths", 3)
    sizes = int_list(args.batch_sizes, "--batch-sizes", 1)
    device, dtype = device_dtype(args.dtype)
    base, _ = load_model(args.model, dtype=dtype)
    base = base.to(device).eval()
    model, _ = build(args.model, "bitune", device, dtype)
    model.eval().merge()
    if max(lengths) > model.text_config.max_position_embeddings:
        raise ValueError(f"--lengths: {max(lengths)} passes the model's {model.text_config.max_position_embeddings} "
                         "positions")

    rows = []
    for B in sizes:
        for P in lengths:
            ids, mask = random_prompts(model.text_config.vocab_size, B, P, device)
            runs = {"base": lambda: base(input_ids=ids[:, :-1], attention_mask=mask[:, :-1], use_cache=True,
                                         logits_to_keep=1)}
            for path in ("batched", "sequential"):
                def read(path=path):
                    model.prompt_passes = path
                    return model.prefill(ids, mask)
                runs[path] = read
            for fn in runs.values():
                fn()  # warm-up
            times = {name: [] for name in runs}
            for _ in range(args.rounds):
                for name, fn in runs.items():
                    times[name].append(timed(fn, device))
            model.prompt_passes = "auto"
            med = {name: statistics.median(t) for name, t in times.items()}
            auto = model.prefill_path(B * (P - 1))
            rows.append({"batch": B, "prompt_tokens": P, **{f"{k}_s": v for k, v in med.items()},
                         "batched_over_sequential": med["batched"] / med["sequential"], "auto": auto,
                         "auto_over_base": med[auto] / med["base"]})
    return {"device": str(device), "dtype": str(dtype), "model": args.model, "threads": torch.get_num_threads(),
            "rounds": args.rounds, "rows": rows}


def render(result: dict) -> None:
    """Print a :func:`measure` record as a table."""
    table = Table(title=f"Prefill, {result['model']}, {result['device']}, merged Bitune (fresh adapters), median of "
                        f"{result['rounds']} interleaved rounds")
    for col in ("batch", "prompt", "base s", "batched s", "sequential s", "batched / sequential", "auto picks",
                "auto / base"):
        table.add_column(col, justify="right")
    for r in result["rows"]:
        table.add_row(str(r["batch"]), str(r["prompt_tokens"]), f"{r['base_s']:.3f}", f"{r['batched_s']:.3f}",
                      f"{r['sequential_s']:.3f}", f"{r['batched_over_sequential']:.2f}", r["auto"],
                      f"{r['auto_over_base']:.2f}")
    Console().print(table)
