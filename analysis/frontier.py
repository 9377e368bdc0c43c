"""The routing frontier (figures 13 and 14): each run's outcome, each dose's summary and the plan's comparisons, as
pure functions over a loaded `Study` and the plan (experiments/frontier/plan.yaml), which is read, never restated.

- `outcomes`: one row per (axis, dose, arm, seed): held-out pass@1 at step 0 and at the end (the primary endpoint),
  whether and when the run collapsed under the plan's collapse-rule version, and what the run reached on its axis
  (routing drift per update, train–inference k3 and routing flips per layer). A run of the frontier's base (no dose)
  is dose 0 of both axes, and appears under each.
- `summary`: per (axis, dose, arm): mean final pass@1 with its 95 % t-interval, k of n collapsed with its exact
  (Clopper–Pearson) interval.
- `comparisons`: per axis and dose, GRPO without replay against the axis's remedy and against GSPO, paired by seed:
  Δ final pass@1 with its t-interval, its reading under the plan's margin (a difference, equivalence within δ,
  underpowered or inconclusive), Fisher's exact one-sided test on the collapsed counts, and a paired bootstrap
  interval where the seeds reach the plan's decisive count.
- `kaplan_meier`: the share of runs not yet collapsed against the step (censored at each run's last step).
- `decisive_dose`: the plan's rule for the dose its decisive runs take.
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


def _curve(study: Study, metric: str, run: str, seed: int) -> pd.DataFrame:
    f = study.values(metric, run)
    return f[f.seed == seed].sort_values("step")


def _mean(study: Study, metric: str, run: str, seed: int) -> float:
    f = _curve(study, metric, run, seed)
    return float(f.value.mean()) if len(f) else math.nan


def outcomes(study: Study, plan: dict) -> pd.DataFrame:
    """One row per (axis, dose, arm, seed) of the study's tracked runs."""
    version = int(plan["collapse_rule"]["version"])
    rows = []
    for r in study.runs:
        rw, p1 = _curve(study, REWARD, r.run, r.seed), _curve(study, PASS1, r.run, r.seed)
        c = collapse(rw.step.to_numpy(), rw.value.to_numpy(), p1.step.to_numpy(), p1.value.to_numpy(), version)
        last = int(rw.step.max()) if len(rw) else 0
        for cell in cells(r.cfg, plan):
            rows.append(
                dict(
                    axis=cell.axis,
                    dose=cell.dose,
                    arm=r.run,
                    seed=r.seed,
                    pass0=float(p1.value.iloc[0]) if len(p1) else math.nan,
                    pass_final=float(p1.value.iloc[-1]) if len(p1) else math.nan,
                    collapsed=c.collapsed,
                    collapse_step=c.step if c.collapsed else last,  # the event's step, or where it was censored
                    collapse_rule=c.rule,
                    drift_per_update=_mean(study, DRIFT, r.run, r.seed),
                    k3=_mean(study, K3, r.run, r.seed),
                    flips_per_layer=_mean(study, FLIPS, r.run, r.seed),
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


def decisive_dose(out: pd.DataFrame, plan: dict, axis: str) -> float | None:
    """The plan's decisive dose of an axis: the non-zero pilot dose with the largest mean (remedy − GRPO without
    replay) in final pass@1; the highest dose when no dose shows a positive gap; None before any run."""
    spec = plan["axes"][axis]
    remedy, doses = spec["remedy"], [float(d) for d in spec["doses"][1:]]
    g = out[(out.axis == axis) & out.dose.isin(doses)]
    gaps = {}
    for dose, d in g.groupby("dose"):
        wide = d.pivot_table(index="seed", columns="arm", values="pass_final")
        if {remedy, BASELINE} <= set(wide.columns):
            gaps[float(dose)] = float((wide[remedy] - wide[BASELINE]).mean())
    if not gaps:
        return None
    best = max(gaps, key=gaps.get)
    return best if gaps[best] > 0 else max(doses)
