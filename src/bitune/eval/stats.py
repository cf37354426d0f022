"""Statistics for comparing methods on the same questions: bootstrap intervals and the exact McNemar test.

Every method is scored on the same questions, so comparisons are **paired**: the per-question difference of two
methods (each averaged over its seeds) is resampled over questions, which removes the between-question variance
that an unpaired comparison of two accuracies carries. The intervals describe the uncertainty from the sample of
questions given these trained models; the spread over training seeds is reported next to them (per-seed values)
and tested apart (:func:`seed_t_test`: the seeds as the unit), not folded in. Resampling uses a fixed seed, so a
report is reproducible to the digit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

BOOTSTRAP = 10_000
"""Bootstrap resamples per interval."""
LEVEL = 0.95
"""Confidence level of every interval."""
SEED = 0
"""Seed of the resampling (fixed: the same inputs give the same interval)."""


@dataclass(frozen=True)
class Interval:
    """A point estimate with a two-sided interval."""

    value: float
    low: float
    high: float

    def text(self, scale: float = 100.0, digits: int = 1) -> str:
        return f"{scale * self.value:.{digits}f} [{scale * self.low:.{digits}f}, {scale * self.high:.{digits}f}]"


def bootstrap_mean(values: np.ndarray, resamples: int = BOOTSTRAP, level: float = LEVEL,
                   seed: int = SEED) -> Interval:
    """Mean of per-question values with a percentile bootstrap interval over questions.

    Args:
        values: (n,) one value per question: a 0/1 correctness, a seed-averaged correctness, or a paired
            difference of two methods on that question.
        resamples: bootstrap resamples.
        level: confidence level.
        seed: resampling seed.
    """
    values = np.asarray(values, dtype=np.float64)
    n = values.shape[0]
    if n == 0:
        raise ValueError("bootstrap_mean: no values")
    rng = np.random.default_rng(seed)
    means = np.empty(resamples)
    chunk = max(1, 2_000_000 // n)
    for start in range(0, resamples, chunk):
        stop = min(resamples, start + chunk)
        idx = rng.integers(0, n, size=(stop - start, n))  # (chunk, n)
        means[start:stop] = values[idx].mean(axis=1)
    alpha = (1.0 - level) / 2.0
    low, high = np.quantile(means, [alpha, 1.0 - alpha])
    return Interval(float(values.mean()), float(low), float(high))


def mcnemar_exact(a: np.ndarray, b: np.ndarray) -> tuple[int, int, float]:
    """Exact (binomial) McNemar test of two 0/1 correctness vectors on the same questions.

    Returns:
        ``(n_a, n_b, p)``: questions only ``a`` gets right, questions only ``b`` gets right, and the two-sided
        p-value ``min(1, 2 P[X <= min(n_a, n_b)])`` with ``X ~ Binomial(n_a + n_b, 1/2)``.
    """
    a, b = np.asarray(a).astype(bool), np.asarray(b).astype(bool)
    if a.shape != b.shape:
        raise ValueError(f"mcnemar_exact: {a.shape} vs {b.shape} questions")
    only_a, only_b = int((a & ~b).sum()), int((~a & b).sum())
    n, k = only_a + only_b, min(only_a, only_b)
    if n == 0:
        return only_a, only_b, 1.0
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n  # exact integers, one rounding
    return only_a, only_b, min(1.0, 2.0 * tail)


def seed_t_test(differences: list[float]) -> float | None:
    """Two-sided p-value of a t-test that the mean of per-seed differences is zero (scipy's ``ttest_1samp``).

    With the seeds as the unit, this covers the variation of training (seed s of one method against seed s of
    the other: a paired t-test) on these questions. None with fewer than 2 seeds or no spread between them.
    """
    from scipy.stats import ttest_1samp

    values = np.asarray(differences, dtype=np.float64)
    if values.shape[0] < 2 or np.ptp(values) == 0:
        return None
    return float(ttest_1samp(values, 0.0).pvalue)


__all__ = ["Interval", "bootstrap_mean", "mcnemar_exact", "seed_t_test", "BOOTSTRAP", "LEVEL", "SEED"]
