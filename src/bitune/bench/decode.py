"""``bitune bench decode``: one decoding step (``BituneModel.decode_step``, what the server batches) against the
model's own forward on the same cache and inputs, per batch size, with a profile of where the time goes.
"""

from __future__ import annotations

from functools import partial

import torch
from rich.console import Console
from rich.table import Table

from ..config import BituneConfig
from ..hub import load_model
from ..model import BituneModel
from .helpers import device_dtype, int_list, random_prompts, shown, timed

PROFILE_GROUPS = {
    "matmuls": ("aten::mm", "aten::addmm", "aten::bmm", "aten::_mkl_linear", "aten::linear", "aten::matmul"),
    "attention": ("aten::_scaled_dot_product_flash_attention_for_cpu", "aten::scaled_dot_product_attention",
                  "aten::_scaled_dot_product_attention_math", "aten::_softmax", "aten::softmax"),
}
"""Operator names (self time) counted as each group of the decoding profile; every other operator is "rest"."""


def bench_decode(args) -> dict:
    """``bitune bench decode``: measure (:func:`measure`), print (:func:`render`), return the record."""
    return shown(measure(args), render)


def measure(args) -> dict:
    """Time ``BituneModel.decode_step`` (the base model as the ``pretrained`` variant: nothing but our wrapper
    around its forward) against the model's own forward on the same cache and inputs, per batch size, and
    profile the step with ``torch.profiler``: self time of matrix products, attention, and the rest."""
    from torch.profiler import ProfilerActivity, profile

    from ..passes import Prefill

    if args.steps < 1 or args.context < 2:
        raise ValueError("bench decode needs --steps >= 1 and --context >= 2")
    sizes = int_list(args.batch_sizes, "--batch-sizes", 1)
    device, dtype = device_dtype(args.dtype)
    base, _ = load_model(args.model, dtype=dtype)
    model = BituneModel(base.to(device).eval(), BituneConfig(variant="pretrained", base_model=args.model))
    positions = model.text_config.max_position_embeddings
    if args.context + args.steps + 8 > positions:
        raise ValueError(f"--context {args.context} + --steps {args.steps} pass the model's {positions} positions")
    pick = lambda logits: logits.argmax(-1)  # noqa: E731

    def fresh(B: int) -> Prefill:
        ids, mask = random_prompts(model.text_config.vocab_size, B, args.context, device)
        return model.prefill(ids, mask)

    def ours(state, n):
        for _ in range(n):
            state = model.decode_step(state, pick)
        return state

    def floor(state, n):  # the forward decode_step wraps, with the inputs prepared once (no per-step bookkeeping)
        cache, token = state.cache, state.last_token
        T = state.mask.shape[1]
        mask = torch.ones(token.shape[0], T + n + 1, dtype=state.mask.dtype, device=device)
        for i in range(n):
            pos = torch.full_like(token, T + i)
            out = model.weights.base(input_ids=token, attention_mask=mask[:, :T + i + 1], position_ids=pos,
                                     cache=cache, use_cache=True, logits_to_keep=1)
            token = pick(out.logits[:, -1]).reshape(-1, 1)
        return state

    rows = {}
    with torch.no_grad():
        for B in sizes:
            times = {}
            for name, fn in (("decode_step", ours), ("model forward", floor)):
                state = fn(fresh(B), 4)  # warm-up
                times[name] = timed(partial(fn, state, args.steps), device) / args.steps
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                ours(fresh(B), args.steps)
            groups = {g: 0.0 for g in (*PROFILE_GROUPS, "rest")}
            for event in prof.key_averages():
                group = next((g for g, names in PROFILE_GROUPS.items() if event.key in names), "rest")
                groups[group] += event.self_cpu_time_total
            total = sum(groups.values()) or 1.0
            rows[B] = {"step_ms": 1e3 * times["decode_step"], "forward_ms": 1e3 * times["model forward"],
                       "overhead": times["decode_step"] / times["model forward"],
                       "profile_share": {g: v / total for g, v in groups.items()},
                       "top_ops": [(e.key, e.self_cpu_time_total / total) for e in
                                   sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:8]]}
    return {"model": args.model, "device": str(device), "dtype": str(dtype), "threads": torch.get_num_threads(),
            "context": args.context, "steps": args.steps, "rows": {str(b): r for b, r in rows.items()}}


def render(result: dict) -> None:
    """Print a :func:`measure` record as a table."""
    table = Table(title=f"Decoding step, {result['model']}, {result['device']}, {result['threads']} threads, "
                        f"context {result['context']} tokens, {result['steps']} steps")
    for col in ("rows", "decode_step ms", "model forward ms", "ours / forward", "matmuls", "attention", "rest"):
        table.add_column(col, justify="right")
    for B, r in result["rows"].items():
        share = r["profile_share"]
        table.add_row(B, f"{r['step_ms']:.1f}", f"{r['forward_ms']:.1f}", f"{r['overhead']:.3f}",
                      f"{100 * share['matmuls']:.0f}%", f"{100 * share['attention']:.0f}%", f"{100 * share['rest']:.0f}%")
    Console().print(table)
