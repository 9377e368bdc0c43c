"""Panels → one matplotlib figure (a colour per arm family, a style per metric, a legend and a caption that say how
each band was made), saved as PNG, PDF and CSV and logged to MLflow as an analysis run."""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from analysis.aggregate import COLUMNS, CONFIDENCE, LONG, X_LABELS, quantity
from analysis.runs import Study
from gspo_study.tracking import checked_client


# ------------------------------------------------------------------------------------------------ drawing
@dataclass
class Panel:
    rows: pd.DataFrame
    title: str
    ylabel: str
    xlabel: str = ""
    logy: bool = False
    logx: bool = False
    ylim: tuple[float, float] | None = None  # a share of runs: the whole [0, 1], not zoomed onto its values


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
        ax.annotate(
            _cell_label(r.cell), (r.x, r.line), fontsize=6.5, alpha=0.8, xytext=(4, 3), textcoords="offset points"
        )


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
        ax.annotate(
            f"{r.line:.3g}",
            (1, r.line),
            xycoords=("axes fraction", "data"),
            xytext=(-2, -2 if below else 2),
            textcoords="offset points",
            ha="right",
            va="top" if below else "bottom",
            fontsize=7,
            color="0.3",
            zorder=1.5,
            bbox={"boxstyle": "square,pad=0.1", "fc": "white", "ec": "none", "alpha": 0.8},
        )


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
        ax.text(
            0.02,
            0.02,
            "not drawn, value 0: " + "; ".join(where),
            transform=ax.transAxes,
            fontsize=6,
            va="bottom",
            wrap=True,
        )


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
        lines.append(
            f"Curves of {LONG}+ steps: each seed's centered {how} over the window marked{said}, then over "
            "seeds; faint: unsmoothed"
        )
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
    fig, axes = plt.subplots(
        nrows, ncols, figsize=(4.6 * ncols, 3.6 * nrows + 1.2), squeeze=False, layout="constrained"
    )
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
        if p.ylim:
            ax.set_ylim(*p.ylim)
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
