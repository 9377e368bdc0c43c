"""The figures' drawing rules, on synthetic runs built to break them (no training, a few seconds): no drawn band or
error bar leaves its quantity's range, a curve of many steps is drawn smoothed (its step-by-step values faint
behind, no marker per step), a figure has one legend and it covers no data, and the CSV holds what is drawn.

The data: figure 11's and figure 10's metrics for two arms at 3 seeds over 300 steps, with seeds far apart near the
ends of each range (a mean ± t-band over 3 seeds then crosses 0 or 1) and single steps far off (a gradient norm of
500, a share of −7), as the shipped runs have them."""

from __future__ import annotations

import math
import zlib
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from analysis import aggregate, drawing, figures
from analysis.runs import Study, TrackedRun, label
from gspo_study.config import load_config

ROOT = Path(__file__).resolve().parents[1]

REWARD, PASS1 = "rollout/reward/mean", "eval/pass@1"
POL, TOTAL, SHARE = "moe/route/pol_var", "moe/route/total_var", "moe/route/r2_removed_share"
ROUTED = "moe/train_infer_routing/tokens_any_changed"
# What each quantity can be (docs/METRICS.md), written here rather than read from analysis/aggregate.py: the rule under
# test must hold against the definitions, not against the table that implements it.
RANGES = {
    REWARD: (0.0, 1.0),
    PASS1: (0.0, 1.0),
    "mismatch/k3": (0.0, math.inf),
    "mismatch/f_tau_2": (0.0, 1.0),
    "train/grad_norm": (0.0, math.inf),
    SHARE: (-math.inf, 1.0),
    ROUTED: (0.0, 1.0),
    "correction/masked_frac/token": (0.0, 1.0),
}
STEPS, EVAL_EVERY, SEEDS = 300, 50, (1, 2, 3)
LONG = 20  # a curve of this many steps or more must be drawn smoothed (docs/FIGURES.md)
ARMS = ("grpo_bf16_recompute", "grpo_r2_bf16_recompute")


def _series(rng, metric: str, seed: int) -> dict[int, float]:
    """One seed's values of `metric`, step → value: seeds far apart near an end of the range, noisy steps, and
    single steps far off."""
    i = SEEDS.index(seed)
    steps = np.arange(1, STEPS + 1)
    noise = rng.standard_normal(STEPS)
    if metric == PASS1:
        at = np.arange(0, STEPS + 1, EVAL_EVERY)
        return dict(zip(at.tolist(), np.clip((0.0, 0.01, 0.3)[i] + 0.01 * noise[: len(at)], 0, 1).tolist()))
    if metric in (REWARD, "moe/train_infer_routing/tokens_any_changed"):
        values = np.clip((0.0, 0.02, 0.25)[i] + 0.05 * noise, 0, 1)
    elif metric in ("mismatch/k3", "mismatch/f_tau_2", "correction/masked_frac/token"):
        values = (1e-5, 1e-4, 1e-3)[i] * np.exp(noise)
        values[rng.choice(STEPS, 5)] = 0.2  # single steps of one seed far off
    elif metric == "train/grad_norm":
        values = 1.0 + 0.1 * np.abs(noise)
        values[150] = 500.0 if i == 0 else values[150]
    elif metric == TOTAL:
        values = np.exp(noise)
        values[rng.choice(STEPS, 5)] = 1e-4  # steps whose total variance is tiny: their share swings to −7
    elif metric == POL:
        total = _series(np.random.default_rng(seed), TOTAL, seed)
        values = np.array([total[s] for s in steps]) * np.clip((0.05, 0.1, 0.7)[i] + 0.05 * noise, 0, None)
        values[values < 1e-3] = 8e-4
    else:
        raise KeyError(metric)
    return dict(zip(steps.tolist(), values.tolist()))


def _frame(runs: tuple[str, ...], metrics: tuple[str, ...]) -> pd.DataFrame:
    rows = []
    for run in runs:
        for seed in SEEDS:
            for metric in metrics:
                rng = np.random.default_rng(seed if metric == TOTAL else zlib.crc32(f"{run} {seed} {metric}".encode()))
                values = _series(rng, metric, seed)
                if metric == POL:  # the share as the trainer logs it, from its two parts
                    total = _series(np.random.default_rng(seed), TOTAL, seed)
                    rows += [(run, seed, s, SHARE, 1 - v / total[s]) for s, v in values.items()]
                rows += [(run, seed, s, metric, v) for s, v in values.items()]
    f = pd.DataFrame(rows, columns=["run", "seed", "step", "metric", "value"])
    f.insert(1, "label", f.run.map(label))
    f.insert(3, "run_id", f.run + "-" + f.seed.astype(str))
    f["flops"] = f.step * 1e10 * (1 + 0.01 * f.run.map(runs.index))  # the arms' x differ a little, as in runs
    return f


def _study(tmp_path, runs, metrics) -> Study:
    cfg = load_config("experiments/smoke/base.yaml", [f"train.steps={STEPS}", f"eval.every={EVAL_EVERY}"])
    tracked = [TrackedRun(r, s, cfg, f"{r}-{s}", {}) for r in runs for s in SEEDS]
    return Study(tracked, _frame(runs, metrics), "", "synthetic", tmp_path, "compute")


LONG_HORIZON = (REWARD, PASS1, "mismatch/k3", "train/grad_norm", POL, TOTAL, ROUTED)
CORRECTIONS = (REWARD, PASS1, "mismatch/k3", "mismatch/f_tau_2", "correction/masked_frac/token")


@pytest.fixture(scope="module")
def figure_11(tmp_path_factory):
    study = _study(tmp_path_factory.mktemp("f11"), ARMS, LONG_HORIZON)
    panels = figures.FIGURES[11](study)
    fig, rows = drawing.draw(study, 11, "synthetic", panels)
    fig.canvas.draw()
    yield study, fig, rows
    import matplotlib.pyplot as plt

    plt.close(fig)


def _metric_of(ax, rows: pd.DataFrame, letter: str) -> str:
    (metric,) = rows[(rows.panel == letter) & (rows.kind != "reference")].metric.unique()
    return metric


def _drawn_ys(ax) -> list[np.ndarray]:
    """The y values of every band (fill_between) and error bar an axes holds."""
    from matplotlib.collections import LineCollection, PolyCollection

    out = []
    for c in ax.collections:
        if isinstance(c, PolyCollection):
            out += [p.vertices[:, 1] for p in c.get_paths()]
        elif isinstance(c, LineCollection):
            out += [np.asarray(s)[:, 1] for s in c.get_segments()]
    return [y[np.isfinite(y)] for y in out]


def _check_ranges(fig, rows) -> None:
    axes = [ax for ax in fig.axes if ax.has_data()]
    for ax, letter in zip(axes, sorted(rows.panel.unique())):
        lo, hi = RANGES[_metric_of(ax, rows, letter)]
        ys = _drawn_ys(ax)
        assert ys, f"panel {letter} draws no band"
        for y in ys:
            assert (y >= lo - 1e-12).all() and (y <= hi + 1e-12).all(), (letter, float(y.min()), float(y.max()))


def test_no_band_leaves_its_quantitys_range(figure_11, tmp_path):
    _, fig, rows = figure_11
    _check_ranges(fig, rows)
    study = _study(tmp_path, ARMS, CORRECTIONS)  # bars: figure 10's panels
    fig10, rows10 = drawing.draw(study, 10, "synthetic", figures.FIGURES[10](study))
    _check_ranges(fig10, rows10)


def _roughness(y) -> float:
    return float(np.nansum(np.abs(np.diff(np.asarray(y, dtype=float)))))


def test_long_curves_are_smoothed_with_the_steps_faint_behind(figure_11):
    """Every curve of LONG+ steps: no marker per step, not the step-by-step mean or median over seeds (those are
    drawn faint behind it, one per curve), and far smoother than the step-by-step mean."""
    study, fig, rows = figure_11
    axes = [ax for ax in fig.axes if ax.has_data()]
    for ax, letter in zip(axes, sorted(rows.panel.unique())):
        metric = _metric_of(ax, rows, letter)
        lines = [ln for ln in ax.lines if len(ln.get_xdata()) >= LONG]
        faint = [ln for ln in lines if (ln.get_alpha() or 1) <= 0.3]
        solid = [ln for ln in lines if (ln.get_alpha() or 1) > 0.3]
        if metric == PASS1:  # evaluated every 50 steps: 7 points, drawn as they are
            assert not lines
            continue
        assert len(solid) == len(ARMS) and len(faint) == len(ARMS), (letter, len(solid), len(faint))
        per_step = study.values(metric).groupby(["run", "step"]).value
        for ln in solid:
            assert ln.get_marker() in (None, "None", "", " "), (letter, ln.get_marker())
            run = next(r for r in ARMS if np.allclose(ln.get_xdata(), rows[(rows.panel == letter) & (rows.run == r)].x))
            y, mean, median = ln.get_ydata(), per_step.mean()[run].to_numpy(), per_step.median()[run].to_numpy()
            for raw in (mean, median):
                assert np.mean(np.abs(y - raw) > 1e-12) > 0.5, (letter, run, "drawn step by step")
            assert _roughness(y) < 0.5 * _roughness(mean), (letter, run)


def test_one_legend_outside_the_data(figure_11):
    _, fig, _ = figure_11
    legends = [*fig.legends, *(ax.get_legend() for ax in fig.axes if ax.get_legend())]
    assert len(legends) == 1
    box = legends[0].get_window_extent()
    for ax in fig.axes:
        if ax.has_data():
            assert not box.overlaps(ax.get_window_extent()), "the legend covers a panel"


def _centered(values: np.ndarray, w: int, how) -> np.ndarray:
    h = w // 2
    return np.array([how(values[max(0, i - h) : i + h + 1]) for i in range(len(values))])


def test_the_csv_holds_what_is_drawn(figure_11):
    """A long curve's line is each seed's centered mean over ~a tenth of its steps, then the mean over seeds (its band
    the t-interval cut to the range); a heavy-tailed one's the centered median, then the median and seed range; a
    share's the pooled ratio over the window, then the median and seed range."""
    study, fig, rows = figure_11
    run, w = ARMS[0], 2 * (STEPS // 20) + 1
    for metric in (REWARD, "train/grad_norm", SHARE):
        per_seed = {}
        for seed in SEEDS:
            f = study.values(metric, run)
            if metric == SHARE:  # 1 − Σ Var ℓ^pol / Σ Var ℓ over the window
                pol, total = (study.values(m, run) for m in (POL, TOTAL))
                num, den = (g[g.seed == seed].sort_values("step").value.to_numpy() for g in (pol, total))
                per_seed[seed] = 1 - _centered(num, w, np.sum) / _centered(den, w, np.sum)
            else:  # a heavy-tailed quantity: the centered median of each seed's steps
                how = np.mean if metric == REWARD else np.median
                per_seed[seed] = _centered(f[f.seed == seed].sort_values("step").value.to_numpy(), w, how)
        v = np.stack([per_seed[s] for s in SEEDS])
        got = rows[(rows.metric == metric) & (rows.run == run) & (rows.kind == "curve")].sort_values("step")
        assert (got.window == w).all() and len(got) == STEPS
        if metric == REWARD:
            mean = v.mean(0)
            half = 4.302652729911275 * v.std(0, ddof=1) / math.sqrt(3)  # t(0.975, 2)
            want = mean, np.maximum(mean - half, 0), np.minimum(mean + half, 1)
        else:
            want = np.median(v, 0), v.min(0), v.max(0)
        for col, w_ in zip(("line", "band_lower", "band_upper"), want):
            assert np.allclose(got[col].to_numpy(), w_, atol=1e-9), (metric, col)
    # and the drawn line is that column
    ax = [a for a in fig.axes if a.has_data()][0]
    drawn = [ln.get_ydata() for ln in ax.lines if (ln.get_alpha() or 1) > 0.3 and len(ln.get_xdata()) == STEPS]
    want = rows[(rows.panel == "a") & (rows.run == ARMS[0])].sort_values("step").line.to_numpy()
    assert any(np.allclose(d, want) for d in drawn)


def test_every_shipped_metric_has_a_range():
    """A metric a shipped figure draws without an entry in `QUANTITIES` would get an unbounded band: none does."""
    metrics = set()
    for path in sorted((ROOT / "results" / "cpu").glob("figure-*.csv")):
        metrics |= set(pd.read_csv(path, usecols=["metric"]).metric)
    unbounded = sorted(m for m in metrics if aggregate.quantity(m) == aggregate.Quantity())
    assert metrics and not unbounded, unbounded
    assert aggregate.quantity("no/such_metric") == aggregate.Quantity()  # the check can fail
