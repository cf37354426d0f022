"""Coverage of the report's 95% intervals of a paired difference, by simulation where the truth is known.

Two methods are scored on ``n`` questions drawn from a population, each trained with ``S`` seeds; seed s of the
one is paired with seed s of the other. Question i has an easiness p_i ~ U(0.3, 0.7) shared by both methods
(the pairing), the method has a question-specific gain g_i ~ U(-h, h) on top of the true mean difference ``mu``,
and each trained run shifts all its questions by a seed effect ~ U(-w, w) (independent per run). A run answers
question i right with that probability (every probability stays inside [0, 1], so the expected difference over
other questions and other seeds is exactly ``mu``). For each scenario the script draws ``--sims`` such studies
and counts how often each interval contains ``mu``:

- question-level: :func:`bitune.stats.bootstrap_mean` of the seed-averaged differences (given these runs);
- two-level: :func:`bitune.stats.two_level_bootstrap` (seed pairs, then questions);
- seed t: the t-interval over the S per-seed-pair differences (S - 1 degrees of freedom);
- seed-aware: :func:`bitune.stats.seed_aware_test` (what ``bitune report`` decides by).

Usage::

    OMP_NUM_THREADS=1 .venv/bin/python scripts/stats_coverage.py --sims 1000 --seeds 3 --questions 1000

Scenarios (``w``, ``h``): ``seeds`` (0.05, 0): runs differ by seed, questions do not; ``questions`` (0, 0.2): the
method helps some questions and hurts others, seeds do not matter; ``both`` (0.03, 0.2).
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

SCENARIOS = {"seeds": (0.05, 0.0), "questions": (0.0, 0.2), "both": (0.03, 0.2)}
"""Name -> (seed effect half-width w, question-specific gain half-width h)."""
MU = 0.02
"""The true mean difference (2 points)."""


def simulate(rng: np.random.Generator, seeds: int, questions: int, mu: float, w: float, h: float) -> np.ndarray:
    """One simulated study: (seeds, questions) differences in {-1, 0, 1}, method minus baseline, expectation mu."""
    easy = rng.uniform(0.3, 0.7, questions)  # (n,)
    gain = rng.uniform(-h, h, questions) if h > 0 else np.zeros(questions)  # (n,)
    shift = rng.uniform(-w, w, (2, seeds)) if w > 0 else np.zeros((2, seeds))  # (2, S): method, baseline
    p_method = easy[None, :] + mu / 2 + gain[None, :] + shift[0][:, None]  # (S, n)
    p_base = easy[None, :] - mu / 2 + shift[1][:, None]  # (S, n)
    a = rng.random((seeds, questions)) < p_method
    b = rng.random((seeds, questions)) < p_base
    return a.astype(np.float64) - b.astype(np.float64)


def coverage(sims: int, seeds: int, questions: int, resamples: int, scenario: str, seed: int = 0) -> dict[str, float]:
    """The share of ``sims`` simulated studies whose interval contains the true difference, per interval."""
    from scipy.stats import t

    from bitune.stats import bootstrap_mean, seed_aware_test, two_level_bootstrap

    w, h = SCENARIOS[scenario]
    rng = np.random.default_rng(seed)
    hits = {"question-level": 0, "two-level": 0, "seed t": 0, "seed-aware": 0}
    for i in range(sims):
        diff = simulate(rng, seeds, questions, MU, w, h)
        ranges = {"question-level": bootstrap_mean(diff.mean(axis=0), resamples, seed=i),
                  "two-level": two_level_bootstrap(diff, resamples, seed=i),
                  "seed-aware": seed_aware_test(diff).interval}
        per_seed = diff.mean(axis=1)  # (S,)
        half = t.ppf(0.975, seeds - 1) * per_seed.std(ddof=1) / np.sqrt(seeds) if seeds > 1 else np.nan
        hits["seed t"] += bool(abs(per_seed.mean() - MU) <= half)
        for name, ci in ranges.items():
            hits[name] += bool(ci.low <= MU <= ci.high)
    return {name: count / sims for name, count in hits.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sims", type=int, default=1000, help="simulated studies per scenario")
    parser.add_argument("--seeds", type=int, default=3, help="seed pairs S per study")
    parser.add_argument("--questions", type=int, default=1000, help="questions n per study")
    parser.add_argument("--resamples", type=int, default=2000, help="bootstrap resamples per interval")
    args = parser.parse_args(argv)
    for name, value in vars(args).items():
        if value < (2 if name == "questions" else 1):
            print(f"stats_coverage: --{name} must be at least {2 if name == 'questions' else 1}, got {value}",
                  file=sys.stderr)
            return 2
    print(f"coverage of 95% intervals, {args.sims} studies per scenario, S = {args.seeds} seed pairs, "
          f"n = {args.questions} questions, true difference {100 * MU:.0f} points")
    print(f"{'scenario':10s} " + " ".join(f"{k:>15s}" for k in ("question-level", "two-level", "seed t", "seed-aware")))
    for scenario in SCENARIOS:
        result = coverage(args.sims, args.seeds, args.questions, args.resamples, scenario)
        print(f"{scenario:10s} " + " ".join(f"{100 * v:14.1f}%" for v in result.values()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
