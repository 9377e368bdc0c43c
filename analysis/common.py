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
from gspo_study.tracking import find_run, metric_name

REWARD, PASS1, FLOPS = "rollout/reward/mean", "eval/pass@1", "compute/flops"
X_NAMES = {"compute": FLOPS, "steps": "step"}
X_LABELS = {"compute": "training compute (FLOPs)", "steps": "RL step"}
CONFIDENCE = 0.95
COLUMNS = ["figure", "panel", "kind", "series", "run", "metric", "x_name", "x", "step", "seed"]
COLUMNS += ["mean", "lower", "upper", "n_seeds", "cell"]

# Readable series names, by run file (experiments/runs/<name>.yaml); other runs show their file name.
LABELS = {
    "gspo": "GSPO",
    "grpo_r2": "GRPO + R2",
    "grpo": "GRPO (no replay)",
    "grpo_r3": "GRPO + R3",
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
def _client(uri: str):
    """A client for `uri`; an unreachable server is a one-line ConfigError, found fast (no retry storm)."""
    import urllib.request

    from mlflow import MlflowClient

    if uri.startswith(("http://", "https://")):
        try:
            urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=5).close()
        except OSError as exc:
            raise ConfigError(f"MLflow tracking URI {uri!r} is unreachable ({type(exc).__name__})") from None
    try:
        return MlflowClient(tracking_uri=uri)
    except Exception as exc:  # noqa: BLE001 - MLflow refuses an unknown scheme with several exception types
        raise ConfigError(
            f"MLflow tracking URI {uri!r} is not usable ({type(exc).__name__}); allowed: sqlite:///<file>, "
            "http(s)://<server> or another store MLflow supports (set tracking.uri or MLFLOW_TRACKING_URI)"
        ) from None


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
        client = clients.setdefault(uri, _client(uri))
        run, why = _find(client, cfg)
        if run is None:
            missing.append((name, cfg.seed, why))
            continue
        runs.append(TrackedRun(name, cfg.seed, cfg, run.info.run_id, dict(run.data.tags)))
        frames.append(_history(client, run, name, cfg.seed, run.info.run_id))
    columns = ["run", "label", "seed", "run_id", "step", "metric", "value", "flops"]
    frame = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=columns)
    return Study(runs, frame, tracking_uri(cfg0), cfg0.tracking.experiment, cfg0.out_dir, x, missing)


# ------------------------------------------------------------------------------------------------ statistics
def mean_ci(values) -> tuple[float, float, float, int]:
    """Mean and 95% Student-t interval over the finite values: (mean, lower, upper, n)."""
    from scipy import stats

    v = np.asarray(values, dtype=float)
    v = v[np.isfinite(v)]
    n = len(v)
    if n == 0:
        return math.nan, math.nan, math.nan, 0
    mean = float(v.mean())
    if n < 2:
        return mean, math.nan, math.nan, n
    half = float(stats.t.ppf(0.5 + CONFIDENCE / 2, n - 1) * v.std(ddof=1) / math.sqrt(n))
    return mean, mean - half, mean + half, n


def csv_row(**kw) -> dict:
    return {c: kw.get(c, "" if c == "cell" else math.nan) for c in COLUMNS}


def curves(study: Study, metric: str, panel: str) -> pd.DataFrame:
    """Per run and step: seed mean and interval of `metric`, at x = mean FLOPs of the step (or the step)."""
    rows = []
    for run, f in study.values(metric).groupby("run", sort=False):
        for step, g in f.groupby("step"):
            mean, lo, hi, n = mean_ci(g.value)
            x = float(g.flops.mean()) if study.x == "compute" else float(step)
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
                    mean=mean,
                    lower=lo,
                    upper=hi,
                    n_seeds=n,
                )
            )
    return pd.DataFrame(rows, columns=COLUMNS)


def bars(study: Study, metrics: dict[float, str], panel: str, x_name: str) -> pd.DataFrame:
    """Per run and x: `metrics[x]` averaged over every logged step of each seed, then mean ± CI over seeds."""
    rows = []
    for run in study.names():
        for x, metric in metrics.items():
            f = study.values(metric, run)
            if f.empty:
                continue
            mean, lo, hi, n = mean_ci(f.groupby("seed").value.mean())
            rows.append(
                csv_row(
                    panel=panel,
                    kind="bar",
                    series=label(run),
                    run=run,
                    metric=metric,
                    x_name=x_name,
                    x=x,
                    mean=mean,
                    lower=lo,
                    upper=hi,
                    n_seeds=n,
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
FAMILIES = ("gspo", "grpo_r2", "grpo", "grpo_r3", "sapo", "gmpo", "cispo", "gspo_token")
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
    base = palette[[0, 1, 2, 4, 6, 5, 9, 8][FAMILIES.index(family)]]
    return tuple(c + (1 - c) * 0.11 * shade for c in base)


def _colors(study: Study) -> dict[str, tuple]:
    return {name: arm_color(name) for name in study.names()}


def _draw_curves(ax, rows: pd.DataFrame, colors) -> None:
    styles = {m: s for m, s in zip(rows.metric.unique(), ["-", "--", ":", "-."] * 4)}
    many = len(styles) > 1
    for (run, metric), g in rows.groupby(["run", "metric"], sort=False):
        g = g.sort_values(["step", "x"])
        name = f"{g.series.iat[0]}: {metric.rsplit('/', 1)[-1]}" if many else g.series.iat[0]
        ax.plot(g.x, g["mean"], styles[metric], color=colors.get(run), marker=".", label=name)
        ax.fill_between(g.x, g.lower, g.upper, color=colors.get(run), alpha=0.2, linewidth=0)


def _draw_bars(ax, rows: pd.DataFrame, colors) -> None:
    xs = sorted(rows.x.unique())
    width = 0.8 / rows.groupby("x").run.nunique().max()
    for i, x in enumerate(xs):
        g = rows[rows.x == x]
        for j, r in enumerate(g.itertuples()):
            pos = i + (j - (len(g) - 1) / 2) * width
            err = None if math.isnan(r.lower) else [[r.mean - r.lower], [r.upper - r.mean]]
            seen = r.series in ax.get_legend_handles_labels()[1]
            ax.bar(pos, r.mean, width, yerr=err, capsize=3, color=colors.get(r.run), label=None if seen else r.series)
    ax.set_xticks(range(len(xs)), [f"{x:g}" for x in xs] if len(xs) > 1 else [""])


def _draw_points(ax, rows: pd.DataFrame, colors) -> None:
    markers = {m: s for m, s in zip(rows.metric.unique(), "ox^s" * 4)}
    for (run, metric), g in rows.groupby(["run", "metric"], sort=False):
        name = f"{g.series.iat[0]}: {metric.rsplit('/', 1)[-1]}"
        ax.scatter(g.x, g["mean"], marker=markers[metric], color=colors.get(run), alpha=0.7, label=name)
        for r in g.itertuples():  # sweep points: say which cell each is
            if isinstance(r.cell, str) and r.cell:
                short = r.cell.replace("train.lr=", "lr ").replace("model.num_hidden_layers=", "L")
                ax.annotate(short, (r.x, r.mean), fontsize=5, alpha=0.7, xytext=(2, 2), textcoords="offset points")
        if g.lower.notna().any():  # seed-aggregated points carry their interval
            err = [(g["mean"] - g.lower).fillna(0), (g.upper - g["mean"]).fillna(0)]
            ax.errorbar(g.x, g["mean"], yerr=err, fmt="none", color=colors.get(run), alpha=0.5, capsize=2)


def _draw_references(ax, rows: pd.DataFrame, colors) -> None:
    for r in rows.itertuples():
        ax.axhline(
            r.mean, color=colors.get(r.run, "grey"), linestyle="--", linewidth=1, label=f"{r.series} ≈ {r.mean:.3g}"
        )


MAX_BAR_LEGEND = 4  # a bar panel with more series than this shares one legend under the figure
DRAW = {"bar": _draw_bars, "curve": _draw_curves, "point": _draw_points, "reference": _draw_references}


def draw(study: Study, figure: int, title: str, panels: list[Panel]):
    """The panels side by side; returns (matplotlib figure, the CSV rows of everything drawn)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import seaborn as sns

    sns.set_theme(style="whitegrid", context="paper")
    colors = _colors(study)
    ncols = 2 if len(panels) == 4 else min(len(panels), 3)  # rows of at most 3: a page's width
    nrows = math.ceil(len(panels) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(5.2 * ncols, 4.2 * nrows), squeeze=False)
    shared = {}  # label → handle of bar panels with many series: one legend under the figure, not on the bars
    for ax, p in zip(axes.flat, panels):
        for kind, rows in p.rows.groupby("kind", sort=False):
            DRAW[kind](ax, rows, colors)
        ax.set(title=p.title, ylabel=p.ylabel, xlabel=p.xlabel or X_LABELS[study.x])
        if p.logy:
            ax.set_yscale("log")
            # a t-band over few seeds can reach 0 or below: keep the axis on the data, the band clipped
            means = p.rows["mean"][p.rows["mean"] > 0]
            if len(means):
                ax.set_ylim(bottom=float(means.min()) / 5)
            zero = p.rows[(p.rows["kind"] != "reference") & (p.rows["mean"] <= 0)]
            if len(zero):  # a log axis cannot draw them: say so rather than leave a gap
                where = sorted({f"{r.series} at {r.x_name} {r.x:g}" for r in zero.itertuples()})
                ax.text(
                    0.02,
                    0.02,
                    "not drawn, value 0: " + "; ".join(where),
                    transform=ax.transAxes,
                    fontsize=6,
                    va="bottom",
                    wrap=True,
                )
        if p.logx:
            ax.set_xscale("log")
        if set(p.rows["kind"]) == {"bar"} and p.rows.series.nunique() > MAX_BAR_LEGEND:
            shared.update(zip(*reversed(ax.get_legend_handles_labels())))
        else:
            ax.legend(fontsize=7)
    seeds = sorted({r.seed for r in study.runs})
    per_seed = any(((p.rows["kind"] == "point") & (p.rows["n_seeds"] == 1)).any() for p in panels)
    how = f"mean over seeds, band/bars: {CONFIDENCE:.0%} t-interval"
    how += "; points without bars: one seed at one step" if per_seed else ""
    fig.suptitle(f"Figure {figure}: {title}\nscale {study.runs[0].cfg.scale}, seeds {seeds}; {how}")
    if shared:
        ncol = min(len(shared), 2 * ncols)
        fig.legend(shared.values(), shared.keys(), loc="lower center", ncol=ncol, fontsize=7, frameon=False)
        fig.tight_layout(rect=(0, 0.035 * math.ceil(len(shared) / ncol), 1, 1))
    else:
        fig.tight_layout()
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
    client = _client(study.uri)
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
