"""False-positive rate, power and coverage of the report's tests of a paired difference, by simulation where the
truth is known, calibrated to study part 4 (Qwen2.5-Coder-0.5B, Bitune minus LoRA on ARC-Easy and CSQA).

A simulated study has the real design: two methods, ``S`` training seeds each, seed s of the one paired with seed
s of the other, every run scored on the same ``n`` questions. A run answers question i right when
``t_i +- g_i / 2 +- d_s / 2 + z > 0`` (``+`` for the method, ``-`` for the baseline; plus ``delta / 2`` each way
for a true difference):

- ``t_i ~ N(level, spread^2)``: how easy question i is, shared by both methods and every seed (questions shared
  across seeds);
- ``g_i ~ N(0, gain^2)``: how much more the method knows on question i than the baseline (zero on average);
- ``d_s ~ N(0, sd^2)``: how training seed s moves the method against the baseline (the scenario's seed effect);
- ``z ~ N(0, 1)`` per run and question, correlated ``shared`` between the two methods of one seed (the paired
  runs of a seed share their batches).

Without ``delta`` the expected difference is exactly 0 on every question (``g`` and ``d`` are symmetric), so a
test that rejects does so falsely. ``level``, ``spread``, ``gain`` and ``shared`` are fitted per task (``--measure``
prints the fit's moments beside the real ones): the accuracy, how often two seeds of one method agree on a
question, the residual mean square of the two-way (seed x question) table of differences (0.19 ARC-Easy, 0.11
CSQA), its question part beyond the residual, and the correlation of the two methods' per-question residuals
within a seed. The seed effect is the scenario: none; the median seed variance of the mean over the 22 three-seed
comparisons of part 4's report (0.4 points^2 at S = 3: a 1.1-point sd per seed pair); and seeds dominating (2.6
points^2, its largest, ARC-Easy Bitune minus the near-causal start: 2.8 points per seed pair). Beside them the
residual's share of the variance of the mean is 0.15-0.45 points^2.

The tests, each given the (S, n) table of per-seed-pair, per-question differences:

- question t: the question-level t over the seed-averaged differences (n - 1 degrees of freedom; these trained
  models, as the sign-flip test);
- Satterthwaite: the report's test before issue 64, a seed t's variance plus a question t's with Satterthwaite's
  degrees of freedom (:func:`satterthwaite_test`);
- seed t: a t over the S per-seed-pair differences (S - 1 degrees of freedom);
- seed-aware: :func:`bitune.stats.seed_aware_test`, what ``bitune report`` decides "resolved" by.

Usage::

    OMP_NUM_THREADS=1 .venv/bin/python scripts/stats_coverage.py --only null --sims 10000
    OMP_NUM_THREADS=1 .venv/bin/python scripts/stats_coverage.py --only power --power-sims 2000
    OMP_NUM_THREADS=1 .venv/bin/python scripts/stats_coverage.py --only coverage --coverage-sims 500
    OMP_NUM_THREADS=1 .venv/bin/python scripts/stats_coverage.py --measure results/qwen2.5-arc-easy-csqa
"""


import argparse
import functools
import math
import sys
from dataclasses import dataclass

import numpy as np

ALPHAS = (0.05, 0.01, 0.0028, 0.05 / 31)
"""The levels the false-positive rate is read at: 5%, 1%, about 0.05/18, and 0.05/31 (Holm's smallest threshold in
part 4's report of 31 comparisons)."""
SEED_SD = {"no seed effect": 0.0, "part 4 median": 1.1, "seeds dominate": 2.8}
"""Scenario -> sd in points of how one training seed pair moves the difference (0.4 and 2.6 points^2 of variance
of the mean at S = 3)."""
TESTS = ("question t", "Satterthwaite", "seed t", "seed-aware")
"""The tests compared, in table order (the last decides in ``bitune report``)."""


@dataclass(frozen=True)
class Design:
    """One task of study part 4 as the simulation draws it (the probit model of the module docstring)."""

    questions: int
    """Questions n of the task."""
    level: float
    """Mean easiness of a question (probit scale)."""
    spread: float
    """Sd of the easiness between questions."""
    gain: float
    """Sd of the method's question-specific gain over the baseline (zero mean)."""
    shared: float
    """Correlation of the two methods' per-question noise within one seed (shared batches)."""

    @functools.cache
    def expected(self, delta: float = 0.0) -> float:
        """The expected difference (a fraction) of a true difference ``delta`` on the latent scale, as
        :func:`simulate` draws it (``delta / 2`` to the method, ``-delta / 2`` to the baseline); with ``delta`` 0,
        its derivative at 0 (the factor from the latent scale to accuracy points)."""
        from scipy.stats import norm

        rng = np.random.default_rng(12345)
        t = rng.normal(self.level, self.spread, 200_000)  # (questions,)
        g = rng.normal(0.0, self.gain, 200_000)  # (questions,)
        if delta == 0.0:
            return float(np.mean(norm.pdf(t + g / 2)))
        return float(np.mean(norm.cdf(t + g / 2 + delta / 2) - norm.cdf(t - g / 2 - delta / 2)))

    def latent(self, points: float) -> float:
        """The latent ``delta`` whose expected difference is ``points`` (bisection on :meth:`expected`)."""
        low, high = 0.0, 5.0
        for _ in range(40):
            mid = (low + high) / 2
            low, high = (mid, high) if 100 * self.expected(mid) < points else (low, mid)
        return (low + high) / 2


DESIGNS = {"arc_easy": Design(2376, -0.109, 1.665, 0.378, 0.328), "csqa": Design(1221, -0.615, 2.522, 0.674, 0.604)}
"""Part 4's tasks, fitted to Bitune and LoRA's three seeds each (``--measure`` prints the fit beside the runs)."""


def simulate(rng: np.random.Generator, design: Design, seeds: int, seed_sd: float = 0.0, delta: float = 0.0,
             questions: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """One simulated study's answers.

    Args:
        rng: the random generator.
        design: the task (:class:`Design`).
        seeds: seed pairs S.
        seed_sd: sd in points of a seed pair's effect on the difference. Default 0.
        delta: the true difference on the latent scale (:meth:`Design.latent`). Default 0: the null.
        questions: n, when not the design's own.

    Returns:
        method: (S, n) 0/1 correctness of the method's runs.
        baseline: (S, n) 0/1 correctness of the baseline's runs.
    """
    n = questions or design.questions
    t = rng.normal(design.level, design.spread, n)  # (n,)
    g = rng.normal(0.0, design.gain, n)  # (n,)
    d = rng.normal(0.0, seed_sd / 100 / design.expected(), seeds) if seed_sd > 0 else np.zeros(seeds)  # (S,)
    shared = rng.standard_normal((seeds, n))  # (S, n): the batches a seed's two runs share
    own = rng.standard_normal((2, seeds, n))  # (2, S, n)
    z = math.sqrt(design.shared) * shared[None] + math.sqrt(1 - design.shared) * own  # (2, S, n)
    shift = (g[None, :] + d[:, None] + delta) / 2  # (S, n)
    return (t + shift + z[0] > 0).astype(np.float64), (t - shift + z[1] > 0).astype(np.float64)


def moments(method: np.ndarray, baseline: np.ndarray) -> dict[str, float]:
    """What the fit matches: mean accuracy, agreement of two seeds of one method, the residual mean square of the
    (S, n) table of differences, its question part beyond the residual ((MS_q - MS_e) / S), the correlation of the
    two methods' per-question residuals within a seed, and the seed variance of the mean difference (points^2)."""
    diff = method - baseline  # (S, n)
    S, n = diff.shape
    seeds, questions = diff.mean(axis=1), diff.mean(axis=0)
    residual = diff - seeds[:, None] - questions[None, :] + diff.mean()
    ms_e = float((residual ** 2).sum()) / ((S - 1) * (n - 1))
    ms_q, ms_s = S * float(questions.var(ddof=1)), n * float(seeds.var(ddof=1))
    own_a, own_b = method - method.mean(axis=0), baseline - baseline.mean(axis=0)
    pairs = [(s, u) for s in range(S) for u in range(S) if s < u]
    return {"accuracy": float((method.mean() + baseline.mean()) / 2),
            "seed agreement": float(np.mean([(x[s] == x[u]).mean() for x in (method, baseline) for s, u in pairs])),
            "residual MS": ms_e, "question part": (ms_q - ms_e) / S,
            "within-seed correlation": float(np.mean([np.corrcoef(own_a[s], own_b[s])[0, 1] for s in range(S)])),
            "seed variance of the mean (pts^2)": 1e4 * (ms_s - ms_e) / (n * S)}


def satterthwaite_test(differences: np.ndarray) -> float:
    """The report's test before issue 64: a t whose variance is the S per-seed-pair means' variance over S plus the
    n seed-averaged differences' variance over n, with Satterthwaite's degrees of freedom; the two-sided p."""
    from scipy.stats import t

    S, n = differences.shape
    a = float(differences.mean(axis=1).var(ddof=1)) / S
    b = float(differences.mean(axis=0).var(ddof=1)) / n
    if a + b <= 0:
        return 1.0
    df = (a + b) ** 2 / (a ** 2 / (S - 1) + b ** 2 / (n - 1))
    return float(2 * t.sf(abs(differences.mean()) / math.sqrt(a + b), df))


def p_values(differences: np.ndarray) -> dict[str, float]:
    """Each test's two-sided p of one (S, n) table of differences (S >= 2)."""
    from scipy.stats import t

    from bitune.stats import seed_aware_test

    S, n = differences.shape
    seeds, questions = differences.mean(axis=1), differences.mean(axis=0)
    mean = float(differences.mean())

    def two_sided(variance: float, df: int) -> float:
        return 1.0 if variance <= 0 else float(2 * t.sf(abs(mean) / math.sqrt(variance), df))

    return {"question t": two_sided(float(questions.var(ddof=1)) / n, n - 1),
            "Satterthwaite": satterthwaite_test(differences),
            "seed t": two_sided(float(seeds.var(ddof=1)) / S, S - 1),
            "seed-aware": seed_aware_test(differences).p}


def pooled_p_values(tables: list[np.ndarray]) -> dict[str, float]:
    """The pooled (task mean) p of the report's tests before and after issue 64 over one table per task."""
    from scipy.stats import t

    from bitune.stats import pooled_seed_aware_test

    mean = float(np.mean([d.mean() for d in tables]))
    terms = []
    for d in tables:
        S, n = d.shape
        terms += [(float(d.mean(axis=1).var(ddof=1)) / S / len(tables) ** 2, S - 1),
                  (float(d.mean(axis=0).var(ddof=1)) / n / len(tables) ** 2, n - 1)]
    variance = sum(v for v, _ in terms)
    df = variance ** 2 / sum(v ** 2 / k for v, k in terms)
    return {"Satterthwaite": float(2 * t.sf(abs(mean) / math.sqrt(variance), df)),
            "seed-aware": pooled_seed_aware_test(tables).p}


def rejections(sims: int, seeds: int, seed_sd: float, points: float = 0.0, alphas: tuple[float, ...] = ALPHAS,
               designs: dict[str, Design] | None = None, questions: int | None = None,
               seed: int = 0) -> dict[str, dict[str, np.ndarray]]:
    """The share of ``sims`` simulated studies each test rejects at each alpha: the false-positive rate when
    ``points`` is 0, the power otherwise.

    Args:
        sims: simulated studies.
        seeds: seed pairs S per study.
        seed_sd: sd in points of a seed pair's effect on the difference.
        points: the true difference in points (0: the null).
        alphas: the levels. Default ``ALPHAS``.
        designs: the tasks; a study draws every one and pools them (task mean) when there are 2 or more. Default
            ``DESIGNS`` (part 4's ARC-Easy and CSQA).
        questions: n per task, when not the designs' own.
        seed: the simulation's seed.

    Returns:
        Per task (and ``pooled``), per test: (len(alphas),) rejection rates.
    """
    designs = designs or DESIGNS
    rng = np.random.default_rng(seed)
    deltas = {name: d.latent(points) if points else 0.0 for name, d in designs.items()}
    limits = np.asarray(alphas)
    counts: dict[str, dict[str, np.ndarray]] = {}
    for _ in range(sims):
        tables = {}
        for name, design in designs.items():
            method, baseline = simulate(rng, design, seeds, seed_sd, deltas[name], questions)
            tables[name] = method - baseline
        found = {name: p_values(d) for name, d in tables.items()}
        if len(tables) > 1:
            found["pooled"] = pooled_p_values(list(tables.values()))
        for where, ps in found.items():
            for test, p in ps.items():
                counts.setdefault(where, {}).setdefault(test, np.zeros(len(alphas)))
                counts[where][test] += p < limits
    return {where: {test: c / sims for test, c in tests.items()} for where, tests in counts.items()}


def coverage(sims: int, seeds: int, seed_sd: float, resamples: int = 2000, design: str = "arc_easy",
             questions: int | None = None, points: float = 2.0, seed: int = 0) -> dict[str, float]:
    """The share of ``sims`` simulated studies whose 95% interval contains the true difference ``points``: the
    question-level bootstrap (:func:`bitune.stats.bootstrap_mean`), the two-level bootstrap
    (:func:`bitune.stats.two_level_bootstrap`) and the seed-aware interval (:func:`bitune.stats.seed_aware_test`)."""
    from bitune.stats import bootstrap_mean, seed_aware_test, two_level_bootstrap

    task = DESIGNS[design]
    delta = task.latent(points)
    truth = task.expected(delta)  # a fraction
    rng = np.random.default_rng(seed)
    hits = {"question-level": 0, "two-level": 0, "seed-aware": 0}
    for i in range(sims):
        method, baseline = simulate(rng, task, seeds, seed_sd, delta, questions)
        diff = method - baseline
        ranges = {"question-level": bootstrap_mean(diff.mean(axis=0), resamples, seed=i),
                  "two-level": two_level_bootstrap(diff, resamples, seed=i),
                  "seed-aware": seed_aware_test(diff).interval}
        for name, ci in ranges.items():
            hits[name] += bool(ci.low <= truth <= ci.high)
    return {name: count / sims for name, count in hits.items()}


def measure(folder: str) -> None:
    """Print the moments of the study's Bitune and LoRA runs per task beside those of the fitted design."""
    from pathlib import Path

    from bitune.eval.report import collect_runs, find_results, find_settings, load_records

    tasks, _ = collect_runs(load_records(find_results([folder])), settings=find_settings([Path(folder)])[0])
    for task, runs in tasks.items():
        if task not in DESIGNS:
            continue
        common = [s for s in runs.methods["bitune"].seeds if s in runs.methods["lora"].seeds]
        real = moments(runs.methods["bitune"].of_seeds(common).astype(np.float64),
                       runs.methods["lora"].of_seeds(common).astype(np.float64))
        fit = moments(*simulate(np.random.default_rng(1), DESIGNS[task], len(common), questions=20_000))
        print(f"{task}: " + "; ".join(f"{k} {real[k]:.3f} (fit {fit[k]:.3f})" for k in real))


POINTS = (2.0, 4.0, 6.0, 8.0, 12.0, 16.0)
"""True differences (points) the power is read at."""


def print_null(sims: int, seeds: int) -> None:
    """The false-positive rate of every test over nominal, per scenario and task (and pooled)."""
    header = " ".join(f"{a:>8.4g}" for a in ALPHAS)
    print(f"false-positive rate / nominal, {sims} null studies per scenario, S = {seeds}; alpha: {header}")
    for scenario, sd in SEED_SD.items():
        for where, tests in rejections(sims, seeds, sd).items():
            for test, rate in tests.items():
                ratio = " ".join(f"{r / a:8.2f}" for r, a in zip(rate, ALPHAS))
                print(f"{scenario:15s} {where:9s} {test:14s} {ratio}")


def print_power(sims: int, seeds: int) -> None:
    """The seed-aware test's power at 5% and at 0.05/31 per scenario, true difference and task (and pooled)."""
    print(f"power of the seed-aware test, {sims} studies per true difference, S = {seeds}; "
          "rejected at alpha 0.05 / 0.05/31")
    for scenario, sd in SEED_SD.items():
        for points in POINTS:
            found = rejections(sims, seeds, sd, points, alphas=(0.05, 0.05 / 31), seed=1)
            cells = "  ".join(f"{where} {100 * t['seed-aware'][0]:5.1f}% / {100 * t['seed-aware'][1]:5.1f}%"
                              for where, t in found.items())
            print(f"{scenario:15s} {points:4.1f} points: {cells}")


def print_coverage(sims: int, seeds: int) -> None:
    """Coverage of the 95% intervals of a 2-point difference on ARC-Easy, per scenario."""
    print(f"coverage of 95% intervals of a 2-point difference on ARC-Easy, {sims} studies, S = {seeds}")
    for scenario, sd in SEED_SD.items():
        result = coverage(sims, seeds, sd)
        print(f"{scenario:15s} " + " ".join(f"{k} {100 * v:.1f}%" for k, v in result.items()))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sims", type=int, default=10_000, help="simulated null studies per scenario")
    parser.add_argument("--power-sims", type=int, default=2000, help="simulated studies per true difference")
    parser.add_argument("--coverage-sims", type=int, default=500, help="simulated studies per coverage scenario")
    parser.add_argument("--seeds", type=int, default=3, help="seed pairs S per study")
    parser.add_argument("--only", choices=("null", "power", "coverage"), help="one part (default: all three)")
    parser.add_argument("--measure", metavar="STUDY", help="print the fit beside a study's runs and stop")
    args = parser.parse_args(argv)
    if args.measure:
        measure(args.measure)
        return 0
    for name in ("sims", "power_sims", "coverage_sims"):
        if getattr(args, name) < 1:
            print(f"stats_coverage: --{name.replace('_', '-')} must be at least 1", file=sys.stderr)
            return 2
    if args.seeds < 2:
        print("stats_coverage: --seeds must be at least 2 (one seed pair has no seed-level test)", file=sys.stderr)
        return 2
    parts = {"null": lambda: print_null(args.sims, args.seeds),
             "power": lambda: print_power(args.power_sims, args.seeds),
             "coverage": lambda: print_coverage(args.coverage_sims, args.seeds)}
    for name, run in parts.items():
        if args.only in (None, name):
            run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
