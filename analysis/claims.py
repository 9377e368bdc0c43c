"""The GSPO paper's claims as the REPORT judges them: one `Claim` each (its text, the paper's number, the one primary
measure its verdict rests on, the runs or figure it reads) and the function that measures it from tracked runs
(`CLAIMS`, in the REPORT's order). The verdict rules are analysis/rules.py's; rendering is analysis/report.py's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from analysis.aggregate import mean_ci
from analysis.figures import PAPER_CLIP_FRAC, PAPER_VOLATILITY, lag_table, sweep_table
from analysis.rules import (
    ALPHA,
    CLIP,
    COLLAPSE_RATE,
    MOVING,
    POWER,
    ROUTE,
    VOL_UPDATE,
    Estimate,
    Result,
    Verdict,
    collapse_verdict_v1,
    count,
    difference,
    estimate,
    factor,
    final_pass,
    final_reward,
    fisher_verdict,
    gain,
    pooled,
    powered,
    training_mean,
)
from analysis.runs import PASS1, REWARD, Study, label
from analysis.stats import fisher_greater, seeds_for_power

# ------------------------------------------------------------------------------------------------ claims
SHORT = {  # arms as the primary measures name them
    "gspo": "GSPO",
    "grpo_r2": "GRPO + R2",
    "grpo": "GRPO (no replay)",
    "grpo_r3": "GRPO + R3",
    "grpo_r2_icepop": "GRPO + R2 + IcePop",
}


def pair(quantity: str, a: str, b: str) -> str:
    """A difference measure's name: "final pass@1, GSPO − GRPO + R2"."""
    return f"{quantity}, {SHORT[a]} − {SHORT[b]}"


@dataclass
class Claim:
    text: str
    paper: str
    primary: str  # the one measure the row's verdict is judged on, declared here once (printed in the REPORT)
    runs: tuple[str, ...]
    measure: object  # (study[, the `also` figures' studies]) -> Result
    figure: int | None = None  # measured on this figure's sweep (its own runs) instead of `runs`
    shown: int | None = None  # the figure the row's runs are drawn in (default: `figure`)
    also: tuple[int, ...] = ()  # other figures whose runs the row reads (row 13: figure 12, for the rule's history)

    @property
    def drawn_in(self) -> int | None:
        return self.figure if self.shown is None else self.shown


def _final_pair(study: Study, a: str, b: str, sign: int) -> Result:
    """A − B paired by seed: final pass@1 judged, the final reward beside it; the interval's half-width against δ
    and the seeds the measured SD would need (rows 2 and 4, as the long-horizon rows)."""
    d = (final_pass(study, a) - final_pass(study, b)).dropna()
    return Result(
        context=powered(d) + headline_check(study, HEADLINE_FIGURES[1]),
        primary=difference(study, final_pass, a, b, "final pass@1", "diff", sign, measure=pair("final pass@1", a, b)),
        secondary=(difference(study, final_reward, a, b, "final reward", "diff", sign),),
    )


HEADLINE_PLAN = Path(__file__).resolve().parents[1] / "experiments" / "headline" / "plan.yaml"
HEADLINE_FIGURES = {1: "headline", 11: "long_horizon"}  # figure → its stage in the headline plan


def headline_check(study: Study, stage: str) -> str:
    """Whether the runs of the seeds the headline plan added (experiments/headline/plan.yaml) descend from its commit:
    "" when none of them is in the study."""
    import yaml

    from analysis.frontier import plan_commit, runs_after_plan

    spec = yaml.safe_load(HEADLINE_PLAN.read_text())["stages"][stage]
    added = [r for r in study.runs if r.seed in spec["seeds_added"]]
    if not added:
        return ""
    commit = plan_commit(HEADLINE_PLAN)
    early = runs_after_plan([r.tags.get("git_commit", "") for r in added], commit) if commit != "unknown" else []
    how = (
        f"not all descend from its commit {commit[:12]} ({', '.join(early)})"
        if early
        else f"all descend from its commit {commit[:12]}"
    )
    return f"; the {len(added)} runs of seeds added by experiments/headline/plan.yaml {how}"


def _efficiency(study: Study) -> Result:
    return _final_pair(study, "gspo", "grpo_r2", +1)


def _clipping(study: Study) -> Result:
    paper = PAPER_CLIP_FRAC["gspo"] - PAPER_CLIP_FRAC["grpo_r2"]
    measure = pair("clip fraction", "gspo", "grpo_r2")
    e = difference(study, training_mean(CLIP), "gspo", "grpo_r2", "clip fraction", "diff", +1, paper, measure)
    a, b = (training_mean(CLIP)(study, r).mean() for r in ("gspo", "grpo_r2"))
    ratio = f"ratio ×{a / b:.3g} (paper ×{PAPER_CLIP_FRAC['gspo'] / PAPER_CLIP_FRAC['grpo_r2']:.3g})" if b > 0 else ""
    return Result(ratio, e)


def _replay(study: Study) -> Result:
    return _final_pair(study, "grpo", "grpo_r2", -1)


VOLATILITY = "routing volatility per update, GRPO (no replay)"


def _volatility(study: Study) -> Result:
    """Claim 5 per optimizer update (the paper's unit), on figure 11's runs: GRPO without replay judged (the arm
    whose routing drift R2 exists to remove), GSPO beside it."""
    found = []
    for arm in ("grpo", "gspo"):
        run = LONG_ARMS[arm]
        e = estimate(
            f"{label(run)}, per update",
            training_mean(VOL_UPDATE)(study, run),
            "magnitude",
            paper=PAPER_VOLATILITY,
            unit="",
            measure=VOLATILITY if arm == "grpo" else "",
        )
        far = factor(e.lo, e.hi, PAPER_VOLATILITY) if not math.isnan(e.lo) else ""
        found.append(Estimate(**{**e.__dict__, "note": f", {far}" if far else ""}))
    return Result(_runs_found(study).rstrip("; "), found[0], (found[1],))


def _precision(study: Study) -> Result:
    a, b = "gspo_bf16_rollout", "gspo_bf16_recompute"
    return Result(
        _runs_found(study).rstrip("; "),
        difference(study, final_pass, a, b, "final pass@1", "no_harm", +1, measure=BYPASS),
        (difference(study, final_reward, a, b, "final reward", "no_harm", +1),),
    )


GAIN = "held-out pass@1 gain over the cold start, GSPO"


def _improves(study: Study) -> Result:
    start = mean_ci(study.values(PASS1, "gspo").query("step == 0").value)[0]
    name = f"GSPO held-out pass@1 gain over the cold start ({start:.3g})"
    return Result(primary=estimate(name, gain(study, "gspo"), unit="", measure=GAIN))


SWEEP = "final pass@1, GRPO + R2 − GRPO (no replay), mean over the moving cells"


def _sweep(study: Study) -> Result:
    """Claim 7: judged on GRPO + R2 − GRPO without replay (replay, the remedy the claim is about); GSPO − GRPO
    without replay beside it."""
    from analysis.collapse import PASS_MARGIN

    t = sweep_table(study)
    total = len(study.runs) + len(study.missing)
    vol = t[t.run == "grpo"].groupby("cell").vol.mean()
    moving = set(vol[vol >= MOVING].index)
    seeds = sorted({int(s) for s in t.seed.unique()})
    head = f"{len(study.runs)} of {total} sweep runs (seed{'s' * (len(seeds) > 1)} {', '.join(map(str, seeds))}); "
    if not moving:
        return Result(head + f"no cell reaches {MOVING:.0%} volatility (max {vol.max():.3g})")
    by_arm = t[t.cell.isin(moving)].groupby(["cell", "run"])[["final", "start"]].mean()
    down = by_arm.final < by_arm.start - PASS_MARGIN
    gone = sorted(c for c in moving if down.loc[c].all())  # every algorithm collapsed there: not a comparison
    pooled_cells = sorted(moving - set(gone))
    head += f"cells with GRPO volatility ≥ {MOVING:.0%}: {', '.join(sorted(moving))}"
    if gone:
        ends = by_arm.loc[gone].final
        span = f"{ends.min():.3g}–{ends.max():.3g}"
        head += f"; every algorithm collapses at {', '.join(gone)} (final pass@1 {span}), not pooled"
    if not pooled_cells:
        return Result(head)
    final = t[t.cell.isin(pooled_cells)].set_index(["run", "cell", "seed"]).final
    found = {}
    for a in ("grpo_r2", "gspo"):
        per_seed = (final.loc[a] - final.loc["grpo"]).dropna().groupby("seed").mean()  # cells fixed, seeds replicate
        name = f"{label(a)} − GRPO (no replay) final pass@1, mean over {len(pooled_cells)} cells"
        found[a] = estimate(name, per_seed, measure=SWEEP if a == "grpo_r2" else "")
    return Result(head, found["grpo_r2"], (found["gspo"],))


def regime_lag(t: pd.DataFrame, share: str = "pooled") -> int | None:
    """The policy-lag sweep's regime: among the lags where GSPO still learns (its mean held-out pass@1 gain over
    the cold start is positive), the one where routing's share of the log-ratio variance (column `share` of GRPO
    without replay: "pooled" over a run's steps, or "share", the mean of per-step ratios; mean over seeds) is
    largest; every lag if GSPO learns at none. None: no such run."""
    by_lag = t[t.run == "grpo"].groupby("lag")[share].mean()
    if by_lag.empty:
        return None
    gspo = t[t.run == "gspo"]
    learns = set((gspo.final - gspo.start).groupby(gspo.lag).mean().loc[lambda g: g > 0].index)
    pool = by_lag[by_lag.index.isin(learns)] if learns & set(by_lag.index) else by_lag
    return int(pool.idxmax())


def _runs_found(study: Study) -> str:
    """How many of a sweep's runs the row is measured on (a partly trained sweep is reported as such)."""
    return f"{len(study.runs)} of {len(study.runs) + len(study.missing)} sweep runs; "


def _lag_table(study: Study) -> pd.DataFrame:
    """figures.lag_table with `pooled`: routing's share of Var ℓ pooled over each run's steps."""
    t = lag_table(study)
    ids = {(r.run, r.seed, r.cfg.rollout.policy_lag): r.run_id for r in study.runs}
    num, den = f"{ROUTE}/var", f"{ROUTE}/total_var"
    t["pooled"] = [pooled(study, num, den, ids[(x.run, x.seed, x.lag)]) for x in t.itertuples()]
    return t


def _lag_claim(study: Study, a: str, b: str, sign: int) -> Result:
    """A − B final pass@1 paired by seed at the sweep's regime (`regime_lag`), judged; at lag 0 (the base, 30 steps)
    and the final reward at the regime beside it."""
    t = _lag_table(study)
    head = _runs_found(study)
    lag = regime_lag(t)
    if lag is None:
        return Result(head + "none of GRPO without replay")
    share = t[t.run == "grpo"].groupby("lag")[["pooled", "share"]].mean()
    by_ratio = regime_lag(t, "share")
    final = t.set_index(["run", "lag", "seed"]).sort_index()
    pairs = final.index.droplevel("seed")
    if (a, lag) not in pairs or (b, lag) not in pairs:
        return Result(head + f"no {label(a)} and {label(b)} pair at lag {lag}")

    def at(k: int, col: str = "final", name: str = "final pass@1", measure: str = "") -> Estimate:
        d = (final.loc[(a, k), col] - final.loc[(b, k), col]).dropna()
        return estimate(f"{name} at lag {k}{' (regime)' if k == lag else ''}", d, "diff", sign, measure=measure)

    primary = at(lag, measure=pair("final pass@1 at the regime lag", a, b))
    secondary = [at(lag, "reward", "final reward")]
    if lag != 0 and (a, 0) in pairs and (b, 0) in pairs:
        secondary.insert(0, at(0))
    same = "the same lag" if by_ratio == lag else f"lag {by_ratio}"
    text = (
        head + f"regime = lag {lag}, the argmax over {len(share)} lags of routing's share of Var ℓ (GRPO without "
        f"replay, pooled over a run's steps, mean over seeds: {share.pooled.loc[lag]:.3g}; the lags' intervals "
        f"overlap; the mean of per-step ratios, {share.share.loc[lag]:.3g}, picks {same}) where GSPO still gains "
        f"over the cold start; 1 comparison judged: {label(a)} − {label(b)} at the regime"
    )
    return Result(text, primary, tuple(secondary))


def _lag(study: Study) -> Result:
    """Claim 4 at the policy-lag sweep's regime (`regime_lag`)."""
    return _lag_claim(study, "grpo", "grpo_r2", -1)


def _lag_efficiency(study: Study) -> Result:
    """Claim 2 at the policy-lag sweep's regime."""
    return _lag_claim(study, "gspo", "grpo_r2", +1)


def _instrument(study: Study) -> Result:
    """The instrument's reading per lag (GRPO without replay, mean over seeds): routing's share of Var ℓ (pooled
    over a run's steps; the mean of per-step ratios in parentheses), the GRPO token / GSPO sequence clip decisions
    routing alone flips, routing volatility per step. A reading, not a claim: no verdict beyond "measured"."""
    t = _lag_table(study)
    head = _runs_found(study)
    g = t[t.run == "grpo"].groupby("lag")[["pooled", "share", "flip_token", "flip_seq", "vol"]].mean()
    if g.empty:
        return Result(head + "none of GRPO without replay")
    n = t[t.run == "grpo"].groupby("lag").seed.nunique()
    cells = [
        f"lag {lag}: share {r.pooled:.3g} pooled ({r.share:.3g} mean of per-step ratios), flips {r.flip_token:.2%} "
        f"token / {r.flip_seq:.2%} seq, volatility {r.vol:.2%} (n={n.loc[lag]})"
        for lag, r in g.iterrows()
    ]
    glance = f"{g.pooled.min():.3g}–{g.pooled.max():.3g} over lags {', '.join(map(str, g.index))}"
    return Result(head + "; ".join(cells), otherwise=Verdict.MEASURED, glance=glance)


CORRECTIONS = {
    "bf16_recompute": "none",
    "bf16_tis": "token TIS",
    "bf16_mis": "sequence MIS",
    "bf16_icepop": "IcePop",
}
BYPASS = "final pass@1, bypass − recompute, GSPO, no correction"
R3_R2 = "final pass@1, GRPO + R3 − GRPO + R2, no correction"


def _changed(base: Verdict, per: dict[str, Verdict]) -> str:
    """Which corrections turn the uncorrected verdict `base` into another, as text."""
    moved = [f"{CORRECTIONS[c]} ({v})" for c, v in per.items() if c != "bf16_recompute" and v != base]
    return "changed by " + ", ".join(moved) if moved else "no correction changes it"


def _multiplicity(k: int) -> str:
    return f"{k} comparisons per arm, only the uncorrected one judged, none corrected for multiplicity; "


def _correction_precision(study: Study) -> Result:
    """§5.4 beside the corrections (figure 10): the bypass (rollout log-probs as π_old) against recomputed π_old
    with no correction and with each correction, final pass@1 paired by seed, "no harm" verdict per pair, for
    GSPO and for GRPO + R2. Judged on GSPO's uncorrected pair (claim 6 at figure 10's runs); the others beside."""
    found, changed = [], []
    for obj in ("gspo", "grpo_r2"):
        per = {}
        for c in CORRECTIONS:
            primary = (obj, c) == ("gspo", "bf16_recompute")
            e = difference(
                study,
                final_pass,
                f"{obj}_bf16_rollout",
                f"{obj}_{c}",
                f"{label(obj)}: bypass − recompute ({CORRECTIONS[c]})",
                "no_harm",
                +1,
                measure=BYPASS if primary else "",
            )
            per[c] = e.verdict
            found.append(e)
        changed.append(f"{label(obj)}: {_changed(per['bf16_recompute'], per)}")
    head = _runs_found(study) + _multiplicity(len(CORRECTIONS)) + "; ".join(changed)
    return Result(head, found[0], tuple(found[1:]))


def _correction_replay(study: Study) -> Result:
    """R2 vs R3 beside the corrections (figure 10): GRPO + R3 − GRPO + R2 final pass@1 paired by seed, with R2's
    π_old recomputed and no correction (figure 7's comparison) and with each correction. R3 paper's sign: R3
    ahead under a mismatched rollout engine. Judged on the uncorrected pair; the others beside, each with the
    correction's masked token fraction."""
    found, per = [], {}
    for c in CORRECTIONS:
        e = difference(
            study,
            final_pass,
            "grpo_r3_bf16",
            f"grpo_r2_{c}",
            f"R3 − R2 ({CORRECTIONS[c]})",
            "diff",
            +1,
            measure=R3_R2 if c == "bf16_recompute" else "",
        )
        masked = training_mean("correction/masked_frac/token")(study, f"grpo_r2_{c}").mean()
        note = "" if math.isnan(masked) else f", R2's masked tokens {masked:.3%}"
        found.append(Estimate(**{**e.__dict__, "note": note}))
        per[c] = e.verdict
    k3_r2, k3_r3 = (training_mean("mismatch/k3")(study, r).mean() for r in ("grpo_r2_bf16_recompute", "grpo_r3_bf16"))
    head = (
        _runs_found(study)
        + _multiplicity(len(CORRECTIONS))
        + f"k3 mismatch R2 {k3_r2:.3g}, R3 {k3_r3:.3g}; {_changed(per['bf16_recompute'], per)}"
    )
    return Result(head, found[0], tuple(found[1:]))


# ------------------------------------------------------------------------------------- figure 11: the long horizon
LONG_ARMS = {
    "grpo": "grpo_bf16_recompute",
    "grpo_r2": "grpo_r2_bf16_recompute",
    "grpo_r3": "grpo_r3_bf16",
    "gspo": "gspo_bf16_recompute",
    "grpo_r2_icepop": "grpo_r2_bf16_icepop",
}
BEFORE = 25  # steps of the instrument's readings before a collapse (or the run's last steps without one)
READINGS = {
    "k3": "mismatch/k3",
    "F(2)": "mismatch/f_tau_2",
    "routing gap": "moe/train_infer_routing/tokens_any_changed",
    "grad norm": "train/grad_norm",
}
R2_SHARE = "R2 share of Var ℓ"  # 1 − Σ Var ℓ^pol / Σ Var ℓ over the same steps (pooled); its per-step mean beside
COLLAPSED = "runs collapsed, GRPO (no replay)"


def _long_claim(study: Study, a: str, b: str, sign: int) -> Result:
    """A − B final pass@1 paired by seed on figure 11's runs (judged), with the interval's half-width and the seeds
    it would take to reach TARGET_HALF_WIDTH; the final reward beside it."""
    ra, rb = LONG_ARMS[a], LONG_ARMS[b]
    d = (final_pass(study, ra) - final_pass(study, rb)).dropna()
    e = difference(study, final_pass, ra, rb, "final pass@1", "diff", sign, measure=pair("final pass@1", a, b))
    reward = difference(study, final_reward, ra, rb, "final reward", "diff", sign)
    return Result(_runs_found(study) + powered(d) + headline_check(study, HEADLINE_FIGURES[11]), e, (reward,))


def _long_replay(study: Study) -> Result:
    """Claim 4 at the long horizon under a bf16 rollout engine (figure 11)."""
    return _long_claim(study, "grpo", "grpo_r2", -1)


def _long_efficiency(study: Study) -> Result:
    """Claim 2 at the long horizon under a bf16 rollout engine (figure 11)."""
    return _long_claim(study, "gspo", "grpo_r2", +1)


def _readings(study: Study, r, upto: int) -> dict[str, float]:
    """The instrument's means over the BEFORE steps up to step `upto` of one run, and R2's share of Var ℓ over
    them, pooled (and as the mean of its per-step ratios)."""
    out = {}
    for name, metric in READINGS.items():
        f = study.values(metric, r.run)
        f = f[(f.seed == r.seed) & (f.step <= upto) & (f.step > upto - BEFORE)]
        out[name] = float(f.value.mean()) if len(f) else math.nan
    kept = pooled(study, f"{ROUTE}/pol_var", f"{ROUTE}/total_var", r.run_id, (upto - BEFORE, upto))
    out[R2_SHARE] = 1 - kept
    f = study.values(f"{ROUTE}/r2_removed_share", r.run)
    f = f[(f.seed == r.seed) & (f.step <= upto) & (f.step > upto - BEFORE)]
    out[f"{R2_SHARE}, mean of per-step ratios"] = float(f.value.mean()) if len(f) else math.nan
    return out


def _curves(study: Study, r) -> tuple[np.ndarray, ...]:
    """(reward steps, reward, pass@1 steps, pass@1) of one run, in step order."""
    rw, p1 = (study.values(m, r.run) for m in (REWARD, PASS1))
    rw, p1 = rw[rw.seed == r.seed].sort_values("step"), p1[p1.seed == r.seed].sort_values("step")
    return rw.step.to_numpy(), rw.value.to_numpy(), p1.step.to_numpy(), p1.value.to_numpy()


def collapses(study: Study, runs: dict[str, str], version: int) -> dict[str, list[tuple[object, object, int]]]:
    """Per arm (key of `runs`): (tracked run, its Collapse under rule `version`, its last step) of every run found."""
    from analysis.collapse import collapse

    out = {}
    for arm, name in runs.items():
        found = []
        for r in (r for r in study.runs if r.run == name):
            curves = _curves(study, r)
            last = int(curves[0].max()) if len(curves[0]) else 0
            found.append((r, collapse(*curves, version=version), last))
        if found:
            out[arm] = found
    return out


def _when(found) -> str:
    down = [(r.seed, c) for r, c, _ in found if c.collapsed]
    return ", ".join(f"seed {seed} at step {c.step} ({c.rule})" for seed, c in down)


def _history(figures: dict[int, Study], now_verdict: Verdict) -> tuple[str, Estimate | None]:
    """The collapse rule's versions on this archive: what each version but the one in force flags in `figures`'
    runs (figure 11's, and figure 12's beside them), and what the row's primary count reads under it."""
    from analysis.collapse import RULES, VERSION

    texts, first = [], None
    now = RULES[VERSION]
    for v, rule in sorted(RULES.items()):
        if v == VERSION:
            continue
        flagged, ends, seeds = [], [], set()
        for fig, s in sorted(figures.items()):
            for found in collapses(s, {r.run: r.run for r in s.runs}, v).values():
                for r, c, last in found:
                    if c.collapsed:
                        flagged.append(f"figure {fig} {label(r.run)} seed {r.seed} at step {c.step}")
                        ends.append(last - c.step)
                        seeds.add(r.seed)
        grpo = collapses(figures[11], {"grpo": LONG_ARMS["grpo"]}, v).get("grpo", [])
        text = f"version {v} ({rule.what}; {rule.since}; in force when this row was introduced) flags " + (
            f"{len(flagged)} runs: {', '.join(flagged)}" if flagged else "no run"
        )
        if flagged:
            text += (
                f" — all at seed{'s' * (len(seeds) > 1)} {', '.join(map(str, sorted(seeds)))}, each within "
                f"{max(ends)} steps of its run's end"
            )
        if grpo and first is None:
            k = sum(c.collapsed for _, c, _ in grpo)
            first = count(f"{label(LONG_ARMS['grpo'])}, under collapse rule version {v}", k, len(grpo))
            same = "the same verdict as" if first.verdict == now_verdict else "against"
            text += f"; under it the primary count reads {first.value()} → {first.verdict}, {same} version {VERSION}'s"
        texts.append(text)
    head = (
        f"collapse rule: version {VERSION} in force ({now.what}; {now.since}), a revision made after the runs it "
        f"judges had been seen, because {now.why} (analysis/collapse.py)"
    )
    return "\n".join([head, *texts]), first


def _collapse(study: Study, others: dict[int, Study] | None = None) -> Result:
    """Runs collapsed per arm (analysis/collapse.py's rule in force, exact 95 % interval), at which step, and the
    instrument's readings over the BEFORE steps before it (over each arm's last BEFORE steps when none did).
    Judged on GRPO without replay's count (`collapse_verdict`); beside it every other arm's count, Fisher's exact
    test against GRPO + R2, the runs per arm that test would need, and the rule's history (`_history`)."""
    found = collapses(study, LONG_ARMS, _version())
    if "grpo" not in found:
        return Result(_runs_found(study) + "none of GRPO without replay")
    texts, shares = [], {}
    for arm, runs in found.items():
        k, n = sum(c.collapsed for _, c, _ in runs), len(runs)
        read = [_readings(study, r, c.step if c.collapsed else last) for r, c, last in runs]
        mean = {key: np.nanmean([x[key] for x in read]) for key in read[0]}
        when = _when(runs)
        shares[arm] = count(
            label(LONG_ARMS[arm]),
            k,
            n,
            COLLAPSED if arm == "grpo" else "",
            judged=arm == "grpo",
            note=f" ({when})" if when else "",
        )
        ratio = f"{R2_SHARE}, mean of per-step ratios"
        shown = ", ".join(f"{key} {v:.3g}" for key, v in mean.items() if key != ratio)
        texts.append(
            f"{label(LONG_ARMS[arm])}, {'before it' if when else f'last {BEFORE} steps'}: {shown} "
            f"({mean[ratio]:.3g} as the mean of per-step ratios)"
        )
    horizon = max(last for runs in found.values() for _, _, last in runs)
    secondary = [e for arm, e in shares.items() if arm != "grpo"]
    if "grpo_r2" in shares:
        k1, n1, k0, n0 = shares["grpo"].k, shares["grpo"].n, shares["grpo_r2"].k, shares["grpo_r2"].n
        p = fisher_greater(k1, n1, k0, n0)
        secondary.append(
            Estimate(
                f"Fisher's exact one-sided test, {SHORT['grpo']} ({k1} of {n1}) vs {SHORT['grpo_r2']} ({k0} of {n0})",
                p,
                math.nan,
                math.nan,
                n1 + n0,
                fisher_verdict(k1, n1, k0, n0),
                unit="p = ",
            )
        )
    history, earlier = _history({11: study, **(others or {})}, shares["grpo"].verdict)
    k_r2 = shares["grpo_r2"].k if "grpo_r2" in shares else 0
    history += (
        f"\ncount rule: version 2 in force (`collapse_verdict`: the exact interval against {COLLAPSE_RATE:.0%}); "
        f"version 1 (`collapse_verdict_v1`: none collapsed → not reproduced), in force until 2026-12-04 and replaced "
        f"after the archive had been seen, reads this row as "
        f"**{collapse_verdict_v1(shares['grpo'].k, shares['grpo'].n, k_r2)}**"
    )
    if earlier is not None:
        secondary.append(earlier)
    need = seeds_for_power(COLLAPSE_RATE, 0.0, POWER, ALPHA)
    context = "\n".join(
        [
            _runs_found(study) + f"{horizon} steps; Fisher's test would need {need} runs per arm for {POWER:.0%} "
            f"power to see a collapse rate of {COLLAPSE_RATE:.0%} against 0 %",
            f"readings (means over seeds; {R2_SHARE} pooled over the steps, 1 − Σ Var ℓ^pol / Σ Var ℓ): "
            + "; ".join(texts),
            history,
        ]
    )
    return Result(context, shares["grpo"], tuple(secondary))


def _version() -> int:
    from analysis.collapse import VERSION

    return VERSION


CLAIMS = [
    Claim(
        text="RL improves on the cold start (precondition for the claims below)",
        paper="steady gains with training compute (Fig. 1)",
        primary=GAIN,
        runs=("gspo",),
        measure=_improves,
        shown=1,
    ),
    Claim(
        text="GSPO trains more efficiently than GRPO + R2 (Fig. 1)",
        paper="higher reward and benchmark scores at equal training compute",
        primary=pair("final pass@1", "gspo", "grpo_r2"),
        runs=("gspo", "grpo_r2"),
        measure=_efficiency,
        shown=1,
    ),
    Claim(
        text="GSPO clips about 100× more tokens than GRPO (Fig. 2)",
        paper=f"{PAPER_CLIP_FRAC['gspo']} vs {PAPER_CLIP_FRAC['grpo_r2']}",
        primary=pair("clip fraction", "gspo", "grpo_r2"),
        runs=("gspo", "grpo_r2"),
        measure=_clipping,
        shown=2,
    ),
    Claim(
        text="GRPO without Routing Replay fails to converge normally on MoE (Fig. 3)",
        paper="lower reward and scores than GRPO + R2",
        primary=pair("final pass@1", "grpo", "grpo_r2"),
        runs=("grpo", "grpo_r2"),
        measure=_replay,
        shown=3,
    ),
    Claim(
        text="Expert volatility: ~10% of activated experts change per update (§5.3; per update, on figure 11's runs)",
        paper=f"~{PAPER_VOLATILITY} (48-layer Qwen3-30B-A3B, one update)",
        primary=VOLATILITY,
        runs=(),
        measure=_volatility,
        figure=11,
    ),
    Claim(
        text="GSPO tolerates precision mismatch: rollout log-probs need no recompute (§5.4)",
        paper="no loss (no number reported)",
        primary=BYPASS,
        runs=(),
        measure=_precision,
        figure=6,
    ),
    Claim(
        text="Where routing moves, GRPO without replay falls behind GSPO and GRPO + R2 (Fig. 8, ours)",
        paper="§5.3: GRPO without replay fails on MoE; replay or GSPO fixes it",
        primary=SWEEP,
        runs=(),
        measure=_sweep,
        figure=8,
    ),
    Claim(
        text=(
            "At the policy lag where routing's share of the ratio's variance is largest (Fig. 9, ours), "
            "GRPO without replay falls behind GRPO + R2 (claim 4 at the regime)"
        ),
        paper="§5.3; Qwen arXiv 2512.01374: replay needed as staleness grows",
        primary=pair("final pass@1 at the regime lag", "grpo", "grpo_r2"),
        runs=(),
        measure=_lag,
        figure=9,
    ),
    Claim(
        text="GSPO trains more efficiently than GRPO + R2 at that regime (claim 2 at the regime, Fig. 9)",
        paper="higher reward and scores (Fig. 1, at lag 0)",
        primary=pair("final pass@1 at the regime lag", "gspo", "grpo_r2"),
        runs=(),
        measure=_lag_efficiency,
        figure=9,
    ),
    Claim(
        text="How much of the importance ratio is routing (the instrument, Fig. 9, ours)",
        paper="R2 removes the routing term (§5.3); no number reported",
        primary="a reading, no verdict: routing's share of Var ℓ per lag, pooled over steps",
        runs=(),
        measure=_instrument,
        figure=9,
    ),
    Claim(
        text=(
            "§5.4 beside the train–inference corrections (Fig. 10, ours): "
            "rollout log-probs are no worse than recomputed π_old, with token TIS, sequence MIS or IcePop"
        ),
        paper="no loss (§5.4); TRL, verl, slime correct by default",
        primary=BYPASS,
        runs=(),
        measure=_correction_precision,
        figure=10,
    ),
    Claim(
        text="R3 ahead of R2 under a bf16 rollout engine, with and without a correction on R2 (Fig. 10, ours)",
        paper="R3 paper (arXiv 2510.11370): R3 fixes the mismatch R2 leaves",
        primary=R3_R2,
        runs=(),
        measure=_correction_replay,
        figure=10,
    ),
    Claim(
        text=(
            "GRPO without replay collapses over ≥ 300 steps under a bf16 rollout engine, GRPO + R2 does not "
            "(Fig. 11, ours; collapse rule: analysis/collapse.py)"
        ),
        paper="R3 paper: 3 of 3 GRPO baselines collapsed (k3 ≈ 1.5e-3); IcePop, Miles, VeXact: after ≈ 150–320 steps",
        primary=COLLAPSED,
        runs=(),
        measure=_collapse,
        figure=11,
        also=(12,),
    ),
    Claim(
        text="GRPO without Routing Replay falls behind GRPO + R2 at the long horizon (claim 4, Fig. 11)",
        paper="lower reward and scores than GRPO + R2 (Fig. 3)",
        primary=pair("final pass@1", "grpo", "grpo_r2"),
        runs=(),
        measure=_long_replay,
        figure=11,
    ),
    Claim(
        text="GSPO trains more efficiently than GRPO + R2 at the long horizon (claim 2, Fig. 11)",
        paper="higher reward and scores (Fig. 1)",
        primary=pair("final pass@1", "gspo", "grpo_r2"),
        runs=(),
        measure=_long_efficiency,
        figure=11,
    ),
]
