"""Draw figure N of the study from its tracked MLflow runs: `results/<scale>/figure-N.{png,pdf,csv}`.

    python -m analysis.figures --figure 1 --scale cpu [--seeds 1,2,3] [--x compute|steps] [key=value ...]

The figure's runs are those of experiments/figures.yaml at that scale and seeds (`key=value` overrides are
applied to every run's config, as for `python -m gspo_study sweep`); each is looked up in MLflow by its
`run_key` tag and must have finished, or the script stops with a one-line error naming what to train
(exit 2). The PNG, PDF and CSV are also logged as artifacts of a run named `figure-N` in the runs'
experiment, tagged `figure=N`, `scale`, `seeds`, `x`. Aggregation and CSV columns: analysis/aggregate.py;
what each figure shows: docs/FIGURES.md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pandas as pd

from analysis.aggregate import COLUMNS, bars, csv_row, curves, points, reference, seed_stats
from analysis.drawing import Panel, draw, log_outputs
from analysis.registry import Drawings
from analysis.runs import PASS1, REWARD, MissingRunError, Study, label, load
from gspo_study.archive import draw_notice
from gspo_study.config import ConfigError
from gspo_study.run import run_key
from gspo_study.study import figure_configs, figure_spec, parse_seeds

# The paper's reported values (GSPO paper, arXiv 2507.18071): Figure 2 and §5.3.
PAPER_CLIP_FRAC = {"gspo": 0.15, "grpo_r2": 0.0013}  # average fraction of clipped tokens, GSPO vs GRPO
PAPER_VOLATILITY = 0.10  # ~10% of activated experts change after one gradient update (48-layer MoE)
CLIP, VOL = "policy/clip_frac/token", "moe/routing_volatility"
LOG_AXIS = {"mismatch/k3", "train/grad_norm"}  # positive, spanning orders of magnitude over training


def _reward_pass(s: Study) -> list[Panel]:
    return [
        Panel(curves(s, REWARD, "a"), "(a) training reward", "mean reward of the rollout batch"),
        Panel(curves(s, PASS1, "b"), "(b) held-out pass@1", "mean pass@1"),
    ]


def figure_1(s: Study) -> list[Panel]:
    return _reward_pass(s)


def figure_2(s: Study) -> list[Panel]:
    refs = [reference(v, label(run), CLIP, "a", run) for run, v in PAPER_CLIP_FRAC.items()]
    a = bars(s, {0: CLIP}, "a", "all steps")  # one group: a bar per run
    n = max(r.cfg.train.num_minibatches for r in s.runs)
    b = bars(s, {j: f"{CLIP}/mb_{j}" for j in range(n)}, "b", "minibatch")
    return [
        Panel(_cat(a, *refs), "(a) clipped-token fraction, mean over training", "fraction", " ", True),
        Panel(b, "(b) per minibatch update (0 = on-policy)", "fraction", "minibatch index", True),
    ]


def figure_3(s: Study) -> list[Panel]:
    return _reward_pass(s)


def figure_4(s: Study) -> list[Panel]:
    layers = sorted({m for m in s.frame.metric.unique() if m.startswith(f"{VOL}/layer_")})
    a = bars(s, {int(m.rsplit("_", 1)[1]): m for m in layers}, "a", "layer")
    ref = [reference(PAPER_VOLATILITY, "~10% per update", f"{VOL}/overall", p) for p in "ab"]
    return [
        Panel(_cat(a, ref[0]), "(a) per layer, mean over training", "changed expert choices", "layer", True),
        Panel(_cat(curves(s, f"{VOL}/overall", "b"), ref[1]), "(b) all MoE layers", "changed expert choices",
              logy=True),
    ]  # fmt: skip


def figure_5(s: Study) -> list[Panel]:
    metrics = ("policy/ratio/token_var", "policy/ratio/seq_var")
    length = "rollout/response_len/mean"
    return [
        Panel(_cat(*(curves(s, m, "a") for m in metrics)), "(a) over training", "ratio variance", logy=True),
        Panel(_cat(*(points(s, m, length, "b") for m in metrics)), "(b) against response length (per step)",
              "ratio variance", "mean response length (tokens)", True),
    ]  # fmt: skip


def figure_6(s: Study) -> list[Panel]:
    return [
        *_reward_pass(s),
        Panel(curves(s, "mismatch/k3", "c"), "(c) rollout–trainer k3 KL", "k3 (log scale)", logy=True),
        Panel(curves(s, "mismatch/f_tau_2", "d"), "(d) tokens with ratio beyond ×2", "F(τ=2)"),
    ]


def figure_7(s: Study) -> list[Panel]:
    k3 = Panel(curves(s, "mismatch/k3", "c"), "(c) rollout–trainer k3 KL", "k3 (log scale)", logy=True)
    return [*_reward_pass(s), k3]


def depth(cfg) -> int:
    """Decoder layers of a run's model (the preset's unless overridden)."""
    from gspo_study.models import PRESETS

    return cfg.model.num_hidden_layers or PRESETS[cfg.model.preset]["num_hidden_layers"]


def sweep_table(s: Study) -> pd.DataFrame:
    """One row per tracked run: run, seed, lr, depth, cell, held-out pass@1 at step 0 (the cold start) and at
    the last step, and routing volatility (`moe/routing_volatility/overall`) averaged over the run's steps."""
    rows = []
    for r in s.runs:
        f = s.frame[s.frame.run_id == r.run_id]
        p = f[f.metric == PASS1].sort_values("step")
        vol = f[f.metric == f"{VOL}/overall"].value
        cell = f"train.lr={r.cfg.train.lr:g} model.num_hidden_layers={depth(r.cfg)}"
        rows.append(
            dict(
                run=r.run,
                seed=r.seed,
                lr=r.cfg.train.lr,
                depth=depth(r.cfg),
                cell=cell,
                start=p.value.iat[0],
                final=p.value.iat[-1],
                final_step=p.step.iat[-1],
                vol=vol.mean(),
            )
        )
    return pd.DataFrame(rows)


def figure_8(s: Study) -> list[Panel]:
    t = sweep_table(s)
    panels, letters = [], iter("abcdefghij")
    for d, at_depth in t.groupby("depth"):
        panel = next(letters)
        rows = []
        for (run, lr), g in at_depth.groupby(["run", "lr"], sort=False):
            rows.append(
                csv_row(
                    panel=panel,
                    kind="curve",
                    series=label(run),
                    run=run,
                    metric=PASS1,
                    x_name="train.lr",
                    x=lr,
                    step=g.final_step.max(),
                    **seed_stats(g.final, PASS1),
                    cell=g.cell.iat[0],
                )
            )
        cold = csv_row(
            panel=panel,
            kind="reference",
            series="cold start (step 0)",
            metric=PASS1,
            x_name="",
            mean=float(at_depth.start.mean()),
            n_seeds=0,
            cell=f"model.num_hidden_layers={d}",
        )
        rows.append(cold)
        panels.append(
            Panel(
                pd.DataFrame(rows),
                f"({panel}) {d} layers: final held-out pass@1",
                "mean pass@1",
                "learning rate",
                logx=True,
            )
        )
    panel, rows = next(letters), []
    for (run, cell), g in t.groupby(["run", "cell"], sort=False):
        rows.append(
            csv_row(
                panel=panel,
                kind="point",
                series=label(run),
                run=run,
                metric=f"{PASS1} change",
                x_name=f"{VOL}/overall",
                x=float(g.vol.mean()),
                step=g.final_step.max(),
                **seed_stats(g.final - g.start, f"{PASS1} change"),
                cell=cell,
            )
        )
    panels.append(
        Panel(
            pd.DataFrame(rows),
            f"({panel}) pass@1 gain over the cold start vs routing volatility",
            "final − cold-start pass@1",
            "routing volatility (changed expert choices per step)",
            logx=True,
        )
    )
    return panels


ROUTE = "moe/route"  # the routing-share instrument (docs/METRICS.md)
LAG = "rollout.policy_lag"
INSTRUMENT = {
    "share": f"{ROUTE}/var_share",
    "flip_token": f"{ROUTE}/clip_flip_token",
    "flip_seq": f"{ROUTE}/clip_flip_seq",
    "vol": f"{VOL}/overall",
}


def lag_table(s: Study) -> pd.DataFrame:
    """One row per tracked run of a policy-lag sweep: run, seed, lag, held-out pass@1 at its last step (and at step
    0, `start`: the cold start), reward
    averaged over its last evaluation interval (as analysis/report.py), and the instrument and routing
    volatility averaged over its steps."""
    rows = []
    for r in s.runs:
        f = s.frame[s.frame.run_id == r.run_id]
        p = f[f.metric == PASS1].sort_values("step")
        start = r.cfg.train.steps - r.cfg.eval.every if r.cfg.eval.every > 0 else 0
        reward = f[(f.metric == REWARD) & (f.step > start)].value.mean()
        means = {k: f[f.metric == m].value.mean() for k, m in INSTRUMENT.items()}
        rows.append(
            dict(
                run=r.run,
                seed=r.seed,
                lag=r.cfg.rollout.policy_lag,
                cell=f"{LAG}={r.cfg.rollout.policy_lag}",
                final=p.value.iat[-1],
                final_step=p.step.iat[-1],
                start=p.value.iat[0],
                reward=reward,
                **means,
            )
        )
    return pd.DataFrame(rows)


def figure_9(s: Study) -> list[Panel]:
    """(a, b) GRPO without − with R2, seed-paired, against routing's share of the log-ratio variance (GRPO
    without replay's), one point per lag; (c–e) the instrument and volatility against the lag, per run."""
    t = lag_table(s).set_index(["run", "lag", "seed"]).sort_index()
    panels = []
    for panel, (col, what) in zip("ab", (("final", "final held-out pass@1"), ("reward", "final reward"))):
        rows = []
        for lag in sorted({lag for _, lag, _ in t.index}):
            if not {("grpo", lag), ("grpo_r2", lag)} <= {(run, la) for run, la, _ in t.index}:
                continue
            d = (t.loc[("grpo", lag)][col] - t.loc[("grpo_r2", lag)][col]).dropna()
            metric = f"{PASS1 if col == 'final' else REWARD} difference"
            rows.append(
                csv_row(
                    panel=panel,
                    kind="point",
                    series="GRPO (no replay) − GRPO + R2",
                    run="grpo",
                    metric=metric,
                    x_name=INSTRUMENT["share"],
                    x=float(t.loc[("grpo", lag)].share.mean()),
                    step=int(t.loc[("grpo", lag)].final_step.max()),
                    **seed_stats(d, metric),
                    cell=f"{LAG}={lag}",
                )
            )
        panels.append(
            Panel(
                pd.DataFrame(rows, columns=COLUMNS),
                f"({panel}) {what}: no replay − R2",
                "difference (paired by seed)",
                "routing's share of Var log-ratio (no replay)",
            )
        )
    for panel, keys, title, ylabel in (
        ("c", ["share"], "(c) routing's share of Var log-ratio", "Var ℓ^route / Var ℓ"),
        ("d", ["flip_token", "flip_seq"], "(d) clip decisions routing flips", "fraction"),
        ("e", ["vol"], "(e) routing volatility per step", "changed expert choices"),
    ):
        rows = []
        for key in keys:
            for (run, lag), g in t.groupby(level=["run", "lag"], sort=False):
                rows.append(
                    csv_row(
                        panel=panel,
                        kind="curve",
                        series=label(run),
                        run=run,
                        metric=INSTRUMENT[key],
                        x_name=LAG,
                        x=float(lag),
                        step=int(g.final_step.max()),
                        **seed_stats(g[key], INSTRUMENT[key]),
                    )
                )
        panels.append(Panel(pd.DataFrame(rows, columns=COLUMNS), title, ylabel, "policy lag (steps)"))
    return panels


def finals(s: Study, metric: str, panel: str, last_interval: bool = False) -> pd.DataFrame:
    """One bar per run: the metric at each seed's last step (or, `last_interval`, averaged over the last
    evaluation interval, as the report's final reward), mean and t-interval over seeds."""
    rows = []
    for run in s.names():
        per_seed = []
        for r in (r for r in s.runs if r.run == run):
            f = s.frame[(s.frame.run_id == r.run_id) & (s.frame.metric == metric)].sort_values("step")
            start = r.cfg.train.steps - r.cfg.eval.every if r.cfg.eval.every > 0 else 0
            per_seed.append(f[f.step > start].value.mean() if last_interval else f.value.iat[-1])
        rows.append(
            csv_row(
                panel=panel,
                kind="bar",
                series=label(run),
                run=run,
                metric=metric,
                x_name=" ",
                x=0,
                **seed_stats(per_seed, metric),
            )
        )
    return pd.DataFrame(rows, columns=COLUMNS)


def figure_10(s: Study) -> list[Panel]:
    return [
        Panel(finals(s, PASS1, "a"), "(a) final held-out pass@1", "mean pass@1", " "),
        Panel(finals(s, REWARD, "b", last_interval=True), "(b) final training reward", "mean reward", " "),
        Panel(bars(s, {0: "mismatch/k3"}, "c", " "), "(c) rollout–trainer k3 KL, mean over training", "k3", " "),
        Panel(bars(s, {0: "mismatch/f_tau_2"}, "d", " "), "(d) tokens with ratio beyond ×2", "F(τ=2)", " "),
        Panel(bars(s, {0: "correction/masked_frac/token"}, "e", " "), "(e) tokens masked by the correction",
              "fraction", " "),
    ]  # fmt: skip


LONG = {  # figure 11's panels: what the papers watch before a collapse (shared/COLLAPSE.md), per arm over training
    "a": (REWARD, "(a) training reward", "mean reward"),
    "b": (PASS1, "(b) held-out pass@1", "mean pass@1"),
    "c": ("mismatch/k3", "(c) train–inference k3 KL", "k3 (log scale)"),
    "d": ("train/grad_norm", "(d) gradient norm", "global L2 norm (log scale)"),
    "e": (f"{ROUTE}/r2_removed_share", "(e) share of Var log-ratio R2 would remove", "1 − Var ℓ^pol / Var ℓ"),
    "f": ("moe/train_infer_routing/tokens_any_changed", "(f) tokens routed differently by the rollout engine",
          "share of tokens (≥ 1 layer)"),
}  # fmt: skip


def figure_11(s: Study) -> list[Panel]:
    """The long horizon under a train–inference mismatch: per arm, mean and interval over seeds."""
    return [
        Panel(curves(s, metric, panel), title, ylabel, logy=metric in LOG_AXIS)
        for panel, (metric, title, ylabel) in LONG.items()
    ]


def figure_13(s: Study) -> list[Panel]:
    """The routing frontier, axis V (analysis/frontier.py, experiments/frontier/plan.yaml)."""
    from analysis.frontier_figures import panels

    return panels(s, 13)


def figure_14(s: Study) -> list[Panel]:
    """The routing frontier, axis M and its control."""
    from analysis.frontier_figures import panels

    return panels(s, 14)


# Figures 15-20 are drawn by their studies' own modules (experiments/figures.yaml names each one's `draw`).
FIGURES = Drawings()  # figure number → its panels function, from experiments/figures.yaml (analysis/registry.py)


def _cat(*frames):
    return pd.concat([f for f in frames if not f.empty], ignore_index=True)


def load_figure(
    figure: int, scale: str, seeds: list[int], overrides=(), x: str = "compute", partial: bool = False
) -> Study:
    """The figure's tracked runs; a missing or unfinished one is an error naming what to train (`partial`: drawn
    without it, the title saying how many of the figure's runs are in, unless none is)."""
    study = load(figure_configs(figure, scale, seeds, tuple(overrides)), x)
    if study.missing and not (partial and study.runs):
        what = ", ".join(f"{run} seed {seed} ({why})" for run, seed, why in study.missing)
        todo = ",".join(str(s) for s in sorted({seed for _, seed, _ in study.missing}))
        cmd = " ".join([f"python -m gspo_study sweep --figure {figure} --scale {scale} --seeds {todo}", *overrides])
        raise MissingRunError(
            f"figure {figure}: no finished MLflow run for {what} in experiment {study.experiment!r} at "
            f"{study.uri}; train it: {cmd}"
        )
    return study


def make_figure(
    figure: int, scale: str, seeds: list[int], overrides=(), x: str = "compute", partial: bool = False
) -> list[Path]:
    """Draw, save and log figure N; returns the png, pdf and csv paths (`partial`: from the finished runs alone)."""
    from analysis.drawing import save

    if figure not in FIGURES:
        raise ConfigError(f"unknown figure {figure}; allowed: {', '.join(map(str, FIGURES))}")
    study = load_figure(figure, scale, seeds, overrides, x, partial)
    note = draw_notice(study.out_dir, {run_key(r.cfg): r.tags for r in study.runs}, f"figure {figure}")
    if note:  # another machine or library draw than the shipped study's: say so, in one line
        print(note)
    title = figure_spec(figure)["title"]
    if study.missing:  # a partly trained figure (--partial): say so where the reader looks first
        done = len(study.runs)
        title = f"{title}\n(partial: {done} of {done + len(study.missing)} runs finished)"
        print(f"figure {figure}: drawn from {done} finished runs; {len(study.missing)} not yet trained")
    fig, rows = draw(study, figure, title, FIGURES[figure](study))
    paths = save(fig, rows, study.out_dir, f"figure-{figure}")
    tags = {"figure": str(figure), "scale": scale, "seeds": ",".join(map(str, seeds)), "x": x}
    log_outputs(study, f"figure-{figure}", tags, paths)
    return paths


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--figure", type=int, required=True, help="figure number (experiments/figures.yaml)")
    p.add_argument("--scale", default="cpu", help="smoke | cpu | paper")
    p.add_argument("--seeds", help="e.g. 1,2,3 (default: the scale's default seeds)")
    p.add_argument("--x", choices=("compute", "steps"), default="compute", help="x axis of curves")
    p.add_argument("--partial", action="store_true", help="draw the finished runs of a partly trained figure")
    p.add_argument("overrides", nargs="*", help="key.sub=value overrides for every run (e.g. results_dir=)")
    args = p.parse_args(argv)
    try:
        seeds = parse_seeds(args.seeds, args.scale, args.figure)
        paths = make_figure(args.figure, args.scale, seeds, args.overrides, args.x, args.partial)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print("\n".join(map(str, paths)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
