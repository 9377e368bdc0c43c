"""`results/<scale>/REPORT.md`: each claim of the GSPO paper, the paper's number, ours, and a verdict.

    python -m analysis.report --scale cpu [--seeds 1,2,3] [--figure N] [key=value ...]

Everything is computed from the tracked MLflow runs (found as in analysis/figures.py); a claim whose runs are
missing or unfinished says "not run"; with no tracked run at all it stops (an error) and leaves REPORT.md as it is.
Each claim declares **one primary measure** (`Claim.primary`, printed in the report's first table); its row's
verdict is that measure's verdict alone (`Result.verdict`), and `results` refuses a row judged on anything else.
The other measures of a row are shown beside it, each with its own verdict, never combined into the headline.
How each number and verdict is computed is `METHOD` (printed under the tables); the rules are `verdict` (an
interval) and `collapse_verdict` (a count, with its exact binomial interval, analysis/stats.py), and
`tests/test_report_rules.py` builds data that must pass and must fail each rule. The REPORT.md is also logged as
an artifact of a run named `report`.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from dataclasses import dataclass
from datetime import datetime, timezone
from enum import StrEnum
from pathlib import Path

import numpy as np
import pandas as pd

from analysis.common import CONFIDENCE, PASS1, REWARD, Study, label, load, log_outputs, mean_ci
from analysis.figures import PAPER_CLIP_FRAC, PAPER_VOLATILITY, depth, lag_table, sweep_table
from analysis.stats import clopper_pearson, fisher_greater, pooled_ratio, seeds_for_power
from gspo_study.archive import draw_notice
from gspo_study.config import ConfigError
from gspo_study.run import run_key, sqlite_path
from gspo_study.study import figure_configs, parse_seeds, run_config
from gspo_study.tracking import git_commit

MARGIN = 0.05  # δ: the smallest gap in pass@1 or reward a difference row tests for; the no-harm rows' margin
WITHIN = 3.0  # a magnitude claim ("~value") reproduces when our interval lies within [value/3, value·3]
COLLAPSE_RATE = 0.5  # the collapse rate a count row tests for: at least half the runs (R3 paper: 3 of 3)
ALPHA = 1 - CONFIDENCE  # Fisher's exact test's level
POWER = 0.8  # the power a count row's "runs per arm it would take" is sized for
CLIP, VOL = "policy/clip_frac/token", "moe/routing_volatility/overall"
VOL_UPDATE = "moe/routing_volatility/per_update/overall"  # the paper's unit: one optimizer update
MOVING = 0.01  # routing volatility per step from which a sweep cell counts as "routing moves" (figure 8)
ROUTE = "moe/route"

METHOD = f"""Per-seed measures:
- final pass@1: `eval/pass@1` at the run's last evaluation (its last step);
- final reward: `rollout/reward/mean` averaged over the last evaluation interval, the steps after
  `train.steps − eval.every` (all steps when eval.every is 0);
- training averages (clip fraction, routing volatility): the metric averaged over every logged step;
- gain over the cold start: final pass@1 minus `eval/pass@1` at step 0 (the cold-start model, same seed);
- a ratio of variances logged per step (`{ROUTE}/var_share` = Var ℓ^route / Var ℓ, `{ROUTE}/r2_removed_share` =
  1 − Var ℓ^pol / Var ℓ) is read **pooled** over a run's steps, Σ Var ℓ^route / Σ Var ℓ and 1 − Σ Var ℓ^pol /
  Σ Var ℓ, then averaged over seeds; the mean of per-step ratios (which weighs a step of tiny Var ℓ as much as
  one of large, and is negative in steps where routing anti-correlates with the policy part) is shown beside it
  only in parentheses.
Differences are paired by seed (every run of a seed starts from the same cold start and sees the same prompts and
sampling streams): Δ_s = A_s − B_s, shown as mean [95 % Student-t interval] ±half-width (n seeds).

One primary measure per claim: each claim declares the one measure its verdict is judged on (the first table's
last column; held-out final pass@1 unless the claim is about something else, such as clipping or volatility).
The row's verdict is that measure's alone. Secondary measures (final reward beside final pass@1, the other
arms, other lags or corrections) are listed under the row, each with its own verdict; none enters the headline.

Verdicts of an interval (`verdict`; δ = {MARGIN} pass@1 or reward, the smallest gap a row tests for):
- a difference claim (A − B has the paper's sign): "reproduces" if the interval excludes 0 on the paper's side;
  "not reproduced" if it excludes every gap ≥ δ on the paper's side (its paper-side bound is below δ, which
  includes an interval wholly on the other side); else "underpowered" if its half-width exceeds δ (the row
  cannot see the gap it tests for), else "inconclusive". Where the paper gives a number (claim 3's clip
  fractions), δ is the paper's own difference; a factor ("about 100× more") is shown, not tested;
- a "no harm" claim (§5.4: A is not worse than B; δ is the non-inferiority margin): "consistent" if the
  interval's lower bound is above −δ, "not reproduced" if its upper bound is below −δ, else "underpowered"
  if its half-width exceeds δ, else "inconclusive";
- a magnitude claim (the paper's ~value): "reproduces" if our interval lies within [value/{WITHIN:g},
  value·{WITHIN:g}], "not reproduced" if it lies wholly outside (the text says by which factor), else
  "inconclusive";
- fewer than 2 seeds: no interval, "inconclusive".
Verdict of a count, "k of n runs collapsed [exact 95 % interval]" (`collapse_verdict`; the Clopper–Pearson
interval of the rate): the row tests for a collapse rate of at least {COLLAPSE_RATE:.0%}. "not reproduced" if the
interval's upper bound is below {COLLAPSE_RATE:.0%} (it excludes that rate), "reproduces" if at least
{COLLAPSE_RATE:.0%} of the runs collapsed, else "underpowered" (fewer did, and the interval still reaches
{COLLAPSE_RATE:.0%}: 0 of 4 allows a rate up to {clopper_pearson(0, 4)[1]:.0%}). Beside it: Fisher's exact
one-sided test of the arm against GRPO + R2 ("reproduces" at p ≤ {ALPHA:.2g}; "underpowered" when not even n of n
against 0 of n could reach it, else "inconclusive"), and the runs per arm at which that test has {POWER:.0%} power
to see {COLLAPSE_RATE:.0%} against 0 %.
Multiplicity: a row that shows several comparisons says how many; only its primary one is judged, and none
is corrected for multiplicity (at n = 3, one uncorrected interval in twenty excludes 0 by chance).
Claim 5 is judged per optimizer update (`{VOL_UPDATE}`, the paper's unit), on figure 11's runs
(the ones that log it).
Claim 6 is measured on figure 6's runs: at the CPU scale figure 10's 20-step bf16 runs, also claim 11's
uncorrected pair.
Claim 7 (figure 8): the unit of replication is the seed (the cells are fixed): per seed, Δ = A − GRPO (no
replay) averaged over the cells where GRPO without replay moves at least {MOVING:.0%} of its activated experts per
step, then the interval over seeds. A cell where every algorithm collapses (each one's mean final pass@1 more
than `analysis.collapse.PASS_MARGIN` below its cold start) is listed apart, not pooled. "inconclusive" when no
cell moves that much. A partly trained sweep is reported as such (the count of its runs is shown).
Claims 8–9 (figure 9) judge claims 4 and 2 at the sweep's regime: among the lags where GSPO still learns (mean
final pass@1 above its cold start), the one where routing's share of the log-ratio variance of GRPO without
replay (`{ROUTE}/var_share`, pooled over a run's steps, mean over seeds) is largest — an argmax over the lags'
means, whose intervals overlap; Δ is paired by seed at that lag and shown at lag 0 too. Claim 10 is a reading
("measured").
Claims 11–12 (figure 10, bf16 rollout engine): the bypass against recomputed π_old with no correction and
with token TIS, sequence MIS and IcePop ("no harm", GSPO and GRPO + R2), and GRPO + R3 against GRPO + R2 with
each ("difference", R3 ahead); each row is judged on its uncorrected pair, and lists which correction, if any,
gives another verdict.
Claims 13–15 (figure 11: 300-step runs under the HF engine's bf16 copy, each seed from its own cold start)
count collapsed runs per arm (all five) by the rule of analysis/collapse.py, at its version in force, with the
step and the instrument's readings over the 25 steps before it, and the rule's history (what version 1 flags);
claims 4 and 2 are judged on final pass@1 paired by seed; where the half-width exceeds δ, the seeds the
measured SD would need.
`--figure N` writes only the claims measured on figure N's sweep, from its runs alone, to REPORT-figure-N.md.
"""


# ------------------------------------------------------------------------------------------------ measures
def final_pass(study: Study, run: str) -> pd.Series:
    f = study.values(PASS1, run).sort_values("step")
    return f.groupby("seed").value.last()


def final_reward(study: Study, run: str) -> pd.Series:
    out = {}
    for r in (r for r in study.runs if r.run == run):
        t = r.cfg.train
        start = t.steps - r.cfg.eval.every if r.cfg.eval.every > 0 else 0
        f = study.values(REWARD, run)
        out[r.seed] = f[(f.seed == r.seed) & (f.step > start)].value.mean()
    return pd.Series(out, dtype=float)


def gain(study: Study, run: str) -> pd.Series:
    f = study.values(PASS1, run).sort_values("step")
    return f.groupby("seed").value.last() - f[f.step == 0].groupby("seed").value.first()


def training_mean(metric: str):
    def measure(study: Study, run: str) -> pd.Series:
        return study.values(metric, run).groupby("seed").value.mean()

    return measure


def pooled(study: Study, num: str, den: str, run_id: str, steps: tuple[int, int] | None = None) -> float:
    """Σ `num` / Σ `den` over one run's logged steps (those in (lo, hi] when `steps` is given)."""
    f = study.frame[(study.frame.run_id == run_id) & study.frame.metric.isin((num, den))]
    if steps is not None:
        f = f[(f.step > steps[0]) & (f.step <= steps[1])]
    w = f.pivot_table(index="step", columns="metric", values="value")
    if num not in w or den not in w:
        return math.nan
    return pooled_ratio(w[num], w[den])


# ------------------------------------------------------------------------------------------------ verdicts
class Verdict(StrEnum):
    REPRODUCES = "reproduces"
    NOT_REPRODUCED = "not reproduced"
    UNDERPOWERED = "underpowered"
    INCONCLUSIVE = "inconclusive"
    CONSISTENT = "consistent"
    MEASURED = "measured"
    NOT_RUN = "not run"


def verdict(kind: str, lo: float, hi: float, sign: int = 1, paper: float = math.nan, effect: float = MARGIN) -> Verdict:
    """`kind`: "diff" (A − B has sign `sign`, the gap tested for is `effect`), "no_harm" (A is not worse than B
    by more than `effect`) or "magnitude" (the interval against the paper's value within a factor WITHIN)."""
    if math.isnan(lo):
        return Verdict.INCONCLUSIVE
    half = (hi - lo) / 2
    if kind == "no_harm":
        if lo > -effect:
            return Verdict.CONSISTENT
        if hi < -effect:
            return Verdict.NOT_REPRODUCED
        return Verdict.UNDERPOWERED if half > effect else Verdict.INCONCLUSIVE
    if kind == "magnitude":
        low, high = paper / WITHIN, paper * WITHIN
        if low <= lo and hi <= high:
            return Verdict.REPRODUCES
        return Verdict.NOT_REPRODUCED if hi < low or lo > high else Verdict.INCONCLUSIVE
    lo, hi = sorted((sign * lo, sign * hi))
    if lo > 0:
        return Verdict.REPRODUCES
    if hi < effect:
        return Verdict.NOT_REPRODUCED
    return Verdict.UNDERPOWERED if half > effect else Verdict.INCONCLUSIVE


def collapse_verdict(k: int, n: int) -> Verdict:
    """k of n runs collapsed, against a rate of COLLAPSE_RATE: "not reproduced" when the exact interval's upper
    bound is below it, "reproduces" when at least that share collapsed, else "underpowered"."""
    if n < 1:
        return Verdict.INCONCLUSIVE
    if clopper_pearson(k, n)[1] < COLLAPSE_RATE:
        return Verdict.NOT_REPRODUCED
    return Verdict.REPRODUCES if k >= COLLAPSE_RATE * n else Verdict.UNDERPOWERED


def collapse_verdict_v1(k: int, n: int, k_r2: int) -> Verdict:
    """The count rule before 2026-12-04 (kept to show what it reads, REPORT row 13): "not reproduced" when no run of
    GRPO without replay collapsed, "reproduces" when at least half did and no GRPO + R2 run, else "inconclusive".
    Replaced after the archive had been seen: 0 of 4 allows a rate up to 60 %, so its "not reproduced" claimed more
    than an interval row's does."""
    if k == 0:
        return Verdict.NOT_REPRODUCED
    return Verdict.REPRODUCES if 2 * k >= n and k_r2 == 0 else Verdict.INCONCLUSIVE


def fisher_verdict(k1: int, n1: int, k0: int, n0: int) -> Verdict:
    """Fisher's one-sided test of arm 1 collapsing more than arm 0: "reproduces" at p ≤ ALPHA, "underpowered" when
    even n1 of n1 against 0 of n0 could not reach it, else "inconclusive"."""
    if fisher_greater(k1, n1, k0, n0) <= ALPHA:
        return Verdict.REPRODUCES
    return Verdict.UNDERPOWERED if fisher_greater(n1, n1, 0, n0) > ALPHA else Verdict.INCONCLUSIVE


def factor(lo: float, hi: float, paper: float) -> str:
    """How far a magnitude interval lies from the paper's value, as "≈ N× lower/higher" ("" when it overlaps)."""
    if hi < paper / WITHIN:
        return f"≈ {paper / ((lo + hi) / 2):.3g}× lower at this scale"
    if lo > paper * WITHIN:
        return f"≈ {(lo + hi) / 2 / paper:.3g}× higher at this scale"
    return ""


def _fmt(mean: float, lo: float, hi: float) -> str:
    return f"{mean:.4g}" + ("" if math.isnan(lo) else f" [{lo:.4g}, {hi:.4g}]")


def _percent(x: float) -> str:
    x *= 100
    return f"{x:.0f}" if x >= 10 or x == 0 else f"{x:.2g}"


@dataclass(frozen=True)
class Estimate:
    """One quantity of a claim: its name, mean, 95 % interval over n (seeds), and verdict; `measure` the declared
    measure it is (a row's primary estimate must be its claim's `primary`); `sides` the two arms' own levels for
    a difference; `k` for a count (k of n, [lo, hi] its exact binomial interval); `note` text shown after it.
    Rendered once, by `text` (in full) and `value` (the number alone)."""

    name: str
    mean: float
    lo: float
    hi: float
    n: int
    verdict: Verdict
    sides: str = ""
    unit: str = "Δ "  # "" for a level rather than a difference
    measure: str = ""
    k: int | None = None
    paper: float = math.nan  # the paper's value (magnitude claims)
    note: str = ""
    equivalent: bool | None = None  # a difference's equivalence reading: both one-sided 95 % bounds inside ±δ
    # (experiments/headline/plan.yaml: a reading beside the verdict, never the verdict); None where not read

    @property
    def half_width(self) -> float:
        return (self.hi - self.lo) / 2

    def value(self) -> str:
        """The number alone: "Δ −0.0162 ±0.148 (n=3)", or "0 of 4 [0, 60 %]" for a count."""
        if self.k is not None:
            return f"{self.k} of {self.n} [{_percent(self.lo)}, {_percent(self.hi)} %]"
        half = "" if math.isnan(self.lo) else f" ±{self.half_width:.3g}"
        far = self.note if math.isfinite(self.paper) else ""  # a magnitude: how far from the paper's value
        return f"{self.unit}{self.mean:.4g}{half} (n={self.n}){far}"

    def text(self) -> str:
        if self.k is not None:
            body = f"{self.k} of {self.n} collapsed [{_percent(self.lo)}, {_percent(self.hi)} %]"
        else:
            half = "" if math.isnan(self.lo) else f" ±{self.half_width:.3g}"
            sides = f"{self.sides}; " if self.sides else ""
            body = f"{sides}{self.unit}{_fmt(self.mean, self.lo, self.hi)}{half} (n={self.n})"
            if self.equivalent:
                body += f", equivalent within ±{MARGIN} (both one-sided 95 % bounds inside)"
        return f"{self.name}: {body}" + (f"{self.note}" if self.note else "")


def estimate(
    name: str,
    values,
    kind: str = "diff",
    sign: int = 1,
    effect: float = MARGIN,
    sides: str = "",
    paper: float = math.nan,
    unit: str = "Δ ",
    measure: str = "",
) -> Estimate:
    from analysis.stats import equivalent, one_sided_bounds

    mean, lo, hi, n = mean_ci(values)
    v = verdict(kind, lo, hi, sign, paper, effect)
    same = None
    if kind == "diff" and n >= 2 and not math.isfinite(paper):
        _, lo1, hi1, _ = one_sided_bounds(values)
        same = equivalent(lo1, hi1, effect)
    return Estimate(name, mean, lo, hi, n, v, sides, unit, measure, paper=paper, equivalent=same)


def count(name: str, k: int, n: int, measure: str = "", judged: bool = True, note: str = "") -> Estimate:
    """k of n runs collapsed, with its exact interval; judged by `collapse_verdict`, or a reading ("measured")."""
    lo, hi = clopper_pearson(k, n)
    v = collapse_verdict(k, n) if judged else Verdict.MEASURED
    return Estimate(name, k / n, lo, hi, n, v, unit="", measure=measure, k=k, note=note)


def difference(
    study: Study, per_seed, a: str, b: str, name: str, kind: str, sign: int, effect: float = MARGIN, measure: str = ""
) -> Estimate:
    """`name`: A − B paired by seed, with both sides' levels."""
    va, vb = per_seed(study, a), per_seed(study, b)
    sides = f"{label(a)} {_fmt(*mean_ci(va)[:3])} vs {label(b)} {_fmt(*mean_ci(vb)[:3])}"
    return estimate(name, (va - vb).dropna(), kind, sign, effect, sides, measure=measure)


@dataclass(frozen=True)
class Result:
    """A claim's result. Its verdict is its primary estimate's, by construction (`otherwise` only when it has
    none: not run, a reading, no data to judge); `secondary` estimates are shown beside it with their own
    verdicts; `context` says what the row is measured on and what it reads beside its measures; `glance` is the
    first table's cell of a row without a primary estimate."""

    context: str = ""
    primary: Estimate | None = None
    secondary: tuple[Estimate, ...] = ()
    otherwise: Verdict = Verdict.INCONCLUSIVE
    glance: str = ""

    @property
    def verdict(self) -> Verdict:
        return self.otherwise if self.primary is None else self.primary.verdict

    @property
    def estimates(self) -> tuple[Estimate, ...]:
        return ((self.primary,) if self.primary else ()) + self.secondary


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
        context=_powered(d) + headline_check(study, HEADLINE_FIGURES[1]),
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
TARGET_HALF_WIDTH = MARGIN  # the gap in final pass@1 the long-horizon comparison is sized to see
BEFORE = 25  # steps of the instrument's readings before a collapse (or the run's last steps without one)
READINGS = {
    "k3": "mismatch/k3",
    "F(2)": "mismatch/f_tau_2",
    "routing gap": "moe/train_infer_routing/tokens_any_changed",
    "grad norm": "train/grad_norm",
}
R2_SHARE = "R2 share of Var ℓ"  # 1 − Σ Var ℓ^pol / Σ Var ℓ over the same steps (pooled); its per-step mean beside
COLLAPSED = "runs collapsed, GRPO (no replay)"


def seeds_needed(sd: float, half_width: float = TARGET_HALF_WIDTH) -> int | None:
    """The fewest seeds whose 95 % t half-width t_{n−1} · sd / √n is at most `half_width` (None: sd unknown)."""
    from scipy import stats

    if not math.isfinite(sd):
        return None
    n = 2
    while stats.t.ppf(0.5 + CONFIDENCE / 2, n - 1) * sd / math.sqrt(n) > half_width and n < 10_000:
        n += 1
    return n


def _powered(d: pd.Series) -> str:
    """Δ's half-width against TARGET_HALF_WIDTH, and the seeds the measured SD says it would take."""
    mean, lo, hi, n = mean_ci(d)
    if math.isnan(lo):
        return f"half-width unknown (n={n})"
    half = (hi - lo) / 2
    if half <= TARGET_HALF_WIDTH:
        return f"half-width {half:.3f} ≤ {TARGET_HALF_WIDTH}"
    need = seeds_needed(float(d.std(ddof=1)))
    return f"half-width {half:.3f} > {TARGET_HALF_WIDTH}; SD {d.std(ddof=1):.3f} needs {need} seeds"


def _long_claim(study: Study, a: str, b: str, sign: int) -> Result:
    """A − B final pass@1 paired by seed on figure 11's runs (judged), with the interval's half-width and the seeds
    it would take to reach TARGET_HALF_WIDTH; the final reward beside it."""
    ra, rb = LONG_ARMS[a], LONG_ARMS[b]
    d = (final_pass(study, ra) - final_pass(study, rb)).dropna()
    e = difference(study, final_pass, ra, rb, "final pass@1", "diff", sign, measure=pair("final pass@1", a, b))
    reward = difference(study, final_reward, ra, rb, "final reward", "diff", sign)
    return Result(_runs_found(study) + _powered(d) + headline_check(study, HEADLINE_FIGURES[11]), e, (reward,))


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


# ------------------------------------------------------------------------------------------------ report
def checked(c: Claim, r: Result) -> Result:
    """`r`, refused when its verdict would come from another measure than the claim's declared primary one."""
    if r.primary is not None and r.primary.measure != c.primary:
        raise ValueError(
            f"claim {CLAIMS.index(c) + 1 if c in CLAIMS else c.text!r} is judged on {r.primary.measure!r}; "
            f"allowed: its primary measure {c.primary!r} alone"
        )
    return r


def results(study: Study, sweeps: dict[int, Study], claims=None) -> list[Result]:
    """Each claim's Result (`claims`: all); "not run" where a run or seed is missing."""
    absent = {run for run, _, _ in study.missing}
    out = []
    for c in CLAIMS if claims is None else claims:
        if c.figure is not None:
            sweep = sweeps[c.figure]
            if not sweep.runs:
                out.append(Result(f"missing: all runs of figure {c.figure}", otherwise=Verdict.NOT_RUN))
                continue
            others = {f: sweeps[f] for f in c.also if f in sweeps}
            out.append(checked(c, c.measure(sweep, others) if c.also else c.measure(sweep)))
            continue
        gone = [r for r in c.runs if r in absent]
        if gone:
            seeds = sorted({s for r, s, _ in study.missing if r in gone})
            out.append(Result(f"missing: {', '.join(gone)} (seeds {seeds})", otherwise=Verdict.NOT_RUN))
            continue
        out.append(checked(c, c.measure(study)))
    return out


@dataclass(frozen=True)
class On:
    """The runs a row is measured on: the figure they are drawn in, their run files, depths, steps and seeds."""

    figure: int | None
    runs: tuple[str, ...]
    layers: tuple[int, ...]
    steps: tuple[int, ...]
    seeds: tuple[int, ...]

    def text(self) -> str:
        if not self.runs:
            return "no tracked run"
        join = lambda xs: ", ".join(map(str, xs))  # noqa: E731
        where = f"figure {self.figure}'s runs" if self.figure else "runs"
        return (
            f"{where} ({', '.join(self.runs)}: {join(self.layers)}-layer model, {join(self.steps)} steps, "
            f"seeds {join(self.seeds)})"
        )


def claim_on(c: Claim, study: Study, sweeps: dict[int, Study]) -> On:
    """Which runs claim `c` is measured on (a sweep's every run, or the claim's own runs), from their configs."""
    if c.figure is not None:
        rs = sweeps[c.figure].runs if c.figure in sweeps else []
    else:
        rs = [r for r in study.runs if r.run in c.runs]
    tidy = lambda xs: tuple(sorted(set(xs)))  # noqa: E731
    return On(
        c.drawn_in,
        tuple(dict.fromkeys(r.run for r in rs)),
        tidy(depth(r.cfg) for r in rs),
        tidy(r.cfg.train.steps for r in rs),
        tidy(r.seed for r in rs),
    )


def _num(x: float) -> float | None:
    return None if x is None or not math.isfinite(x) else float(x)


def _record(e: Estimate, role: str) -> dict:
    return dict(
        role=role,
        measure=e.measure or None,
        name=e.name,
        mean=_num(e.mean),
        lower=_num(e.lo),
        upper=_num(e.hi),
        half_width=None if e.k is not None else _num(e.half_width),
        n=e.n,
        k=e.k,
        paper=_num(e.paper),
        value=e.value(),
        verdict=str(e.verdict),
        equivalent=e.equivalent,
    )


def as_records(claims, found: list[Result], on: list[On]) -> list[dict]:
    """REPORT.json: per claim its number, text, the figure and runs it is measured on, its declared primary
    measure, its verdict (the primary's) and its estimates as numbers, primary first (null where there is none)."""
    return [
        dict(
            claim=CLAIMS.index(c) + 1,
            text=c.text,
            paper=c.paper,
            figure=c.drawn_in,
            runs=o.text(),
            layers=list(o.layers),
            steps=list(o.steps),
            seeds=list(o.seeds),
            primary_measure=c.primary,
            verdict=str(r.verdict),
            glance=_glance(r),
            estimates=[_record(e, "primary" if e is r.primary else "secondary") for e in r.estimates],
        )
        for c, r, o in zip(claims, found, on)
    ]


def _glance(r: Result) -> str:
    return r.primary.value() if r.primary is not None else (r.glance or "—")


def _cell(x: str) -> str:
    return x.replace("|", "\\|")


def _details(n: int, c: Claim, r: Result, on: str) -> list[str]:
    lines = [f"### {n}. {c.text}", "", f"- paper: {c.paper}", f"- measured on: {on}"]
    if r.primary is not None:
        lines.append(f"- **primary** ({c.primary}): {r.primary.text()} → **{r.primary.verdict}** (the row's verdict)")
    else:
        lines.append(f"- verdict: **{r.verdict}** ({c.primary})")
    lines += [f"- secondary: {e.text()} → {e.verdict}" for e in r.secondary]
    lines += [f"- {line}" for line in r.context.split("\n") if line]
    return [*lines, ""]


def sections(text: str) -> dict[int, str]:
    """A rendered report's rows: claim number → its first table's line and its details section, joined."""
    glance = {int(m[1]): m[0] for m in re.finditer(r"^\| (\d+) \|.*$", text, re.M)}
    details = {int(m[1]): m[0] for m in re.finditer(r"^### (\d+)\. .*?(?=^### |^## |\Z)", text, re.M | re.S)}
    return {k: glance[k] + "\n" + details.get(k, "") for k in glance}


def verdict_of(line: str) -> str:
    """The verdict cell of a first-table line."""
    return re.split(r"(?<!\\)\|", line.strip().strip("|"))[4].strip()


def _shown_uri(uri: str) -> str:
    """A sqlite store under the repository (or the working directory) named relative to it, not by this machine's
    absolute path; any other URI as it is."""
    path = sqlite_path(uri)
    if path is None:
        return uri
    for root in (Path(__file__).resolve().parents[1], Path.cwd().resolve()):
        try:
            return f"sqlite:///{path.resolve().relative_to(root)}"
        except ValueError:
            continue
    return uri


def _seeds_line(seeds: list[int], per_figure: dict[int, list[int]]) -> str:
    own = [f"figure {f}: {', '.join(map(str, s))}" for f, s in sorted(per_figure.items()) if s != seeds]
    return ", ".join(map(str, seeds)) + (f" ({'; '.join(own)})" if own else "")


def render(
    study: Study,
    sweeps: dict[int, Study],
    scale: str,
    seeds: list[int],
    figure: int | None = None,
    found: list[Result] | None = None,
    per_figure: dict[int, list[int]] | None = None,
) -> str:
    runs = [*study.runs, *(r for sweep in sweeps.values() for r in sweep.runs)]
    commits = sorted({r.tags.get("git_commit", "unknown")[:12] for r in runs}) or ["(no runs)"]
    claims = CLAIMS if figure is None else [c for c in CLAIMS if c.figure == figure]
    found = results(study, sweeps, claims) if found is None else found
    title = f"# Reproduction report: scale `{scale}`" + (
        f", the claims measured on figure {figure}'s sweep" if figure else ""
    )
    lines = [
        title,
        "",
        f"- seeds: {_seeds_line(seeds, per_figure or {})}",
        f"- git commit(s) of the runs: {', '.join(commits)}; report drawn at {git_commit(short=True)}",
        f"- date: {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC",
        f"- runs: MLflow experiment `{study.experiment}` at `{_shown_uri(study.uri)}`",
        "",
        "Each row is judged on its primary measure alone (the last column, declared once per claim); the other "
        "measures are listed under the row's details, each with its own verdict.",
        "",
        "| # | claim (GSPO paper) | paper | ours: primary measure, mean ±95 % half-width (seeds) | verdict "
        "| primary measure (figure whose runs) |",
        "|---|---|---|---|---|---|",
    ]
    for c, r in zip(claims, found):
        fig = f" (figure {c.drawn_in})" if c.drawn_in else ""
        row = (c.text, c.paper, _glance(r), str(r.verdict), c.primary + fig)
        lines.append(f"| {CLAIMS.index(c) + 1} | " + " | ".join(_cell(x) for x in row) + " |")
    lines += ["", "## Each row in detail", ""]
    for c, r in zip(claims, found):
        lines += _details(CLAIMS.index(c) + 1, c, r, claim_on(c, study, sweeps).text())
    return "\n".join(lines) + "\n## How the numbers and verdicts are computed\n\n" + METHOD


def _frontier(scale: str, seeds: list[int] | None, overrides) -> tuple[str, dict, dict[int, Study]]:
    """The routing frontier's section and records (analysis/frontier.py) from the finished runs of figures 13 and
    14 (the pilot) and 15 (the decisive stage); ("", {}) where none has finished; and the studies it read."""
    from analysis.frontier import FIGURES, section

    studies, planned = {}, set()
    for f in FIGURES:
        own = seeds if seeds is not None else parse_seeds(None, scale, f)
        configs = figure_configs(f, scale, own, tuple(overrides))
        planned |= {run_key(c) for _, c in configs}  # a run shared by both figures (dose 0) is planned once
        studies[f] = load(configs)
    return (*section(studies, planned=len(planned)), studies)


def _mechanism(scale: str, seeds: list[int] | None, overrides, frontier: dict[int, Study]) -> tuple[str, dict]:
    """Axis R's section and records (analysis/mechanism.py) from figure 17's finished runs, its cause-of-death table
    joined by the frontier's collapsed runs; ("", {}) where none has finished."""
    from analysis import frontier as fr
    from analysis import mechanism

    own = seeds if seeds is not None else parse_seeds(None, scale, mechanism.FIGURE)
    study = load(figure_configs(mechanism.FIGURE, scale, own, tuple(overrides)))
    plan = fr.load_plan()
    dead = [(s, fr.outcomes(s, plan, decisive=True)) for s in frontier.values() if s.runs]
    return mechanism.section(study, frontier=dead)


def _dppo(scale: str, seeds: list[int] | None, overrides) -> tuple[str, dict]:
    """The DPPO arm's section and records (analysis/dppo.py) from figure 18's finished runs; ("", {}) before any
    DPPO run finished."""
    from analysis import dppo

    own = seeds if seeds is not None else parse_seeds(None, scale, dppo.FIGURE)
    return dppo.section(load(figure_configs(dppo.FIGURE, scale, own, tuple(overrides))))


def make_report(scale: str, seeds: list[int] | None, overrides=(), figure: int | None = None) -> Path:
    """REPORT.md and REPORT.json (every claim), or with `figure` REPORT-figure-N.md: only the claims measured on
    that figure's sweep, from its runs alone (and the runs of the figures those claims also read). `seeds` None:
    the scale's default seeds, and each figure's own for the claims measured on its sweep (`study.parse_seeds`)."""
    given = seeds
    seeds = parse_seeds(None, scale) if seeds is None else seeds
    claims = CLAIMS if figure is None else [c for c in CLAIMS if c.figure == figure]
    if not claims:
        raise ConfigError(
            f"bad figure {figure!r}; allowed: one whose sweep a claim is measured on "
            f"({', '.join(str(c.figure) for c in CLAIMS if c.figure is not None)})"
        )
    runs = list(dict.fromkeys(r for c in claims for r in c.runs))
    figs = {c.figure for c in claims if c.figure is not None} | {f for c in claims for f in c.also}
    per_figure = {f: given if given is not None else parse_seeds(None, scale, f) for f in figs}
    sweeps = {f: load(figure_configs(f, scale, per_figure[f], tuple(overrides))) for f in sorted(figs)}
    study = (
        load([(r, run_config(scale, r, s, tuple(overrides))) for r in runs for s in seeds]) if runs else sweeps[figure]
    )
    path = study.out_dir / ("REPORT.md" if figure is None else f"REPORT-figure-{figure}.md")
    if not study.runs and not any(s.runs for s in sweeps.values()):  # e.g. a fresh clone: no store shipped
        raise ConfigError(
            f"no tracked runs of scale {scale!r} (seeds {', '.join(map(str, seeds))}) in {study.uri}; train them "
            f"first (make reproduce-figure-N SCALE={scale}); {path} is left as it is"
        )
    used = {run_key(r.cfg): r.tags for r in [*study.runs, *(r for w in sweeps.values() for r in w.runs)]}
    note = draw_notice(study.out_dir, used, f"the {scale} report")
    if note:  # another machine or library draw than the shipped study's: say so, in one line
        print(note)
    path.parent.mkdir(parents=True, exist_ok=True)
    found = results(study, sweeps, claims)
    text = render(study, sweeps, scale, seeds, figure, found, per_figure)
    frontier, frontier_records, studies = _frontier(scale, given, overrides) if figure is None else ("", {}, {})
    mech, mech_records = _mechanism(scale, given, overrides, studies) if figure is None else ("", {})
    arm, arm_records = _dppo(scale, given, overrides) if figure is None else ("", {})
    frontier = "\n".join(t for t in (frontier, mech, arm) if t)
    if frontier:  # before the method, after the claims: the routing frontier and axis R, judged as their plans say
        head, _, method = text.partition("\n## How the numbers and verdicts are computed\n")
        text = f"{head}\n{frontier}\n## How the numbers and verdicts are computed\n{method}"
    path.write_text(text)
    written = [path]
    if figure is None:  # the same results as numbers, for text written from them (analysis/readme.py)
        records = path.with_suffix(".json")
        on = [claim_on(c, study, sweeps) for c in claims]
        records.write_text(json.dumps(as_records(claims, found, on), indent=1, allow_nan=False) + "\n")
        written.append(records)
        extras = (("FRONTIER.json", frontier_records), ("AXIS_R.json", mech_records), ("DPPO.json", arm_records))
        for name, recs in extras:
            if recs:
                extra = path.with_name(name)
                extra.write_text(json.dumps(recs, indent=1, allow_nan=False) + "\n")
                written.append(extra)
    if study.runs:
        log_outputs(study, "report", {"report": scale, "seeds": ",".join(map(str, seeds))}, written)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scale", default="cpu", help="smoke | cpu | paper")
    p.add_argument("--seeds", help="e.g. 1,2,3 (default: the scale's default seeds)")
    p.add_argument("--figure", type=int, help="only the claims measured on this figure's sweep (REPORT-figure-N.md)")
    p.add_argument("overrides", nargs="*", help="key.sub=value overrides for every run (e.g. results_dir=)")
    args = p.parse_args(argv)
    try:
        seeds = parse_seeds(args.seeds, args.scale) if args.seeds else None
        path = make_report(args.scale, seeds, args.overrides, args.figure)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
