"""analysis/stats.py against scipy and hand-computed float64 values, and on data built to fail each statistic:
the exact binomial interval, Fisher's one-sided test and its power, the equivalence (TOST) reading, the paired
percentile bootstrap and the pooled ratio."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from scipy import stats as sp

from analysis.stats import (
    clopper_pearson,
    equivalence_reading,
    equivalent,
    fisher_greater,
    fisher_power,
    one_sided_bounds,
    paired_bootstrap,
    pooled_ratio,
    seeds_for_power,
)


@pytest.mark.parametrize(("k", "n"), [(0, 4), (1, 4), (2, 4), (4, 4), (0, 1), (3, 10), (7, 30)])
def test_clopper_pearson_is_scipys_exact_interval(k, n):
    want = sp.binomtest(k, n).proportion_ci(confidence_level=0.95, method="exact")
    assert clopper_pearson(k, n) == pytest.approx((want.low, want.high), abs=1e-12)


def test_clopper_pearson_by_hand_and_its_tails():
    assert clopper_pearson(0, 4) == (0.0, pytest.approx(1 - 0.025 ** (1 / 4), abs=1e-15))  # "0 of 4 [0, 60 %]"
    assert clopper_pearson(4, 4) == (pytest.approx(0.025 ** (1 / 4), abs=1e-15), 1.0)
    lo, hi = clopper_pearson(2, 7)  # each bound is where the tail beyond k holds 2.5 %
    assert sp.binom.sf(1, 7, lo) == pytest.approx(0.025, abs=1e-12)
    assert sp.binom.cdf(2, 7, hi) == pytest.approx(0.025, abs=1e-12)
    assert clopper_pearson(0, 40)[1] < 0.1 < clopper_pearson(0, 4)[1]  # more runs, a narrower interval
    for bad in ((5, 4), (-1, 4), (0, 0)):
        with pytest.raises(ValueError, match="bad"):
            clopper_pearson(*bad)


@pytest.mark.parametrize(
    ("k1", "n1", "k0", "n0"), [(3, 3, 0, 3), (0, 4, 0, 4), (4, 10, 0, 10), (2, 5, 3, 6), (5, 8, 1, 9)]
)
def test_fisher_one_sided_is_scipys(k1, n1, k0, n0):
    want = sp.fisher_exact([[k1, n1 - k1], [k0, n0 - k0]], alternative="greater").pvalue
    assert fisher_greater(k1, n1, k0, n0) == pytest.approx(want, rel=1e-12)


def test_fisher_by_hand_and_its_direction():
    assert fisher_greater(3, 3, 0, 3) == 0.05  # 1 / C(6, 3), exactly: the R3 paper's 3 of 3 against 0 of 3
    assert fisher_greater(0, 3, 3, 3) == 1.0  # the other direction is no evidence
    assert fisher_greater(0, 4, 0, 4) == 1.0
    assert fisher_greater(4, 10, 0, 10) == pytest.approx(math.comb(10, 4) / math.comb(20, 4), rel=1e-15)


def test_fisher_power_and_the_seeds_it_takes():
    # 50 % against 0 %: with n per arm the test rejects when k1 reaches the first count whose p ≤ 0.05 (k1 ≥ 4 at
    # n = 10, since C(10,4)/C(20,4) = 0.043 and C(10,3)/C(20,3) = 0.105), so the power is P(Bin(10, ½) ≥ 4)
    assert fisher_power(0.5, 0.0, 10) == pytest.approx(sp.binom.sf(3, 10, 0.5), rel=1e-12)
    assert seeds_for_power(0.5, 0.0) == 10  # ≈ 10 seeds per arm to show 50 % against 0 % (issue 46)
    assert fisher_power(0.3, 0.3, 8) <= 0.05  # equal rates: the test holds its level
    assert fisher_power(1.0, 0.0, 3) == 1.0  # 3 of 3 against 0 of 3 always, p = 0.05 exactly
    with pytest.raises(ValueError, match="bad rates"):
        fisher_power(1.5, 0.0, 4)


def test_equivalence_is_two_one_sided_t_tests():
    """Both one-sided 95 % bounds inside ±δ exactly when both TOST p-values (scipy's one-sample t-tests against
    −δ and +δ) are below 0.05."""
    rng = np.random.default_rng(0)
    for shift, sd, delta in ((0.0, 0.01, 0.05), (0.03, 0.01, 0.05), (0.0, 0.08, 0.05), (-0.06, 0.01, 0.05)):
        v = shift + rng.normal(0, sd, 6)
        mean, lo, hi, n = one_sided_bounds(v)
        half = sp.t.ppf(0.95, n - 1) * v.std(ddof=1) / math.sqrt(n)
        assert (lo, hi) == pytest.approx((v.mean() - half, v.mean() + half), abs=1e-15)
        p_lo = sp.ttest_1samp(v, -delta, alternative="greater").pvalue
        p_hi = sp.ttest_1samp(v, delta, alternative="less").pvalue
        assert equivalent(lo, hi, delta) == (max(p_lo, p_hi) < 0.05), (shift, sd)
    assert equivalent(-0.01, 0.02, 0.05) and not equivalent(-0.01, 0.06, 0.05)  # a bound outside: not shown
    assert "not shown equivalent" in equivalence_reading(-0.2, 0.2, 0.05)
    assert equivalence_reading(-0.01, 0.02, 0.05).startswith("equivalent within ±0.05")
    with pytest.raises(ValueError, match="bad equivalence margin"):
        equivalent(0.0, 0.0, 0.0)


def _exact_bootstrap(d: np.ndarray, q: float) -> float:
    """The bootstrap distribution of the mean enumerated over all n^n resamples (equally likely)."""
    means = np.array([d[list(i)].mean() for i in itertools.product(range(len(d)), repeat=len(d))])
    return float(np.percentile(means, q))


def test_paired_bootstrap_against_the_enumerated_distribution():
    a = np.array([0.61, 0.55, 0.70, 0.58, 0.66])
    b = np.array([0.60, 0.50, 0.62, 0.57, 0.60])
    mean, lo, hi, n = paired_bootstrap(a, b, n_boot=20_000)
    d = a - b
    assert n == 5 and mean == pytest.approx(d.mean(), abs=1e-15)
    assert lo == pytest.approx(_exact_bootstrap(d, 2.5), abs=0.003)
    assert hi == pytest.approx(_exact_bootstrap(d, 97.5), abs=0.003)
    assert paired_bootstrap(a, b, n_boot=50) == paired_bootstrap(a, b, n_boot=50)  # seeded: the same
    assert paired_bootstrap(a, b, n_boot=50, seed=1) != paired_bootstrap(a, b, n_boot=50)  # another draw


def test_paired_bootstrap_pairs_the_samples():
    """Levels that differ widely between seeds but a constant difference: the paired interval is that constant,
    where resampling the arms apart would spread it over the levels' range."""
    levels = np.array([0.2, 0.5, 0.8, 0.35])
    _, lo, hi, _ = paired_bootstrap(levels + 0.03, levels, n_boot=500)
    assert lo == pytest.approx(0.03, abs=1e-12) and hi == pytest.approx(0.03, abs=1e-12)
    _, lo, hi, _ = paired_bootstrap(np.array([0.05, -0.04, 0.02, -0.03]), n_boot=2000)
    assert lo < 0 < hi  # no shift: the interval holds 0
    assert math.isnan(paired_bootstrap([0.1], [0.0])[1])  # one pair: no interval
    with pytest.raises(ValueError, match="bad paired samples"):
        paired_bootstrap([0.1, 0.2], [0.0])


def test_pooled_ratio_is_a_ratio_of_sums_not_a_mean_of_ratios():
    num, den = np.array([0.9, -0.7, 0.1]), np.array([1.0, 0.1, 1.0])  # a small-Var step with a wild ratio
    assert pooled_ratio(num, den) == pytest.approx(0.3 / 2.1, abs=1e-15)
    assert np.mean(num / den) == pytest.approx(-2.0, abs=1e-12)  # what a mean of per-step ratios reads
    assert math.isnan(pooled_ratio([1.0], [0.0]))
