"""Axis R's figures (17: the pilot, 19: the decisive stage, 20: the frozen router), drawn from analysis/mechanism.py's
outcomes, summaries and paired comparisons; the rules and the REPORT section stay there. A cell of fewer than
PILOT_N seeds is drawn as its mean alone, marked a pilot's (no t-interval)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd

from analysis.aggregate import COLUMNS, PILOT_N, drawn_row, margin_rows, mean_ci, pilot_note
from analysis.drawing import Panel
from analysis.frontier import kaplan_meier
from analysis.mechanism import OBJ, comparisons, load_plan, outcomes, summary
from analysis.runs import PASS1, Study, label


def panels(study: Study, plan: dict | None = None, calibration: Path | None = None) -> list:
    """Figures 17 and 19 (the pilot's cells, the decisive stage's): (a) the calibration (routing's share and flips per
    update against σ); (b) what the runs reached; (c) final pass@1 per dose and arm; (d) Δ against GRPO without replay
    with ±δ; (e) share collapsed; (f) the sham and the positive control; (g) time to collapse at the highest dose."""
    plan = plan or load_plan()
    out = outcomes(study, plan)
    summ, comp = summary(out), comparisons(out, plan)
    x = "σ (train.route_noise)"
    result, letters = [], iter("abcdefgh")
    table = pd.read_csv(calibration or study.out_dir / "calibration.csv", dtype={"dose": str})
    cal = table[(table.axis == "R") & (table.dial == "train.route_noise")].copy()
    cal["x"] = pd.to_numeric(cal.dose, errors="coerce")
    p = next(letters)
    rows = [
        drawn_row(
            p,
            "curve",
            {"route_share": "routing's share of Var ℓ", "route_flips": "flips per update"}[r.measure],
            "",
            f"calibration/{r.measure}",
            "σ",
            r.x,
            r.mean,
            n=int(r.n),
        )
        for r in cal[(cal.x > 0) & cal.measure.isin(["route_share", "route_flips"])].sort_values("x").itertuples()
    ]
    result.append(
        Panel(
            pd.DataFrame(rows, columns=COLUMNS),
            f"({p}) calibration (4 steps, seed 3's cold start)",
            "share",
            x,
            logx=True,
        )
    )
    r_cells = summ[summ.kind == "R"]
    p = next(letters)
    rows = [
        drawn_row(
            p, "point", label(r.arm), r.arm, f"{OBJ}/r2_removed_share", "σ", r.dose, r.share, n=int(r.runs), step=r.dose
        )
        for r in r_cells.itertuples()
        if r.share == r.share
    ]
    result.append(
        Panel(
            pd.DataFrame(rows, columns=COLUMNS),
            f"({p}) reached in the runs: routing's share of Var ℓ",
            "share (pooled over updates)",
            x,
        )
    )
    for value, metric, title, ylabel in (
        ("pass", PASS1, "final held-out pass@1", "mean pass@1"),
        (
            "collapsed",
            "frontier/collapsed",
            f"runs collapsed (rule v{plan['collapse_rule']['version']})",
            "share of runs (exact 95 %)",
        ),
    ):
        p = next(letters)
        note = pilot_note(r_cells.runs) if value == "pass" else ""
        ylim = SHARE if value == "collapsed" else None
        result.append(Panel(_dose_points(r_cells, p, value, metric), f"({p}) {title}{note}", ylabel, x, ylim=ylim))
    p = next(letters)
    c = comp[comp.kind == "R"]
    rows = [
        drawn_row(
            p,
            "point",
            label(r.arm),
            r.arm,
            "eval/pass@1 difference",
            "σ",
            r.dose,
            r.delta,
            *((r.lo, r.hi) if r.n >= 3 else (math.nan, math.nan)),
            int(r.n),
            step=r.dose,
        )
        for r in c.itertuples()
    ]
    margin = float(plan["margin"])
    refs = margin_rows(p, margin)
    result.append(
        Panel(pd.DataFrame([*rows, *refs], columns=COLUMNS), f"({p}) Δ final pass@1 vs GRPO (paired)", "Δ pass@1", x)
    )
    controls = summ[summ.kind.isin(["sham", "positive"])]
    if not controls.empty:
        p = next(letters)
        rows = [
            drawn_row(
                p,
                "bar",
                label(r.arm),
                r.arm,
                PASS1,
                "cell",
                i,
                r.pass_final,
                *((max(r.pass_lo, 0), min(r.pass_hi, 1)) if r.n >= 3 else (math.nan, math.nan)),
                int(r.n),
                step=i,
            )
            for i, (_, g) in enumerate(controls.groupby(["kind", "dose"], sort=True))
            for r in g.itertuples()
        ]
        short = {"positive": "random top-k", "sham": "sham σ {:g}"}  # the title must fit the panel
        cells = controls.groupby(["kind", "dose"]).groups
        names = " · ".join(f"{i} {short[k].format(d)}" for i, (k, d) in enumerate(cells))
        result.append(Panel(pd.DataFrame(rows, columns=COLUMNS), f"({p}) controls: {names}", "final pass@1", " "))
    top = max((d for d in r_cells.dose.unique()), default=None)
    if top:
        p = next(letters)
        result.append(
            Panel(
                _survival(out, top, p),
                f"({p}) not yet collapsed at σ {top:g} (Kaplan–Meier; arms offset)",
                "share of runs",
                "RL step",
                ylim=SHARE,
            )
        )
    return result


def _dose_points(t: pd.DataFrame, panel: str, value: str, metric: str) -> pd.DataFrame:
    """Per arm and dose, mean final pass@1 [95 % t] or the share collapsed [exact 95 %]; fewer than 3 seeds: the
    point alone (a t-interval of 2 seeds spans most of [0, 1] and says nothing), its series marked as a pilot's."""
    arms = list(dict.fromkeys(t.arm))
    rows = []
    for r in t.itertuples():
        k = arms.index(r.arm) - (len(arms) - 1) / 2
        x = r.dose + k * 0.004  # arms side by side at a dose
        if value == "pass":
            y, lo, hi = r.pass_final, max(r.pass_lo, 0.0), min(r.pass_hi, 1.0)
        else:
            y, lo, hi = r.collapsed / r.runs, r.collapsed_lo, r.collapsed_hi
        if r.runs < PILOT_N and value == "pass":
            lo = hi = math.nan
        rows.append(drawn_row(panel, "point", label(r.arm), r.arm, metric, "σ", x, y, lo, hi, int(r.runs), step=r.dose))
    return pd.DataFrame(rows, columns=COLUMNS)


def _survival(out: pd.DataFrame, dose: float, panel: str) -> pd.DataFrame:
    """Kaplan–Meier per arm at one dose, each arm's curve offset by 0.01 so coinciding curves stay visible."""
    g = out[(out.kind == "R") & (out.dose == dose)]
    rows = []
    for i, (arm, a) in enumerate(g.groupby("arm", sort=True)):
        xs, ys = kaplan_meier(a.collapse_step, a.collapsed)
        xs, ys = np.append(xs, float(a.collapse_step.max())), np.append(ys, ys[-1])
        xs, ys = np.repeat(xs, 2)[1:], np.repeat(ys, 2)[:-1]
        for xv, yv in zip(xs, ys):
            rows.append(
                drawn_row(
                    panel, "curve", label(arm), arm, "frontier/survival", "step", xv, yv - 0.01 * i, n=len(a), step=xv
                )
            )
    return pd.DataFrame(rows, columns=COLUMNS)


SHARE = (-0.05, 1.05)  # a share of runs is drawn on the whole of [0, 1]
FROZEN_CELLS = (("frozen", "routers frozen"), ("minibatches", "routers trained"))  # figure 20's two cells, in x order


def frozen_panels(study: Study, plan: dict | None = None) -> list:
    """Figure 20, the frozen router at 16 minibatches beside its trained-router twin (x: 0 frozen, 1 trained): (a) final
    pass@1 per arm; (b) Δ against GRPO without replay, paired, with ±δ; (c) routing drift per update (the share of
    activated experts π_θ's update moved, here through the hidden states alone where the routers are frozen); (d) the
    share of runs collapsed [exact 95 %]."""
    plan = plan or load_plan()
    out = outcomes(study, plan)
    if out.empty:
        return []
    out = out[out.kind.isin([k for k, _ in FROZEN_CELLS])]
    summ, comp = summary(out), comparisons(out, plan)
    at = {k: i for i, (k, _) in enumerate(FROZEN_CELLS)}
    xname = "cell — " + " · ".join(f"{i}: {what}" for i, (_, what) in enumerate(FROZEN_CELLS))
    arms = sorted(set(out.arm))

    def x_of(kind: str, arm: str) -> float:  # arms side by side within a cell
        return at[kind] + 0.06 * (arms.index(arm) - (len(arms) - 1) / 2)

    def interval(lo: float, hi: float, n: int) -> tuple[float, float]:
        return (lo, hi) if n >= PILOT_N else (math.nan, math.nan)

    pass_rows = [
        drawn_row(
            "a",
            "point",
            label(r.arm),
            r.arm,
            PASS1,
            "cell",
            x_of(r.kind, r.arm),
            r.pass_final,
            *interval(max(r.pass_lo, 0.0), min(r.pass_hi, 1.0), int(r.n)),
            int(r.n),
            step=at[r.kind],
        )
        for r in summ.itertuples()
    ]
    delta_rows = [
        drawn_row(
            "b",
            "point",
            label(r.arm),
            r.arm,
            "eval/pass@1 difference",
            "cell",
            x_of(r.kind, r.arm),
            r.delta,
            *interval(r.lo, r.hi, int(r.n)),
            int(r.n),
            step=at[r.kind],
        )
        for r in comp.itertuples()
    ]
    margin = float(plan["margin"])
    refs = margin_rows("b", margin)
    drift_rows = []
    for (kind, arm), g in out.groupby(["kind", "arm"], sort=True):
        mean, lo, hi, n = mean_ci(g.drift_per_update.dropna())
        if n:
            drift_rows.append(
                drawn_row(
                    "c",
                    "point",
                    label(arm),
                    arm,
                    "moe/routing_volatility/per_update/overall",
                    "cell",
                    x_of(kind, arm),
                    mean,
                    *interval(max(lo, 0.0), hi, n),
                    n,
                    step=at[kind],
                )
            )
    down_rows = [
        drawn_row(
            "d",
            "point",
            label(r.arm),
            r.arm,
            "frontier/collapsed",
            "cell",
            x_of(r.kind, r.arm),
            r.collapsed / r.runs,
            r.collapsed_lo,
            r.collapsed_hi,
            int(r.runs),
            step=at[r.kind],
        )
        for r in summ.itertuples()
    ]
    note = pilot_note(summ.runs) if not summ.empty else ""
    frame = lambda rows: pd.DataFrame(rows, columns=COLUMNS)  # noqa: E731 - four panels, one shape
    return [
        Panel(frame(pass_rows), f"(a) final held-out pass@1{note}", "mean pass@1", xname),
        Panel(
            pd.concat([frame(delta_rows), frame(refs)], ignore_index=True),
            "(b) Δ final pass@1 vs GRPO (paired)",
            "Δ pass@1",
            xname,
        ),
        Panel(frame(drift_rows), "(c) routing drift per update", "share of activated experts moved", xname),
        Panel(
            frame(down_rows),
            f"(d) runs collapsed (rule v{plan['collapse_rule']['version']})",
            "share of runs (exact 95 %)",
            xname,
            ylim=SHARE,
        ),
    ]
