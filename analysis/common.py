"""Shared analysis layer: tracked MLflow runs → a long pandas frame → seed aggregates → plots, CSV, artifacts.

- Runs are found only in MLflow: the run of a config is the one tagged `run_key = run.run_key(cfg)` in
  experiment `cfg.tracking.experiment` at `run.tracking_uri(cfg)`; only FINISHED runs count.
- The long frame has one row per (run, seed, step, metric): columns run, label, seed, run_id, step, metric,
  value, flops. `flops` is the run's cumulative `compute/flops` at that step; step 0 (the cold-start
  evaluation, before any training) has none logged and is taken as 0.
- Seed aggregates are the mean and a two-sided 95% Student-t interval, mean ± t(0.975, n−1)·s/√n with s
  the sample standard deviation over seeds (n < 2 seeds: no interval, lower = upper = NaN). With x =
  compute, seeds of one run reach a step with slightly different FLOPs (response lengths differ), so curves
  are aggregated by step and drawn at the mean FLOPs of that step over the seeds.
- Every drawn point, bar and reference line is one row of the figure's CSV (`COLUMNS`), so the CSV is
  exactly the plotted data.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from gspo_study.config import Config, ConfigError
from gspo_study.run import run_key, tracking_uri
from gspo_study.tracking import checked_client, find_run, metric_name

REWARD, PASS1, FLOPS = "rollout/reward/mean", "eval/pass@1", "compute/flops"
X_NAMES = {"compute": FLOPS, "steps": "step"}
X_LABELS = {"compute": "training compute (FLOPs)", "steps": "RL step"}
CONFIDENCE = 0.95
COLUMNS = ["figure", "panel", "kind", "series", "run", "metric", "x_name", "x", "step", "seed"]
COLUMNS += ["mean", "lower", "upper", "n_seeds", "cell", "stat", "window", "raw", "line", "band_lower", "band_upper"]

# Readable series names, by run file (experiments/runs/<name>.yaml); other runs show their file name.
LABELS = {
    "gspo": "GSPO",
    "grpo_r2": "GRPO + R2",
    "grpo": "GRPO (no replay)",
    "grpo_r3": "GRPO + R3",
    "dppo": "DPPO",
    "grpo_r3_bf16": "GRPO + R3, bf16 rollout",
    "gspo_bf16_rollout": "GSPO, bf16 rollout log-probs",
    "gspo_bf16_recompute": "GSPO, bf16 rollout, recomputed π_old",
    "grpo_r2_bf16_rollout": "GRPO + R2, bf16 rollout log-probs",
    "grpo_r2_bf16_recompute": "GRPO + R2, bf16 rollout, recomputed π_old",
    "grpo_bf16_recompute": "GRPO (no replay), bf16 rollout, recomputed π_old",
    **{
        f"{run}_bf16_{c}": f"{name}, bf16 rollout, {what}"
        for run, name in (("gspo", "GSPO"), ("grpo_r2", "GRPO + R2"))
        for c, what in (("tis", "token TIS"), ("mis", "sequence MIS"), ("icepop", "IcePop"))
    },
}


def label(run: str) -> str:
    return LABELS.get(run, run.replace("_", " "))


class MissingRunError(ConfigError):
    """A run the analysis needs is not in the tracking store (or did not finish)."""


@dataclass
class TrackedRun:
    run: str  # run file name (experiments/runs/<run>.yaml)
    seed: int
    cfg: Config
    run_id: str
    tags: dict[str, str]
    numerics: int = 1  # the run's numerics version (its `numerics` param; runs from before the param: 1)


@dataclass
class Study:
    """The tracked runs of a figure (or a report) and their metric histories."""

    runs: list[TrackedRun]
    frame: pd.DataFrame
    uri: str
    experiment: str
    out_dir: Path
    x: str = "compute"
    missing: list[tuple[str, int, str]] = field(default_factory=list)  # (run, seed, why)

    def values(self, metric: str, run: str | None = None) -> pd.DataFrame:
        f = self.frame[self.frame.metric == metric]
        return f if run is None else f[f.run == run]

    def names(self) -> list[str]:
        return list(dict.fromkeys(r.run for r in self.runs))


# ------------------------------------------------------------------------------------------------ loading
def _find(client, cfg: Config):
    """The config's run in its experiment, or why there is none."""
    exp = client.get_experiment_by_name(cfg.tracking.experiment)
    if exp is None:
        return None, f"no experiment {cfg.tracking.experiment!r}"
    found = find_run(client, exp.experiment_id, run_key(cfg))
    if found is None:
        return None, "not trained"
    if found.info.status != "FINISHED":
        return None, f"status {found.info.status}"
    return found, ""


def _history(client, run, name: str, seed: int, rid: str) -> pd.DataFrame:
    rows = []
    for key in run.data.metrics:
        rows += [(m.step, metric_name(key), m.value) for m in client.get_metric_history(rid, key)]
    out = pd.DataFrame(rows, columns=["step", "metric", "value"])
    out.insert(0, "run_id", rid)
    out.insert(0, "seed", seed)
    out.insert(0, "label", label(name))
    out.insert(0, "run", name)
    flops = out[out.metric == FLOPS].set_index("step").value
    out["flops"] = out.step.map(flops).where(out.step != 0, 0.0)  # step 0 = cold start, no compute yet
    return out


def load(pairs: Iterable[tuple[str, Config]], x: str = "compute") -> Study:
    """Metric histories of every (run, config) found; the others are listed in `Study.missing`."""
    pairs = list(pairs)
    if not pairs:
        raise ConfigError("no runs to analyse")
    cfg0 = pairs[0][1]
    clients: dict[str, object] = {}
    runs, frames, missing = [], [], []
    for name, cfg in pairs:
        uri = tracking_uri(cfg)
        client = clients.setdefault(uri, checked_client(uri))
        run, why = _find(client, cfg)
        if run is None:
            missing.append((name, cfg.seed, why))
            continue
        numerics = int(run.data.params.get("numerics", 1))
        runs.append(TrackedRun(name, cfg.seed, cfg, run.info.run_id, dict(run.data.tags), numerics))
        frames.append(_history(client, run, name, cfg.seed, run.info.run_id))
    check_numerics(runs)
    columns = ["run", "label", "seed", "run_id", "step", "metric", "value", "flops"]
    frame = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=columns)
    return Study(runs, frame, tracking_uri(cfg0), cfg0.tracking.experiment, cfg0.out_dir, x, missing)


def check_numerics(runs: list[TrackedRun]) -> None:
    """A figure or report compares runs of one numerics version only (the `numerics` knob: kernels and reduction
    orders that move numbers): a one-line error naming the versions and a run of each otherwise."""
    by: dict[int, TrackedRun] = {}
    for r in runs:
        by.setdefault(r.numerics, r)
    if len(by) > 1:
        shown = "; ".join(f"numerics {v}: e.g. {r.run} seed {r.seed}" for v, r in sorted(by.items()))
        raise ConfigError(f"these runs mix numerics versions ({shown}); allowed: one version per comparison")


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
    return dict(mean=mean, lower=lo, upper=hi, n_seeds=n, stat=q.stat if n > 1 else "", line=line,
                band_lower=band_lo, band_upper=band_hi)  # fmt: skip


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


# ------------------------------------------------------------------------------------------------ drawing
@dataclass
class Panel:
    rows: pd.DataFrame
    title: str
    ylabel: str
    xlabel: str = ""
    logy: bool = False
    logx: bool = False


# One colour per arm in every figure: the algorithm family sets the hue, a run's variant (engine precision,
# correction) a lighter shade of it, so GRPO + R2 is the same orange in figures 1, 3, 10 and 11.
FAMILIES = ("gspo", "grpo_r2", "grpo", "grpo_r3", "sapo", "gmpo", "cispo", "gspo_token", "dppo")
VARIANTS = ("", "_bf16_recompute", "_bf16", "_bf16_rollout", "_bf16_tis", "_bf16_mis", "_bf16_icepop")


def arm_color(run: str) -> tuple[float, float, float]:
    """The colour of run file `run`: its family's colour of seaborn's colorblind palette, mixed toward white by
    its variant's place in VARIANTS (other runs: the palette's grey)."""
    import seaborn as sns

    palette = sns.color_palette("colorblind", 10)
    family = max((f for f in FAMILIES if run == f or run.startswith(f + "_")), key=len, default=None)
    if family is None:
        return palette[7]
    rest = run.removeprefix(family)
    shade = VARIANTS.index(rest) if rest in VARIANTS else len(VARIANTS)
    base = palette[[0, 1, 2, 4, 6, 5, 9, 8, 3][FAMILIES.index(family)]]
    return tuple(c + (1 - c) * 0.11 * shade for c in base)


STYLES = [("-", "o"), ("--", "x"), (":", "^"), ("-.", "s")]  # a panel's 1st, 2nd, … metric: line style, marker
FAINT, BAND = 0.2, 0.13  # alpha of an unsmoothed curve behind its smoothed one, and of a band


def _short(metric: str) -> str:
    return metric.rsplit("/", 1)[-1]


def _draw_curves(ax, rows: pd.DataFrame, colors, styles) -> None:
    for (run, metric), g in rows.groupby(["run", "metric"], sort=False):
        g = g.sort_values(["step", "x"])
        line, marker = styles.get(metric, STYLES[0])
        if (g.window > 1).any():  # smoothed: the step-by-step values faint behind
            ax.plot(g.x, g.raw, line, color=colors.get(run, "grey"), alpha=FAINT, linewidth=0.6)
        short = len(g) < LONG
        ax.plot(g.x, g.line, line, color=colors.get(run, "grey"), marker=marker if short else None, markersize=3.5)
        ax.fill_between(g.x, g.band_lower, g.band_upper, color=colors.get(run, "grey"), alpha=BAND, linewidth=0)


def _draw_bars(ax, rows: pd.DataFrame, colors, styles) -> None:
    xs = sorted(rows.x.unique())
    width = 0.8 / rows.groupby("x").run.nunique().max()
    for i, x in enumerate(xs):
        g = rows[rows.x == x]
        for j, r in enumerate(g.itertuples()):
            pos = i + (j - (len(g) - 1) / 2) * width
            err = None if math.isnan(r.band_lower) else [[r.line - r.band_lower], [r.band_upper - r.line]]
            ax.bar(pos, r.line, width, yerr=err, capsize=2, color=colors.get(r.run, "grey"), error_kw={"linewidth": 1})
    ax.set_xticks(range(len(xs)), [f"{x:g}" for x in xs] if len(xs) > 1 else [""])


def _cell_label(cell: str) -> str:
    """A sweep cell in a few characters: `train.lr=4e-05 model.num_hidden_layers=16` → `lr 4e-05, L16`."""
    names = {"train.lr=": "lr ", "model.num_hidden_layers=": "L", "rollout.policy_lag=": "lag "}
    parts = cell.split()
    for old, new in names.items():
        parts = [p.replace(old, new) for p in parts]
    return ", ".join(parts)


def _draw_points(ax, rows: pd.DataFrame, colors, styles) -> None:
    for (run, metric), g in rows.groupby(["run", "metric"], sort=False):
        marker = styles.get(metric, STYLES[0])[1]
        ax.scatter(g.x, g.line, marker=marker, color=colors.get(run, "grey"), alpha=0.7, s=14, linewidths=1)
        if g.band_lower.notna().any():  # seed-aggregated points carry their band
            err = [(g.line - g.band_lower).fillna(0), (g.band_upper - g.line).fillna(0)]
            ax.errorbar(g.x, g.line, yerr=err, fmt="none", color=colors.get(run, "grey"), alpha=0.6, capsize=2)


def _label_cells(ax, rows: pd.DataFrame) -> None:
    """Sweep points: name each cell once, beside its first run's point (the runs of a cell sit close together)."""
    cells = rows[rows.cell.map(lambda c: isinstance(c, str) and c != "")].drop_duplicates("cell")
    for r in cells.itertuples():
        ax.annotate(_cell_label(r.cell), (r.x, r.line), fontsize=6.5, alpha=0.8, xytext=(4, 3),
                    textcoords="offset points")  # fmt: skip


def _plain_log(axis) -> None:
    """A log axis labelled in plain numbers (0.002, not 2 × 10⁻³): at 1, 2 and 5 × 10^k over up to two decades."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    lo, hi = sorted(axis.get_view_interval())
    subs = (1.0, 2.0, 5.0) if lo > 0 and hi / lo < 10**2.5 else (1.0,)
    axis.set_major_locator(LogLocator(subs=subs))
    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    axis.set_minor_formatter(NullFormatter())


def _log_x(ax, rows: pd.DataFrame) -> None:
    """A log x axis: ticks at a sweep's few values themselves, else `_plain_log`."""
    from matplotlib.ticker import NullFormatter

    ax.set_xscale("log")
    xs = sorted(rows.loc[rows.kind != "reference", "x"].dropna().unique())
    if 0 < len(xs) <= 6 and (rows.kind == "curve").any():
        ax.set_xticks(xs, [f"{x:g}" for x in xs])
        ax.xaxis.set_minor_formatter(NullFormatter())
    else:
        _plain_log(ax.xaxis)


def _draw_references(ax, rows: pd.DataFrame, colors, styles) -> None:
    for r in rows.itertuples():
        ax.axhline(r.line, color=colors.get(r.run, "grey"), linestyle="--", linewidth=1)
        below = r.line < 0  # a negative line's label goes under it (a margin's −δ would sit on the bars near 0)
        # on a white box above the bars (figure 16's +0.05 had sat under GSPO's ×170 bar), below lines and points
        ax.annotate(f"{r.line:.3g}", (1, r.line), xycoords=("axes fraction", "data"), xytext=(-2, -2 if below else 2),
                    textcoords="offset points", ha="right", va="top" if below else "bottom", fontsize=7,
                    color="0.3", zorder=1.5, bbox={"boxstyle": "square,pad=0.1", "fc": "white", "ec": "none",
                                                 "alpha": 0.8})  # fmt: skip


DRAW = {"bar": _draw_bars, "curve": _draw_curves, "point": _draw_points, "reference": _draw_references}


def _styles(panels: list[Panel]) -> dict[str, tuple[str, str]]:
    """Line style and marker of each metric that shares a panel with another; the others draw solid, with o."""
    drawn = [p.rows[p.rows.kind.isin(("curve", "point"))] for p in panels]  # a bar panel's metrics are its x groups
    shared = [m for rows in drawn for m in rows.metric.unique() if rows.metric.nunique() > 1]
    return {m: STYLES[i % len(STYLES)] for i, m in enumerate(dict.fromkeys(shared))}


def _legend(panels: list[Panel], colors, styles) -> dict:
    """label → handle: one entry per arm (its colour), per metric that shares a panel (its line and marker), per
    reference line (the paper's value, a cold start)."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    rows = pd.concat([p.rows for p in panels], ignore_index=True)
    arms = rows[rows.kind != "reference"].drop_duplicates("series")
    out = {r.series: Patch(color=colors.get(r.run, "grey")) for r in arms.itertuples()}
    for metric, (line, marker) in styles.items():
        out[_short(metric)] = Line2D([], [], color="0.3", linestyle=line, marker=marker, markersize=4)
    for r in rows[rows.kind == "reference"].drop_duplicates("series").itertuples():
        out[r.series] = Line2D([], [], color=colors.get(r.run, "grey"), linestyle="--", linewidth=1)
    return out


def _subtitle(rows: pd.DataFrame) -> str:
    """How a panel's values are drawn, where that differs from the caption's mean and t-band."""
    curve = rows[rows.kind == "curve"]
    said = []
    if (curve.window > 1).any():
        q = quantity(curve.metric.iat[0])
        kind = "pooled share" if q.pooled else "centered median" if q.stat == "range" else "centered mean"
        said.append(f"{int(curve.window.max())}-step {kind}")
    if (rows.stat == "range").any():
        said.append("median, seed range")
    return f"\n{'; '.join(said)}" if said else ""


def _fit_y(ax, p: Panel) -> None:
    """Keep a panel's axis on what it says: the lines and bands (and most of a smoothed curve's faint steps, whose
    single outliers would otherwise set the scale); on a log axis, its positive values."""
    rows = p.rows
    curve = rows[(rows.kind == "curve") & (rows.window > 1)]
    if curve.empty and not p.logy:
        return
    shown = pd.concat([rows.line, rows.band_lower, rows.band_upper, curve.raw.quantile([0.01, 0.99])])
    shown = shown[np.isfinite(shown) & ((shown > 0) if p.logy else True)]
    if shown.empty:
        return
    lo, hi = float(shown.min()), float(shown.max())
    if (rows.kind == "bar").any() and not p.logy:
        lo = min(lo, 0.0)
    if p.logy:
        pad = max(hi / lo, 1.0001) ** 0.06
        ax.set_ylim(lo / pad, hi * pad)
    else:
        pad = 0.05 * (hi - lo) or 0.05 * abs(hi) or 0.05
        ax.set_ylim(lo - pad, hi + pad)


def _zero_note(ax, p: Panel) -> None:
    """A log axis cannot draw a value of 0: the panel names what it leaves out instead of leaving a gap."""
    zero = p.rows[(p.rows["kind"] != "reference") & (p.rows["line"] <= 0)]
    if len(zero):
        where = sorted({f"{r.series} at {r.x_name} {r.x:g}" for r in zero.itertuples()})
        ax.text(0.02, 0.02, "not drawn, value 0: " + "; ".join(where), transform=ax.transAxes, fontsize=6,
                va="bottom", wrap=True)  # fmt: skip


def _caption(study: Study, figure: int, title: str, panels: list[Panel], width: int) -> str:
    """The figure's title and how its values are drawn, wrapped to `width` characters."""
    import textwrap

    rows = pd.concat([p.rows for p in panels], ignore_index=True)
    seeds = sorted({r.seed for r in study.runs})
    how = f"mean over seeds, band: {CONFIDENCE:.0%} t-interval cut to the quantity's range"
    if (rows.stat == "range").any():
        how += "; where marked, median and seed range (lowest to highest seed)"
    if (rows.loc[rows.kind != "reference", "n_seeds"] <= 1).all():
        how = "one seed, no band"
    lines = [f"Figure {figure}: {title}", f"scale {study.runs[0].cfg.scale}, seeds {seeds}: {how}"]
    smoothed = rows[(rows.kind == "curve") & (rows.window > 1)]
    if len(smoothed):
        pooled = [q.pooled for q in map(quantity, smoothed.metric.unique()) if q.pooled]
        said = "".join(f" (pooled: 1 − Σ {_short(n)} / Σ {_short(d)})" for n, d in pooled)
        how = "mean (or median)" if (smoothed.stat == "range").any() else "mean"
        lines.append(f"Curves of {LONG}+ steps: each seed's centered {how} over the window marked{said}, then over "
                     "seeds; faint: unsmoothed")  # fmt: skip
    if ((rows.kind == "point") & (rows.n_seeds == 1)).any():
        lines.append("Points without bars: one seed at one step")
    return "\n".join(textwrap.fill(line, width) for line in lines)


def draw(study: Study, figure: int, title: str, panels: list[Panel]):
    """The panels in rows of at most 3, one legend for the figure outside every panel (in a free panel slot, or under
    the panels); returns (matplotlib figure, the CSV rows of everything drawn)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import seaborn as sns

    sns.set_theme(style="whitegrid", context="paper", font_scale=1.2)
    colors = {name: arm_color(name) for name in study.names()}
    styles = _styles(panels)
    ncols = 1 if len(panels) == 1 else 2 if len(panels) in (2, 4) else 3
    nrows = math.ceil(len(panels) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.6 * ncols, 3.6 * nrows + 1.2), squeeze=False,
                             layout="constrained")  # fmt: skip
    for ax, p in zip(axes.flat, panels):
        for kind, rows in p.rows.groupby("kind", sort=False):
            DRAW[kind](ax, rows, colors, styles)
        ax.set_title(p.title + _subtitle(p.rows), fontsize=9.5)
        ax.set(ylabel=p.ylabel, xlabel=p.xlabel or X_LABELS[study.x])
        if p.logy:
            ax.set_yscale("log")
            _zero_note(ax, p)
        if p.logx:
            _log_x(ax, p.rows)
        if (p.rows.kind == "point").any():
            _label_cells(ax, p.rows[p.rows.kind == "point"])
        _fit_y(ax, p)
        if p.logy:
            _plain_log(ax.yaxis)
    entries = _legend(panels, colors, styles)
    free = list(axes.flat[len(panels) :])
    for ax in free:
        ax.axis("off")
    if free:
        free[0].legend(entries.values(), entries.keys(), loc="center", frameon=False, fontsize=8)
    else:
        widest = max(len(k) for k in entries) * 0.075 + 0.6  # inches of one entry at 8 pt
        ncol = max(1, min(len(entries), int(fig.get_figwidth() / widest)))
        fig.legend(entries.values(), entries.keys(), loc="outside lower center", ncol=ncol, frameon=False, fontsize=8)
    fig.suptitle(_caption(study, figure, title, panels, int(fig.get_figwidth() * 13)), fontsize=10)
    rows = pd.concat([p.rows for p in panels], ignore_index=True)
    rows["figure"] = figure
    return fig, rows


# ------------------------------------------------------------------------------------------------ outputs
def save(fig, rows: pd.DataFrame, out_dir: Path, stem: str) -> list[Path]:
    """`<stem>.png`, `.pdf` and `.csv` (the plotted rows) under `out_dir`."""
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / f"{stem}.{ext}" for ext in ("png", "pdf", "csv")]
    fig.savefig(paths[0], dpi=150)
    fig.savefig(paths[1])
    plt.close(fig)
    rows[COLUMNS].to_csv(paths[2], index=False)
    return paths


def log_outputs(study: Study, name: str, tags: dict[str, str], paths: list[Path]) -> str:
    """Log `paths` at the artifact root of a dedicated run `name` in the runs' experiment, tagged `tags`.

    The run is reused when the same analysis (same tags, same source runs) is drawn again, so redrawing
    replaces the artifacts instead of adding runs. Returns its run id."""
    client = checked_client(study.uri)
    exp_id = client.get_experiment_by_name(study.experiment).experiment_id
    sources = ",".join(sorted(r.run_id for r in study.runs))
    key = hashlib.sha256(f"{sorted(tags.items())}|{sources}".encode()).hexdigest()[:12]
    found = client.search_runs([exp_id], f"tags.analysis_key = '{key}'", max_results=1)
    rid = found[0].info.run_id if found else None
    if rid is None:
        all_tags = {
            **tags,
            "analysis_key": key,
            "source_run_ids": sources,
            "mlflow.note.content": f"{name}: drawn by analysis/ from runs {sources}",
        }
        rid = client.create_run(exp_id, run_name=name, tags=all_tags).info.run_id
    for path in paths:
        client.log_artifact(rid, str(path))
    client.set_terminated(rid, status="FINISHED")
    return rid
