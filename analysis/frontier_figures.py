"""The routing frontier's figures (13: axis V's pilot, 14: axis M's, 15: the decisive stage, 16: axis V refined), drawn
from analysis/frontier.py's outcomes, summaries and paired comparisons; the rules and the REPORT section stay there."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd

from analysis.aggregate import COLUMNS, PILOT_N, csv_row, drawn_row, margin_rows, pilot_note, reference
from analysis.drawing import Panel
from analysis.frontier import (
    comparisons,
    decisive_dose,
    kaplan_meier,
    load_plan,
    outcomes,
    summary,
)
from analysis.runs import Study, label

AXIS_OF = {13: "V", 14: "M"}  # the pilot's figures, one axis each
CALIBRATION = {  # per axis: (dial, measure, y label, the paper's value or None)
    "V": [("train.router_lr_scale", "per_update", "activated experts changed per update", 0.10)],
    "M": [
        ("rollout.router_noise", "flips_per_layer", "routing flips per layer", 0.057),
        ("rollout.router_noise", "k3", "train–inference k3", 1.5e-3),
    ],
}
CONTROL_DIAL = "rollout.head_noise"


def calibration_rows(table: pd.DataFrame, axis: str, spec: tuple) -> tuple[pd.DataFrame, str, float | None]:
    """Panel (a): each calibrated dose's reading (mean ± SD over the calibration's batches or steps), the control's
    k3 beside axis M's, and the paper's level as a reference line."""
    rows, refs, panel = [], [], ""
    dial, measure, ylabel, paper = spec
    dials = [(dial, "rollout copy's router logits" if axis == "M" else "router lr scale")]
    control = _control_k3(table, panel) if measure == "k3" else None  # the control's own dial is another quantity:
    if control is not None:  # its matched k3 is a line here, not a curve on this panel's x-axis
        refs.append(control)
    for name, what in dials:
        t = table[(table.dial == name) & (table.measure == measure)].copy()
        t["x"] = pd.to_numeric(t.dose, errors="coerce")
        for r in t[t.x > 0].sort_values("x").itertuples():
            se = 0.0 if math.isnan(r.sd) else r.sd / math.sqrt(r.n)  # the standard error of the reading's mean
            rows.append(
                drawn_row(
                    panel,
                    "curve",
                    f"calibration: {what}",
                    "",
                    f"calibration/{measure}/{name}",
                    name,
                    r.x,
                    r.mean,
                    max(r.mean - se, r.mean / 10),
                    r.mean + se,
                    int(r.n),
                )
            )
    if paper is not None:
        refs.append(
            reference(
                paper, f"≈ {paper:g} ({'GSPO §5.3' if axis == 'V' else 'R3 paper'})", f"calibration/{measure}", panel
            )
        )
    frame = pd.concat([pd.DataFrame(rows, columns=COLUMNS), *refs], ignore_index=True)
    return frame, ylabel, paper


def _control_k3(table: pd.DataFrame, panel: str) -> pd.DataFrame | None:
    """The control's k3 at the plan's dose (LM-head noise, matched to axis M's top dose), as a reference line."""
    dose = load_plan()["control"]["dose"]
    t = table[(table.dial == CONTROL_DIAL) & (table.measure == "k3")]
    t = t[np.isclose(pd.to_numeric(t.dose, errors="coerce"), float(dose))]
    if t.empty:
        return None
    line = csv_row(
        panel=panel,
        kind="reference",
        series=f"control (LM-head σ {dose:g}): k3",
        run="",
        metric="calibration/k3",
        x_name="",
        mean=float(t["mean"].iloc[0]),
        n_seeds=0,
    )
    return pd.DataFrame([line], columns=COLUMNS)


def dose_rows(summ: pd.DataFrame, axis: str, panel: str, value: str, log: bool = False) -> pd.DataFrame:
    """Panels (b) and (c): per arm and dose, mean final pass@1 [95 % t] or the share collapsed [exact 95 %]."""
    cols = {
        "pass": ("pass_final", "pass_lo", "pass_hi", "eval/pass@1"),
        "collapsed": ("share", "collapsed_lo", "collapsed_hi", "frontier/collapsed"),
    }[value]
    t = summ[summ.axis == axis].copy()
    t["share"] = t.collapsed / t.runs
    arms = list(dict.fromkeys(t.arm))
    rows = []
    for r in t.itertuples():
        x = dodge(r.dose, arms.index(r.arm), len(arms), log)
        lo, hi = (max(getattr(r, cols[1]), 0.0), min(getattr(r, cols[2]), 1.0))  # both lie in [0, 1]
        if value == "pass" and r.runs < PILOT_N:
            lo = hi = math.nan
        rows.append(
            drawn_row(
                panel,
                "point",
                label(r.arm),
                r.arm,
                cols[3],
                "dose",
                x,
                getattr(r, cols[0]),
                lo,
                hi,
                int(r.runs),
                step=r.dose,
            )
        )
    return pd.DataFrame(rows, columns=COLUMNS)


DODGE = 0.12  # arms at one dose are drawn side by side: x × (1 ± 12 %) per arm on a log axis, ± 0.012·max on linear


def dodge(dose: float, i: int, n: int, log: bool, top: float = 0.3) -> float:
    """The drawn x of arm i of n at a dose (the dose itself is the row's `step` column in the CSV)."""
    k = i - (n - 1) / 2
    return dose * (1 + DODGE) ** k if log else dose + k * DODGE * top / 10


SURVIVAL_OFFSET = 0.015  # drawn offset between arms' Kaplan–Meier curves (the CSV's rows carry the offset too)


def any_collapsed(out: pd.DataFrame, axis: str, doses: list[float]) -> bool:
    """Whether a Kaplan–Meier panel would show anything: some run at these doses collapsed."""
    g = out[(out.axis == axis) & out.dose.isin(doses)]
    return bool(g.collapsed.any())


def survival_rows(out: pd.DataFrame, axis: str, doses: list[float], panel: str) -> pd.DataFrame:
    """Panel (d): per arm, the Kaplan–Meier share of runs not yet collapsed against the step, at each dose (with
    several, each dose is its own metric, `frontier/survival, dose D`, so it gets its own line style)."""
    rows = []
    for d in doses:
        metric = "frontier/survival" if len(doses) == 1 else f"frontier/survival, dose {d:g}"
        g = out[(out.axis == axis) & np.isclose(out.dose, d)]
        for i, (arm, a) in enumerate(g.groupby("arm", sort=False)):
            xs, ys = kaplan_meier(a.collapse_step, a.collapsed)
            end = float(a.collapse_step.max())
            xs, ys = np.append(xs, end), np.append(ys, ys[-1])  # the curve runs to the last censored step
            xs, ys = np.repeat(xs, 2)[1:], np.repeat(ys, 2)[:-1]  # drawn as a step function: flat, then a drop
            ys = ys - SURVIVAL_OFFSET * i  # arms whose curves coincide stay visible, each a hair below the last
            for x, y in zip(xs, ys):
                rows.append(drawn_row(panel, "curve", label(arm), arm, metric, "step", x, y, n=len(a), step=x))
    return pd.DataFrame(rows, columns=COLUMNS)


def panels(study: Study, figure: int, plan: dict | None = None, calibration: Path | None = None) -> list:
    """Figure 13 (axis V, with the positive control) or 14 (axis M, with the control): the calibration, the primary
    endpoint and the share collapsed against dose, time to collapse at the decisive dose, and the axis's control."""
    plan = plan or load_plan()
    axis, letters = AXIS_OF[figure], iter("abcdefgh")
    out = outcomes(study, plan)
    summ = summary(out)
    table = pd.read_csv(calibration or study.out_dir / "calibration.csv", dtype={"dose": str})
    dial = plan["axes"][axis]["dial"]
    x, logx = f"dose ({dial})", axis == "V"
    result = []
    for spec in CALIBRATION[axis]:
        p = next(letters)
        rows, ylabel, _ = calibration_rows(table, axis, spec)
        result.append(Panel(rows, f"({p}) calibration on the cold start (± s.e.)", ylabel, x, logy=True, logx=True))
        result[-1].rows["panel"] = p
    p = next(letters)
    note = pilot_note(summ[summ.axis == axis].runs)
    result.append(
        Panel(
            dose_rows(summ, axis, p, "pass", logx),
            f"({p}) final held-out pass@1" + note,
            "mean pass@1" + ("" if note else " (95 % t)"),
            x,
            logx=logx,
        )
    )
    p = next(letters)
    rule = plan["collapse_rule"]["version"]
    result.append(
        Panel(
            dose_rows(summ, axis, p, "collapsed", logx),
            f"({p}) runs collapsed (rule version {rule})",
            "share of runs (exact 95 %)",
            x,
            logx=logx,
        )
    )
    dose = decisive_dose(out, plan, axis)
    if dose is not None and any_collapsed(out, axis, [dose]):  # a flat line at 1 says nothing a count does not
        p = next(letters)
        result.append(
            Panel(
                survival_rows(out, axis, [dose], p),
                f"({p}) not yet collapsed, at dose {dose:g} (arms offset)",
                "share of runs (Kaplan–Meier)",
                "RL step",
            )
        )
    extra = "positive" if axis == "V" else "control"
    if (summ.axis == extra).any():
        p = next(letters)
        if extra == "positive":  # its point is that the detector fires: the share collapsed, not a pass@1 of 0
            title, ylabel = f"({p}) positive control (lr that must wreck every arm): runs collapsed", "share of runs"
            result.append(Panel(_bars(summ, extra, p, "collapsed"), title, ylabel + " (exact 95 %)", " "))
        else:
            note = pilot_note(summ[summ.axis == extra].runs)
            result.append(Panel(_bars(summ, extra, p), f"({p}) control (LM-head noise){note}", "final pass@1", " "))
    return result


def decisive_panels(study: Study, plan: dict | None = None) -> list:
    """Figure 15, the decisive stage: per axis, at dose 0 and at its decisive dose, every arm's final pass@1
    [95 % t], its share collapsed [exact 95 %], its paired Δ final pass@1 against GRPO without replay [95 % t] with
    the plan's margin ±δ, and Kaplan–Meier at the decisive dose."""
    plan = plan or load_plan()
    out = outcomes(study, plan, decisive=True)
    summ, comp, letters, result = summary(out), comparisons(out, plan), iter("abcdefghij"), []
    margin = float(plan["margin"])
    for axis in plan["axes"]:
        dial = plan["axes"][axis]["dial"]
        t = summ[summ.axis == axis].assign(share=lambda d: d.collapsed / d.runs)
        if t.empty:
            continue
        x = f"dose ({dial})"
        p = next(letters)
        rows = [
            drawn_row(
                p,
                "bar",
                label(r.arm),
                r.arm,
                "eval/pass@1",
                dial,
                r.dose,
                r.pass_final,
                max(r.pass_lo, 0.0),
                min(r.pass_hi, 1.0),
                int(r.n),
                step=r.dose,
            )
            for r in t.itertuples()
        ]
        result.append(
            Panel(
                pd.DataFrame(rows, columns=COLUMNS),
                f"({p}) axis {axis}: final held-out pass@1",
                "mean pass@1 (95 % t)",
                x,
            )
        )
        p = next(letters)
        rows = [
            drawn_row(
                p,
                "bar",
                label(r.arm),
                r.arm,
                "frontier/collapsed",
                dial,
                r.dose,
                r.share,
                r.collapsed_lo,
                r.collapsed_hi,
                int(r.runs),
                step=r.dose,
            )
            for r in t.itertuples()
        ]
        rule = plan["collapse_rule"]["version"]
        result.append(
            Panel(
                pd.DataFrame(rows, columns=COLUMNS),
                f"({p}) axis {axis}: runs collapsed (rule v{rule})",
                "share of runs (exact 95 %)",
                x,
            )
        )
        p = next(letters)
        c = comp[comp.axis == axis]
        rows = [
            drawn_row(
                p,
                "bar",
                label(r.arm),
                r.arm,
                "eval/pass@1 difference",
                dial,
                r.dose,
                r.delta,
                r.lo,
                r.hi,
                int(r.n),
                step=r.dose,
            )
            for r in c.itertuples()
        ]
        refs = margin_rows(p, margin)
        result.append(
            Panel(
                pd.DataFrame([*rows, *refs], columns=COLUMNS),
                f"({p}) axis {axis}: Δ final pass@1 vs GRPO (paired)",
                "Δ pass@1 (95 % t)",
                x,
            )
        )
        # time to collapse at every dose but the axis's first (today's level): figure 15's decisive dose, figure
        # 16's three refinement doses (one line style each)
        doses = [d for d in sorted(t.dose.unique()) if not np.isclose(d, float(plan["axes"][axis]["doses"][0]))]
        if doses:
            p = next(letters)
            at = f"at dose {doses[0]:g}" if len(doses) == 1 else "per dose (line style)"
            title = f"({p}) axis {axis}: not yet collapsed, {at}, arms offset"
            result.append(Panel(survival_rows(out, axis, doses, p), title, "share of runs (Kaplan–Meier)", "RL step"))
    return result


def _bars(summ: pd.DataFrame, axis: str, panel: str, value: str = "pass") -> pd.DataFrame:
    """One bar per arm of a control cell: final pass@1 [95 % t, cut to [0, 1]; none below PILOT_N seeds] or the
    share of runs collapsed [exact 95 %]."""
    rows = []
    for r in summ[summ.axis == axis].itertuples():
        if value == "collapsed":
            y, lo, hi, metric, name = (
                r.collapsed / r.runs,
                r.collapsed_lo,
                r.collapsed_hi,
                "frontier/collapsed",
                label(r.arm),
            )
        else:
            y, metric, name = r.pass_final, "eval/pass@1", label(r.arm)
            lo, hi = (max(r.pass_lo, 0.0), min(r.pass_hi, 1.0)) if r.runs >= PILOT_N else (math.nan, math.nan)
        rows.append(drawn_row(panel, "bar", name, r.arm, metric, " ", 0, y, lo, hi, int(r.runs)))
    return pd.DataFrame(rows, columns=COLUMNS)
