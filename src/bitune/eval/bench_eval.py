"""Multiple-choice scoring speed: the ``bitune`` model type against lm-eval's ``hf`` on the same base model.

Both score the same lm-eval requests of one task (every choice of the first ``--limit`` questions) with the same
weights, tokenizer and batch size; the ``bitune`` side is the ``pretrained`` variant (prefill each question once,
score its choices from the cache), the ``hf`` side concatenates context and choice per row. Prints questions per
second for each, the speed-up, and the largest score difference (a parity check on a real model)::

    python -m bitune.eval.bench_eval --model smollm2-135m --task piqa --limit 20 --batch-size 8 --threads 2
"""

from __future__ import annotations

import argparse
import json
import time


def bench(model_name: str = "smollm2-135m", task: str = "piqa", limit: int = 20, batch_size: int = 8,
          device: str = "cpu", repeats: int = 1) -> dict:
    """Time ``loglikelihood`` over one task's requests for ``bitune`` and ``hf``; returns the measurements."""
    import torch
    from lm_eval.models.huggingface import HFLM

    from .lm import BituneLM, load_for_eval
    from .tasks import make_task

    model, tokenizer = load_for_eval(pretrained=model_name, device=device)
    t = make_task(task)
    t.build_all_requests(limit=limit)
    requests = [inst for inst in t.instances]
    questions = len({inst.doc_id for inst in requests})
    ours = BituneLM(model=model, tokenizer=tokenizer, batch_size=batch_size)
    theirs = HFLM(pretrained=model.weights.base, tokenizer=tokenizer, batch_size=batch_size, device=device)
    out = {"model": model_name, "task": task, "questions": questions, "requests": len(requests),
           "batch_size": batch_size, "device": device, "threads": torch.get_num_threads()}
    scores = {}
    for name, lm in (("hf", theirs), ("bitune", ours)):
        lm.loglikelihood(requests[: min(len(requests), batch_size)], disable_tqdm=True)  # warm-up
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            scores[name] = lm.loglikelihood(requests, disable_tqdm=True)
            best = min(best, time.perf_counter() - start)
        out[f"{name}_s"] = round(best, 3)
        out[f"{name}_questions_per_s"] = round(questions / best, 3)
    out["speedup"] = round(out["hf_s"] / out["bitune_s"], 3)
    out["max_abs_logprob_diff"] = max(abs(a[0] - b[0]) for a, b in zip(scores["bitune"], scores["hf"]))
    out["greedy_agree"] = all(a[1] == b[1] for a, b in zip(scores["bitune"], scores["hf"]))
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bitune.eval.bench_eval", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--task", default="piqa")
    parser.add_argument("--limit", type=int, default=20, help="questions")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, help="torch CPU threads")
    parser.add_argument("--repeats", type=int, default=1, help="timed runs; the fastest counts")
    args = parser.parse_args(argv)
    if args.threads is not None and args.threads < 1:
        parser.error(f"--threads {args.threads}: needs a positive number of threads")
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    print(json.dumps(bench(args.model, args.task, args.limit, args.batch_size, args.device, args.repeats), indent=2))


if __name__ == "__main__":
    main()
