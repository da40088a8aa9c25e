"""engine/training/stats.py against known values: Newcombe's published Wilson intervals,
exact binomial tails, the normal-theory interval of a mean, and the power the sample-size
formula promises, checked by simulation."""

import math

import numpy as np
import pytest

from edgetune.engine.training import stats


@pytest.mark.parametrize("passed,n,low,high", [
    # Newcombe (1998), "Two-sided confidence intervals for the single proportion", Table I, method 3
    (81, 263, 0.2553, 0.3662), (15, 148, 0.0624, 0.1605), (0, 20, 0.0, 0.1611), (1, 29, 0.0061, 0.1718)])
def test_wilson_interval_matches_newcombes_table(passed, n, low, high):
    ci = stats.wilson(passed, n)
    assert ci.estimate == passed / n
    assert (round(ci.low, 4), round(ci.high, 4)) == (low, high)


def test_wilson_refuses_an_impossible_count():
    with pytest.raises(ValueError, match="0 <= passed <= n"):
        stats.wilson(5, 4)


def test_bootstrap_interval_of_a_mean_is_the_normal_one_on_a_large_sample_and_repeats():
    x = np.random.default_rng(1).normal(3.0, 2.0, size=2000)
    ci = stats.bootstrap_mean(x)
    se = x.std(ddof=1) / math.sqrt(x.size)
    assert ci.estimate == pytest.approx(x.mean())
    assert ci.low == pytest.approx(x.mean() - 1.96 * se, abs=0.15 * se)
    assert ci.high == pytest.approx(x.mean() + 1.96 * se, abs=0.15 * se)
    assert stats.bootstrap_mean(x) == ci  # a fixed seed: the same interval every time
    one = stats.bootstrap_mean([0.5] * 7)
    assert (one.low, one.high) == (0.5, 0.5)


def test_exact_mcnemar_is_the_two_sided_binomial_tail():
    assert stats.mcnemar_exact(2, 8) == pytest.approx(2 * (1 + 10 + 45) / 1024)  # 0.109375
    assert stats.mcnemar_exact(0, 6) == pytest.approx(2 / 64)
    assert stats.mcnemar_exact(5, 5) == 1.0 and stats.mcnemar_exact(0, 0) == 1.0
    scipy_stats = pytest.importorskip("scipy.stats")
    for b, w in [(3, 12), (9, 4), (20, 31), (1, 0)]:
        assert stats.mcnemar_exact(b, w) == pytest.approx(scipy_stats.binomtest(b, b + w, 0.5).pvalue)


def test_paired_proportions_count_the_discordant_items():
    a = [1] * 20 + [0] * 30  # the base: 20 of 50
    b = [1] * 18 + [0] * 2 + [1] * 12 + [0] * 18  # the adapter: loses 2, gains 12 -> 30 of 50
    c = stats.compare_proportions(a, b)
    assert (c.n, c.better, c.worse) == (50, 12, 2)
    assert c.difference == pytest.approx(0.2)
    assert c.p_value == pytest.approx(stats.mcnemar_exact(12, 2)) and c.p_value < 0.05
    # Agresti-Min by hand: cells +1/2, n* = 52, d* = 10/52, se = sqrt(((12.5 + 2.5)/52 - d*^2) / 52)
    d_ = 10 / 52
    se = math.sqrt((15 / 52 - d_ * d_) / 52)
    assert (c.low, c.high) == pytest.approx((d_ - 1.959964 * se, d_ + 1.959964 * se))
    assert 0 < c.low < 0.2 < c.high
    assert stats.in_words(c, "the base", "adapter B") == \
        f"adapter B is better than the base by 20 points (95% CI {100 * c.low:.0f} to {100 * c.high:.0f}, p = 0.013)"
    same = stats.compare_proportions([1, 0] * 25, [1, 0] * 25)
    assert (same.difference, same.p_value) == (0, 1.0) and same.low < 0 < same.high
    with pytest.raises(ValueError, match="same items"):
        stats.compare_proportions([1, 0], [1])


def test_sample_size_gives_the_promised_power():
    """At the n the formula gives for a 5-point gap with 20% discordant items, the exact
    McNemar test finds the gap about 80% of the time (it is a little conservative)."""
    n = stats.paired_sample_size(0.2, 0.05)
    assert 600 < n < 650  # (1.96 sqrt(.2) + 0.8416 sqrt(.2 - .0025))^2 / .0025 = 625.5
    rng = np.random.default_rng(0)
    p_better, p_worse = 0.125, 0.075  # discordant 0.2, gap 0.05
    found = 0
    trials = 400
    for _ in range(trials):
        cells = rng.multinomial(n, [p_better, p_worse, 1 - p_better - p_worse])
        found += stats.mcnemar_exact(int(cells[0]), int(cells[1])) < 0.05
    assert 0.7 < found / trials < 0.9


def test_no_detectable_difference_says_how_many_prompts_would_show_one():
    a = [1] * 20 + [0] * 30
    b = [1] * 18 + [0] * 2 + [1] * 3 + [0] * 27  # +3 -2 on 50 prompts
    c = stats.compare_proportions(a, b)
    assert c.p_value == 1.0 and c.needed == stats.paired_sample_size(5 / 50)
    assert stats.in_words(c, "A", "B") == f"A vs B: no detectable difference on 50 prompts (p = 1); " \
                                          f"about {c.needed} would show a 5-point gap"


def test_paired_bootstrap_of_real_scores():
    rng = np.random.default_rng(2)
    a = rng.normal(0.4, 0.2, size=300)
    b = a + 0.1 + rng.normal(0, 0.05, size=300)  # b is 0.1 better on every item, give or take
    c = stats.compare_means(a, b)
    d = b - a
    se = d.std(ddof=1) / math.sqrt(d.size)
    assert c.difference == pytest.approx(d.mean())
    assert (c.low, c.high) == pytest.approx((d.mean() - 1.96 * se, d.mean() + 1.96 * se), abs=0.2 * se)
    assert c.p_value == pytest.approx(1 / (stats.RESAMPLES + 1))  # never as far out as 0
    assert stats.in_words(c, "the base", "B") == \
        f"B is better than the base by {c.difference:.3g} (95% CI {c.low:.3g} to {c.high:.3g}, p < 0.001)"
    noise = stats.compare_means(a, a + rng.normal(0, 0.05, size=300))
    assert noise.p_value > 0.05 and noise.low < 0 < noise.high
    assert "no detectable difference on 300 prompts" in stats.in_words(noise, "A", "B")
    assert stats.compare_means([0.5, 0.5], [0.5, 0.5]).p_value == 1.0
