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


def compare(folder: Path, a: str, b: str, seeds: list[int]) -> dict:
    """The counts and training statistics that :func:`main` prints, each run read once."""
    runs = {(m, s): answers(folder / f"{m}-{s}") for m in (a, b) for s in seeds}
    out = {"differ": {s: differ(runs[a, s], runs[b, s]) for s in seeds}, "n": len(runs[a, seeds[0]])}
    if len(seeds) >= 2:
        out["scale"] = differ(runs[a, seeds[0]], runs[a, seeds[1]])
    losses, norms = [], []
    for seed in seeds:
        la, lb = logged(folder / f"{a}-{seed}"), logged(folder / f"{b}-{seed}")
        for step in la.keys() & lb.keys():
            losses.append(abs(lb[step][0] - la[step][0]))
            norms.append(lb[step][1] / la[step][1])
    if losses:
        out["training"] = {"steps": len(losses), "loss_max": max(losses), "loss_median": statistics.median(losses),
                           "norm_min": min(norms), "norm_max": max(norms), "norm_median": statistics.median(norms)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path, help="a task folder of a study (holding <method>-<seed>/eval.json)")
    parser.add_argument("a", help="one method's label")
    parser.add_argument("b", help="the other method's label")
    parser.add_argument("--seeds", nargs="+", type=int, default=[42, 43, 44])
    args = parser.parse_args()
    c = compare(args.folder, args.a, args.b, args.seeds)
    for seed, k in c["differ"].items():
        print(f"seed {seed}: {args.a} and {args.b} answer {k} of {c['n']} questions differently")
    if tr := c.get("training"):
        print(f"training, {tr['steps']} steps logged by both: |loss difference| at most {tr['loss_max']:.3f} "
              f"(median {tr['loss_median']:.3f}); {args.b}'s gradient norm / {args.a}'s "
              f"{tr['norm_min']:.2f}-{tr['norm_max']:.2f} (median {tr['norm_median']:.2f})")
    if "scale" in c:
        s, t = args.seeds[:2]
        print(f"for scale: {args.a} seeds {s} and {t} answer {c['scale']} differently")


if __name__ == "__main__":
    from bitune.cli import run_script

    sys.exit(run_script("study agreement", main))
