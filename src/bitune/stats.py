"""Statistics for comparing methods on the same questions (what ``bitune report`` shows): bootstrap intervals, a
sign-flip permutation test, the seed-aware t-test, the exact McNemar test and Holm's adjustment.

Every method is scored on the same questions, so comparisons are **paired**: the per-question difference of two
methods removes the between-question variance that an unpaired comparison of two accuracies carries. Two sources
of variation remain, and a claim about the methods (not about these trained models) must cover both: which
questions were drawn, and which training seeds. :func:`bootstrap_mean` and :func:`sign_flip_test` resample or
permute questions only (given these trained models). :func:`two_level_bootstrap` resamples seed pairs, then
questions within them, but with S seed pairs its seed-level variance is (S - 1) / S of the sample's (2/3 at
S = 3) and its percentile interval is too short at few seeds. :func:`seed_aware_test` is the test a report
decides "resolved" by: a t over the S seed pairs with S - 1 degrees of freedom whose variance is that of the S
per-seed-pair differences over S plus the question part a two-way (seed x question) analysis of variance finds
beyond the residual. Its degrees of freedom never leave S - 1, so its false-positive rate stays at or below
nominal in the tails Holm's adjustment reads (``scripts/stats_coverage.py`` measures it), at the price of power
at few seeds. With one seed pair the seed part cannot be estimated: :attr:`SeedTest.seed_aware` is False and the
test is the question-level t.
Resampling uses a fixed seed, so a report is reproducible to the digit.
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
    """The point estimate."""
    low: float
    """The interval's lower end."""
    high: float
    """The interval's upper end."""

    def text(self, scale: float = 100.0, digits: int = 1) -> str:
        """``value [low, high]`` scaled (default: percent) with ``digits`` decimals, e.g. ``61.2 [58.3, 64.0]``.

        Args:
            scale: factor applied to the three numbers. Default 100.
            digits: decimals shown. Default 1.

        Returns:
            The text.
        """
        return f"{scale * self.value:.{digits}f} [{scale * self.low:.{digits}f}, {scale * self.high:.{digits}f}]"


def bootstrap_mean(values: np.ndarray, resamples: int = BOOTSTRAP, level: float = LEVEL,
                   seed: int = SEED) -> Interval:
    """Mean of per-question values with a percentile bootstrap interval over questions.

    Args:
        values: (n,) one value per question: a 0/1 correctness, a seed-averaged correctness, or a paired
            difference of two methods on that question.
        resamples: bootstrap resamples. Default ``BOOTSTRAP`` (10,000).
        level: confidence level. Default ``LEVEL`` (0.95).
        seed: resampling seed. Default ``SEED`` (0): the same values give the same interval.

    Returns:
        The mean of ``values`` with the ``(1 - level) / 2`` and ``(1 + level) / 2`` quantiles of the resampled
            means.

    Raises:
        ValueError: ``values`` is empty.
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

    Args:
        a: (n,) correctness of one method (or one run) per question, 0/1 or bool.
        b: (n,) correctness of the other on the same questions, in the same order.

    Returns:
        n_a: The questions only ``a`` gets right.
        n_b: The questions only ``b`` gets right.
        p: The two-sided p-value ``min(1, 2 P[X <= min(n_a, n_b)])`` with ``X ~ Binomial(n_a + n_b, 1/2)``; 1
            when no question is discordant.

    Raises:
        ValueError: ``a`` and ``b`` have different shapes.
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


def two_level_bootstrap(differences: np.ndarray, resamples: int = BOOTSTRAP, level: float = LEVEL,
                        seed: int = SEED) -> Interval:
    """Mean paired difference with a two-level percentile bootstrap: seed pairs, then questions within them.

    Each resample draws ``S`` seed pairs with replacement, then ``n`` questions with replacement, and averages
    the drawn pairs' differences on the drawn questions. Unlike :func:`bootstrap_mean` of the seed-averaged
    differences, the interval widens when the difference varies between training seeds (with one seed pair it
    is the question-level interval).

    Args:
        differences: (S, n) per seed pair and question, the method's correctness minus the baseline's (a 0/1
            difference in {-1, 0, 1}).
        resamples: bootstrap resamples. Default ``BOOTSTRAP`` (10,000).
        level: confidence level. Default ``LEVEL`` (0.95).
        seed: resampling seed. Default ``SEED`` (0).

    Returns:
        The mean of all differences with the percentile interval of the resampled means.

    Raises:
        ValueError: ``differences`` is not a non-empty 2-D array.
    """
    diff = np.asarray(differences, dtype=np.float64)
    if diff.ndim != 2 or diff.size == 0:
        raise ValueError(f"two_level_bootstrap: need (seed pairs, questions) differences, got shape {diff.shape}")
    S, n = diff.shape
    rng = np.random.default_rng(seed)
    means = np.empty(resamples)
    chunk = max(1, 2_000_000 // (n * S))
    for start in range(0, resamples, chunk):
        stop = min(resamples, start + chunk)
        pairs = rng.integers(0, S, size=(stop - start, S))  # (chunk, S)
        per_question = diff[pairs].mean(axis=1)  # (chunk, n): the drawn pairs averaged per question
        questions = rng.integers(0, n, size=(stop - start, n))  # (chunk, n)
        means[start:stop] = np.take_along_axis(per_question, questions, axis=1).mean(axis=1)
    alpha = (1.0 - level) / 2.0
    low, high = np.quantile(means, [alpha, 1.0 - alpha])
    return Interval(float(diff.mean()), float(low), float(high))


def sign_flip_test(differences: np.ndarray, resamples: int = BOOTSTRAP, seed: int = SEED) -> float:
    """Two-sided p-value of a sign-flip permutation test that the mean paired difference is zero.

    Under the null hypothesis the two methods are exchangeable on each question, so each question's difference
    is as likely to have the opposite sign. The p-value is ``(1 + #{|mean(s * d)| >= |mean(d)|}) / (1 + R)`` over
    ``R`` random sign vectors ``s`` (Monte Carlo, fixed seed; never 0).

    Args:
        differences: (n,) per question, the method's (seed-averaged) correctness minus the baseline's.
        resamples: random sign vectors R. Default ``BOOTSTRAP`` (10,000).
        seed: seed of the sign vectors. Default ``SEED`` (0).

    Returns:
        The p-value, in ``[1 / (1 + R), 1]``.

    Raises:
        ValueError: ``differences`` is not a non-empty 1-D array.
    """
    d = np.asarray(differences, dtype=np.float64)
    if d.ndim != 1 or d.size == 0:
        raise ValueError(f"sign_flip_test: need (questions,) differences, got shape {d.shape}")
    observed = abs(d.mean())
    rng = np.random.default_rng(seed)
    hits = 0
    chunk = max(1, 2_000_000 // d.size)
    for start in range(0, resamples, chunk):
        stop = min(resamples, start + chunk)
        signs = rng.integers(0, 2, size=(stop - start, d.size)) * 2.0 - 1.0  # (chunk, n) of +-1
        hits += int((np.abs((signs * d).mean(axis=1)) >= observed - 1e-12).sum())
    return (1 + hits) / (1 + resamples)


def seed_t_test(differences: list[float]) -> float | None:
    """Two-sided p-value of a t-test that the mean of per-seed differences is zero (scipy's ``ttest_1samp``).

    With the seeds as the unit, this covers the variation of training (seed s of one method against seed s of
    the other: a paired t-test) on these questions.

    Args:
        differences: per seed pair, the method's accuracy minus the baseline's.

    Returns:
        The p-value; None with fewer than 2 seed pairs or no spread between them.
    """
    from scipy.stats import ttest_1samp

    values = np.asarray(differences, dtype=np.float64)
    if values.shape[0] < 2 or np.ptp(values) == 0:
        return None
    return float(ttest_1samp(values, 0.0).pvalue)


@dataclass(frozen=True)
class SeedTest:
    """A paired difference tested with seeds and questions as sources of variation (:func:`seed_aware_test`)."""

    interval: Interval
    """The mean difference with the seed-aware interval (``LEVEL``)."""
    p: float
    """Two-sided p-value that the expected difference (over other questions and training seeds) is zero."""
    pairs: int
    """The fewest seed pairs of a task in it (1: the seed part could not be estimated)."""

    @property
    def seed_aware(self) -> bool:
        """Whether the between-seed variance is in the test: 2 or more seed pairs (a t over 1 pair is undefined)."""
        return self.pairs >= 2


def seed_question_variance(differences: np.ndarray) -> tuple[float, int]:
    """The variance of the mean of a (S, n) table of paired differences as the seed-aware test estimates it, with
    its degrees of freedom.

    With S >= 2 seed pairs: the variance of the S per-seed-pair means over S (a paired t over seed pairs: how the
    difference varies between training runs, the per-question noise of each run included) plus the question part
    of a two-way (seed x question) analysis of variance, ``max(0, MS_questions - MS_residual) / (S n)`` (how the
    true difference varies between questions: which questions were drawn), with S - 1 degrees of freedom. The
    seed part alone is a t over seed pairs; the question part adds what that t leaves out, and counts nothing
    twice. With one seed pair: the variance of the n differences over n (the question-level t), n - 1 degrees of
    freedom.

    Args:
        differences: (S, n) per seed pair and question, the method's correctness minus the baseline's.

    Returns:
        variance: The estimated variance of the mean difference.
        df: Its degrees of freedom: S - 1, or n - 1 with one seed pair.
    """
    S, n = differences.shape
    if S == 1:
        return (float(differences[0].var(ddof=1)) / n if n > 1 else 0.0), n - 1
    seeds = differences.mean(axis=1)  # (S,)
    questions = differences.mean(axis=0)  # (n,)
    if n == 1:
        return float(seeds.var(ddof=1)) / S, S - 1
    residual = differences - seeds[:, None] - questions[None, :] + differences.mean()  # (S, n)
    ms_questions = S * float(questions.var(ddof=1))
    ms_residual = float((residual ** 2).sum()) / ((S - 1) * (n - 1))
    return float(seeds.var(ddof=1)) / S + max(0.0, ms_questions - ms_residual) / (S * n), S - 1


def _t(mean: float, terms: list[tuple[float, int]], level: float) -> tuple[Interval, float]:
    """t-interval and two-sided p of ``mean`` whose variance is the sum of ``terms`` ``(variance, df)``, with
    Satterthwaite's degrees of freedom (terms without degrees of freedom left out)."""
    from scipy.stats import t

    terms = [(v, df) for v, df in terms if df > 0]
    variance = sum(v for v, _ in terms)
    if variance <= 0.0:  # no spread at all: every difference equal
        return Interval(mean, mean, mean), (1.0 if mean == 0 else 0.0)
    df = variance ** 2 / sum(v ** 2 / df for v, df in terms)
    se = math.sqrt(variance)
    half = float(t.ppf((1.0 + level) / 2.0, df)) * se
    return Interval(mean, mean - half, mean + half), float(2.0 * t.sf(abs(mean) / se, df))


def seed_aware_test(differences: np.ndarray, level: float = LEVEL) -> SeedTest:
    """Mean paired difference with a test and interval for other training seeds as well as other questions.

    A t with S - 1 degrees of freedom whose variance is :func:`seed_question_variance`: the variance of the S
    per-seed-pair differences over S plus the question part beyond the residual. Simulated studies calibrated to
    study part 4 keep its false-positive rate at or below nominal at alpha 0.05, 0.01 and 0.0028, where a
    Satterthwaite mix of a seed t and a question t reaches several times nominal (``scripts/stats_coverage.py``).
    With one seed pair the seed part is not estimable and the result is the question-level t
    (:attr:`SeedTest.seed_aware` False): it covers other questions, not other training runs.

    Args:
        differences: (S, n) per seed pair and question, the method's correctness minus the baseline's.
        level: confidence level of the interval. Default ``LEVEL`` (0.95).

    Returns:
        The test (:class:`SeedTest`).

    Raises:
        ValueError: ``differences`` is not a non-empty 2-D array.
    """
    diff = np.asarray(differences, dtype=np.float64)
    if diff.ndim != 2 or diff.size == 0:
        raise ValueError(f"seed_aware_test: need (seed pairs, questions) differences, got shape {diff.shape}")
    interval, p = _t(float(diff.mean()), [seed_question_variance(diff)], level)
    return SeedTest(interval, p, diff.shape[0])


def pooled_seed_aware_test(differences: list[np.ndarray], level: float = LEVEL) -> SeedTest:
    """:func:`seed_aware_test` of the task-averaged mean difference: every task's variance
    (:func:`seed_question_variance`) divided by the tasks squared and summed, Satterthwaite's degrees of freedom
    over the tasks (between the fewest of one task, S - 1 at S seed pairs each, and their sum).

    Args:
        differences: per task, a (S_t, n_t) array (seed pairs x questions) of differences.
        level: confidence level of the interval. Default ``LEVEL`` (0.95).

    Raises:
        ValueError: no tasks, or a task's differences are not a non-empty 2-D array.
    """
    diffs = [np.asarray(d, dtype=np.float64) for d in differences]
    if not diffs or any(d.ndim != 2 or d.size == 0 for d in diffs):
        raise ValueError("pooled_seed_aware_test: need one (seed pairs, questions) array per task")
    mean = float(np.mean([d.mean() for d in diffs]))
    terms = [(v / len(diffs) ** 2, df) for v, df in map(seed_question_variance, diffs)]
    interval, p = _t(mean, terms, level)
    return SeedTest(interval, p, min(d.shape[0] for d in diffs))


def pooled_two_level_bootstrap(differences: list[np.ndarray], resamples: int = BOOTSTRAP, level: float = LEVEL,
                                seed: int = SEED) -> Interval:
    """The task-averaged mean paired difference with a two-level percentile bootstrap within each task.

    The estimate is the mean over tasks of each task's mean difference (every task weighs the same, whatever its
    number of questions). Each resample draws, independently per task, that task's seed pairs with replacement,
    then its questions with replacement (as :func:`two_level_bootstrap`), and averages the tasks' means.

    Args:
        differences: per task, a (S_t, n_t) array: per seed pair and question, the method's correctness minus the
            baseline's.
        resamples: bootstrap resamples. Default ``BOOTSTRAP`` (10,000).
        level: confidence level. Default ``LEVEL`` (0.95).
        seed: resampling seed. Default ``SEED`` (0).

    Returns:
        The mean over tasks of each task's mean difference, with the percentile interval of the resampled
            task-averaged means.

    Raises:
        ValueError: no tasks, or a task's differences are not a non-empty 2-D array.
    """
    diffs = [np.asarray(d, dtype=np.float64) for d in differences]
    if not diffs or any(d.ndim != 2 or d.size == 0 for d in diffs):
        raise ValueError("pooled_two_level_bootstrap: need one (seed pairs, questions) array per task")
    rng = np.random.default_rng(seed)
    means = np.zeros(resamples)
    for diff in diffs:
        S, n = diff.shape
        chunk = max(1, 2_000_000 // (n * S))
        for start in range(0, resamples, chunk):
            stop = min(resamples, start + chunk)
            pairs = rng.integers(0, S, size=(stop - start, S))  # (chunk, S)
            per_question = diff[pairs].mean(axis=1)  # (chunk, n)
            questions = rng.integers(0, n, size=(stop - start, n))  # (chunk, n)
            means[start:stop] += np.take_along_axis(per_question, questions, axis=1).mean(axis=1)
    means /= len(diffs)
    alpha = (1.0 - level) / 2.0
    low, high = np.quantile(means, [alpha, 1.0 - alpha])
    return Interval(float(np.mean([d.mean() for d in diffs])), float(low), float(high))


def pooled_sign_flip_test(differences: list[np.ndarray], resamples: int = BOOTSTRAP, seed: int = SEED) -> float:
    """Two-sided sign-flip p-value that the task-averaged mean paired difference is zero: :func:`sign_flip_test`
    over the questions of all tasks together, each question weighted ``1 / (tasks x its task's questions)`` so
    that the statistic is the mean of the tasks' means.

    Args:
        differences: per task, a (n_t,) array of per-question (seed-averaged) differences.
        resamples: random sign vectors. Default ``BOOTSTRAP`` (10,000).
        seed: seed of the sign vectors. Default ``SEED`` (0).

    Returns:
        The p-value, as :func:`sign_flip_test` gives it.

    Raises:
        ValueError: no tasks, or a task's differences are not a non-empty 1-D array.
    """
    diffs = [np.asarray(d, dtype=np.float64) for d in differences]
    if not diffs or any(d.ndim != 1 or d.size == 0 for d in diffs):
        raise ValueError("pooled_sign_flip_test: need one (questions,) array per task")
    weighted = np.concatenate([d / (len(diffs) * d.size) for d in diffs])
    return sign_flip_test(weighted * weighted.size, resamples, seed)  # mean(weighted * N) = sum(weighted)


def holm(pvalues: list[float]) -> list[float]:
    """Holm's step-down adjustment of a family of p-values (controls the family-wise error rate).

    Sorted ascending, the i-th (from 0) is multiplied by ``m - i``, made non-decreasing, capped at 1. A comparison
    is resolved at level alpha when its adjusted p is below alpha.

    Args:
        pvalues: the family's m p-values, in any order.

    Returns:
        The adjusted p-values, in the input order (empty for an empty family).
    """
    m = len(pvalues)
    order = sorted(range(m), key=lambda i: pvalues[i])
    adjusted, running = [0.0] * m, 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * pvalues[i]))
        adjusted[i] = running
    return adjusted


__all__ = ["Interval", "SeedTest", "bootstrap_mean", "two_level_bootstrap", "sign_flip_test", "mcnemar_exact",
           "seed_t_test", "seed_question_variance", "seed_aware_test", "pooled_two_level_bootstrap",
           "pooled_sign_flip_test", "pooled_seed_aware_test", "holm", "BOOTSTRAP", "LEVEL", "SEED"]
