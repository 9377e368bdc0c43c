"""The routing frontier (figures 13 and 14): each run's outcome, each dose's summary and the plan's comparisons, as
pure functions over a loaded `Study` and the plan (experiments/frontier/plan.yaml), which is read, never restated.

- `outcomes`: one row per (axis, dose, arm, seed): held-out pass@1 at step 0 and at the end (the primary endpoint),
  whether and when the run collapsed under the plan's collapse-rule version, and what the run reached on its axis
  (routing drift per update, at the run's first update and averaged over the run; train–inference k3 and routing
  flips per layer). A run of the frontier's base (no dose) is dose 0 of both axes, and appears under each.
- `summary`: per (axis, dose, arm): mean final pass@1 with its 95 % t-interval, k of n collapsed with its exact
  (Clopper–Pearson) interval.
- `comparisons`: per axis and dose, GRPO without replay against the axis's remedy and against GSPO, paired by seed:
  Δ final pass@1 with its t-interval, its reading under the plan's margin (a difference, equivalence within δ,
  underpowered or inconclusive), Fisher's exact one-sided test on the collapsed counts, and a paired bootstrap
  interval where the seeds reach the plan's decisive count.
- `kaplan_meier`: the share of runs not yet collapsed against the step (censored at each run's last step).
- `decisive_dose`: the plan's rule for the dose its decisive runs take.
- `frontier_dose`, `refinement_reading`: the refinement stage's reading (figure 16): per arm, the lowest axis-V dose
  at which at least half its runs collapsed, and whether replay moves it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import yaml

from analysis.collapse import collapse
from analysis.common import PASS1, REWARD, Study, mean_ci
from analysis.stats import clopper_pearson, fisher_greater, one_sided_bounds, paired_bootstrap
from gspo_study.paths import EXPERIMENTS

PLAN = EXPERIMENTS / "frontier" / "plan.yaml"
DRIFT = "moe/routing_volatility/per_update/overall"
K3, FLIPS = "mismatch/k3", "moe/train_infer_routing/overall"
BASELINE = "grpo"  # GRPO without routing replay: every comparison's first arm


def load_plan(path: Path = PLAN) -> dict:
    return yaml.safe_load(Path(path).read_text())


@dataclass(frozen=True)
class Cell:
    """Where a run sits in the frontier: its axis ("V", "M", "control", "positive") and its dose on that axis."""

    axis: str
    dose: float


def cells(cfg, plan: dict) -> list[Cell]:
    """The frontier cells a run's config belongs to (a base run is dose 0 of both axes: two cells)."""
    base_lr = float(plan["base"]["train.lr"])
    if not math.isclose(cfg.train.lr, base_lr):
        return [Cell("positive", cfg.train.lr)]
    if cfg.rollout.head_noise > 0:
        return [Cell("control", cfg.rollout.head_noise)]
    v, m = cfg.train.router_lr_scale, cfg.rollout.router_noise
    if m > 0:
        return [Cell("M", m)]
    if v != float(plan["axes"]["V"]["doses"][0]):
        return [Cell("V", v)]
    return [Cell("V", v), Cell("M", m)]


def arms_of(plan: dict, axis: str, decisive: bool = False) -> list[str]:
    """The arms the plan gives an axis (or the control, the positive control); with `decisive`, an axis's also
    include the decisive stage's (every arm at dose 0 and at the decisive dose)."""
    spec = {"positive": plan["positive_control"], "control": plan["control"]}.get(axis) or plan["axes"][axis]
    extra = plan["decisive"]["arms"] if decisive and axis in plan["axes"] else []
    return list(dict.fromkeys([*spec["arms"], *extra]))


def _curve(study: Study, metric: str, run_id: str) -> pd.DataFrame:
    """One tracked run's history of `metric` (by its MLflow id: a figure's cells share run names and seeds)."""
    f = study.frame
    return f[(f.run_id == run_id) & (f.metric == metric)].sort_values("step")


def _mean(study: Study, metric: str, run_id: str) -> float:
    f = _curve(study, metric, run_id)
    return float(f.value.mean()) if len(f) else math.nan


def _first(study: Study, metric: str, run_id: str) -> float:
    """The metric at the run's first logged step (for drift per update: the dose as it meets the cold start, before
    the run has changed the router it acts on)."""
    f = _curve(study, metric, run_id)
    return float(f.value.iloc[0]) if len(f) else math.nan


def outcomes(study: Study, plan: dict, decisive: bool = False) -> pd.DataFrame:
    """One row per (axis, dose, arm, seed) of the study's tracked runs (`decisive`: the decisive stage's arms too,
    `arms_of`)."""
    version = int(plan["collapse_rule"]["version"])
    rows = []
    for r in study.runs:
        rw, p1 = _curve(study, REWARD, r.run_id), _curve(study, PASS1, r.run_id)
        c = collapse(rw.step.to_numpy(), rw.value.to_numpy(), p1.step.to_numpy(), p1.value.to_numpy(), version)
        last = int(rw.step.max()) if len(rw) else 0
        for cell in (c for c in cells(r.cfg, plan) if r.run in arms_of(plan, c.axis, decisive)):
            rows.append(
                dict(
                    axis=cell.axis,
                    dose=cell.dose,
                    arm=r.run,
                    seed=r.seed,
                    run_id=r.run_id,
                    pass0=float(p1.value.iloc[0]) if len(p1) else math.nan,
                    pass_final=float(p1.value.iloc[-1]) if len(p1) else math.nan,
                    collapsed=c.collapsed,
                    collapse_step=c.step if c.collapsed else last,  # the event's step, or where it was censored
                    collapse_rule=c.rule,
                    drift_per_update=_mean(study, DRIFT, r.run_id),
                    drift_first=_first(study, DRIFT, r.run_id),
                    k3=_mean(study, K3, r.run_id),
                    flips_per_layer=_mean(study, FLIPS, r.run_id),
                )
            )
    return pd.DataFrame(rows)


def summary(out: pd.DataFrame) -> pd.DataFrame:
    """Per (axis, dose, arm): mean final pass@1 [95 % t], k of n collapsed [exact 95 %], and the dose reached."""
    rows = []
    for (axis, dose, arm), g in out.groupby(["axis", "dose", "arm"], sort=True):
        mean, lo, hi, n = mean_ci(g.pass_final)
        k = int(g.collapsed.sum())
        cp_lo, cp_hi = clopper_pearson(k, len(g))
        rows.append(
            dict(
                axis=axis,
                dose=dose,
                arm=arm,
                n=n,
                pass_final=mean,
                pass_lo=lo,
                pass_hi=hi,
                collapsed=k,
                runs=len(g),
                collapsed_lo=cp_lo,
                collapsed_hi=cp_hi,
                drift_per_update=float(g.drift_per_update.mean()),
                drift_first=float(g.drift_first.mean()),
                k3=float(g.k3.mean()),
                flips_per_layer=float(g.flips_per_layer.mean()),
            )
        )
    return pd.DataFrame(rows)


def reading(diffs, margin: float) -> tuple[str, float, float, float, int]:
    """(reading, mean, lower, upper, n) of a paired Δ = other arm − GRPO without replay (positive: the other arm is
    better): "difference" when the 95 % t-interval excludes 0, "equivalent within δ" when both one-sided 95 %
    bounds lie inside ±δ, else "underpowered" when the half-width exceeds δ, else "inconclusive"."""
    from analysis.stats import equivalent

    mean, lo, hi, n = mean_ci(diffs)
    if n < 2:
        return "inconclusive", mean, lo, hi, n
    if lo > 0 or hi < 0:
        return "difference", mean, lo, hi, n
    _, lo1, hi1, _ = one_sided_bounds(diffs)
    if equivalent(lo1, hi1, margin):
        return f"equivalent within ±{margin:g}", mean, lo, hi, n
    return ("underpowered" if (hi - lo) / 2 > margin else "inconclusive"), mean, lo, hi, n


def comparisons(out: pd.DataFrame, plan: dict) -> pd.DataFrame:
    """Per axis (and the control, the positive control) and dose: each other arm against GRPO without replay,
    paired by seed."""
    margin = float(plan["margin"])
    decisive_n = len(plan["decisive"]["seeds"])
    rows = []
    for (axis, dose), g in out.groupby(["axis", "dose"], sort=True):
        wide = g.pivot_table(index="seed", columns="arm", values="pass_final")
        down = g.groupby("arm").collapsed.agg(["sum", "count"])
        if BASELINE not in wide:
            continue
        for arm in (a for a in wide.columns if a != BASELINE):
            pair = wide[[arm, BASELINE]].dropna()
            diffs = (pair[arm] - pair[BASELINE]).to_numpy()
            word, mean, lo, hi, n = reading(diffs, margin)
            k0, n0 = int(down.loc[BASELINE, "sum"]), int(down.loc[BASELINE, "count"])
            k1, n1 = int(down.loc[arm, "sum"]), int(down.loc[arm, "count"])
            boot = paired_bootstrap(diffs) if n >= decisive_n else (math.nan,) * 4
            rows.append(
                dict(
                    axis=axis,
                    dose=dose,
                    arm=arm,
                    n=n,
                    delta=mean,
                    lo=lo,
                    hi=hi,
                    reading=word,
                    boot_lo=boot[1],
                    boot_hi=boot[2],
                    grpo_collapsed=f"{k0} of {n0}",
                    arm_collapsed=f"{k1} of {n1}",
                    fisher_p=fisher_greater(k0, n0, k1, n1),  # no replay collapses more often than this arm
                )
            )
    return pd.DataFrame(rows)


def kaplan_meier(steps, events) -> tuple[np.ndarray, np.ndarray]:
    """(step, share not collapsed) after each distinct event step, starting at (0, 1): the product-limit estimate,
    `events[i]` True when run i collapsed at `steps[i]`, else censored there."""
    steps, events = np.asarray(steps, dtype=float), np.asarray(events, dtype=bool)
    xs, ys, surv = [0.0], [1.0], 1.0
    for s in np.unique(steps[events]):
        at_risk = int((steps >= s).sum())
        died = int(((steps == s) & events).sum())
        surv *= 1 - died / at_risk
        xs.append(float(s))
        ys.append(surv)
    return np.array(xs), np.array(ys)


def dose_gaps(out: pd.DataFrame, plan: dict, axis: str) -> dict[float, float]:
    """Per non-zero dose of an axis, the pilot's mean over its seeds of (remedy − GRPO without replay) in final
    pass@1: what the plan's decisive-dose rule compares (the pilot's seeds alone, whatever else `out` holds)."""
    spec = plan["axes"][axis]
    remedy, doses = spec["remedy"], [float(d) for d in spec["doses"][1:]]
    g = out[(out.axis == axis) & out.dose.isin(doses) & out.seed.isin(plan["pilot"]["seeds"])]
    gaps = {}
    for dose, d in g.groupby("dose"):
        wide = d.pivot_table(index="seed", columns="arm", values="pass_final")
        if {remedy, BASELINE} <= set(wide.columns):
            gaps[float(dose)] = float((wide[remedy] - wide[BASELINE]).mean())
    return gaps


def decisive_dose(out: pd.DataFrame, plan: dict, axis: str) -> float | None:
    """The plan's decisive dose of an axis: the non-zero pilot dose with the largest mean (remedy − GRPO without
    replay) in final pass@1; the highest dose when no dose shows a positive gap; None before any run."""
    gaps = dose_gaps(out, plan, axis)
    if not gaps:
        return None
    best = max(gaps, key=gaps.get)
    return best if gaps[best] > 0 else max(float(d) for d in plan["axes"][axis]["doses"])


def frontier_dose(out: pd.DataFrame, plan: dict, arm: str) -> float | None:
    """The refinement's frontier dose of one arm: the lowest dose of axis V, over the refinement's seeds (its own
    doses and the decisive stage's together), at which at least half the arm's runs collapsed; None where none did."""
    g = out[(out.axis == "V") & (out.arm == arm) & out.seed.isin(plan["refinement"]["seeds"])]
    shares = g.groupby("dose").collapsed.mean()
    hit = shares[shares >= 0.5]
    return float(hit.index.min()) if len(hit) else None


def refinement_reading(out: pd.DataFrame, comp: pd.DataFrame, plan: dict) -> str:
    """The plan's refinement reading in one sentence: each arm's frontier dose, and whether replay moves the frontier
    (GRPO + R2's frontier dose above GRPO's, with Fisher's p < 0.05 at a dose from GRPO's up to R2's)."""
    spec, remedy = plan["refinement"], plan["axes"]["V"]["remedy"]
    mine = out[(out.axis == "V") & out.dose.isin([float(d) for d in spec["doses"]]) & out.seed.isin(spec["seeds"])]
    if mine.empty:
        return ""
    at = {arm: frontier_dose(out, plan, arm) for arm in spec["arms"]}
    shown = ", ".join(f"{a} {'none' if d is None else f'×{d:g}'}" for a, d in at.items())
    lo, hi = at[BASELINE], at[remedy]
    if lo is None or (hi is not None and hi <= lo):
        verdict = "replay does not move the frontier"
    else:
        c = comp[(comp.axis == "V") & (comp.arm == remedy) & (comp.dose >= lo) & (hi is None or comp.dose < hi)]
        best = c.fisher_p.min() if len(c) else math.nan
        moved = best < 0.05
        verdict = (
            f"replay {'moves' if moved else 'does not significantly move'} the frontier (least Fisher p {best:.3g})"
        )
    seeds = ", ".join(map(str, sorted(mine.seed.unique())))
    planned = ", ".join(map(str, spec["seeds"]))
    return (f"- refinement (figure 16, seeds {seeds} of {planned}): the frontier dose per arm, the lowest router-lr "
            f"dose at which at least half its runs collapsed: {shown}; {verdict}.")  # fmt: skip


# ------------------------------------------------------------------------------------------------ figures 13 and 14
AXIS_OF = {13: "V", 14: "M"}  # the pilot's figures, one axis each
FIGURES = (13, 14, 15, 16)  # 15: the decisive stage (every arm at dose 0 and each axis's decisive dose); 16: the
# refinement of axis V between its last dose without collapse and its first with every run collapsed
CALIBRATION = {  # per axis: (dial, measure, y label, the paper's value or None)
    "V": [("train.router_lr_scale", "per_update", "activated experts changed per update", 0.10)],
    "M": [
        ("rollout.router_noise", "flips_per_layer", "routing flips per layer", 0.057),
        ("rollout.router_noise", "k3", "train–inference k3", 1.5e-3),
    ],
}
CONTROL_DIAL = "rollout.head_noise"


def _row(panel: str, kind: str, series: str, run: str, metric: str, x_name: str, x: float, line: float,
         lo: float = math.nan, hi: float = math.nan, n: int = 0, step: float = math.nan) -> dict:  # fmt: skip
    """A drawn row whose line and band are given (never clipped again: the caller's interval is already in range)."""
    from analysis.common import csv_row

    return csv_row(panel=panel, kind=kind, series=series, run=run, metric=metric, x_name=x_name, x=x, step=step,
                   mean=line, lower=lo, upper=hi, n_seeds=n, line=line, band_lower=lo, band_upper=hi,
                   stat="t" if n > 1 else "", window=1, raw=line)  # fmt: skip


def calibration_rows(table: pd.DataFrame, axis: str, spec: tuple) -> tuple[pd.DataFrame, str, float | None]:
    """Panel (a): each calibrated dose's reading (mean ± SD over the calibration's batches or steps), the control's
    k3 beside axis M's, and the paper's level as a reference line."""
    from analysis.common import COLUMNS, reference

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
            rows.append(_row(panel, "curve", f"calibration: {what}", "", f"calibration/{measure}/{name}", name,
                             r.x, r.mean, max(r.mean - se, r.mean / 10), r.mean + se, int(r.n)))  # fmt: skip
    if paper is not None:
        refs.append(reference(paper, f"≈ {paper:g} ({'GSPO §5.3' if axis == 'V' else 'R3 paper'})",
                              f"calibration/{measure}", panel))  # fmt: skip
    frame = pd.concat([pd.DataFrame(rows, columns=COLUMNS), *refs], ignore_index=True)
    return frame, ylabel, paper


def _control_k3(table: pd.DataFrame, panel: str) -> pd.DataFrame | None:
    """The control's k3 at the plan's dose (LM-head noise, matched to axis M's top dose), as a reference line."""
    from analysis.common import COLUMNS, csv_row

    dose = load_plan()["control"]["dose"]
    t = table[(table.dial == CONTROL_DIAL) & (table.measure == "k3")]
    t = t[np.isclose(pd.to_numeric(t.dose, errors="coerce"), float(dose))]
    if t.empty:
        return None
    line = csv_row(panel=panel, kind="reference", series=f"control (LM-head σ {dose:g}): k3", run="",
                   metric="calibration/k3", x_name="", mean=float(t["mean"].iloc[0]), n_seeds=0)  # fmt: skip
    return pd.DataFrame([line], columns=COLUMNS)


PILOT_N = 3  # below this many seeds a cell is drawn as its mean alone, marked a pilot's: a t-interval of 2 seeds
# spans most of [0, 1] and says nothing (two-seed cells once drew intervals from −0.02 to 1.56)


def pilot_note(runs) -> str:
    """A panel's title note where some cell has fewer than PILOT_N seeds (drawn as its mean alone)."""
    few = sorted({int(n) for n in runs if n < PILOT_N})
    return f" — pilot, n = {', '.join(map(str, few))}: means only" if few else ""


def dose_rows(summ: pd.DataFrame, axis: str, panel: str, value: str, log: bool = False) -> pd.DataFrame:
    """Panels (b) and (c): per arm and dose, mean final pass@1 [95 % t] or the share collapsed [exact 95 %]."""
    from analysis.common import COLUMNS, label

    cols = {"pass": ("pass_final", "pass_lo", "pass_hi", "eval/pass@1"),
            "collapsed": ("share", "collapsed_lo", "collapsed_hi", "frontier/collapsed")}[value]  # fmt: skip
    t = summ[summ.axis == axis].copy()
    t["share"] = t.collapsed / t.runs
    arms = list(dict.fromkeys(t.arm))
    rows = []
    for r in t.itertuples():
        x = dodge(r.dose, arms.index(r.arm), len(arms), log)
        lo, hi = (max(getattr(r, cols[1]), 0.0), min(getattr(r, cols[2]), 1.0))  # both lie in [0, 1]
        if value == "pass" and r.runs < PILOT_N:
            lo = hi = math.nan
        rows.append(_row(panel, "point", label(r.arm), r.arm, cols[3], "dose", x, getattr(r, cols[0]), lo, hi,
                         int(r.runs), step=r.dose))  # fmt: skip
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
    from analysis.common import COLUMNS, label

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
                rows.append(_row(panel, "curve", label(arm), arm, metric, "step", x, y, n=len(a), step=x))
    return pd.DataFrame(rows, columns=COLUMNS)


def panels(study: Study, figure: int, plan: dict | None = None, calibration: Path | None = None) -> list:
    """Figure 13 (axis V, with the positive control) or 14 (axis M, with the control): the calibration, the primary
    endpoint and the share collapsed against dose, time to collapse at the decisive dose, and the axis's control."""
    from analysis.common import Panel

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
    result.append(Panel(dose_rows(summ, axis, p, "pass", logx), f"({p}) final held-out pass@1" + note,
                        "mean pass@1" + ("" if note else " (95 % t)"), x, logx=logx))  # fmt: skip  # fmt: skip
    p = next(letters)
    rule = plan["collapse_rule"]["version"]
    result.append(Panel(dose_rows(summ, axis, p, "collapsed", logx), f"({p}) runs collapsed (rule version {rule})",
                        "share of runs (exact 95 %)", x, logx=logx))  # fmt: skip
    dose = decisive_dose(out, plan, axis)
    if dose is not None and any_collapsed(out, axis, [dose]):  # a flat line at 1 says nothing a count does not
        p = next(letters)
        result.append(Panel(survival_rows(out, axis, [dose], p), f"({p}) not yet collapsed, at dose {dose:g} "
                            "(arms offset)", "share of runs (Kaplan–Meier)", "RL step"))  # fmt: skip
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
    from analysis.common import COLUMNS, Panel, csv_row, label

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
        rows = [_row(p, "bar", label(r.arm), r.arm, "eval/pass@1", dial, r.dose, r.pass_final, max(r.pass_lo, 0.0),
                     min(r.pass_hi, 1.0), int(r.n), step=r.dose) for r in t.itertuples()]  # fmt: skip
        result.append(Panel(pd.DataFrame(rows, columns=COLUMNS), f"({p}) axis {axis}: final held-out pass@1",
                            "mean pass@1 (95 % t)", x))  # fmt: skip
        p = next(letters)
        rows = [_row(p, "bar", label(r.arm), r.arm, "frontier/collapsed", dial, r.dose, r.share, r.collapsed_lo,
                     r.collapsed_hi, int(r.runs), step=r.dose) for r in t.itertuples()]  # fmt: skip
        rule = plan["collapse_rule"]["version"]
        result.append(Panel(pd.DataFrame(rows, columns=COLUMNS), f"({p}) axis {axis}: runs collapsed (rule v{rule})",
                            "share of runs (exact 95 %)", x))  # fmt: skip
        p = next(letters)
        c = comp[comp.axis == axis]
        rows = [_row(p, "bar", label(r.arm), r.arm, "eval/pass@1 difference", dial, r.dose, r.delta, r.lo, r.hi,
                     int(r.n), step=r.dose) for r in c.itertuples()]  # fmt: skip
        refs = [csv_row(panel=p, kind="reference", series=f"margin {sign}{margin:g}", run="",
                        metric="eval/pass@1 difference", x_name="", mean=v * margin, n_seeds=0)
                for sign, v in (("+", 1), ("−", -1))]  # fmt: skip
        result.append(Panel(pd.DataFrame([*rows, *refs], columns=COLUMNS),
                            f"({p}) axis {axis}: Δ final pass@1 vs GRPO (paired)",
                            "Δ pass@1 (95 % t)", x))  # fmt: skip
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
    from analysis.common import COLUMNS, label

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
        rows.append(_row(panel, "bar", name, r.arm, metric, " ", 0, y, lo, hi, int(r.runs)))
    return pd.DataFrame(rows, columns=COLUMNS)


# ------------------------------------------------------------------------------------------------ the REPORT's section
def plan_commit(path: Path = PLAN, added: str | None = None) -> str:
    """The commit that fixed the plan (the one that added the file; later changes are its `history` entries), or
    with `added` the first commit whose change put that text in it (a stage added later: `refinement:`); "unknown"
    outside a git checkout."""
    import subprocess

    try:
        pick = ["--diff-filter=A"] if added is None else [f"-S{added}"]
        cmd = ["git", "log", *pick, "--format=%H", "--", str(path)]
        out = subprocess.run(cmd, capture_output=True, text=True, cwd=path.parent, timeout=30)
        return (out.stdout.split() or ["unknown"])[-1]
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def runs_after_plan(commits: list[str], plan: str, root: Path = PLAN.parent) -> list[str]:
    """The run commits that do NOT descend from the plan's commit (a run started before its plan was fixed)."""
    import subprocess

    bad = []
    for c in sorted(set(commits)):
        done = subprocess.run(["git", "merge-base", "--is-ancestor", plan, c], cwd=root, capture_output=True)
        if done.returncode != 0:
            bad.append(c[:12])
    return bad


def _fmt(mean: float, lo: float, hi: float, n: int) -> str:
    if math.isnan(lo):
        return f"{mean:.3f} (n={n})"
    return f"{mean:.3f} [{lo:.3f}, {hi:.3f}] ±{(hi - lo) / 2:.3f} (n={n})"


def _history(h) -> str:
    """One entry of the plan's history as a sentence: when, what, why, and what had been seen."""
    if not isinstance(h, dict):
        return str(h)
    return f"{h.get('when', '?')}: {h.get('what', '')} (why: {h.get('why', '?')}; seen: {h.get('seen', '?')})"


def _share(k: int, n: int, lo: float, hi: float) -> str:
    return f"{k} of {n} [{lo:.0%}, {hi:.0%}]"


def section(
    studies: dict[int, Study], plan: dict | None = None, planned: dict[int, int] | None = None
) -> tuple[str, dict]:
    """The REPORT's frontier section (markdown) and its records (REPORT.json's `frontier`), from the finished runs
    of figures 13 and 14 (the pilot) and 15 (the decisive stage), judged exactly as the plan says."""
    plan = plan or load_plan()
    commit = plan_commit()
    runs = [r for s in studies.values() for r in s.runs]
    outs = [outcomes(s, plan, decisive=True) for s in studies.values() if s.runs]
    if not outs:
        return "", {}
    out = pd.concat(outs).drop_duplicates(["axis", "dose", "arm", "seed"])
    summ, comp = summary(out), comparisons(out, plan)
    early = runs_after_plan([r.tags.get("git_commit", "") for r in runs], commit) if commit != "unknown" else []
    total = planned or len({r.run_id for r in runs})
    deviations = [f"runs at commits {', '.join(early)} do not descend from the plan's commit"] if early else []
    refined = studies.get(16)
    later = plan_commit(added="refinement:") if refined and refined.runs and commit != "unknown" else "unknown"
    if later != "unknown" and (early16 := runs_after_plan([r.tags.get("git_commit", "") for r in refined.runs], later)):
        deviations.append(f"refinement runs at commits {', '.join(early16)} do not descend from the commit that "
                          f"added the refinement ({later[:12]})")  # fmt: skip
    deviations += [_history(h) for h in plan.get("history") or []]
    stage = {f: len({r.run_id for r in s.runs}) for f, s in studies.items()}
    refinement = plan.get("refinement")
    chosen, picked = [], {}
    for axis in plan["axes"]:
        gaps = ", ".join(f"{d:g} → {g:+.4f}" for d, g in sorted(dose_gaps(out, plan, axis).items()))
        dose = picked[axis] = decisive_dose(out, plan, axis)
        chosen.append(f"{axis} {'–' if dose is None else f'{dose:g}'} (gaps: {gaps or 'none yet'})")
    lines = [
        f"## The routing frontier (figures 13–{max(FIGURES)}; plan `experiments/frontier/plan.yaml` at {commit[:12]})",
        "",
        f"- runs finished: {len({r.run_id for r in runs})} of {total} planned; the pilot (figures 13–14, seeds "
        f"{', '.join(map(str, plan['pilot']['seeds']))}): {stage.get(13, 0)} and {stage.get(14, 0)}; the decisive "
        f"stage (figure 15, seeds {', '.join(map(str, plan['decisive']['seeds']))}): {stage.get(15, 0)}"
        + (
            f"; the refinement (figure 16, seeds {', '.join(map(str, refinement['seeds']))}): {stage.get(16, 0)}"
            if refinement
            else ""
        ),
        "- decisive dose per axis by the plan's rule, recomputed from the pilot's runs (mean over the pilot's seeds of"
        f" remedy − GRPO without replay in final pass@1, per dose): {'; '.join(chosen)}",
        f"- applied as planned: primary endpoint final held-out pass@1, δ = {plan['margin']}, collapse rule "
        f"version {plan['collapse_rule']['version']}, comparisons paired by seed against GRPO without replay",
        "- deviations from the plan:" + ("".join(f"\n  - {d}" for d in deviations) or " none"),
        "",
        "| axis | dose | arm | reached: drift per update (first update / run mean) / flips per layer / k3 | "
        "final pass@1 [95 % t] | collapsed [exact 95 %] |",
        "|---|---|---|---|---|---|",
    ]
    for r in summ.itertuples():
        reached = f"{r.drift_first:.3g} / {r.drift_per_update:.3g} / {r.flips_per_layer:.3g} / {r.k3:.2g}"
        lines.append(f"| {r.axis} | {r.dose:g} | {r.arm} | {reached} | {_fmt(r.pass_final, r.pass_lo, r.pass_hi, r.n)}"
                     f" | {_share(r.collapsed, r.runs, r.collapsed_lo, r.collapsed_hi)} |")  # fmt: skip
    lines += [
        "",
        "Each arm against GRPO without replay, paired by seed (Δ = arm − GRPO without replay in final pass@1; the "
        "reading: a difference when the 95 % t-interval excludes 0, equivalence when both one-sided 95 % bounds lie "
        f"inside ±{plan['margin']}, else underpowered or inconclusive; Fisher's exact one-sided test that GRPO without"
        " replay collapses more often):",
        "",
        "| axis | dose | arm | Δ final pass@1 [95 % t] | reading | bootstrap 95 % | collapsed: GRPO / arm | Fisher p |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in comp.itertuples():
        boot = "–" if math.isnan(r.boot_lo) else f"[{r.boot_lo:.3f}, {r.boot_hi:.3f}]"
        lines.append(f"| {r.axis} | {r.dose:g} | {r.arm} | {_fmt(r.delta, r.lo, r.hi, r.n)} | {r.reading} | {boot} | "
                     f"{r.grpo_collapsed} / {r.arm_collapsed} | {r.fisher_p:.3g} |")  # fmt: skip
    lines += ["", *frontier_sentences(out, summ, plan)]
    lines += [s for s in [refinement_reading(out, comp, plan) if refinement else ""] if s] + [""]
    records = _plain(
        {
            "plan_commit": commit,
            "runs_not_after_plan": early,
            "decisive_doses": picked,  # per axis, by the plan's rule from the pilot's runs (None before them)
            "summary": summ.to_dict("records"),
            "comparisons": comp.to_dict("records"),
        }
    )
    return "\n".join(lines), records


def _plain(x):
    """JSON-ready: numpy scalars as Python numbers, NaN as null."""
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_plain(v) for v in x]
    if isinstance(x, np.generic):
        x = x.item()
    return None if isinstance(x, float) and not math.isfinite(x) else x


def frontier_sentences(out: pd.DataFrame, summ: pd.DataFrame, plan: dict) -> list[str]:
    """Per axis, the frontier in one sentence each (written from the numbers), and the controls' outcome."""
    said = []
    for axis, spec in plan["axes"].items():
        s = summ[summ.axis == axis]
        if s.empty:
            continue
        parts = []
        for dose, g in s.groupby("dose"):
            k = {r.arm: f"{r.collapsed}/{r.runs}" for r in g.itertuples()}
            steps = out[(out.axis == axis) & (out.dose == dose) & out.collapsed].collapse_step
            when = f" (at steps {steps.min()}–{steps.max()})" if len(steps) else ""
            parts.append(f"dose {dose:g}: collapsed " + ", ".join(f"{a} {v}" for a, v in k.items()) + when)
        said.append(f"- axis {axis} ({spec['dial']}): " + "; ".join(parts) + ".")
    pos = summ[summ.axis == "positive"]
    if not pos.empty:
        k, n = int(pos.collapsed.sum()), int(pos.runs.sum())
        fired = "fired in every run" if k == n else f"fired in {k} of {n} runs: the detector failed its control"
        said.append(f"- positive control ({plan['positive_control']['cell']}): the collapse rule {fired}.")
    ctl = summ[summ.axis == "control"]
    if not ctl.empty:
        arms = ", ".join(f"{r.arm} {r.collapsed}/{r.runs}" for r in ctl.itertuples())
        said.append(f"- control (LM-head noise): collapsed {arms}, k3 reached {ctl.k3.mean():.2g}.")
    return said
