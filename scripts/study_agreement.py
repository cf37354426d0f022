"""How many questions two evaluated runs answer differently: the choice each run scores highest, compared question
by question from the runs' committed ``eval.json`` samples (their per-choice log-likelihoods).

    .venv/bin/python scripts/study_agreement.py results/smollm2-csqa-piqa-siqa/csqa lora lora16 --seeds 42 43 44

prints, per seed, the questions where ``<folder>/<a>-<seed>`` and ``<folder>/<b>-<seed>`` pick different choices,
and, for scale, how many the first method's first two seeds differ on. Counts both runs' correct and wrong answers
alike (the report's McNemar counts show only the questions where correctness differs). Then the two methods'
training side by side over every step both ``log.jsonl`` files logged: the largest and median absolute difference
of the loss, and the range and median of b's gradient norm over a's.
"""

import argparse
import json
import statistics
import sys
from pathlib import Path


def answers(run: Path) -> dict[int, int]:
    """The chosen answer (the highest-scoring choice) of each question of a run's one task, by document id."""
    path = run / "eval.json"
    if not path.is_file():
        found = sorted(p.parent.name for p in run.parent.glob("*/eval.json"))
        sys.exit(f"{path}: no such file (evaluated runs in {run.parent}: {', '.join(found) or 'none'})")
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        sys.exit(f"{path}: not valid JSON ({e})")
    samples = record.get("samples") or {}
    if len(samples) != 1:
        sys.exit(f"{run}/eval.json: expected the samples of one task, found {sorted(samples) or 'none'}")
    (task,) = samples.values()
    return {d: max(range(len(ll)), key=ll.__getitem__) for d, ll in zip(task["doc_id"], task["loglik"], strict=True)}


def logged(run: Path) -> dict[int, tuple[float, float]]:
    """A run's logged training steps: step -> (loss, gradient norm); none for a run without a training log."""
    path = run / "log.jsonl"
    if not path.is_file():
        return {}
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return {r["step"]: (r["loss"], r["grad_norm"]) for r in rows if "loss" in r and "grad_norm" in r}


def differ(a: dict[int, int], b: dict[int, int]) -> int:
    if a.keys() != b.keys():
        sys.exit("the two runs were scored on different questions")
    return sum(a[d] != b[d] for d in a)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path, help="a task folder of a study (holding <method>-<seed>/eval.json)")
    parser.add_argument("a", help="one method's label")
    parser.add_argument("b", help="the other method's label")
    parser.add_argument("--seeds", nargs="+", type=int, default=[42, 43, 44])
    args = parser.parse_args()
    for seed in args.seeds:
        a, b = (answers(args.folder / f"{m}-{seed}") for m in (args.a, args.b))
        print(f"seed {seed}: {args.a} and {args.b} answer {differ(a, b)} of {len(a)} questions differently")
    losses, norms = [], []
    for seed in args.seeds:
        a, b = (logged(args.folder / f"{m}-{seed}") for m in (args.a, args.b))
        for step in a.keys() & b.keys():
            losses.append(abs(b[step][0] - a[step][0]))
            norms.append(b[step][1] / a[step][1])
    if losses:
        print(f"training, {len(losses)} steps logged by both: |loss difference| at most {max(losses):.3f} "
              f"(median {statistics.median(losses):.3f}); {args.b}'s gradient norm / {args.a}'s "
              f"{min(norms):.2f}-{max(norms):.2f} (median {statistics.median(norms):.2f})")
    if len(args.seeds) >= 2:
        s, t = args.seeds[:2]
        print(f"for scale: {args.a} seeds {s} and {t} answer "
              f"{differ(answers(args.folder / f'{args.a}-{s}'), answers(args.folder / f'{args.a}-{t}'))} differently")


if __name__ == "__main__":
    main()
