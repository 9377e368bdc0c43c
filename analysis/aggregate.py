"""What a figure plots, as numbers: each metric's range and summary (`Quantity`), seed aggregates, smoothing, and the
CSV rows (`COLUMNS`) that every drawn point, bar, curve and reference line is one of — so a figure's CSV is exactly
its plotted data.

- Seed aggregates are the mean and a two-sided 95% Student-t interval, mean ± t(0.975, n−1)·s/√n with s
  the sample standard deviation over seeds (n < 2 seeds: no interval, lower = upper = NaN). With x =
  compute, seeds of one run reach a step with slightly different FLOPs (response lengths differ), so curves
  are aggregated by step and drawn at the mean FLOPs of that step over the seeds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pandas as pd

from analysis.runs import FLOPS, PASS1, REWARD, Study, label

X_NAMES = {"compute": FLOPS, "steps": "step"}
X_LABELS = {"compute": "training compute (FLOPs)", "steps": "RL step"}
CONFIDENCE = 0.95
COLUMNS = ["figure", "panel", "kind", "series", "run", "metric", "x_name", "x", "step", "seed"]
COLUMNS += ["mean", "lower", "upper", "n_seeds", "cell", "stat", "window", "raw", "line", "band_lower", "band_upper"]


# ------------------------------------------------------------------------------------------------ quantities
@dataclass(frozen=True)
class Quantity:
    """What a metric can be, so that no drawn band leaves it: its range [low, high], and how its seeds are summed up
    — "t" (mean, 95 % t-band clipped to the range) or "range" (median, band from the lowest to the highest seed:
    heavy-tailed quantities, whose mean and t-band over a few seeds one step of one seed can set). `pooled`: a share
    1 − Σ numerator / Σ denominator, smoothed as the ratio of window sums rather than as a mean of per-step ratios."""

    low: float = -math.inf
    high: float = math.inf
    stat: str = "t"
    pooled: tuple[str, str] | None = None


UNIT = Quantity(0.0, 1.0)
HEAVY = Quantity(0.0, math.inf, "range")  # positive and heavy-tailed
# By metric name, the longest matching prefix (docs/METRICS.md); an unlisted metric: unbounded, mean and t-band.
QUANTITIES = {
    REWARD: UNIT,  # r_i ∈ {0, 1}
    PASS1: UNIT,
    "policy/clip_frac": UNIT,
    "moe/routing_volatility": UNIT,
    "moe/train_infer_routing": UNIT,
    "moe/route/clip_flip": UNIT,
    "moe/route/var_share": Quantity(0.0),  # not bounded by 1: ℓ^pol and ℓ^route may anti-correlate
    "moe/route/r2_removed_share": Quantity(high=1.0, stat="range", pooled=("moe/route/pol_var", "moe/route/total_var")),
    "mismatch/k3": HEAVY,
    "mismatch/f_tau": Quantity(0.0, 1.0, "range"),
    "train/grad_norm": HEAVY,
    "policy/ratio/token_var": HEAVY,
    "policy/ratio/seq_var": HEAVY,
    "correction/masked_frac": Quantity(0.0, 1.0, "range"),
    "frontier/collapsed": UNIT,  # the share of a dose's runs that collapsed (analysis/frontier.py)
    "frontier/survival": UNIT,  # Kaplan–Meier: the share not yet collapsed
    "calibration/per_update": UNIT,  # the frontier's calibration (gspo_study/calibrate.py): shares of choices
    "calibration/flips_per_layer": UNIT,
    "calibration/k3": HEAVY,
    "calibration/route_share": Quantity(high=1.0),  # axis R's calibration: routing's share of Var ℓ (1 − pol / total)
    "calibration/route_flips": UNIT,
    "moe/route_obj/r2_removed_share": Quantity(high=1.0),  # the same share, read in the runs (analysis/mechanism.py)
    "moe/route_obj/flips": UNIT,
}
DIFFERENCE = (" difference", " change")  # "<metric> difference": two values of the metric subtracted


def quantity(metric: str) -> Quantity:
    """The metric's Quantity; a difference of two values of a metric ranges over ± the width of its range."""
    for suffix in DIFFERENCE:
        if metric.endswith(suffix):
            q = quantity(metric.removesuffix(suffix))
            return Quantity(q.low - q.high, q.high - q.low)
    key = max((k for k in QUANTITIES if metric.startswith(k)), key=len, default=None)
    return QUANTITIES[key] if key else Quantity()


# ------------------------------------------------------------------------------------------------ statistics
def mean_ci(values) -> tuple[float, float, float, int]:
    """Mean and 95% Student-t interval over the finite values: (mean, lower, upper, n) — the one-sided bounds at
    97.5 % (analysis.stats)."""
    from analysis.stats import one_sided_bounds

    return one_sided_bounds(values, 0.5 + CONFIDENCE / 2)


def summary(values, q: Quantity) -> tuple[float, float, float]:
    """What is drawn for values over seeds: (line, band lower, band upper) — the mean and its t-band clipped to the
    quantity's range, or (stat "range") the median and the lowest and highest seed; no band under 2 seeds."""
    v = np.asarray(values, dtype=float)
    v = v[np.isfinite(v)]
    if q.stat == "range":
        if len(v) == 0:
            return math.nan, math.nan, math.nan
        return float(np.median(v)), *((float(v.min()), float(v.max())) if len(v) > 1 else (math.nan, math.nan))
    mean, lo, hi, _ = mean_ci(v)
    return mean, lo if math.isnan(lo) else max(lo, q.low), hi if math.isnan(hi) else min(hi, q.high)


def seed_stats(values, metric: str) -> dict:
    """The CSV fields of one value over seeds: the numbers (mean, 95 % t-interval, n_seeds) and what is drawn
    (`summary`: line, band, and the stat that made them)."""
    q = quantity(metric)
    mean, lo, hi, n = mean_ci(values)
    line, band_lo, band_hi = summary(values, q)
    return dict(
        mean=mean,
        lower=lo,
        upper=hi,
        n_seeds=n,
        stat=q.stat if n > 1 else "",
        line=line,
        band_lower=band_lo,
        band_upper=band_hi,
    )


LONG = 20  # a curve of this many steps or more is smoothed, and drawn without a marker per step


def window(steps: int) -> int:
    """The centered smoothing window of a curve of `steps` logged steps: 2⌊steps/20⌋ + 1, about a tenth of them
    (1, no smoothing, under LONG steps; 3 at 20 steps, 7 at 60, 31 at 300)."""
    return 2 * (steps // LONG) + 1


def smooth(values: pd.Series, w: int, q: Quantity) -> pd.Series:
    """One seed's values in step order: the mean of the w logged steps centered on each (fewer at the ends); for a
    heavy-tailed quantity (stat "range") their median, so that a single step far off does not lift w of them."""
    roll = values.rolling(w, center=True, min_periods=1)
    return roll.median() if q.stat == "range" else roll.mean()


def smooth_pooled(num: pd.Series, den: pd.Series, w: int) -> pd.Series:
    """1 − Σ num / Σ den over the same centered windows (0 where Σ den = 0, as the per-step share)."""
    n, d = (s.rolling(w, center=True, min_periods=1).sum() for s in (num, den))
    return (1 - n / d.where(d != 0)).where(d != 0, 0.0)


def csv_row(**kw) -> dict:
    """A CSV row; one whose drawn fields are not given is drawn as its numbers: line = mean, band = its interval
    clipped to the metric's range."""
    row = {c: kw.get(c, "" if c in ("cell", "stat") else math.nan) for c in COLUMNS}
    if "line" not in kw:
        q = quantity(str(row["metric"]))
        row["line"] = row["mean"]
        row["band_lower"] = row["lower"] if math.isnan(row["lower"]) else max(row["lower"], q.low)
        row["band_upper"] = row["upper"] if math.isnan(row["upper"]) else min(row["upper"], q.high)
        row["stat"] = "" if math.isnan(row["lower"]) else "t"
    return row


def _seed_series(study: Study, metric: str, run: str, seed: int) -> pd.Series:
    f = study.values(metric, run)
    return f[f.seed == seed].set_index("step").value.sort_index()


def _smoothed(study: Study, run: str, metric: str, w: int) -> pd.DataFrame:
    """steps × seeds: each seed's smoothed values of `metric` (pooled quantities from their two parts)."""
    q = quantity(metric)
    out = {}
    for seed in sorted(study.values(metric, run).seed.unique()):
        values = _seed_series(study, metric, run, seed)
        if q.pooled:
            num, den = (_seed_series(study, m, run, seed).reindex(values.index) for m in q.pooled)
            out[seed] = smooth_pooled(num, den, w)
        else:
            out[seed] = smooth(values, w, q)
    return pd.DataFrame(out)


def curves(study: Study, metric: str, panel: str) -> pd.DataFrame:
    """Per run and step: seed mean and interval of `metric` (the numbers; x = mean FLOPs of the step, or the
    step) and what is drawn: each seed's values smoothed over `window(steps)` steps, then `summary` over seeds
    (`raw`: the same summary of the step's unsmoothed values, drawn faint behind a smoothed curve)."""
    q = quantity(metric)
    rows = []
    for run, f in study.values(metric).groupby("run", sort=False):
        w = window(f.step.nunique())
        smoothed = _smoothed(study, run, metric, w)
        for step, g in f.groupby("step"):
            line, band_lo, band_hi = summary(smoothed.loc[step], q)
            x = float(g.flops.mean()) if study.x == "compute" else float(step)
            stats = seed_stats(g.value, metric)
            rows.append(
                csv_row(
                    panel=panel,
                    kind="curve",
                    series=label(run),
                    run=run,
                    metric=metric,
                    x_name=X_NAMES[study.x],
                    x=x,
                    step=step,
                    **{**stats, "line": line, "band_lower": band_lo, "band_upper": band_hi},
                    window=w,
                    raw=stats["line"],
                )
            )
    return pd.DataFrame(rows, columns=COLUMNS)


def bars(study: Study, metrics: dict[float, str], panel: str, x_name: str) -> pd.DataFrame:
    """Per run and x: `metrics[x]` averaged over every logged step of each seed, then its seed statistics."""
    rows = []
    for run in study.names():
        for x, metric in metrics.items():
            f = study.values(metric, run)
            if f.empty:
                continue
            rows.append(
                csv_row(
                    panel=panel,
                    kind="bar",
                    series=label(run),
                    run=run,
                    metric=metric,
                    x_name=x_name,
                    x=x,
                    **seed_stats(f.groupby("seed").value.mean(), metric),
                )
            )
    return pd.DataFrame(rows, columns=COLUMNS)


def points(study: Study, metric: str, x_metric: str, panel: str) -> pd.DataFrame:
    """One point per (run, seed, step): `metric` against `x_metric` at the same step (not aggregated)."""
    y = study.values(metric).set_index(["run", "seed", "step"]).value
    x = study.values(x_metric).set_index(["run", "seed", "step"]).value
    both = pd.concat({"x": x, "y": y}, axis=1).dropna().reset_index()
    rows = [
        csv_row(
            panel=panel,
            kind="point",
            series=label(r.run),
            run=r.run,
            metric=metric,
            x_name=x_metric,
            x=r.x,
            step=r.step,
            seed=r.seed,
            mean=r.y,
            n_seeds=1,
        )
        for r in both.itertuples()
    ]
    return pd.DataFrame(rows, columns=COLUMNS)


def reference(value: float, what: str, metric: str, panel: str, run: str = "") -> pd.DataFrame:
    """A horizontal line at one of the paper's reported values."""
    line = csv_row(
        panel=panel, kind="reference", series=f"paper: {what}", run=run, metric=metric, x_name="", mean=value, n_seeds=0
    )
    return pd.DataFrame([line], columns=COLUMNS)


def drawn_row(
    panel: str,
    kind: str,
    series: str,
    run: str,
    metric: str,
    x_name: str,
    x: float,
    line: float,
    lo: float = math.nan,
    hi: float = math.nan,
    n: int = 0,
    step: float = math.nan,
) -> dict:
    """A drawn row whose line and band are given (never clipped again: the caller's interval is already in range)."""
    return csv_row(
        panel=panel,
        kind=kind,
        series=series,
        run=run,
        metric=metric,
        x_name=x_name,
        x=x,
        step=step,
        mean=line,
        lower=lo,
        upper=hi,
        n_seeds=n,
        line=line,
        band_lower=lo,
        band_upper=hi,
        stat="t" if n > 1 else "",
        window=1,
        raw=line,
    )


PILOT_N = 3  # below this many seeds a cell is drawn as its mean alone, marked a pilot's: a t-interval of 2 seeds
# spans most of [0, 1] and says nothing (two-seed cells once drew intervals from −0.02 to 1.56)


def pilot_note(runs) -> str:
    """A panel's title note where some cell has fewer than PILOT_N seeds (drawn as its mean alone)."""
    few = sorted({int(n) for n in runs if n < PILOT_N})
    return f" — pilot, n = {', '.join(map(str, few))}: means only" if few else ""


def margin_rows(panel: str, margin: float, metric: str = "eval/pass@1 difference") -> list[dict]:
    """The ±δ reference lines of a panel of paired differences (what "equivalent within ±δ" is read against)."""
    return [
        csv_row(
            panel=panel,
            kind="reference",
            series=f"margin {sign}{margin:g}",
            run="",
            metric=metric,
            x_name="",
            mean=v * margin,
            n_seeds=0,
        )
        for sign, v in (("+", 1), ("−", -1))
    ]
