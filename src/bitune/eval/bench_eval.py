"""Multiple-choice scoring speed: the ``bitune`` model type against lm-eval's ``hf`` on the same base model.

All score the same lm-eval requests of one task (every choice of the first ``--limit`` questions) with the same
base weights, tokenizer and batch size: lm-eval's ``hf`` (context and choice concatenated per row), ``bitune``
with the ``pretrained`` variant (one prompt pass per question, every choice scored from its cache) and ``bitune``
with a two-pass Bitune model (a ``--checkpoint``, or the base model wrapped as Bitune with fresh adapters: the
same compute). Rounds are interleaved, the order reversed every round, and the machine's load average is printed
with the result, so a busy machine shows. Prints questions per second for each, the ratios to ``hf``, and the
largest score difference of ``pretrained`` to ``hf`` (a parity check on a real model)::

    python -m bitune.eval.bench_eval --model smollm2-135m --task arc_easy --limit 200 --batch-size 8 --threads 2
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
from lm_eval.models.huggingface import HFLM

from ..commands.options import ArgumentParser
from ..config import BituneConfig
from ..hub import DEFAULT_MODEL
from ..loading import load_bitune
from ..model import BituneModel
from .lm import BituneLM
from .tasks import make_task


def bench(model_name: str = DEFAULT_MODEL, task: str = "piqa", limit: int = 20, batch_size: int = 8,
          device: str = "cpu", rounds: int = 2, checkpoint: str | None = None) -> dict:
    """Time ``loglikelihood`` over one task's requests for ``hf``, ``pretrained`` and ``bitune``."""
    model, tokenizer = load_bitune(model=model_name, device=device)
    if checkpoint:
        two_pass, _ = load_bitune(checkpoint=checkpoint, device=device)
    else:
        base, _ = load_bitune(model=model_name, device=device)
        two_pass = BituneModel.wrap(base.weights.base, BituneConfig(variant="bitune")).eval()
    t = make_task(task)
    t.build_all_requests(limit=limit)
    requests = [inst for inst in t.instances]
    questions = len({inst.doc_id for inst in requests})
    lms = {"hf": HFLM(pretrained=model.weights.base, tokenizer=tokenizer, batch_size=batch_size, device=device),
           "pretrained": BituneLM(model=model, tokenizer=tokenizer, batch_size=batch_size),
           "bitune": BituneLM(model=two_pass, tokenizer=tokenizer, batch_size=batch_size)}
    out = {"model": model_name, "task": task, "questions": questions, "requests": len(requests),
           "batch_size": batch_size, "device": device, "threads": torch.get_num_threads(), "rounds": rounds,
           "checkpoint": checkpoint, "load_average_before": [round(x, 2) for x in os.getloadavg()]}
    for lm in lms.values():
        lm.loglikelihood(requests[: min(len(requests), batch_size)], disable_tqdm=True)  # warm-up
    times: dict[str, list[float]] = {name: [] for name in lms}
    scores = {}
    for r in range(rounds):
        for name in (list(lms) if r % 2 == 0 else list(lms)[::-1]):
            start = time.perf_counter()
            scores[name] = lms[name].loglikelihood(requests, disable_tqdm=True)
            times[name].append(time.perf_counter() - start)
    out["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
    for name, ts in times.items():
        out[f"{name}_s"] = [round(t, 3) for t in ts]
        out[f"{name}_questions_per_s"] = round(questions / min(ts), 3)
    for name in ("pretrained", "bitune"):
        out[f"{name}_over_hf"] = round(min(times["hf"]) / min(times[name]), 3)
    out["max_abs_logprob_diff"] = max(abs(a[0] - b[0]) for a, b in zip(scores["pretrained"], scores["hf"]))
    out["greedy_agree"] = all(a[1] == b[1] for a, b in zip(scores["pretrained"], scores["hf"]))
    return out


def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(prog="python -m bitune.eval.bench_eval", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--task", default="piqa")
    parser.add_argument("--limit", type=int, default=20, help="questions")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, help="torch CPU threads")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved timed rounds; the fastest counts")
    parser.add_argument("--checkpoint", help="a two-pass Bitune checkpoint (default: fresh Bitune adapters)")
    args = parser.parse_args(argv)
    if args.threads is not None and args.threads < 1:
        parser.error(f"--threads {args.threads}: needs a positive number of threads")
    if args.threads:
        torch.set_num_threads(args.threads)
    print(json.dumps(bench(args.model, args.task, args.limit, args.batch_size, args.device, args.rounds,
                           args.checkpoint), indent=2))


if __name__ == "__main__":
    main()
