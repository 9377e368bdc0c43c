"""The statistics the REPORT's rows are judged with, as small pure functions over numbers (no MLflow, no frames).

- `clopper_pearson(k, n)`: the exact two-sided binomial interval of a rate seen as k of n ("0 of 4 [0, 60 %]"):
  each bound is where the binomial tail beyond k has probability (1 − confidence)/2; never narrower than the
  true coverage asks, so a small n gives a wide interval instead of a false certainty.
- `fisher_greater(k1, n1, k0, n0)`: Fisher's exact test, one-sided — the probability, with both arms' rates
  equal and the k1 + k0 events fixed, that arm 1 holds at least k1 of them (hypergeometric tail; computed in
  exact rational arithmetic, so 3 of 3 against 0 of 3 is exactly 1/20). `fisher_power` and `seeds_for_power`:
  the chance the test reaches `alpha` when the true rates are p1 and p0, and the fewest runs per arm that give
  `power` (exact sums over every outcome).
- `one_sided_bounds(values, confidence)` and `equivalent(lo, hi, delta)`: the equivalence reading of a "no
  difference" claim (two one-sided tests, TOST): the mean's lower and upper one-sided `confidence` bounds
  (Student t over the values) both inside ±δ — "equivalent within δ" — rather than a difference that failed
  to appear.
- `paired_bootstrap(a, b)`: the percentile bootstrap interval of the mean of a − b, resampling pairs (seeds)
  with replacement, seeded: the same inputs give the same interval.
- `pooled_ratio(num, den)`: a ratio of sums, Σ num / Σ den — how a ratio of variances logged per step is read
  over many steps (a mean of per-step ratios weighs a step of tiny Var ℓ as much as one of large, and can be
  far from it: docs/METRICS.md, `moe/route/*`).
Each is tested against scipy or hand-computed float64 values and on data built to fail it
(tests/test_stats.py).
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np

CONFIDENCE = 0.95


def _check_count(k: int, n: int) -> None:
    if not (isinstance(n, int | np.integer) and n >= 1):
        raise ValueError(f"bad number of runs n={n!r}; allowed: an integer ≥ 1")
    if not (isinstance(k, int | np.integer) and 0 <= k <= n):
        raise ValueError(f"bad count k={k!r}; allowed: an integer from 0 to n={n}")


def clopper_pearson(k: int, n: int, confidence: float = CONFIDENCE) -> tuple[float, float]:
    """The exact (Clopper–Pearson) two-sided `confidence` interval of a binomial rate seen as k of n."""
    from scipy import stats

    _check_count(k, n)
    tail = (1 - confidence) / 2
    lo = 0.0 if k == 0 else float(stats.beta.ppf(tail, k, n - k + 1))
    hi = 1.0 if k == n else float(stats.beta.ppf(1 - tail, k + 1, n - k))
    return lo, hi


def _fisher_exact(k1: int, n1: int, k0: int, n0: int) -> Fraction:
    total = k1 + k0
    tail = sum(math.comb(n1, x) * math.comb(n0, total - x) for x in range(k1, min(n1, total) + 1))
    return Fraction(tail, math.comb(n1 + n0, total))


def fisher_greater(k1: int, n1: int, k0: int, n0: int) -> float:
    """Fisher's exact one-sided p-value that arm 1's rate (k1 of n1) exceeds arm 0's (k0 of n0)."""
    _check_count(k1, n1)
    _check_count(k0, n0)
    return float(_fisher_exact(k1, n1, k0, n0))


def _binom_pmf(n: int, p: float) -> list[float]:
    return [math.comb(n, x) * p**x * (1 - p) ** (n - x) for x in range(n + 1)]


def fisher_power(p1: float, p0: float, n: int, alpha: float = 1 - CONFIDENCE) -> float:
    """The probability that `fisher_greater` reaches p ≤ `alpha` with n runs per arm at true rates p1 and p0."""
    if not (0 <= p0 <= 1 and 0 <= p1 <= 1):
        raise ValueError(f"bad rates p1={p1!r}, p0={p0!r}; allowed: numbers in [0, 1]")
    _check_count(0, n)
    w1, w0 = _binom_pmf(n, p1), _binom_pmf(n, p0)
    return float(
        sum(a * b for k1, a in enumerate(w1) for k0, b in enumerate(w0) if _fisher_exact(k1, n, k0, n) <= alpha)
    )


def seeds_for_power(
    p1: float, p0: float, power: float = 0.8, alpha: float = 1 - CONFIDENCE, most: int = 200
) -> int | None:
    """The fewest runs per arm at which `fisher_power(p1, p0, n, alpha)` reaches `power` (None beyond `most`)."""
    return next((n for n in range(1, most + 1) if fisher_power(p1, p0, n, alpha) >= power), None)


def one_sided_bounds(values, confidence: float = CONFIDENCE) -> tuple[float, float, float, int]:
    """(mean, lower, upper, n): the mean's one-sided `confidence` Student-t bounds, mean ∓ t(confidence, n−1)·s/√n
    (NaN bounds under 2 finite values)."""
    from scipy import stats

    v = np.asarray(values, dtype=float)
    v = v[np.isfinite(v)]
    n = len(v)
    if n == 0:
        return math.nan, math.nan, math.nan, 0
    mean = float(v.mean())
    if n < 2:
        return mean, math.nan, math.nan, n
    half = float(stats.t.ppf(confidence, n - 1) * v.std(ddof=1) / math.sqrt(n))
    return mean, mean - half, mean + half, n


def equivalent(lo: float, hi: float, delta: float) -> bool:
    """Both one-sided bounds inside ±`delta`: the difference is equivalent to 0 within δ (False without bounds)."""
    if not delta > 0:
        raise ValueError(f"bad equivalence margin delta={delta!r}; allowed: a number > 0")
    return bool(-delta < lo and hi < delta)


def equivalence_reading(lo: float, hi: float, delta: float) -> str:
    """The equivalence reading in words, with the bounds it rests on."""
    if math.isnan(lo):
        return "no equivalence reading (fewer than 2 values)"
    word = "equivalent" if equivalent(lo, hi, delta) else "not shown equivalent"
    return f"{word} within ±{delta:g} (one-sided bounds {lo:.3g}, {hi:.3g})"


def paired_bootstrap(
    a, b=None, n_boot: int = 10_000, confidence: float = CONFIDENCE, seed: int = 0
) -> tuple[float, float, float, int]:
    """(mean, lower, upper, n): the mean of a − b (of a alone when b is None) and its percentile bootstrap
    interval, resampling the pairs with replacement `n_boot` times from a generator seeded with `seed`."""
    a = np.asarray(a, dtype=float)
    d = a if b is None else a - np.asarray(b, dtype=float)
    if d.ndim != 1 or (b is not None and np.shape(b) != a.shape):
        raise ValueError(f"bad paired samples of shapes {a.shape} and {np.shape(b)}; allowed: two 1-d of one length")
    d = d[np.isfinite(d)]
    n = len(d)
    if n < 2:
        return (float(d.mean()) if n else math.nan), math.nan, math.nan, n
    if n_boot < 1:
        raise ValueError(f"bad n_boot={n_boot!r}; allowed: an integer ≥ 1")
    idx = np.random.default_rng(seed).integers(0, n, size=(n_boot, n))
    means = d[idx].mean(axis=1)
    tail = (1 - confidence) / 2 * 100
    lo, hi = np.percentile(means, [tail, 100 - tail])
    return float(d.mean()), float(lo), float(hi), n


def pooled_ratio(num, den) -> float:
    """Σ num / Σ den over the finite pairs (NaN when Σ den is 0): a ratio read over many steps."""
    num, den = np.asarray(num, dtype=float), np.asarray(den, dtype=float)
    ok = np.isfinite(num) & np.isfinite(den)
    total = den[ok].sum()
    return float(num[ok].sum() / total) if total != 0 else math.nan
