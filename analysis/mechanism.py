"""Axis R (figure 17; plan experiments/frontier/plan_r.yaml): a routing change between π_old and π_θ that only R2
removes, judged exactly as its plan says, read never restated. Pure functions over a loaded `Study` and the plan.

- `cell`: where a run sits (its dose of `train.route_noise`, the sham, the positive control, the frozen router).
- `outcomes`: one row per (cell, arm, seed): held-out pass@1 at step 0 and at the end, final training reward, collapsed
  under the plan's rule version and under version 2, and what the run reached inside its ratio (routing's share of the
  objective's Var ℓ pooled over every update of the run, experts changed per update, Var ℓ^pol). GRPO + R2 at a dose
  where a seed's run was not trained is that seed's dose-0 run (`stand_in`): bit-identical by construction, which
  `remedy_check` verifies on every trained copy.
- `summary`, `comparisons`: per cell and arm, and each arm against GRPO without replay paired by seed (the frontier's
  reading: a difference, equivalence within δ, underpowered or inconclusive; Fisher's exact test on collapses).
- `verdict`: the plan's reading in one sentence — "R2 matters", "R2 does not matter here" or underpowered.
- `cause_of_death`: for every collapsed run (this stage's and the frontier's), the signals at the collapse step and
  over the 25 steps before it.
- `section` (the REPORT's) and `panels` (figure 17).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import yaml

from analysis.aggregate import mean_ci
from analysis.collapse import PERSIST, collapse
from analysis.frontier import (
    BASELINE,
    _history,
    _plain,
    plan_commit,
    reading,
    runs_after_plan,
)
from analysis.rules import seeds_needed
from analysis.runs import PASS1, REWARD, Study
from analysis.stats import clopper_pearson, fisher_greater, paired_bootstrap
from gspo_study.paths import EXPERIMENTS

PLAN = EXPERIMENTS / "frontier" / "plan_r.yaml"
FIGURES = (17, 19, 20)  # the pilot, the decisive stage, the frozen router (experiments/figures.yaml); one section
BASE_MINIBATCHES = 4  # the frontier's base (figure 13's settings)
OBJ = "moe/route_obj"
TIMING = ("compute/seconds", "perf/tokens_per_s")  # wall clock: the only numbers two identical runs may differ in


def load_plan(path: Path = PLAN) -> dict:
    return yaml.safe_load(Path(path).read_text())


@dataclass(frozen=True)
class Cell:
    """Where a run sits: `kind` "R" (a dose of route_noise, 0 included), "sham", "positive", "frozen" (routers frozen)
    or "minibatches" (the frozen cell's unfrozen twin); `dose` σ (the last two: the run's minibatches per step)."""

    kind: str
    dose: float


def cell(cfg) -> Cell:
    t = cfg.train
    if t.route_random:
        return Cell("positive", math.inf)
    if t.router_lr_scale == 0:
        return Cell("frozen", float(t.num_minibatches))
    if t.num_minibatches != BASE_MINIBATCHES and t.route_noise == 0:
        return Cell("minibatches", float(t.num_minibatches))
    return Cell("sham" if t.route_sham else "R", float(t.route_noise))


# ------------------------------------------------------------------------------------------------ per run
def _curve(study: Study, metric: str, run_id: str) -> pd.DataFrame:
    f = study.frame
    return f[(f.run_id == run_id) & (f.metric == metric)].sort_values("step")


def _mean(study: Study, metric: str, run_id: str) -> float:
    c = _curve(study, metric, run_id)
    return float(c.value.mean()) if len(c) else math.nan


def pooled_share(study: Study, run_id: str) -> float:
    """Routing's share of the objective's Var ℓ over every update of the run: 1 − Σ pol_var / Σ total_var (each step
    logs its updates' means, so the sums over steps weigh every update alike); NaN for a run without the reading."""
    pol, tot = _curve(study, f"{OBJ}/pol_var", run_id), _curve(study, f"{OBJ}/total_var", run_id)
    return 1.0 - pol.value.sum() / tot.value.sum() if len(tot) and tot.value.sum() > 0 else math.nan


def final_reward(study: Study, run_id: str, cfg) -> float:
    """The training reward averaged over the last evaluation interval (the plan's secondary endpoint)."""
    c = _curve(study, REWARD, run_id)
    start = cfg.train.steps - cfg.eval.every if cfg.eval.every > 0 else 0
    return float(c[c.step > start].value.mean()) if len(c) else math.nan


def run_row(study: Study, r, version: int) -> dict:
    """One run's outcome under collapse rule `version` (and version 2 beside it) and what it reached."""
    rw, p1 = _curve(study, REWARD, r.run_id), _curve(study, PASS1, r.run_id)
    args = (rw.step.to_numpy(), rw.value.to_numpy(), p1.step.to_numpy(), p1.value.to_numpy())
    c, c2 = collapse(*args, version), collapse(*args, 2)
    last = int(rw.step.max()) if len(rw) else 0
    where = cell(r.cfg)
    return dict(
        kind=where.kind,
        dose=where.dose,
        arm=r.run,
        seed=r.seed,
        run_id=r.run_id,
        stand_in=False,
        pass0=float(p1.value.iloc[0]) if len(p1) else math.nan,
        pass_final=float(p1.value.iloc[-1]) if len(p1) else math.nan,
        reward_final=final_reward(study, r.run_id, r.cfg),
        collapsed=c.collapsed,
        collapse_step=c.step if c.collapsed else last,
        collapse_rule=c.rule,
        collapsed_v2=c2.collapsed,
        collapse_step_v2=c2.step if c2.collapsed else last,
        share=pooled_share(study, r.run_id),
        flips=_mean(study, f"{OBJ}/flips", r.run_id),
        flips_first=_mean(study, f"{OBJ}/mb_0/flips", r.run_id),
        pol_var=_mean(study, f"{OBJ}/pol_var", r.run_id),
        drift_per_update=_mean(study, "moe/routing_volatility/per_update/overall", r.run_id),
    )


def outcomes(study: Study, plan: dict) -> pd.DataFrame:
    """One row per (cell, arm, seed), with the remedy's dose-0 runs standing in where its copy was not trained."""
    out = pd.DataFrame([run_row(study, r, int(plan["collapse_rule"]["version"])) for r in study.runs])
    if out.empty:
        return out
    remedy, doses = plan["remedy"], [float(d) for d in plan["doses"]]
    base = out[(out.arm == remedy) & (out.kind == "R") & (out.dose == 0.0)]
    cells = [("R", d) for d in doses[1:]] + [("positive", math.inf)]
    extra = []
    for kind, dose in cells:
        have = set(out[(out.arm == remedy) & (out.kind == kind) & (out.dose == dose)].seed)
        seeds = set(out[(out.kind == kind) & (out.dose == dose)].seed) - have
        for r in base[base.seed.isin(seeds)].itertuples(index=False):
            extra.append({**r._asdict(), "kind": kind, "dose": dose, "stand_in": True})
    return pd.concat([out, pd.DataFrame(extra)], ignore_index=True) if extra else out


def _values(frame: pd.DataFrame, keys: set[str]) -> pd.DataFrame:
    """(metric, step, value) of `keys`, in one order."""
    f = frame[frame.metric.isin(keys)].sort_values(["metric", "step"])
    return f[["metric", "step", "value"]].reset_index(drop=True)


def remedy_check(study: Study, plan: dict) -> list[dict]:
    """Every trained GRPO + R2 run at a dose (or under the positive control) against the same seed's dose-0 run: the
    metrics both logged (the dose-0 runs may predate some telemetry), every step, wall clock aside."""
    remedy = plan["remedy"]
    runs = {(cell(r.cfg), r.seed): r for r in study.runs if r.run == remedy}
    rows = []
    for (where, seed), r in sorted(runs.items(), key=lambda kv: (kv[0][1], kv[0][0].kind, kv[0][0].dose)):
        base = runs.get((Cell("R", 0.0), seed))
        if where.kind not in ("R", "positive") or where == Cell("R", 0.0) or base is None:
            continue
        a, b = (study.frame[study.frame.run_id == x.run_id] for x in (r, base))
        keys = (set(a.metric) & set(b.metric)) - set(TIMING)
        left, right = (_values(f, keys) for f in (a, b))
        same = len(left) == len(right) and (left.to_numpy() == right.to_numpy()).all()
        rows.append(
            dict(seed=seed, kind=where.kind, dose=where.dose, metrics=len(keys), points=len(left), equal=bool(same))
        )
    return rows


# ------------------------------------------------------------------------------------------------ per cell
def summary(out: pd.DataFrame) -> pd.DataFrame:
    rows = []
    for (kind, dose, arm), g in out.groupby(["kind", "dose", "arm"], sort=True):
        mean, lo, hi, n = mean_ci(g.pass_final)
        k, k2 = int(g.collapsed.sum()), int(g.collapsed_v2.sum())
        cp_lo, cp_hi = clopper_pearson(k, len(g))
        rows.append(
            dict(
                kind=kind,
                dose=dose,
                arm=arm,
                n=n,
                pass_final=mean,
                pass_lo=lo,
                pass_hi=hi,
                reward_final=float(g.reward_final.mean()),
                collapsed=k,
                collapsed_v2=k2,
                runs=len(g),
                collapsed_lo=cp_lo,
                collapsed_hi=cp_hi,
                stand_ins=int(g.stand_in.sum()),
                share=float(g.share.mean()),
                flips=float(g.flips.mean()),
                flips_first=float(g.flips_first.mean()),
                pol_var=float(g.pol_var.mean()),
            )
        )
    return pd.DataFrame(rows)


def comparisons(out: pd.DataFrame, plan: dict) -> pd.DataFrame:
    """Per cell, each arm against GRPO without replay, paired by seed: Δ final pass@1 and its reading, Fisher's test."""
    margin, decisive_n = float(plan["margin"]), len(plan["decisive"]["seeds"])
    rows = []
    for (kind, dose), g in out.groupby(["kind", "dose"], sort=True):
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
            sd = float(np.std(diffs, ddof=1)) if n > 1 else math.nan
            rows.append(
                dict(
                    kind=kind,
                    dose=dose,
                    arm=arm,
                    n=n,
                    delta=mean,
                    lo=lo,
                    hi=hi,
                    reading=word,
                    boot_lo=boot[1],
                    boot_hi=boot[2],
                    sd=sd,
                    grpo_collapsed=f"{k0} of {n0}",
                    arm_collapsed=f"{k1} of {n1}",
                    fisher_p=fisher_greater(k0, n0, k1, n1),
                )
            )
    return pd.DataFrame(rows)


def verdict(summ: pd.DataFrame, comp: pd.DataFrame, plan: dict) -> tuple[str, str]:
    """The plan's reading (`readings`): ("R2 matters" | "R2 does not matter here" | "underpowered" | "not run", why)."""
    margin, remedy = float(plan["margin"]), plan["remedy"]
    grpo = summ[(summ.arm == BASELINE) & (summ.kind == "R")].set_index("dose")
    r2 = comp[(comp.arm == remedy) & (comp.kind == "R")].set_index("dose")
    if r2.empty:
        return "not run", "no dose has both arms yet"
    eligible = [d for d in r2.index if d > 0 and grpo.share.get(d, math.nan) >= 0.5 and grpo.flips.get(d, 1) <= 0.2]
    sham = comp[(comp.arm == remedy) & (comp.kind == "sham")]
    sham_ok = not sham.empty and bool((sham.delta <= margin).all())
    means = r2.delta.sort_index()
    grows = bool((np.diff(means.to_numpy()) >= 0).all())
    for d in eligible:
        row = r2.loc[d]
        fisher = row.fisher_p < 0.05
        if ((row.lo > 0 and row.delta > margin) or fisher) and sham_ok and grows:
            how = f"Δ {row.delta:+.3f} [{row.lo:.3f}, {row.hi:.3f}]" + (
                f", Fisher p {row.fisher_p:.3g}" if fisher else ""
            )
            return "R2 matters", f"at σ {d:g} (share {grpo.share[d]:.2f}, flips {grpo.flips[d]:.1%}): {how}"
    pos = summ[(summ.kind == "positive") & (summ.arm == BASELINE)]
    base = summ[(summ.kind == "R") & (summ.dose == 0.0) & (summ.arm == BASELINE)]
    seen = not pos.empty and (
        pos.collapsed.iloc[0] >= pos.runs.iloc[0] / 2
        or (not base.empty and pos.pass_final.iloc[0] < base.pass_final.iloc[0] - margin)
    )
    up_to = [d for d in r2.index if grpo.share.get(d, math.nan) >= 0.75]
    if up_to and seen:
        top = min(up_to)
        if all(str(r2.loc[d].reading).startswith("equivalent") for d in r2.index if d <= top):
            return "R2 does not matter here", f"Δ equivalent within ±{margin:g} at every dose up to σ {top:g}"
    return "underpowered", "neither reading's conditions hold at the seeds finished"


def reading_rule(plan: dict) -> tuple[int, float | None]:
    """The reading rule in force and the decisive dose, from the plan's history (each entry may set `reading_rule`
    and `decisive_dose`; the latest wins): rule 1 and no dose before any entry sets them."""
    rule, dose = 1, None
    for entry in plan.get("history") or []:
        rule = int(entry.get("reading_rule", rule))
        dose = entry.get("decisive_dose", dose)
    return rule, None if dose is None else float(dose)


def decisive_cells(out: pd.DataFrame, plan: dict) -> pd.DataFrame:
    """Rule 2's scope (plan_r.yaml, history of 2026-12-07): the decisive stage's cells — dose 0 and the decisive dose,
    the sham at that dose, at the decisive seeds — and the positive control (the detector); empty before a decisive
    dose is chosen."""
    _, dose = reading_rule(plan)
    if dose is None or out.empty:
        return out.iloc[0:0]
    seeds = out.seed.isin([int(s) for s in plan["decisive"]["seeds"]])
    doses = (out.kind == "R") & out.dose.isin([0.0, dose])
    sham = (out.kind == "sham") & (out.dose == dose)
    return out[(seeds & (doses | sham)) | (out.kind == "positive")]


def decisive_progress(out: pd.DataFrame, plan: dict) -> tuple[list[int], list[int]]:
    """(seeds whose every decisive cell has GRPO without replay finished, the plan's decisive seeds)."""
    _, dose = reading_rule(plan)
    planned = [int(s) for s in plan["decisive"]["seeds"]]
    if dose is None or out.empty:
        return [], planned
    base = out[out.arm == BASELINE]
    cells = [("R", 0.0), ("R", dose), ("sham", dose)]
    have = [set(base[(base.kind == k) & (base.dose == d)].seed) for k, d in cells]
    return sorted(int(s) for s in set.intersection(*have) if s in planned), planned


def readings(
    out: pd.DataFrame, plan: dict, summ: pd.DataFrame | None = None, comp: pd.DataFrame | None = None
) -> dict[int, tuple[str, str]]:
    """The plan's reading under each rule version: 1 on every dose pooled (as first coded; `summ` and `comp` are
    `out`'s summary and comparisons where the caller has them), 2 on the decisive stage's cells alone
    (`decisive_cells`)."""
    summ = summary(out) if summ is None else summ
    found = {1: verdict(summ, comparisons(out, plan) if comp is None else comp, plan)}
    scoped = decisive_cells(out, plan)
    found[2] = (
        verdict(summary(scoped), comparisons(scoped, plan), plan)
        if not scoped.empty
        else ("not run", "no decisive dose chosen yet")
    )
    return found


def frozen_reading(comp: pd.DataFrame, plan: dict) -> tuple[str, str]:
    """The frozen stage's reading (plan_r.yaml, history of 2026-12-07): in the frozen-router cell, GRPO + R2 − GRPO
    without replay paired by seed — "R2 matters through hidden-state drift alone" when its 95 % t-interval lies above 0
    with a mean above δ, "R2 does not matter there" when equivalent within ±δ, else the comparison's own reading."""
    margin, remedy = float(plan["margin"]), plan["remedy"]
    row = comp[(comp.kind == "frozen") & (comp.arm == remedy)]
    if row.empty:
        return "not run", "no frozen-router cell has both arms yet"
    from scipy import stats

    r = row.iloc[0]
    shown = _fmt(r.delta, r.lo, r.hi, int(r.n))
    if r.n < 2:
        return "inconclusive", f"Δ {shown}"
    if r.lo > 0 and r.delta > margin:
        return "R2 matters through hidden-state drift alone", f"Δ {shown}"
    half1 = stats.t.ppf(0.95, r.n - 1) * r.sd / math.sqrt(r.n)  # the one-sided 95 % bounds' distance from the mean
    if -margin < r.delta - half1 and r.delta + half1 < margin:
        return "R2 does not matter there", f"Δ {shown}, equivalent within ±{margin:g}"
    return ("underpowered" if (r.hi - r.lo) / 2 > margin else "inconclusive"), f"Δ {shown}"


# ------------------------------------------------------------------------------------------------ cause of death
DEATH = {  # what the table shows, at the collapse step and over the PERSIST steps before it
    "reward": REWARD,
    "zero-std groups": "rollout/zero_std_group_frac",
    "grad norm": "train/grad_norm",
    "clip frac": "policy/clip_frac/token",
    "KL k3": "policy/kl/k3",
    "drift per update": "moe/routing_volatility/per_update/overall",
    "routing share in ratio": f"{OBJ}/r2_removed_share",
    "max expert share": "moe/load/max_share/max",
    "load entropy": "moe/load/entropy/mean",
    "dead experts": "moe/load/dead_frac/mean",
    "router logit norm": "moe/router/logit_norm/mean",
    "top-k margin": "moe/router/topk_margin/mean",
    "entropy": "train/entropy",
}


def cause_of_death(study: Study, out: pd.DataFrame, stage: str) -> pd.DataFrame:
    """For every collapsed run of `out` (its `run_id`s in `study`; a stand-in is its source run's row, not its own):
    each signal at the collapse step and its mean over the PERSIST steps before it (NaN where not logged)."""
    rows = []
    stand_in = out.stand_in.astype(bool) if "stand_in" in out else pd.Series(False, index=out.index)
    for r in out[out.collapsed.astype(bool) & ~stand_in].itertuples():
        row = dict(
            stage=stage,
            arm=r.arm,
            seed=r.seed,
            cell=f"{r.kind} {r.dose:g}",
            run_id=r.run_id,
            step=int(r.collapse_step),
            rule=r.collapse_rule,
        )
        for name, metric in DEATH.items():
            c = _curve(study, metric, r.run_id)
            at = c[c.step == r.collapse_step].value
            before = c[(c.step < r.collapse_step) & (c.step >= r.collapse_step - PERSIST)].value
            row[name] = float(at.iloc[0]) if len(at) else math.nan
            row[f"{name} before"] = float(before.mean()) if len(before) else math.nan
        rows.append(row)
    return pd.DataFrame(rows)


def death_table(dead: pd.DataFrame) -> list[str]:
    """The cause-of-death table as markdown lines (value at the collapse step, the mean before it in parentheses)."""
    if dead.empty:
        return ["No run collapsed."]
    shown = [
        "reward",
        "zero-std groups",
        "grad norm",
        "KL k3",
        "drift per update",
        "routing share in ratio",
        "max expert share",
        "load entropy",
        "dead experts",
        "router logit norm",
        "top-k margin",
    ]
    head = "| stage | cell | arm | seed | step (rule) | " + " | ".join(shown) + " |"
    lines = [head, "|" + "---|" * (5 + len(shown))]
    for d in dead.to_dict("records"):
        cells = [_cell(d[n], d[f"{n} before"]) for n in shown]
        lines.append(
            f"| {d['stage']} | {d['cell']} | {d['arm']} | {d['seed']} | {d['step']} ({d['rule']}) | "
            + " | ".join(cells)
            + " |"
        )
    return lines


def _cell(at: float, before: float) -> str:
    if at != at and before != before:
        return "—"
    return f"{at:.3g} ({before:.3g})"


# ------------------------------------------------------------------------------------------------ the REPORT's section
def _fmt(mean: float, lo: float, hi: float, n: int) -> str:
    return f"{mean:.3f} (n={n})" if math.isnan(lo) else f"{mean:.3f} [{lo:.3f}, {hi:.3f}] ±{(hi - lo) / 2:.3f} (n={n})"


def _where(kind: str, dose: float) -> str:
    return {
        "positive": "positive control (random top-k)",
        "sham": f"sham σ {dose:g}",
        "frozen": f"frozen router, {dose:g} minibatches",
        "minibatches": f"router trained, {dose:g} minibatches",
    }.get(kind, f"σ {dose:g}")


def reading_lines(out: pd.DataFrame, plan: dict, summ: pd.DataFrame, comp: pd.DataFrame) -> tuple[list[str], dict]:
    """The section's readings as lines and records: the rule in force (interim while the decisive stage is incomplete),
    rule v1 beside v2, and the frozen router's reading."""
    rule, dose = reading_rule(plan)
    by_rule = readings(out, plan, summ, comp)
    word, why = by_rule[rule]
    done, planned = decisive_progress(out, plan)
    interim = dose is not None and len(done) < len(planned)
    scope, note = "", ""
    if rule >= 2 and dose is not None:
        seeds = plan["decisive"]["seeds"]
        scope = f": the decisive stage's cells, dose 0, σ {dose:g} and its sham, seeds {seeds[0]}–{seeds[-1]}"
    if interim:
        n = len(planned)
        note = f" (interim: {len(done)} of {n} decisive seeds finished; the plan reads at all {n})"
    lines = [f"- **the plan's reading (rule v{rule}{scope}): {word}**{note} — {why}"]
    if rule >= 2:
        lines.append(
            "- rule v1 (every dose pooled, pilot's included, as first coded; replaced before any decisive-stage run "
            "was read, because with the pilot's 2-seed doses neither reading could be reached — plan_r.yaml history): "
            f"{by_rule[1][0]} — {by_rule[1][1]}"
        )
    frozen = frozen_reading(comp, plan)
    lines.append(f"- the frozen router's reading (16 minibatches, routers at lr 0): **{frozen[0]}** — {frozen[1]}")
    records = dict(
        reading=word,
        why=why,
        reading_rule=rule,
        decisive_seeds_done=done,
        decisive_seeds_planned=planned,
        interim=interim,
        readings={f"v{v}": {"reading": w, "why": y} for v, (w, y) in by_rule.items()},
        frozen_reading=frozen[0],
        frozen_why=frozen[1],
    )
    return lines, records


def section(
    study: Study, plan: dict | None = None, frontier: list[tuple[Study, pd.DataFrame]] = ()
) -> tuple[str, dict]:
    """The REPORT's axis-R section (markdown) and its records (REPORT.json's `mechanism`); `frontier`: the frontier's
    studies with their outcomes, whose collapsed runs join the cause-of-death table."""
    plan = plan or load_plan()
    if not study.runs:
        return "", {}
    out = outcomes(study, plan)
    summ, comp = summary(out), comparisons(out, plan)
    commit = plan_commit(PLAN)
    reused = {r.run_id for r in study.runs if cell(r.cfg) == Cell("R", 0.0)}
    new = [r.tags.get("git_commit", "") for r in study.runs if r.run_id not in reused]
    early = runs_after_plan(new, commit) if commit != "unknown" and new else []
    check = remedy_check(study, plan)
    read, read_records = reading_lines(out, plan, summ, comp)
    margin, version = float(plan["margin"]), plan["collapse_rule"]["version"]
    lines = [
        "## Axis R: routing noise inside the ratio, which only R2 removes (figures "
        f"{', '.join(map(str, FIGURES))}; plan `experiments/frontier/plan_r.yaml` at {commit[:12]})",
        "",
        f"- runs: {len(reused)} reused at dose 0 (the frontier's base, same run keys) and {len(new)} trained under "
        f"the plan; seeds {', '.join(map(str, sorted(out.seed.unique())))}"
        + (
            f"; runs not descending from the plan's commit: {', '.join(early)}"
            if early
            else "; every new run descends from the plan's commit"
        ),
        "- the remedy control (GRPO + R2 at a dose is GRPO + R2 at dose 0): "
        + (
            "; ".join(
                f"seed {c['seed']} {_where(c['kind'], c['dose'])}: "
                f"{'bit-identical' if c['equal'] else 'DIFFERS'} on {c['metrics']} metrics, {c['points']} values"
                for c in check
            )
            or "no trained copy yet"
        ),
        f"- applied as planned: primary endpoint final held-out pass@1, δ = {margin:g}, collapse rule version "
        f"{version} (version 2's count beside it), comparisons paired by seed against GRPO without replay",
        *read,
        *(f"- plan history, {_history(h)}" for h in plan.get("history") or []),
        "",
        "| cell | arm | reached in the ratio: routing's share of Var ℓ / flips per update (first update) / Var ℓ^pol | "
        "final pass@1 [95 % t] | final reward | collapsed v"
        f"{version} [exact 95 %] | v2 |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in summ.itertuples():
        reached = (
            "—" if r.share != r.share else f"{r.share:.2f} / {r.flips:.3%} ({r.flips_first:.3%}) / {r.pol_var:.2g}"
        )
        stand = f" ({r.stand_ins} stand-in)" if r.stand_ins else ""
        lines.append(
            f"| {_where(r.kind, r.dose)} | {r.arm}{stand} | {reached} | "
            f"{_fmt(r.pass_final, r.pass_lo, r.pass_hi, r.n)} | {r.reward_final:.3f} | "
            f"{r.collapsed} of {r.runs} [{r.collapsed_lo:.0%}, {r.collapsed_hi:.0%}] | {r.collapsed_v2} |"
        )
    lines += [
        "",
        "Each arm against GRPO without replay, paired by seed (Δ = arm − GRPO without replay in final pass@1; the "
        f"reading as the frontier's: a difference, equivalence within ±{margin:g}, underpowered or inconclusive; where "
        "underpowered, the paired seeds the measured SD would need for a half-width of δ):",
        "",
        "| cell | arm | Δ final pass@1 [95 % t] | reading | seeds needed | bootstrap 95 % | collapsed: GRPO / arm "
        "| Fisher p |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in comp.itertuples():
        boot = "–" if math.isnan(r.boot_lo) else f"[{r.boot_lo:.3f}, {r.boot_hi:.3f}]"
        need = seeds_needed(r.sd, margin) if r.reading == "underpowered" else None
        lines.append(
            f"| {_where(r.kind, r.dose)} | {r.arm} | {_fmt(r.delta, r.lo, r.hi, r.n)} | {r.reading} | "
            f"{need or '–'} | {boot} | {r.grpo_collapsed} / {r.arm_collapsed} | {r.fisher_p:.3g} |"
        )
    dead = cause_of_death(study, out, "axis R")
    frames = [dead] + [cause_of_death(s, o.assign(kind=o.axis), "frontier") for s, o in frontier]
    if any(not d.empty for d in frames):  # each run once: a run in two frontier figures, or standing in for another arm
        dead = pd.concat([d for d in frames if not d.empty], ignore_index=True).drop_duplicates("run_id")
    lines += [
        "",
        f"Cause of death: every collapsed run, its signals at the collapse step and (in parentheses) their mean "
        f"over the {PERSIST} steps before it; — where the run did not log the signal (the frontier's runs "
        "predate the load and router telemetry):",
        "",
        *death_table(dead),
        "",
    ]
    records = _plain(
        dict(
            plan_commit=commit,
            runs_not_after_plan=early,
            **read_records,
            remedy_check=check,
            summary=summ.to_dict("records"),
            comparisons=comp.to_dict("records"),
            cause_of_death=dead.to_dict("records"),
        )
    )
    return "\n".join(lines), records
