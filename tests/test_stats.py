"""Paired statistics: bootstrap intervals over questions and the exact McNemar test, on known inputs."""

from __future__ import annotations

import math

import numpy as np
import pytest

from bitune.stats import (
    bootstrap_mean,
    holm,
    mcnemar_exact,
    pooled_seed_aware_test,
    pooled_sign_flip_test,
    pooled_two_level_bootstrap,
    seed_aware_test,
    sign_flip_test,
    two_level_bootstrap,
)
from helpers.scripts import load_script


def test_mcnemar_exact_on_a_hand_computed_table():
    # a right / b wrong on 3 questions, a wrong / b right on 1: n = 4, k = 1
    # p = 2 * P[Binomial(4, 1/2) <= 1] = 2 * (1 + 4) / 16 = 0.625
    a = np.array([1, 1, 1, 0, 1, 0])
    b = np.array([0, 0, 0, 1, 1, 0])
    assert mcnemar_exact(a, b) == (3, 1, pytest.approx(0.625))
    # 10 vs 0 discordant: p = 2 / 2^10
    assert mcnemar_exact(np.r_[np.ones(10), np.zeros(5)], np.zeros(15))[2] == pytest.approx(2 / 1024)
    # symmetric table: p = 1 (capped), and no discordant pair at all: p = 1
    assert mcnemar_exact([1, 0], [0, 1])[2] == 1.0
    assert mcnemar_exact([1, 1], [1, 1]) == (0, 0, 1.0)


def test_mcnemar_exact_handles_more_than_a_thousand_discordant_pairs():
    a = np.r_[np.ones(700), np.zeros(600)]
    b = 1 - a
    only_a, only_b, p = mcnemar_exact(a, b)
    assert (only_a, only_b) == (700, 600)
    # normal approximation with continuity correction for a check: z = (|700 - 600| - 1) / sqrt(1300)
    z = 99 / math.sqrt(1300)
    assert p == pytest.approx(math.erfc(z / math.sqrt(2)), rel=0.05)


def test_mcnemar_rejects_mismatched_questions():
    with pytest.raises(ValueError, match="questions"):
        mcnemar_exact([1, 0], [1, 0, 1])


def test_bootstrap_interval_contains_the_known_difference_and_shrinks_with_n():
    rng = np.random.default_rng(7)
    # two methods on the same questions; the second is right on 10% more of them (true difference +0.10)
    n = 2000
    base = rng.random(n) < 0.4
    better = base | (rng.random(n) < 0.1 / 0.6)
    diff = better.astype(float) - base.astype(float)
    ci = bootstrap_mean(diff)
    assert ci.low < 0.10 < ci.high
    assert ci.low > 0  # the difference is detected
    assert ci.value == pytest.approx(diff.mean())
    small = bootstrap_mean(diff[:200])
    assert (small.high - small.low) > 2 * (ci.high - ci.low)  # ~ 1 / sqrt(n)


def test_bootstrap_matches_the_binomial_interval_and_its_stored_draw():
    values = np.r_[np.ones(300), np.zeros(700)]  # accuracy 0.3 on 1000 questions
    a = bootstrap_mean(values)
    half = 1.96 * math.sqrt(0.3 * 0.7 / 1000)  # the normal interval: 0.3 +- 0.0284 = [0.2716, 0.3284]
    assert a.low == pytest.approx(0.3 - half, abs=0.003) and a.high == pytest.approx(0.3 + half, abs=0.003)
    # the fixed seed's draw (numpy's PCG64 stream is the same on every platform): a report reproduces to the digit
    assert (a.value, a.low, a.high) == (0.3, 0.272, 0.328)
    assert bootstrap_mean(np.ones(5)).low == 1.0


def test_seed_t_test_on_hand_computed_values():
    from bitune.stats import seed_t_test

    # differences 1, 2, 3: mean 2, sd 1, t = 2 sqrt(3) with 2 df; P(|T| > t) = 1 - t / sqrt(2 + t^2) = 1 - sqrt(12/14)
    assert seed_t_test([1.0, 2.0, 3.0]) == pytest.approx(1 - math.sqrt(12 / 14), abs=1e-9)
    assert seed_t_test([-1.0, -2.0, -3.0]) == pytest.approx(1 - math.sqrt(12 / 14), abs=1e-9)  # two-sided
    assert seed_t_test([0.5]) is None  # one seed: no spread to test against
    assert seed_t_test([0.02, 0.02]) is None  # no spread between seeds


def _pairs(per_seed_gain: list[float], n: int = 1000, seed: int = 3) -> np.ndarray:
    """(seeds, n) paired 0/1 differences: per seed pair, the method gains ``gain * n`` questions net."""
    rng = np.random.default_rng(seed)
    rows = []
    for gain in per_seed_gain:
        d = np.zeros(n)
        flips = rng.permutation(n)
        up = int(round((0.15 + max(gain, 0)) * n))
        down = int(round((0.15 + max(-gain, 0)) * n))
        d[flips[:up]] = 1.0
        d[flips[up:up + down]] = -1.0
        rows.append(d)
    return np.stack(rows)


def test_two_level_bootstrap_widens_with_seed_variation_and_question_level_does_not():

    steady = _pairs([0.03, 0.03, 0.03])  # every seed pair gains 3 points
    erratic = _pairs([0.09, -0.03, 0.03])  # the same mean gain, varying between seed pairs
    for d in (steady, erratic):
        assert two_level_bootstrap(d).value == pytest.approx(0.03, abs=1e-3)
    # the question-level interval of the seed-averaged differences hardly notices the seed spread ...
    q_steady, q_erratic = bootstrap_mean(steady.mean(0)), bootstrap_mean(erratic.mean(0))
    assert (q_erratic.high - q_erratic.low) < 1.3 * (q_steady.high - q_steady.low)
    # ... the two-level interval does, and it is never narrower than the question-level one
    t_steady, t_erratic = two_level_bootstrap(steady), two_level_bootstrap(erratic)
    assert (t_erratic.high - t_erratic.low) > 2 * (t_steady.high - t_steady.low)
    assert (t_erratic.high - t_erratic.low) > 2 * (q_erratic.high - q_erratic.low)
    assert t_erratic.low < 0 < q_erratic.low  # the seed spread makes the gain uncertain
    # one seed pair: the two-level bootstrap is the question-level one
    one = two_level_bootstrap(steady[:1])
    ref = bootstrap_mean(steady[0])
    assert one.value == ref.value and abs((one.high - one.low) - (ref.high - ref.low)) < 0.004
    with pytest.raises(ValueError, match="seed pairs"):
        two_level_bootstrap(steady[0])


def test_sign_flip_test_matches_the_exact_sign_test():

    # +-1 differences: |mean(s d)| >= |mean(d)| exactly when the binomial count of + signs is as extreme, so the
    # p-value is the exact two-sided sign test: 8 of 10 positive -> 2 * P[Binomial(10, 1/2) <= 2] = 2 * 56 / 1024
    d = np.r_[np.ones(8), -np.ones(2), np.zeros(5)]  # ties (0) change no statistic
    assert sign_flip_test(d) == pytest.approx(2 * 56 / 1024, abs=0.01)
    assert sign_flip_test(np.r_[np.ones(5), -np.ones(5)]) == 1.0  # no difference at all
    assert sign_flip_test(np.ones(30)) == pytest.approx(1 / 10_001)  # never 0: one over the draws
    # the fixed seed's draw (platform-independent stream): 1082 of 10000 sign vectors as extreme, plus one
    assert sign_flip_test(d) == pytest.approx(1083 / 10_001, abs=1e-12)
    with pytest.raises(ValueError, match="questions"):
        sign_flip_test(np.ones((2, 3)))


def test_holm_on_a_hand_computed_family():
    # sorted: 0.005 x 4 = 0.02, 0.01 x 3 = 0.03, 0.03 x 2 = 0.06, 0.04 x 1 = 0.04 -> kept non-decreasing: 0.06
    assert holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert holm([0.5, 0.9]) == pytest.approx([1.0, 1.0])  # capped at 1
    assert holm([0.04]) == pytest.approx([0.04])  # a family of one is not adjusted
    assert holm([]) == []


def test_pooled_interval_weighs_every_task_the_same():
    """Task A: +1 on each of 10 questions; task B: 0 on each of 1000: the task mean is +0.5 (a question-weighted
    mean would be about +0.01); with no spread inside a task the interval is the point."""
    a, b = np.ones((2, 10)), np.zeros((2, 1000))
    ci = pooled_two_level_bootstrap([a, b], resamples=500)
    assert (ci.value, ci.low, ci.high) == pytest.approx((0.5, 0.5, 0.5))


def test_pooled_interval_of_one_task_is_its_two_level_interval():
    rng = np.random.default_rng(1)
    diff = rng.integers(-1, 2, size=(3, 200)).astype(float)
    pooled, single = pooled_two_level_bootstrap([diff], resamples=2000), two_level_bootstrap(diff, resamples=2000)
    assert (pooled.value, pooled.low, pooled.high) == pytest.approx((single.value, single.low, single.high))


def test_pooled_interval_covers_the_task_mean_of_known_gains():
    """Three tasks with true gains +4, 0 and +2 points (task mean +2): the interval holds +2 and excludes 0."""
    tasks = [_pairs([g, g, g], n=1500, seed=s) for g, s in ((0.04, 1), (0.0, 2), (0.02, 3))]
    ci = pooled_two_level_bootstrap(tasks, resamples=2000)
    assert ci.low < 0.02 < ci.high and ci.low > 0
    assert ci.value == pytest.approx(np.mean([t.mean() for t in tasks]))


def test_pooled_sign_flip_of_one_task_is_the_sign_flip_test():
    d = np.r_[np.ones(20), -np.ones(10), np.zeros(50)]
    assert pooled_sign_flip_test([d], resamples=2000) == pytest.approx(sign_flip_test(d, resamples=2000))
    assert pooled_sign_flip_test([np.zeros(5), np.zeros(9)], resamples=200) == 1.0  # no difference at all
    # a clear gain on a small task is not drowned by a large task without any: weighted by task, not question
    assert pooled_sign_flip_test([np.ones(30), np.zeros(2000)], resamples=2000) < 0.01


def _coverage_script():
    """scripts/stats_coverage.py, the simulation the evaluation guide's coverage table comes from."""
    return load_script("stats_coverage")


def _seeds_disagree(n: int = 1000) -> np.ndarray:
    """(3, n): seed pairs +10, -6 and +11 points, each the same on every question it moves (the questions agree)."""
    diff = np.zeros((3, n))
    diff[0, :100] = 1  # +10
    diff[1, 100:160] = -1  # -6
    diff[2, 160:270] = 1  # +11
    return diff


def test_seeds_that_disagree_while_questions_agree_do_not_resolve():
    diff = _seeds_disagree()
    assert sign_flip_test(diff.mean(axis=0)) < 0.001  # the question-level test alone would call it resolved
    test = seed_aware_test(diff)
    assert test.seed_aware and test.pairs == 3
    assert test.p > 0.2 and test.interval.low < 0 < test.interval.high
    assert test.interval.value == pytest.approx(0.05)


def test_a_consistent_effect_resolves_after_holm():
    """A method that also gets 12% of the baseline's wrong answers right in every one of 5 seed pairs (about +6
    points) resolves in a family of 21 (at 3 seed pairs the t has 2 degrees of freedom: this draw's p is 0.006,
    0.13 after Holm, the price of a test calibrated in the tails)."""
    rng = np.random.default_rng(1)
    base = rng.random((5, 1000)) < 0.5  # the baseline's correctness per seed
    gain = rng.random((5, 1000)) < 0.12  # the method also gets 12% of its wrong answers right, in every seed
    diff = (base | gain).astype(float) - base.astype(float)
    test = seed_aware_test(diff)
    assert test.interval.low > 0.03 and test.p < 1e-3
    nulls = [seed_aware_test(_seeds_disagree()).p] * 20  # a family of 21 with 20 unresolved
    assert holm([test.p, *nulls])[0] < 0.05


def test_seed_aware_variance_is_the_seed_t_plus_the_question_part_beyond_the_residual():
    """Hand-computed: a table that is exactly seed effect + question effect has no residual, so its variance is
    the seed t's plus the question means' variance over n; S - 1 degrees of freedom whatever n."""
    from scipy.stats import t

    from bitune.stats import seed_question_variance

    rows, cols = np.array([0.1, 0.3, 0.2]), np.array([0.0, 0.5, -0.5, 1.0])
    diff = rows[:, None] + cols[None, :]  # (3, 4)
    variance, df = seed_question_variance(diff)
    assert df == 2
    assert variance == pytest.approx(rows.var(ddof=1) / 3 + cols.var(ddof=1) / 4)
    test = seed_aware_test(diff)
    assert test.p == pytest.approx(2 * t.sf(diff.mean() / math.sqrt(variance), 2))
    # pure noise around the seed means: the question part is floored at 0, the seed t alone remains
    noise = np.array([[1.0, -1.0, 1.0, -1.0], [-1.0, 1.0, -1.0, 1.0], [0.0, 0.0, 0.0, 0.0]]) + rows[:, None]
    assert seed_question_variance(noise) == (pytest.approx(rows.var(ddof=1) / 3), 2)


def test_one_seed_pair_is_the_question_level_t_and_says_so():
    from scipy.stats import ttest_1samp

    diff = np.r_[np.ones(30), -np.ones(10), np.zeros(60)][None, :]  # (1, 100)
    test = seed_aware_test(diff)
    assert not test.seed_aware and test.pairs == 1
    assert test.p == pytest.approx(ttest_1samp(diff[0], 0.0).pvalue, rel=1e-9)


def test_pooled_seed_aware_of_one_task_is_its_test_and_tasks_weigh_the_same():
    diff = _seeds_disagree(200)
    one, alone = pooled_seed_aware_test([diff]), seed_aware_test(diff)
    assert one.p == pytest.approx(alone.p) and one.interval == alone.interval
    both = pooled_seed_aware_test([diff, np.zeros((3, 50))])
    assert both.interval.value == pytest.approx(diff.mean() / 2)  # each task weighs the same


@pytest.mark.parametrize("bad", [np.zeros(5), np.zeros((0, 3)), np.zeros((2, 2, 2))])
def test_seed_aware_test_refuses_what_is_not_a_seed_pairs_by_questions_table(bad):
    with pytest.raises(ValueError, match="seed pairs, questions"):
        seed_aware_test(bad)


def test_seed_aware_interval_covers_at_three_seeds_where_question_level_does_not():
    """Coverage at S = 3 on simulated studies whose true difference is known (scripts/stats_coverage.py, fewer
    and smaller studies): when training seeds move the difference, the question-level interval misses the truth
    far more often than 5%, the seed-aware one does not."""
    result = _coverage_script().coverage(sims=100, seeds=3, seed_sd=8.0, resamples=300, questions=300)
    assert result["seed-aware"] >= 0.9
    assert result["question-level"] < 0.8


def test_the_old_test_fails_in_the_tails_where_the_seed_aware_test_holds():
    """Null studies (true difference 0) where seeds dominate, as in part 4's largest seed variance (a smaller study:
    300 questions, a seed effect scaled to keep its ratio to the residual): the Satterthwaite mix the report used
    before rejects several times as often as alpha 0.0028 says, the seed-aware test at most 1.2 times."""
    script = _coverage_script()
    design = {"arc_easy": script.DESIGNS["arc_easy"]}
    rates = script.rejections(2000, 3, 8.0, alphas=(0.01, 0.0028), designs=design, questions=300)["arc_easy"]
    assert rates["Satterthwaite"][1] > 2 * 0.0028
    assert rates["seed-aware"][0] <= 1.2 * 0.01 and rates["seed-aware"][1] <= 1.2 * 0.0028
    assert rates["question t"][1] > 10 * 0.0028  # ignoring the seeds is far worse


def test_the_seed_aware_test_finds_a_large_true_difference():
    """Power where the truth is known: a 12-point difference on 1000 questions without a seed effect is resolved at
    5% in most simulated studies of 3 seed pairs."""
    script = _coverage_script()
    design = {"arc_easy": script.DESIGNS["arc_easy"]}
    rates = script.rejections(200, 3, 0.0, points=12.0, alphas=(0.05,), designs=design, questions=1000, seed=3)
    assert rates["arc_easy"]["seed-aware"][0] > 0.8
    method, baseline = script.simulate(np.random.default_rng(0), design["arc_easy"], 3,
                                       delta=design["arc_easy"].latent(12.0), questions=20_000)
    assert 100 * (method - baseline).mean() == pytest.approx(12.0, abs=0.5)  # the truth is the difference asked for
