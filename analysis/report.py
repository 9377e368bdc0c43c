"""`results/<scale>/REPORT.md`: each claim of the GSPO paper, the paper's number, ours, and a verdict.

    python -m analysis.report --scale cpu [--seeds 1,2,3] [--figure N] [key=value ...]

Everything is computed from the tracked MLflow runs (found as in analysis/figures.py); a claim whose runs are
missing or unfinished says "not run"; with no tracked run at all it stops (an error) and leaves REPORT.md as it is.
How each number and verdict is computed is `METHOD` (printed under the table); the rules are `verdict` and
`combine`, each claim's judged quantities are `Estimate` records, and `tests/test_report_rules.py` builds data that
must pass and must fail each rule. The REPORT.md is also logged as an artifact of a run named `report`.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from datetime import datetime, timezone
from enum import StrEnum
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pandas as pd

from analysis.common import CONFIDENCE, PASS1, REWARD, Study, label, load, log_outputs, mean_ci
from analysis.figures import PAPER_CLIP_FRAC, PAPER_VOLATILITY, lag_table, sweep_table
from gspo_study.archive import draw_notice
from gspo_study.config import ConfigError
from gspo_study.run import run_key, sqlite_path
from gspo_study.study import figure_configs, parse_seeds, run_config
from gspo_study.tracking import git_commit

MARGIN = 0.05  # δ: the smallest gap in pass@1 or reward a difference row tests for; the no-harm rows' margin
WITHIN = 3.0  # a magnitude claim ("~value") reproduces when our interval lies within [value/3, value·3]
CLIP, VOL = "policy/clip_frac/token", "moe/routing_volatility/overall"
VOL_UPDATE = "moe/routing_volatility/per_update/overall"  # the paper's unit: one optimizer update
MOVING = 0.01  # routing volatility per step from which a sweep cell counts as "routing moves" (figure 8)

METHOD = f"""Per-seed measures:
- final pass@1: `eval/pass@1` at the run's last evaluation (its last step);
- final reward: `rollout/reward/mean` averaged over the last evaluation interval, the steps after
  `train.steps − eval.every` (all steps when eval.every is 0);
- training averages (clip fraction, routing volatility): the metric averaged over every logged step;
- gain over the cold start: final pass@1 minus `eval/pass@1` at step 0 (the cold-start model, same seed).
Differences are paired by seed (every run of a seed starts from the same cold start and sees the same prompts and
sampling streams): Δ_s = A_s − B_s, shown as mean [95 % Student-t interval] ±half-width (n seeds).

Verdicts (`verdict`; δ = {MARGIN} pass@1 or reward, the smallest gap a row tests for):
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
- fewer than 2 seeds: no interval, "inconclusive";
- a claim measured in several ways (`combine`): "not reproduced" if any measure is; "reproduces" (or
  "consistent") if all are; else "underpowered" if any is; else "inconclusive".
Multiplicity: a row that shows several comparisons says how many; only the one it names is judged, and none
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
replay (`moe/route/var_share`, mean over seeds) is largest — an argmax over the lags' means, whose intervals
overlap; Δ is paired by seed at that lag and shown at lag 0 too. Claim 10 is a reading ("measured").
Claims 11–12 (figure 10, bf16 rollout engine): the bypass against recomputed π_old with no correction and
with token TIS, sequence MIS and IcePop ("no harm", GSPO and GRPO + R2), and GRPO + R3 against GRPO + R2 with
each ("difference", R3 ahead); each row's verdict is its uncorrected pair's, and its text says which correction,
if any, gives another verdict.
Claims 13–15 (figure 11: 300-step runs under the HF engine's bf16 copy, each seed from its own cold start)
count collapsed runs per arm by the rule of analysis/collapse.py ("k of n", with the step and the instrument's
readings over the 25 steps before it), and judge claims 4 and 2 on final pass@1 paired by seed; where the
half-width exceeds δ, the seeds the measured SD would need.
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


def combine(verdicts: list[Verdict]) -> Verdict:
    if Verdict.NOT_REPRODUCED in verdicts:
        return Verdict.NOT_REPRODUCED
    if all(v in (Verdict.REPRODUCES, Verdict.CONSISTENT) for v in verdicts):
        return verdicts[0] if len(set(verdicts)) == 1 else Verdict.REPRODUCES
    return Verdict.UNDERPOWERED if Verdict.UNDERPOWERED in verdicts else Verdict.INCONCLUSIVE


def factor(lo: float, hi: float, paper: float) -> str:
    """How far a magnitude interval lies from the paper's value, as "≈ N× lower/higher" ("" when it overlaps)."""
    if hi < paper / WITHIN:
        return f"≈ {paper / ((lo + hi) / 2):.3g}× lower at this scale"
    if lo > paper * WITHIN:
        return f"≈ {(lo + hi) / 2 / paper:.3g}× higher at this scale"
    return ""


def _fmt(mean: float, lo: float, hi: float) -> str:
    return f"{mean:.4g}" + ("" if math.isnan(lo) else f" [{lo:.4g}, {hi:.4g}]")


@dataclass(frozen=True)
class Estimate:
    """One judged quantity of a claim: its name, mean, 95 % interval over n (seeds), and verdict; `sides` the two
    arms' own levels for a difference. Rendered once, by `text`."""

    name: str
    mean: float
    lo: float
    hi: float
    n: int
    verdict: Verdict
    sides: str = ""
    unit: str = "Δ "  # "" for a level rather than a difference

    @property
    def half_width(self) -> float:
        return (self.hi - self.lo) / 2

    def text(self) -> str:
        half = "" if math.isnan(self.lo) else f" ±{self.half_width:.3g}"
        sides = f"{self.sides}; " if self.sides else ""
        return f"{self.name}: {sides}{self.unit}{_fmt(self.mean, self.lo, self.hi)}{half} (n={self.n})"


def estimate(
    name: str,
    values,
    kind: str = "diff",
    sign: int = 1,
    effect: float = MARGIN,
    sides: str = "",
    paper: float = math.nan,
    unit: str = "Δ ",
) -> Estimate:
    mean, lo, hi, n = mean_ci(values)
    return Estimate(name, mean, lo, hi, n, verdict(kind, lo, hi, sign, paper, effect), sides, unit)


def difference(
    study: Study, measure, a: str, b: str, name: str, kind: str, sign: int, effect: float = MARGIN
) -> Estimate:
    """`name`: A − B paired by seed, with both sides' levels."""
    va, vb = measure(study, a), measure(study, b)
    sides = f"{label(a)} {_fmt(*mean_ci(va)[:3])} vs {label(b)} {_fmt(*mean_ci(vb)[:3])}"
    return estimate(name, (va - vb).dropna(), kind, sign, effect, sides)


class Result(NamedTuple):
    """A claim's result: the text of the report's "ours" column, its verdict, and the estimates it was judged on
    (REPORT.json holds them as numbers, for the README and docs text written from them)."""

    ours: str
    verdict: Verdict
    estimates: tuple[Estimate, ...] = ()


def judged(estimates: list[Estimate], head: str = "") -> Result:
    """A claim's row from its estimates: their texts, and their combined verdict."""
    return Result(
        head + "; ".join(e.text() for e in estimates),
        combine([e.verdict for e in estimates]),
        tuple(estimates),
    )


# ------------------------------------------------------------------------------------------------ claims
@dataclass
class Claim:
    text: str
    paper: str
    runs: tuple[str, ...]
    measure: object  # (study) -> (ours text, Verdict)
    figure: int | None = None  # measured on this figure's sweep (its own runs) instead of `runs`


def _efficiency(study: Study):
    return judged(
        [
            difference(study, final_pass, "gspo", "grpo_r2", "final pass@1", "diff", +1),
            difference(study, final_reward, "gspo", "grpo_r2", "final reward", "diff", +1),
        ]
    )


def _clipping(study: Study):
    paper = PAPER_CLIP_FRAC["gspo"] - PAPER_CLIP_FRAC["grpo_r2"]
    e = difference(study, training_mean(CLIP), "gspo", "grpo_r2", "clip fraction", "diff", +1, effect=paper)
    a, b = (training_mean(CLIP)(study, r).mean() for r in ("gspo", "grpo_r2"))
    ratio = f"; ratio ×{a / b:.3g} (paper ×{PAPER_CLIP_FRAC['gspo'] / PAPER_CLIP_FRAC['grpo_r2']:.3g})" if b > 0 else ""
    return Result(e.text() + ratio, e.verdict, (e,))


def _replay(study: Study):
    return judged(
        [
            difference(study, final_pass, "grpo", "grpo_r2", "final pass@1", "diff", -1),
            difference(study, final_reward, "grpo", "grpo_r2", "final reward", "diff", -1),
        ]
    )


def _volatility(study: Study):
    """Claim 5 per optimizer update (the paper's unit), on figure 11's GSPO and GRPO-without-replay runs."""
    texts, estimates = [], []
    for run in (LONG_ARMS["gspo"], LONG_ARMS["grpo"]):
        e = estimate(
            f"{label(run)}, per update",
            training_mean(VOL_UPDATE)(study, run),
            "magnitude",
            paper=PAPER_VOLATILITY,
            unit="",
        )
        far = factor(e.lo, e.hi, PAPER_VOLATILITY) if not math.isnan(e.lo) else ""
        texts.append(e.text() + (f", {far}" if far else ""))
        estimates.append(e)
    return Result(_runs_found(study) + "; ".join(texts), combine([e.verdict for e in estimates]), tuple(estimates))


def _precision(study: Study):
    a, b = "gspo_bf16_rollout", "gspo_bf16_recompute"
    return judged(
        [
            difference(study, final_pass, a, b, "final pass@1", "no_harm", +1),
            difference(study, final_reward, a, b, "final reward", "no_harm", +1),
        ],
        _runs_found(study),
    )


def _improves(study: Study):
    start = mean_ci(study.values(PASS1, "gspo").query("step == 0").value)[0]
    e = estimate(f"GSPO held-out pass@1 gain over the cold start ({start:.3g})", gain(study, "gspo"), unit="")
    return Result(e.text(), e.verdict, (e,))


def _sweep(study: Study):
    from analysis.collapse import PASS_MARGIN

    t = sweep_table(study)
    total = len(study.runs) + len(study.missing)
    vol = t[t.run == "grpo"].groupby("cell").vol.mean()
    moving = set(vol[vol >= MOVING].index)
    seeds = sorted({int(s) for s in t.seed.unique()})
    head = f"{len(study.runs)} of {total} sweep runs (seed{'s' * (len(seeds) > 1)} {', '.join(map(str, seeds))}); "
    if not moving:
        return head + f"no cell reaches {MOVING:.0%} volatility (max {vol.max():.3g})", Verdict.INCONCLUSIVE
    by_arm = t[t.cell.isin(moving)].groupby(["cell", "run"])[["final", "start"]].mean()
    down = by_arm.final < by_arm.start - PASS_MARGIN
    gone = sorted(c for c in moving if down.loc[c].all())  # every algorithm collapsed there: not a comparison
    pooled = sorted(moving - set(gone))
    head += f"cells with GRPO volatility ≥ {MOVING:.0%}: {', '.join(sorted(moving))}"
    if gone:
        ends = by_arm.loc[gone].final
        span = f"{ends.min():.3g}–{ends.max():.3g}"
        head += f"; every algorithm collapses at {', '.join(gone)} (final pass@1 {span}), not pooled"
    if not pooled:
        return head, Verdict.INCONCLUSIVE
    final = t[t.cell.isin(pooled)].set_index(["run", "cell", "seed"]).final
    estimates = []
    for a in ("gspo", "grpo_r2"):
        per_seed = (final.loc[a] - final.loc["grpo"]).dropna().groupby("seed").mean()  # cells fixed, seeds replicate
        estimates.append(
            estimate(f"{label(a)} − GRPO (no replay) final pass@1, mean over {len(pooled)} cells", per_seed)
        )
    return judged(estimates, head + "; ")


def regime_lag(t: pd.DataFrame) -> int | None:
    """The policy-lag sweep's regime: among the lags where GSPO still learns (its mean held-out pass@1 gain over
    the cold start is positive), the one where routing's share of the log-ratio variance (`moe/route/var_share`
    of GRPO without replay, mean over seeds) is largest; every lag if GSPO learns at none. None: no such run."""
    share = t[t.run == "grpo"].groupby("lag").share.mean()
    if share.empty:
        return None
    gspo = t[t.run == "gspo"]
    learns = set((gspo.final - gspo.start).groupby(gspo.lag).mean().loc[lambda g: g > 0].index)
    pool = share[share.index.isin(learns)] if learns & set(share.index) else share
    return int(pool.idxmax())


def _runs_found(study: Study) -> str:
    """How many of a sweep's runs the row is measured on (a partly trained sweep is reported as such)."""
    return f"{len(study.runs)} of {len(study.runs) + len(study.missing)} sweep runs; "


def _lag_claim(study: Study, a: str, b: str, sign: int):
    """A − B final pass@1 paired by seed at the sweep's lag 0 (the base, 30 steps) and at its regime
    (`regime_lag`); the verdict is the regime's."""
    t = lag_table(study)
    head = _runs_found(study)
    lag = regime_lag(t)
    if lag is None:
        return head + "none of GRPO without replay", Verdict.INCONCLUSIVE
    share = t[t.run == "grpo"].groupby("lag").share.mean()
    final = t.set_index(["run", "lag", "seed"]).final.sort_index()
    pairs = final.index.droplevel("seed")
    found = {
        k: estimate(
            f"at lag {k}{' (regime)' if k == lag else ''}",
            (final.loc[(a, k)] - final.loc[(b, k)]).dropna(),
            "diff",
            sign,
        )
        for k in sorted({0, lag})
        if (a, k) in pairs and (b, k) in pairs
    }
    if lag not in found:
        return head + f"no {label(a)} and {label(b)} pair at lag {lag}", Verdict.INCONCLUSIVE
    text = (
        head + f"regime = lag {lag}, the argmax over {share.index.nunique()} lags' mean routing share of Var "
        f"log-ratio ({share.loc[lag]:.3g}; the lags' intervals overlap) where GSPO still gains over the cold "
        f"start; 1 comparison judged (lag 0 shown); {label(a)} − {label(b)} final pass@1 "
        + "; ".join(e.text() for e in found.values())
    )
    return Result(text, found[lag].verdict, (found[lag],))


def _lag(study: Study):
    """Claim 4 at the policy-lag sweep's regime (`regime_lag`)."""
    return _lag_claim(study, "grpo", "grpo_r2", -1)


def _lag_efficiency(study: Study):
    """Claim 2 at the policy-lag sweep's regime."""
    return _lag_claim(study, "gspo", "grpo_r2", +1)


def _instrument(study: Study):
    """The instrument's reading per lag (GRPO without replay, mean over seeds): routing's share of Var ℓ, the
    GRPO token / GSPO sequence clip decisions routing alone flips, routing volatility per step. A reading, not
    a claim: no verdict beyond "measured"."""
    t = lag_table(study)
    head = _runs_found(study)
    g = t[t.run == "grpo"].groupby("lag")[["share", "flip_token", "flip_seq", "vol"]].mean()
    if g.empty:
        return head + "none of GRPO without replay", Verdict.INCONCLUSIVE
    n = t[t.run == "grpo"].groupby("lag").seed.nunique()
    cells = [
        f"lag {lag}: share {r.share:.3g}, flips {r.flip_token:.2%} token / {r.flip_seq:.2%} seq, volatility "
        f"{r.vol:.2%} (n={n.loc[lag]})"
        for lag, r in g.iterrows()
    ]
    return head + "; ".join(cells), Verdict.MEASURED


CORRECTIONS = {
    "bf16_recompute": "none",
    "bf16_tis": "token TIS",
    "bf16_mis": "sequence MIS",
    "bf16_icepop": "IcePop",
}


def _changed(base: Verdict, per: dict[str, Verdict]) -> str:
    """Which corrections turn the uncorrected verdict `base` into another, as text."""
    moved = [f"{CORRECTIONS[c]} ({v})" for c, v in per.items() if c != "bf16_recompute" and v != base]
    return "changed by " + ", ".join(moved) if moved else "no correction changes it"


def _multiplicity(k: int) -> str:
    return f"{k} comparisons per arm, only the uncorrected one judged, none corrected for multiplicity; "


def _correction_precision(study: Study):
    """§5.4 beside the corrections (figure 10): the bypass (rollout log-probs as π_old) against recomputed π_old
    with no correction and with each correction, final pass@1 paired by seed, "no harm" verdict per pair, for
    GSPO and for GRPO + R2. The verdict is GSPO's uncorrected one (claim 6 at figure 10's runs); the text says
    which correction, if any, gives another."""
    texts, verdicts, judged_on = [], {}, None
    for obj in ("gspo", "grpo_r2"):
        per = {}
        for c in CORRECTIONS:
            e = difference(
                study,
                final_pass,
                f"{obj}_bf16_rollout",
                f"{obj}_{c}",
                f"bypass − recompute ({CORRECTIONS[c]})",
                "no_harm",
                +1,
            )
            per[c] = e.verdict
            judged_on = e if (obj, c) == ("gspo", "bf16_recompute") else judged_on
            texts.append(f"{label(obj)}: {e.text()} → {e.verdict}")
        verdicts[obj] = per
        texts.append(f"{label(obj)}: {_changed(per['bf16_recompute'], per)}")
    head = _runs_found(study) + _multiplicity(len(CORRECTIONS))
    return Result(head + "; ".join(texts), verdicts["gspo"]["bf16_recompute"], (judged_on,))


def _correction_replay(study: Study):
    """R2 vs R3 beside the corrections (figure 10): GRPO + R3 − GRPO + R2 final pass@1 paired by seed, with R2's
    π_old recomputed and no correction (figure 7's comparison) and with each correction. R3 paper's sign: R3
    ahead under a mismatched rollout engine. The verdict is the uncorrected pair's; the text says which
    correction changes it, and each correction's masked token fraction."""
    texts, per, judged_on = [], {}, None
    for c in CORRECTIONS:
        e = difference(study, final_pass, "grpo_r3_bf16", f"grpo_r2_{c}", f"R3 − R2 ({CORRECTIONS[c]})", "diff", +1)
        per[c] = e.verdict
        judged_on = e if c == "bf16_recompute" else judged_on
        masked = training_mean("correction/masked_frac/token")(study, f"grpo_r2_{c}").mean()
        masked_text = "" if math.isnan(masked) else f", R2's masked tokens {masked:.3%}"
        texts.append(f"{e.text()}{masked_text} → {e.verdict}")
    k3_r2, k3_r3 = (training_mean("mismatch/k3")(study, r).mean() for r in ("grpo_r2_bf16_recompute", "grpo_r3_bf16"))
    texts.append(f"k3 mismatch R2 {k3_r2:.3g}, R3 {k3_r3:.3g}")
    texts.append(_changed(per["bf16_recompute"], per))
    head = _runs_found(study) + _multiplicity(len(CORRECTIONS))
    return Result(head + "; ".join(texts), per["bf16_recompute"], (judged_on,))


# ------------------------------------------------------------------------------------- figure 11: the long horizon
LONG_ARMS = {
    "grpo": "grpo_bf16_recompute",
    "grpo_r2": "grpo_r2_bf16_recompute",
    "grpo_r3": "grpo_r3_bf16",
    "gspo": "gspo_bf16_recompute",
}
TARGET_HALF_WIDTH = MARGIN  # the gap in final pass@1 the long-horizon comparison is sized to see
BEFORE = 25  # steps of the instrument's readings before a collapse (or the run's last steps without one)
READINGS = {
    "k3": "mismatch/k3",
    "F(2)": "mismatch/f_tau_2",
    "routing gap": "moe/train_infer_routing/tokens_any_changed",
    "R2 share": "moe/route/r2_removed_share",
    "grad norm": "train/grad_norm",
}


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


def _long_claim(study: Study, a: str, b: str, sign: int):
    """A − B final pass@1 paired by seed on figure 11's runs, with the interval's half-width and the seeds it
    would take to reach TARGET_HALF_WIDTH; verdict as every difference row."""
    ra, rb = LONG_ARMS[a], LONG_ARMS[b]
    d = (final_pass(study, ra) - final_pass(study, rb)).dropna()
    e = difference(study, final_pass, ra, rb, "final pass@1", "diff", sign)
    return Result(_runs_found(study) + f"{e.text()}; {_powered(d)}", e.verdict, (e,))


def _long_replay(study: Study):
    """Claim 4 at the long horizon under a bf16 rollout engine (figure 11)."""
    return _long_claim(study, "grpo", "grpo_r2", -1)


def _long_efficiency(study: Study):
    """Claim 2 at the long horizon under a bf16 rollout engine (figure 11)."""
    return _long_claim(study, "gspo", "grpo_r2", +1)


def _readings(study: Study, run: str, seed: int, upto: int) -> dict[str, float]:
    """The instrument's means over the BEFORE steps up to step `upto` of one run."""
    out = {}
    for name, metric in READINGS.items():
        f = study.values(metric, run)
        f = f[(f.seed == seed) & (f.step <= upto) & (f.step > upto - BEFORE)]
        out[name] = float(f.value.mean()) if len(f) else math.nan
    return out


def _collapse(study: Study):
    """Runs that collapsed per arm (analysis/collapse.py's rule), at which step, and the instrument's readings over
    the BEFORE steps before it (over each arm's last BEFORE steps when none did). Verdict: `collapse_verdict`."""
    from analysis.collapse import collapse

    texts, counts = [], {}
    for arm, run in LONG_ARMS.items():
        found = []
        for r in (r for r in study.runs if r.run == run):
            rw, p1 = (study.values(m, run) for m in (REWARD, PASS1))
            rw, p1 = rw[rw.seed == r.seed].sort_values("step"), p1[p1.seed == r.seed].sort_values("step")
            c = collapse(rw.step.to_numpy(), rw.value.to_numpy(), p1.step.to_numpy(), p1.value.to_numpy())
            last = int(rw.step.max()) if len(rw) else 0
            found.append((r.seed, c, _readings(study, run, r.seed, c.step if c.collapsed else last), last))
        if not found:
            continue
        down = [(seed, c) for seed, c, _, _ in found if c.collapsed]
        counts[arm] = (len(down), len(found))
        mean = {k: np.nanmean([x[2][k] for x in found]) for k in READINGS}
        when = ", ".join(f"seed {seed} at step {c.step} ({c.rule})" for seed, c in down)
        horizon = max(x[3] for x in found)
        readings = ", ".join(f"{k} {v:.3g}" for k, v in mean.items())
        texts.append(
            f"{label(run)}: {len(down)} of {len(found)} collapsed"
            + (f" ({when})" if when else "")
            + f" in {horizon} steps; {'before it' if down else f'last {BEFORE} steps'}: {readings}"
        )
    if "grpo" not in counts:
        return _runs_found(study) + "none of GRPO without replay", Verdict.INCONCLUSIVE
    k, n = counts["grpo"]
    v = collapse_verdict(k, n, counts.get("grpo_r2", (0, 0))[0])
    shares = tuple(
        Estimate(f"{label(LONG_ARMS[arm])}: share of runs collapsed", kk / nn, math.nan, math.nan, nn, v, unit="")
        for arm, (kk, nn) in counts.items()
    )
    return Result(_runs_found(study) + "; ".join(texts), v, shares)


def collapse_verdict(k: int, n: int, k_r2: int) -> Verdict:
    """k of n GRPO-without-replay runs collapsed, k_r2 GRPO + R2 runs: "reproduces" when at least half of the
    former and none of the latter did, "not reproduced" when none of the former did, else "inconclusive"."""
    if k == 0:
        return Verdict.NOT_REPRODUCED
    return Verdict.REPRODUCES if 2 * k >= n and k_r2 == 0 else Verdict.INCONCLUSIVE


CLAIMS = [
    Claim(
        text="RL improves on the cold start (precondition for the claims below)",
        paper="steady gains with training compute (Fig. 1)",
        runs=("gspo",),
        measure=_improves,
    ),
    Claim(
        text="GSPO trains more efficiently than GRPO + R2 (Fig. 1)",
        paper="higher reward and benchmark scores at equal training compute",
        runs=("gspo", "grpo_r2"),
        measure=_efficiency,
    ),
    Claim(
        text="GSPO clips about 100× more tokens than GRPO (Fig. 2)",
        paper=f"{PAPER_CLIP_FRAC['gspo']} vs {PAPER_CLIP_FRAC['grpo_r2']}",
        runs=("gspo", "grpo_r2"),
        measure=_clipping,
    ),
    Claim(
        text="GRPO without Routing Replay fails to converge normally on MoE (Fig. 3)",
        paper="lower reward and scores than GRPO + R2",
        runs=("grpo", "grpo_r2"),
        measure=_replay,
    ),
    Claim(
        text="Expert volatility: ~10% of activated experts change per update (§5.3; per update, on figure 11's runs)",
        paper=f"~{PAPER_VOLATILITY} (48-layer Qwen3-30B-A3B, one update)",
        runs=(),
        measure=_volatility,
        figure=11,
    ),
    Claim(
        text="GSPO tolerates precision mismatch: rollout log-probs need no recompute (§5.4)",
        paper="no loss (no number reported)",
        runs=(),
        measure=_precision,
        figure=6,
    ),
    Claim(
        text="Where routing moves, GRPO without replay falls behind GSPO and GRPO + R2 (Fig. 8, ours)",
        paper="§5.3: GRPO without replay fails on MoE; replay or GSPO fixes it",
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
        runs=(),
        measure=_lag,
        figure=9,
    ),
    Claim(
        text="GSPO trains more efficiently than GRPO + R2 at that regime (claim 2 at the regime, Fig. 9)",
        paper="higher reward and scores (Fig. 1, at lag 0)",
        runs=(),
        measure=_lag_efficiency,
        figure=9,
    ),
    Claim(
        text="How much of the importance ratio is routing (the instrument, Fig. 9, ours)",
        paper="R2 removes the routing term (§5.3); no number reported",
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
        runs=(),
        measure=_correction_precision,
        figure=10,
    ),
    Claim(
        text="R3 ahead of R2 under a bf16 rollout engine, with and without a correction on R2 (Fig. 10, ours)",
        paper="R3 paper (arXiv 2510.11370): R3 fixes the mismatch R2 leaves",
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
        runs=(),
        measure=_collapse,
        figure=11,
    ),
    Claim(
        text="GRPO without Routing Replay falls behind GRPO + R2 at the long horizon (claim 4, Fig. 11)",
        paper="lower reward and scores than GRPO + R2 (Fig. 3)",
        runs=(),
        measure=_long_replay,
        figure=11,
    ),
    Claim(
        text="GSPO trains more efficiently than GRPO + R2 at the long horizon (claim 2, Fig. 11)",
        paper="higher reward and scores (Fig. 1)",
        runs=(),
        measure=_long_efficiency,
        figure=11,
    ),
]


# ------------------------------------------------------------------------------------------------ report
def results(study: Study, sweeps: dict[int, Study], claims=None) -> list[Result]:
    """Each claim's Result (`claims`: all); "not run" where a run or seed is missing."""
    absent = {run for run, _, _ in study.missing}
    out = []
    for c in CLAIMS if claims is None else claims:
        if c.figure is not None:
            sweep = sweeps[c.figure]
            out.append(
                Result(*c.measure(sweep))
                if sweep.runs
                else Result(f"missing: all runs of figure {c.figure}", Verdict.NOT_RUN)
            )
            continue
        gone = [r for r in c.runs if r in absent]
        if gone:
            seeds = sorted({s for r, s, _ in study.missing if r in gone})
            out.append(Result(f"missing: {', '.join(gone)} (seeds {seeds})", Verdict.NOT_RUN))
            continue
        out.append(Result(*c.measure(study)))
    return out


def rows(study: Study, sweeps: dict[int, Study], claims=None) -> list[tuple[str, str, str, str]]:
    """(claim, paper, ours, verdict) per claim (`claims`: all)."""
    claims = CLAIMS if claims is None else claims
    return [(c.text, c.paper, r.ours, r.verdict) for c, r in zip(claims, results(study, sweeps, claims))]


def _num(x: float) -> float | None:
    return None if x is None or not math.isfinite(x) else float(x)


def as_records(claims, found: list[Result]) -> list[dict]:
    """REPORT.json: per claim its number, text, verdict and estimates as numbers (null where there is none)."""
    return [
        dict(
            claim=CLAIMS.index(c) + 1,
            text=c.text,
            verdict=str(r.verdict),
            estimates=[
                dict(
                    name=e.name,
                    mean=_num(e.mean),
                    lower=_num(e.lo),
                    upper=_num(e.hi),
                    half_width=_num(e.half_width),
                    n=e.n,
                    verdict=str(e.verdict),
                )
                for e in r.estimates
            ],
        )
        for c, r in zip(claims, found)
    ]


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
        "| # | claim (GSPO paper) | paper | ours (mean [95% CI] ±half-width) | verdict |",
        "|---|---|---|---|---|",
    ]
    for c, r in zip(claims, found):
        row = (c.text, c.paper, r.ours, r.verdict)
        lines.append(f"| {CLAIMS.index(c) + 1} | " + " | ".join(x.replace("|", "\\|") for x in row) + " |")
    return "\n".join(lines) + "\n\n## How the numbers and verdicts are computed\n\n" + METHOD


def make_report(scale: str, seeds: list[int] | None, overrides=(), figure: int | None = None) -> Path:
    """REPORT.md and REPORT.json (every claim), or with `figure` REPORT-figure-N.md: only the claims measured on
    that figure's sweep, from its runs alone. `seeds` None: the scale's default seeds, and each figure's own for
    the claims measured on its sweep (`study.parse_seeds`)."""
    given = seeds
    seeds = parse_seeds(None, scale) if seeds is None else seeds
    claims = CLAIMS if figure is None else [c for c in CLAIMS if c.figure == figure]
    if not claims:
        raise ConfigError(
            f"bad figure {figure!r}; allowed: one whose sweep a claim is measured on "
            f"({', '.join(str(c.figure) for c in CLAIMS if c.figure is not None)})"
        )
    runs = list(dict.fromkeys(r for c in claims for r in c.runs))
    figs = {c.figure for c in claims if c.figure is not None}
    per_figure = {f: given if given is not None else parse_seeds(None, scale, f) for f in figs}
    sweeps = {f: load(figure_configs(f, scale, per_figure[f], tuple(overrides))) for f in figs}
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
    path.write_text(render(study, sweeps, scale, seeds, figure, found, per_figure))
    written = [path]
    if figure is None:  # the same results as numbers, for text written from them (analysis/readme.py)
        records = path.with_suffix(".json")
        records.write_text(json.dumps(as_records(claims, found), indent=1, allow_nan=False) + "\n")
        written.append(records)
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
