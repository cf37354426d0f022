"""Count what one decoding step runs, the base model against Bitune merged and unmerged (docs/benchmarks.md):
Python calls (``sys.setprofile``) and aten operators (``torch.profiler``). Counts, not times: they do not depend
on the machine's load.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/decode_calls.py [--model smollm2-135m]
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter

import torch
from torch.profiler import ProfilerActivity, profile

from bitune import BituneConfig, BituneModel
from bitune.bench.helpers import build, random_prompts
from bitune.hub import load_model


def counts(model: BituneModel, prompt) -> tuple[int, Counter]:
    pick = lambda logits: logits.argmax(-1)  # noqa: E731
    state = model.decode_step(model.prefill(*prompt), pick)  # warm-up
    calls = [0]

    def count(frame, event, arg):
        if event in ("call", "c_call"):
            calls[0] += 1
    sys.setprofile(count)
    state = model.decode_step(state, pick)
    sys.setprofile(None)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        model.decode_step(state, pick)
    return calls[0], Counter({e.key: e.count for e in prof.key_averages()})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    args = parser.parse_args()
    device = torch.device("cpu")
    base, _ = load_model(args.model, dtype=torch.float32)
    models = {"base": BituneModel(base.eval(), BituneConfig(variant="pretrained", base_model=args.model))}
    for name, merge in (("bitune merged", True), ("bitune unmerged", False)):
        model, _ = build(args.model, "bitune", device, torch.float32)
        models[name] = model.eval().merge() if merge else model.eval()
    prompt = random_prompts(models["base"].text_config.vocab_size, 1, 64, device)
    with torch.no_grad():
        results = {name: counts(model, prompt) for name, model in models.items()}
    base_ops = results["base"][1]
    for name, (calls, ops) in results.items():
        extra = sum((ops - base_ops).values())
        print(f"{name}: {calls} Python calls, {sum(ops.values())} aten operators ({extra} more than the base model)")


if __name__ == "__main__":
    from bitune.cli import run_script

    sys.exit(run_script("decode calls", main))
