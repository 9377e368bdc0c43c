"""The DPPO arm (figure 18; plan experiments/dppo/plan.yaml): DPPO beside GRPO without replay, GRPO + R2 and GSPO at the
frontier's base cell and at axis M's highest dose, judged exactly as its plan says. Pure functions over a loaded
`Study` and the plan.

- `outcomes`: one row per (cell, arm, seed): held-out pass@1 at step 0 and at the end, final training reward, collapsed
  under the plan's rule version and under version 2 (`analysis.mechanism.run_row`).
- `judge`: the plan's per-comparison reading of a paired Δ ("DPPO ahead", "DPPO behind", "equivalent within ±δ",
  "underpowered", "inconclusive").
- `comparisons`: per cell, DPPO against each other arm, paired by seed; `mismatch`: each arm's cost of the mismatch
  (M dose − base, paired) and DPPO's against GRPO's, read only where the dose costs GRPO something measurable.
- `section` (the REPORT's, with its records for DPPO.json) and `panels` (figure 18).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd
import yaml

from analysis.aggregate import COLUMNS, drawn_row, margin_rows, mean_ci
from analysis.drawing import Panel
from analysis.frontier import BASELINE, _plain, plan_commit, runs_after_plan
from analysis.mechanism import run_row, summary
from analysis.rules import seeds_needed
from analysis.runs import Study, label
from analysis.stats import equivalent, fisher_greater, one_sided_bounds, paired_bootstrap
from gspo_study.paths import EXPERIMENTS

PLAN = EXPERIMENTS / "dppo" / "plan.yaml"
FIGURE = 18
ARM = "dppo"
UNTESTED = "untested at this dose (the dose costs GRPO nothing measurable)"


def load_plan(path: Path = PLAN) -> dict:
    return yaml.safe_load(Path(path).read_text())


def where(cfg) -> tuple[str, float]:
    """A run's cell: ("base", 0) or ("M", σ of rollout.router_noise)."""
    s = float(cfg.rollout.router_noise)
    return ("M", s) if s > 0 else ("base", 0.0)


def _name(kind: str, dose: float) -> str:
    return "base" if kind == "base" else f"axis M σ = {dose:g}"


def outcomes(study: Study, plan: dict) -> pd.DataFrame:
    version = int(plan["collapse_rule"]["version"])
    rows = []
    for r in study.runs:
        kind, dose = where(r.cfg)
        rows.append({**run_row(study, r, version), "kind": kind, "dose": dose})
    return pd.DataFrame(rows)


def judge(diffs, margin: float) -> tuple[str, float, float, float, int]:
    """(reading, mean, lower, upper, n) of a paired Δ = DPPO − other arm, the plan's `readings.per_comparison`:
    "DPPO ahead" when the 95 % t-interval excludes 0 above and the mean exceeds δ; "DPPO behind" when it excludes 0
    below and the mean is below −δ; "equivalent within ±δ" when both one-sided 95 % bounds lie inside ±δ; else
    "underpowered" when the half-width exceeds δ, else "inconclusive"."""
    mean, lo, hi, n = mean_ci(diffs)
    if n < 2:
        return "inconclusive", mean, lo, hi, n
    if lo > 0 and mean > margin:
        return "DPPO ahead", mean, lo, hi, n
    if hi < 0 and mean < -margin:
        return "DPPO behind", mean, lo, hi, n
    _, lo1, hi1, _ = one_sided_bounds(diffs)
    if equivalent(lo1, hi1, margin):
        return f"equivalent within ±{margin:g}", mean, lo, hi, n
    return ("underpowered" if (hi - lo) / 2 > margin else "inconclusive"), mean, lo, hi, n


def _paired(wide: pd.DataFrame, a: str, b: str) -> np.ndarray:
    pair = wide[[a, b]].dropna()
    return (pair[a] - pair[b]).to_numpy()


def _comparison(diffs: np.ndarray, margin: float, full_n: int, **where) -> dict:
    word, mean, lo, hi, n = judge(diffs, margin)
    boot = paired_bootstrap(diffs) if n >= full_n else (math.nan,) * 4
    sd = float(np.std(diffs, ddof=1)) if n > 1 else math.nan
    return dict(**where, n=n, delta=mean, lo=lo, hi=hi, reading=word, boot_lo=boot[1], boot_hi=boot[2], sd=sd)


def comparisons(out: pd.DataFrame, plan: dict) -> pd.DataFrame:
    """Per cell, DPPO − each other arm in final pass@1, paired by seed, with Fisher's one-sided test on collapsed
    counts (the other arm collapsing more often) where any run of the two collapsed."""
    margin, full_n = float(plan["margin"]), len(plan["seeds"])
    rows = []
    for (kind, dose), g in out.groupby(["kind", "dose"], sort=True):
        wide = g.pivot_table(index="seed", columns="arm", values="pass_final")
        down = g.groupby("arm").collapsed.agg(["sum", "count"])
        if ARM not in wide:
            continue
        for other in (a for a in plan["arms"] if a != ARM and a in wide):
            row = _comparison(_paired(wide, ARM, other), margin, full_n, kind=kind, dose=dose, arm=other)
            k0, n0 = int(down.loc[other, "sum"]), int(down.loc[other, "count"])
            k1, n1 = int(down.loc[ARM, "sum"]), int(down.loc[ARM, "count"])
            p = fisher_greater(k0, n0, k1, n1) if k0 + k1 else math.nan
            rows.append({**row, "other_collapsed": f"{k0} of {n0}", "dppo_collapsed": f"{k1} of {n1}", "fisher_p": p})
    return pd.DataFrame(rows)


def mismatch(out: pd.DataFrame, plan: dict) -> tuple[pd.DataFrame, str]:
    """Each arm's cost of the mismatch (final pass@1 at axis M's dose − at the base, paired by seed) and the plan's
    `readings.mismatch`: DPPO's cost against GRPO's (a difference of differences) only where GRPO's cost is below −δ
    with its interval excluding 0; otherwise `UNTESTED`."""
    margin, full_n = float(plan["margin"]), len(plan["seeds"])
    m = out[out.kind == "M"]
    if m.empty or not (out.kind == "base").any():
        return pd.DataFrame(), "not run"
    dose = float(m.dose.max())
    rows, cost = [], {}
    for arm in plan["arms"]:
        g = out[out.arm == arm].pivot_table(index="seed", columns="kind", values="pass_final")
        if not {"base", "M"} <= set(g.columns):
            continue
        g = g.dropna()
        cost[arm] = (g["M"] - g["base"]).rename(arm)
        mean, lo, hi, n = mean_ci(cost[arm].to_numpy())
        rows.append(dict(arm=arm, dose=dose, n=n, cost=mean, lo=lo, hi=hi))
    table = pd.DataFrame(rows)
    if BASELINE not in cost or ARM not in cost:
        return table, "not run"
    g = table.set_index("arm").loc[BASELINE]
    if not (g.cost < -margin and g.hi < 0):
        return table, UNTESTED
    both = pd.concat([cost[ARM], cost[BASELINE]], axis=1).dropna()
    row = _comparison((both[ARM] - both[BASELINE]).to_numpy(), margin, full_n, kind="M", dose=dose, arm=BASELINE)
    shown = _fmt(row["delta"], row["lo"], row["hi"], row["n"])
    return table, f"DPPO's mismatch cost − GRPO's: {shown}, {row['reading']}"


def _fmt(mean: float, lo: float, hi: float, n: int) -> str:
    if math.isnan(lo):
        return f"{mean:+.3f} (n = {n})"
    return f"{mean:+.3f} [{lo:+.3f}, {hi:+.3f}] ±{(hi - lo) / 2:.3f} (n = {n})"


def section(study: Study, plan: dict | None = None) -> tuple[str, dict]:
    """The REPORT's DPPO section (markdown) and its records (DPPO.json); ("", {}) before any DPPO run finished."""
    plan = plan or load_plan()
    if not any(r.run == ARM for r in study.runs):
        return "", {}
    out = outcomes(study, plan)
    summ, comp = summary(out), comparisons(out, plan)
    cost, word = mismatch(out, plan)
    commit = plan_commit(PLAN)
    new = [r.tags.get("git_commit", "") for r in study.runs if r.run == ARM]
    early = runs_after_plan(new, commit) if commit != "unknown" and new else []
    margin, version = float(plan["margin"]), plan["collapse_rule"]["version"]
    lines = [
        f"## DPPO beside GRPO, GRPO + R2 and GSPO (figure {FIGURE}; plan `experiments/dppo/plan.yaml` at "
        f"{commit[:12]})",
        "",
        f"- runs: {len(new)} DPPO runs (prime-rl's default loss, ratio against the rollout's log-probs μ) and "
        f"{len(study.runs) - len(new)} of the other arms, most reused from the frontier (same run keys); seeds "
        f"{', '.join(map(str, sorted(out.seed.unique())))}"
        + (f"; DPPO runs not descending from the plan's commit: {', '.join(early)}" if early else ""),
        f"- applied as planned: primary endpoint final held-out pass@1, δ = {margin:g}, paired by seed, collapse "
        f"rule version {version} (version 2's count beside it)",
        f"- **the mismatch reading: {word}**",
        "",
        f"| cell | arm | final pass@1 [95 % t] ±half-width | final reward | collapsed v{version} [exact 95 %] | v2 |",
        "|---|---|---|---|---|---|",
    ]
    for r in summ.itertuples():
        lines.append(
            f"| {_name(r.kind, r.dose)} | {r.arm} | {_fmt(r.pass_final, r.pass_lo, r.pass_hi, r.n).lstrip('+')} | "
            f"{r.reward_final:.3f} | {r.collapsed} of {r.runs} [{r.collapsed_lo:.0%}, {r.collapsed_hi:.0%}] | "
            f"{r.collapsed_v2} |"
        )
    lines += [
        "",
        "DPPO against each arm, paired by seed (Δ = DPPO − arm in final pass@1; where underpowered, the paired seeds "
        "the measured SD would need for a half-width of δ):",
        "",
        "| cell | DPPO − | Δ final pass@1 [95 % t] ±half-width | reading | seeds needed | bootstrap 95 % | "
        "collapsed: arm / DPPO | Fisher p |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in comp.itertuples():
        boot = "–" if math.isnan(r.boot_lo) else f"[{r.boot_lo:+.3f}, {r.boot_hi:+.3f}]"
        need = seeds_needed(r.sd, margin) if r.reading == "underpowered" else None
        p = "–" if math.isnan(r.fisher_p) else f"{r.fisher_p:.3g}"
        lines.append(
            f"| {_name(r.kind, r.dose)} | {r.arm} | {_fmt(r.delta, r.lo, r.hi, r.n)} | {r.reading} | {need or '–'} "
            f"| {boot} | {r.other_collapsed} / {r.dppo_collapsed} | {p} |"
        )
    if not cost.empty:
        lines += [
            "",
            "The mismatch's cost per arm (final pass@1 at axis M's dose − at the base, paired by seed):",
            "",
            "| arm | cost [95 % t] ±half-width |",
            "|---|---|",
            *(f"| {r.arm} | {_fmt(r.cost, r.lo, r.hi, r.n)} |" for r in cost.itertuples()),
        ]
    records = _plain(
        dict(
            plan_commit=commit,
            runs_not_after_plan=early,
            mismatch_reading=word,
            summary=summ.to_dict("records"),
            comparisons=comp.to_dict("records"),
            mismatch_cost=cost.to_dict("records"),
        )
    )
    return "\n".join(lines) + "\n", records


# ------------------------------------------------------------------------------------------------ figure 18
def panels(study: Study, plan: dict | None = None) -> list:
    """Figure 18: (a) final held-out pass@1 per arm at each cell [95 % t]; (b) DPPO − each arm, paired [95 % t], with
    the plan's margin ±δ; (c) the mismatch's cost per arm [95 % t]."""
    plan = plan or load_plan()
    out = outcomes(study, plan)
    if out.empty:
        return []
    summ, comp = summary(out), comparisons(out, plan)
    cost, _ = mismatch(out, plan)
    margin, x = float(plan["margin"]), "rollout.router_noise"
    rows = [
        drawn_row(
            "a",
            "bar",
            label(r.arm),
            r.arm,
            "eval/pass@1",
            x,
            r.dose,
            r.pass_final,
            max(r.pass_lo, 0.0),
            min(r.pass_hi, 1.0),
            int(r.n),
            step=r.dose,
        )
        for r in summ.itertuples()
    ]
    result = [
        Panel(pd.DataFrame(rows, columns=COLUMNS), "(a) final held-out pass@1", "mean pass@1 (95 % t)", f"cell ({x})")
    ]
    if not comp.empty:
        rows = [
            drawn_row(
                "b",
                "bar",
                f"DPPO − {label(r.arm)}",
                r.arm,
                "eval/pass@1 difference",
                x,
                r.dose,
                r.delta,
                r.lo,
                r.hi,
                int(r.n),
                step=r.dose,
            )
            for r in comp.itertuples()
        ]
        refs = margin_rows("b", margin)
        result.append(
            Panel(
                pd.DataFrame([*rows, *refs], columns=COLUMNS),
                "(b) DPPO − each arm, paired by seed",
                "Δ pass@1 (95 % t)",
                f"cell ({x})",
            )
        )
    if not cost.empty:
        rows = [
            drawn_row(
                "c",
                "bar",
                label(r.arm),
                r.arm,
                "eval/pass@1 difference",
                x,
                r.dose,
                r.cost,
                r.lo,
                r.hi,
                int(r.n),
                step=r.dose,
            )
            for r in cost.itertuples()
        ]
        result.append(
            Panel(
                pd.DataFrame(rows, columns=COLUMNS),
                "(c) the mismatch's cost: M dose − base, paired",
                "Δ pass@1 (95 % t)",
                f"axis M dose ({x})",
            )
        )
    return result
