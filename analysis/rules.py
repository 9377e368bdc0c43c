"""The report's verdict rules and the per-seed measures they read: how a paired interval, a count of collapsed
runs or Fisher's exact test becomes a verdict (`verdict`, `collapse_verdict`, `fisher_verdict`), and the result
types a claim returns (`Estimate`, `Result`). `tests/test_report_rules.py` builds data that must pass and must fail
each rule; the rules in words are analysis/report.py's `METHOD`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum

import pandas as pd

from analysis.aggregate import CONFIDENCE, mean_ci
from analysis.runs import PASS1, REWARD, Study, label
from analysis.stats import clopper_pearson, fisher_greater, pooled_ratio

MARGIN = 0.05  # δ: the smallest gap in pass@1 or reward a difference row tests for; the no-harm rows' margin
WITHIN = 3.0  # a magnitude claim ("~value") reproduces when our interval lies within [value/3, value·3]
COLLAPSE_RATE = 0.5  # the collapse rate a count row tests for: at least half the runs (R3 paper: 3 of 3)
ALPHA = 1 - CONFIDENCE  # Fisher's exact test's level
POWER = 0.8  # the power a count row's "runs per arm it would take" is sized for
CLIP, VOL = "policy/clip_frac/token", "moe/routing_volatility/overall"
VOL_UPDATE = "moe/routing_volatility/per_update/overall"  # the paper's unit: one optimizer update
MOVING = 0.01  # routing volatility per step from which a sweep cell counts as "routing moves" (figure 8)
ROUTE = "moe/route"


# ------------------------------------------------------------------------------------------------ measures
def final_pass(study: Study, run: str) -> pd.Series:
    f = study.values(PASS1, run).sort_values("step")
    return f.groupby("seed").value.last()


def final_reward(study: Study, run: str) -> pd.Series:
    out = {}
    for r in (r for r in study.runs if r.run == run):
        t = r.cfg.train
        start = t.steps - r.cfg.eval.every if r.cfg.eval.every > 0 else 0
        f = study.values(REWARD, run)
        out[r.seed] = f[(f.seed == r.seed) & (f.step > start)].value.mean()
    return pd.Series(out, dtype=float)


def gain(study: Study, run: str) -> pd.Series:
    f = study.values(PASS1, run).sort_values("step")
    return f.groupby("seed").value.last() - f[f.step == 0].groupby("seed").value.first()


def training_mean(metric: str):
    def measure(study: Study, run: str) -> pd.Series:
        return study.values(metric, run).groupby("seed").value.mean()

    return measure


def pooled(study: Study, num: str, den: str, run_id: str, steps: tuple[int, int] | None = None) -> float:
    """Σ `num` / Σ `den` over one run's logged steps (those in (lo, hi] when `steps` is given)."""
    f = study.frame[(study.frame.run_id == run_id) & study.frame.metric.isin((num, den))]
    if steps is not None:
        f = f[(f.step > steps[0]) & (f.step <= steps[1])]
    w = f.pivot_table(index="step", columns="metric", values="value")
    if num not in w or den not in w:
        return math.nan
    return pooled_ratio(w[num], w[den])


# ------------------------------------------------------------------------------------------------ verdicts
class Verdict(StrEnum):
    REPRODUCES = "reproduces"
    NOT_REPRODUCED = "not reproduced"
    UNDERPOWERED = "underpowered"
    INCONCLUSIVE = "inconclusive"
    CONSISTENT = "consistent"
    MEASURED = "measured"
    NOT_RUN = "not run"


def verdict(kind: str, lo: float, hi: float, sign: int = 1, paper: float = math.nan, effect: float = MARGIN) -> Verdict:
    """`kind`: "diff" (A − B has sign `sign`, the gap tested for is `effect`), "no_harm" (A is not worse than B
    by more than `effect`) or "magnitude" (the interval against the paper's value within a factor WITHIN)."""
    if math.isnan(lo):
        return Verdict.INCONCLUSIVE
    half = (hi - lo) / 2
    if kind == "no_harm":
        if lo > -effect:
            return Verdict.CONSISTENT
        if hi < -effect:
            return Verdict.NOT_REPRODUCED
        return Verdict.UNDERPOWERED if half > effect else Verdict.INCONCLUSIVE
    if kind == "magnitude":
        low, high = paper / WITHIN, paper * WITHIN
        if low <= lo and hi <= high:
            return Verdict.REPRODUCES
        return Verdict.NOT_REPRODUCED if hi < low or lo > high else Verdict.INCONCLUSIVE
    lo, hi = sorted((sign * lo, sign * hi))
    if lo > 0:
        return Verdict.REPRODUCES
    if hi < effect:
        return Verdict.NOT_REPRODUCED
    return Verdict.UNDERPOWERED if half > effect else Verdict.INCONCLUSIVE


def collapse_verdict(k: int, n: int) -> Verdict:
    """k of n runs collapsed, against a rate of COLLAPSE_RATE: "not reproduced" when the exact interval's upper
    bound is below it, "reproduces" when at least that share collapsed, else "underpowered"."""
    if n < 1:
        return Verdict.INCONCLUSIVE
    if clopper_pearson(k, n)[1] < COLLAPSE_RATE:
        return Verdict.NOT_REPRODUCED
    return Verdict.REPRODUCES if k >= COLLAPSE_RATE * n else Verdict.UNDERPOWERED


def collapse_verdict_v1(k: int, n: int, k_r2: int) -> Verdict:
    """The count rule before 2026-12-04 (kept to show what it reads, REPORT row 13): "not reproduced" when no run of
    GRPO without replay collapsed, "reproduces" when at least half did and no GRPO + R2 run, else "inconclusive".
    Replaced after the archive had been seen: 0 of 4 allows a rate up to 60 %, so its "not reproduced" claimed more
    than an interval row's does."""
    if k == 0:
        return Verdict.NOT_REPRODUCED
    return Verdict.REPRODUCES if 2 * k >= n and k_r2 == 0 else Verdict.INCONCLUSIVE


def fisher_verdict(k1: int, n1: int, k0: int, n0: int) -> Verdict:
    """Fisher's one-sided test of arm 1 collapsing more than arm 0: "reproduces" at p ≤ ALPHA, "underpowered" when
    even n1 of n1 against 0 of n0 could not reach it, else "inconclusive"."""
    if fisher_greater(k1, n1, k0, n0) <= ALPHA:
        return Verdict.REPRODUCES
    return Verdict.UNDERPOWERED if fisher_greater(n1, n1, 0, n0) > ALPHA else Verdict.INCONCLUSIVE


def factor(lo: float, hi: float, paper: float) -> str:
    """How far a magnitude interval lies from the paper's value, as "≈ N× lower/higher" ("" when it overlaps)."""
    if hi < paper / WITHIN:
        return f"≈ {paper / ((lo + hi) / 2):.3g}× lower at this scale"
    if lo > paper * WITHIN:
        return f"≈ {(lo + hi) / 2 / paper:.3g}× higher at this scale"
    return ""


def _fmt(mean: float, lo: float, hi: float) -> str:
    return f"{mean:.4g}" + ("" if math.isnan(lo) else f" [{lo:.4g}, {hi:.4g}]")


def _percent(x: float) -> str:
    x *= 100
    return f"{x:.0f}" if x >= 10 or x == 0 else f"{x:.2g}"


@dataclass(frozen=True)
class Estimate:
    """One quantity of a claim: its name, mean, 95 % interval over n (seeds), and verdict; `measure` the declared
    measure it is (a row's primary estimate must be its claim's `primary`); `sides` the two arms' own levels for
    a difference; `k` for a count (k of n, [lo, hi] its exact binomial interval); `note` text shown after it.
    Rendered once, by `text` (in full) and `value` (the number alone)."""

    name: str
    mean: float
    lo: float
    hi: float
    n: int
    verdict: Verdict
    sides: str = ""
    unit: str = "Δ "  # "" for a level rather than a difference
    measure: str = ""
    k: int | None = None
    paper: float = math.nan  # the paper's value (magnitude claims)
    note: str = ""
    equivalent: bool | None = None  # a difference's equivalence reading: both one-sided 95 % bounds inside ±δ
    # (experiments/headline/plan.yaml: a reading beside the verdict, never the verdict); None where not read

    @property
    def half_width(self) -> float:
        return (self.hi - self.lo) / 2

    def value(self) -> str:
        """The number alone: "Δ −0.0162 ±0.148 (n=3)", or "0 of 4 [0, 60 %]" for a count."""
        if self.k is not None:
            return f"{self.k} of {self.n} [{_percent(self.lo)}, {_percent(self.hi)} %]"
        half = "" if math.isnan(self.lo) else f" ±{self.half_width:.3g}"
        far = self.note if math.isfinite(self.paper) else ""  # a magnitude: how far from the paper's value
        return f"{self.unit}{self.mean:.4g}{half} (n={self.n}){far}"

    def text(self) -> str:
        if self.k is not None:
            body = f"{self.k} of {self.n} collapsed [{_percent(self.lo)}, {_percent(self.hi)} %]"
        else:
            half = "" if math.isnan(self.lo) else f" ±{self.half_width:.3g}"
            sides = f"{self.sides}; " if self.sides else ""
            body = f"{sides}{self.unit}{_fmt(self.mean, self.lo, self.hi)}{half} (n={self.n})"
            if self.equivalent:
                body += f", equivalent within ±{MARGIN} (both one-sided 95 % bounds inside)"
        return f"{self.name}: {body}" + (f"{self.note}" if self.note else "")


def estimate(
    name: str,
    values,
    kind: str = "diff",
    sign: int = 1,
    effect: float = MARGIN,
    sides: str = "",
    paper: float = math.nan,
    unit: str = "Δ ",
    measure: str = "",
) -> Estimate:
    from analysis.stats import equivalent, one_sided_bounds

    mean, lo, hi, n = mean_ci(values)
    v = verdict(kind, lo, hi, sign, paper, effect)
    same = None
    if kind == "diff" and n >= 2 and not math.isfinite(paper):
        _, lo1, hi1, _ = one_sided_bounds(values)
        same = equivalent(lo1, hi1, effect)
    return Estimate(name, mean, lo, hi, n, v, sides, unit, measure, paper=paper, equivalent=same)


def count(name: str, k: int, n: int, measure: str = "", judged: bool = True, note: str = "") -> Estimate:
    """k of n runs collapsed, with its exact interval; judged by `collapse_verdict`, or a reading ("measured")."""
    lo, hi = clopper_pearson(k, n)
    v = collapse_verdict(k, n) if judged else Verdict.MEASURED
    return Estimate(name, k / n, lo, hi, n, v, unit="", measure=measure, k=k, note=note)


def difference(
    study: Study, per_seed, a: str, b: str, name: str, kind: str, sign: int, effect: float = MARGIN, measure: str = ""
) -> Estimate:
    """`name`: A − B paired by seed, with both sides' levels."""
    va, vb = per_seed(study, a), per_seed(study, b)
    sides = f"{label(a)} {_fmt(*mean_ci(va)[:3])} vs {label(b)} {_fmt(*mean_ci(vb)[:3])}"
    return estimate(name, (va - vb).dropna(), kind, sign, effect, sides, measure=measure)


@dataclass(frozen=True)
class Result:
    """A claim's result. Its verdict is its primary estimate's, by construction (`otherwise` only when it has
    none: not run, a reading, no data to judge); `secondary` estimates are shown beside it with their own
    verdicts; `context` says what the row is measured on and what it reads beside its measures; `glance` is the
    first table's cell of a row without a primary estimate."""

    context: str = ""
    primary: Estimate | None = None
    secondary: tuple[Estimate, ...] = ()
    otherwise: Verdict = Verdict.INCONCLUSIVE
    glance: str = ""

    @property
    def verdict(self) -> Verdict:
        return self.otherwise if self.primary is None else self.primary.verdict

    @property
    def estimates(self) -> tuple[Estimate, ...]:
        return ((self.primary,) if self.primary else ()) + self.secondary


# ------------------------------------------------------------------------------------------------ power
TARGET_HALF_WIDTH = MARGIN  # the gap in final pass@1 the long-horizon comparison is sized to see


def seeds_needed(sd: float, half_width: float = TARGET_HALF_WIDTH) -> int | None:
    """The fewest seeds whose 95 % t half-width t_{n−1} · sd / √n is at most `half_width` (None: sd unknown)."""
    from scipy import stats

    if not math.isfinite(sd):
        return None
    n = 2
    while stats.t.ppf(0.5 + CONFIDENCE / 2, n - 1) * sd / math.sqrt(n) > half_width and n < 10_000:
        n += 1
    return n


def powered(d: pd.Series) -> str:
    """Δ's half-width against TARGET_HALF_WIDTH, and the seeds the measured SD says it would take."""
    mean, lo, hi, n = mean_ci(d)
    if math.isnan(lo):
        return f"half-width unknown (n={n})"
    half = (hi - lo) / 2
    if half <= TARGET_HALF_WIDTH:
        return f"half-width {half:.3f} ≤ {TARGET_HALF_WIDTH}"
    need = seeds_needed(float(d.std(ddof=1)))
    return f"half-width {half:.3f} > {TARGET_HALF_WIDTH}; SD {d.std(ddof=1):.3f} needs {need} seeds"
