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

from analysis.aggregate import mean_ci
from analysis.collapse import collapse
from analysis.runs import PASS1, REWARD, Study
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
    return (
        f"- refinement (figure 16, seeds {seeds} of {planned}): the frontier dose per arm, the lowest router-lr "
        f"dose at which at least half its runs collapsed: {shown}; {verdict}."
    )


# figures 13-16 are drawn by analysis/frontier_figures.py
FIGURES = (13, 14, 15, 16)  # 15: the decisive stage (every arm at dose 0 and each axis's decisive dose); 16: the
# refinement of axis V between its last dose without collapse and its first with every run collapsed


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
        deviations.append(
            f"refinement runs at commits {', '.join(early16)} do not descend from the commit that "
            f"added the refinement ({later[:12]})"
        )
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
        lines.append(
            f"| {r.axis} | {r.dose:g} | {r.arm} | {reached} | {_fmt(r.pass_final, r.pass_lo, r.pass_hi, r.n)}"
            f" | {_share(r.collapsed, r.runs, r.collapsed_lo, r.collapsed_hi)} |"
        )
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
        lines.append(
            f"| {r.axis} | {r.dose:g} | {r.arm} | {_fmt(r.delta, r.lo, r.hi, r.n)} | {r.reading} | {boot} | "
            f"{r.grpo_collapsed} / {r.arm_collapsed} | {r.fisher_p:.3g} |"
        )
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
