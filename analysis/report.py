"""`results/<scale>/REPORT.md`: each claim of the GSPO paper, the paper's number, ours, and a verdict.

    python analysis/report.py --scale cpu [--seeds 1,2,3] [key=value ...]

Everything is computed from the tracked MLflow runs (found as in analysis/figures.py); a claim whose runs
are missing or unfinished says "not run"; with no tracked run at all it stops (an error) and leaves REPORT.md
as it is. Per-seed measures:
- final pass@1: `eval/pass@1` at the run's last evaluation (its last step);
- final reward: `rollout/reward/mean` averaged over the last evaluation interval, the steps after
  `train.steps − eval.every` (all steps when eval.every is 0);
- training averages (clip fraction, routing volatility): the metric averaged over every logged step;
- gain over the cold start: final pass@1 minus `eval/pass@1` at step 0 (the cold-start model, same seed).
Differences are paired by seed (every run of a seed starts from the same cold start and sees the same
prompts and sampling streams): Δ_s = A_s − B_s, reported as mean and 95% Student-t interval over seeds.

Verdict rule (`verdict`), for a claim that A − B has the paper's sign (where the paper also gives a factor,
e.g. "about 100× more", only the sign is judged; the factor is shown, not tested):
- "reproduces" if the interval of Δ excludes 0 on the paper's side, "not reproduced" if it excludes 0 on
  the other side, "inconclusive" otherwise (including fewer than 2 seeds);
- "no harm" claims (§5.4: A is not worse than B): "not reproduced" if the interval lies below 0,
  "consistent" otherwise (no harm detected at this number of seeds; read the interval's width);
- magnitude claims (the paper's ~value): "reproduces" if our interval lies within one order of magnitude
  of the paper's value (between value/10 and value·10), "not reproduced" if it lies wholly outside,
  "inconclusive" otherwise;
- a claim measured in several ways is "not reproduced" if any measure is, "reproduces" (or "consistent")
  if all are, else "inconclusive".
The precision claim (6) is measured on figure 6's runs: at the CPU scale figure 10's 20-step bf16 runs
(experiments/figures.yaml), which are also claim 11's uncorrected pair.
The sweep claim (figure 8) pools the cells where GRPO without replay moves at least `MOVING` (1%) of its
activated experts per step: Δ = A − GRPO (no replay) paired by cell and seed, mean and t-interval over those
pairs, verdict as above; "inconclusive" when no cell moves that much. It uses the sweep's runs that exist
(the count is shown), so a partly trained sweep is reported as such.
The policy-lag claims (figure 9) judge claims 4 and 2 at the sweep's regime: among the lags where GSPO still
learns (mean final pass@1 above its cold start), the one where routing's share of the log-ratio variance of
GRPO without replay (`moe/route/var_share`, mean over seeds) is largest; Δ is paired by seed at that lag, and
shown at lag 0 too. The instrument's row is a reading (verdict "measured"), per lag, means over seeds.
`--figure 9` writes only those rows, from the sweep's runs alone, to REPORT-figure-9.md.
The correction claims (figure 10, bf16 rollout engine) pair by seed: the bypass against recomputed π_old with no
correction and with token TIS, sequence MIS and IcePop ("no harm", GSPO and GRPO + R2), and GRPO + R3 against
GRPO + R2 with each ("diff", R3 ahead); each row's verdict is the uncorrected pair's, and its text says which
correction, if any, gives another verdict. The per-correction verdicts are not corrected for multiple
comparisons (four pairs per row): at n = 3 one interval in eight excluding 0 is what chance alone gives.
`--figure 10` writes them to REPORT-figure-10.md.
The long-horizon claims (figure 11: 300-step runs under the HF engine's bf16 copy, each seed from its own cold
start) count collapsed runs per arm by the rule of analysis/collapse.py ("k of n", with the step and the
instrument's readings over the 25 steps before it), and judge claims 4 and 2 on final pass@1 paired by seed,
printing the interval's half-width against the 0.05 the comparison is sized for and, where it is wider, the seeds
the measured SD would need. `--figure 11` writes them to REPORT-figure-11.md.
The REPORT.md is also logged as an artifact of a run named `report` (tags `report=<scale>`, `seeds`).
"""

from __future__ import annotations

import argparse
import math
import subprocess
import sys
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

if __package__ in (None, ""):  # run as a script (the Makefile does): make `analysis` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from analysis.common import CONFIDENCE, PASS1, REWARD, Study, label, load, log_outputs, mean_ci  # noqa: E402
from analysis.figures import PAPER_CLIP_FRAC, PAPER_VOLATILITY, lag_table, sweep_table  # noqa: E402
from gspo_study.archive import draw_notice  # noqa: E402
from gspo_study.config import ConfigError  # noqa: E402
from gspo_study.study import figure_configs, parse_seeds, run_config  # noqa: E402
from gspo_study.tracking import run_key  # noqa: E402

ORDER_OF_MAGNITUDE = 10.0  # what "~value" is read as, for magnitude claims (see the verdict rule)
CLIP, VOL = "policy/clip_frac/token", "moe/routing_volatility/overall"
MOVING = 0.01  # routing volatility per step from which a sweep cell counts as "routing moves" (issue 10)


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
def _fmt(mean: float, lo: float, hi: float) -> str:
    return f"{mean:.4g}" + ("" if math.isnan(lo) else f" [{lo:.4g}, {hi:.4g}]")


def verdict(kind: str, lo: float, hi: float, sign: int = 1, paper: float = math.nan) -> str:
    if math.isnan(lo):
        return "inconclusive"
    if kind == "no_harm":
        return "not reproduced" if hi < 0 else "consistent"
    if kind == "magnitude":
        low, high = paper / ORDER_OF_MAGNITUDE, paper * ORDER_OF_MAGNITUDE
        inside, outside = low <= lo and hi <= high, hi < low or lo > high
        return "reproduces" if inside else "not reproduced" if outside else "inconclusive"
    lo, hi = sorted((sign * lo, sign * hi))
    return "reproduces" if lo > 0 else "not reproduced" if hi < 0 else "inconclusive"


def combine(verdicts: list[str]) -> str:
    if "not reproduced" in verdicts:
        return "not reproduced"
    if all(v in ("reproduces", "consistent") for v in verdicts):
        return verdicts[0] if len(set(verdicts)) == 1 else "reproduces"
    return "inconclusive"


def difference(study: Study, measure, a: str, b: str, name: str, kind: str, sign: int) -> tuple[str, str]:
    """`name`: A − B paired by seed, as text with both sides, and its verdict."""
    va, vb = measure(study, a), measure(study, b)
    mean, lo, hi, n = mean_ci((va - vb).dropna())
    text = (
        f"{name}: {label(a)} {_fmt(*mean_ci(va)[:3])} vs {label(b)} {_fmt(*mean_ci(vb)[:3])}; "
        f"Δ {_fmt(mean, lo, hi)} (n={n})"
    )
    return text, verdict(kind, lo, hi, sign)


# ------------------------------------------------------------------------------------------------ claims
@dataclass
class Claim:
    text: str
    paper: str
    runs: tuple[str, ...]
    measure: object  # (study) -> (ours text, verdict)
    figure: int | None = None  # measured on this figure's sweep (its own runs) instead of `runs`


def _efficiency(study: Study):
    parts = [
        difference(study, final_pass, "gspo", "grpo_r2", "final pass@1", "diff", +1),
        difference(study, final_reward, "gspo", "grpo_r2", "final reward", "diff", +1),
    ]
    return "; ".join(p[0] for p in parts), combine([p[1] for p in parts])


def _clipping(study: Study):
    text, v = difference(study, training_mean(CLIP), "gspo", "grpo_r2", "clip fraction", "diff", +1)
    a, b = (training_mean(CLIP)(study, r).mean() for r in ("gspo", "grpo_r2"))
    return f"{text}; ratio ×{a / b:.3g}" if b > 0 else text, v


def _replay(study: Study):
    parts = [
        difference(study, final_pass, "grpo", "grpo_r2", "final pass@1", "diff", -1),
        difference(study, final_reward, "grpo", "grpo_r2", "final reward", "diff", -1),
    ]
    return "; ".join(p[0] for p in parts), combine([p[1] for p in parts])


def _volatility(study: Study):
    texts, verdicts = [], []
    for run in ("gspo", "grpo"):
        mean, lo, hi, n = mean_ci(training_mean(VOL)(study, run))
        updates = next(r.cfg.train.num_minibatches for r in study.runs if r.run == run)
        texts.append(f"{label(run)} {_fmt(mean, lo, hi)} (n={n}, after a step's {updates} updates)")
        verdicts.append(verdict("magnitude", lo, hi, paper=PAPER_VOLATILITY))
    return "; ".join(texts), combine(verdicts)


def _precision(study: Study):
    a, b = "gspo_bf16_rollout", "gspo_bf16_recompute"
    parts = [
        difference(study, final_pass, a, b, "final pass@1", "no_harm", +1),
        difference(study, final_reward, a, b, "final reward", "no_harm", +1),
    ]
    return _runs_found(study) + "; ".join(p[0] for p in parts), combine([p[1] for p in parts])


def _improves(study: Study):
    mean, lo, hi, n = mean_ci(gain(study, "gspo"))
    start = mean_ci(study.values(PASS1, "gspo").query("step == 0").value)[0]
    text = f"GSPO held-out pass@1 gain over the cold start ({start:.3g}): {_fmt(mean, lo, hi)} (n={n})"
    return text, verdict("diff", lo, hi, +1)


def _sweep(study: Study):
    t = sweep_table(study)
    total = len(study.runs) + len(study.missing)
    vol = t[t.run == "grpo"].groupby("cell").vol.mean()
    moving = set(vol[vol >= MOVING].index)
    seeds = sorted({int(s) for s in t.seed.unique()})
    head = f"{len(study.runs)} of {total} sweep runs (seed{'s' * (len(seeds) > 1)} {', '.join(map(str, seeds))}); "
    if not moving:
        return head + f"no cell reaches {MOVING:.0%} volatility (max {vol.max():.3g})", "inconclusive"
    final = t[t.cell.isin(moving)].set_index(["run", "cell", "seed"]).final
    texts, verdicts = [], []
    for a in ("gspo", "grpo_r2"):
        d = (final.loc[a] - final.loc["grpo"]).dropna()
        mean, lo, hi, n = mean_ci(d)
        texts.append(f"{label(a)} − GRPO (no replay) final pass@1 {_fmt(mean, lo, hi)} (n={n} pairs)")
        verdicts.append(verdict("diff", lo, hi, +1))
    cells = ", ".join(sorted(moving))
    return head + f"cells with GRPO volatility ≥ {MOVING:.0%}: {cells}; " + "; ".join(texts), combine(
        verdicts
    )


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


def _at_lags(t: pd.DataFrame, a: str, b: str, lags: list[int]) -> list[tuple[int, float, float, float, int]]:
    final = t.set_index(["run", "lag", "seed"]).final.sort_index()
    out = []
    for lag in lags:
        if (a, lag) in final.index.droplevel("seed") and (b, lag) in final.index.droplevel("seed"):
            out.append((lag, *mean_ci((final.loc[(a, lag)] - final.loc[(b, lag)]).dropna())))
    return out


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
        return head + "none of GRPO without replay", "inconclusive"
    share = t[t.run == "grpo"].groupby("lag").share.mean()
    found = {k: (m, lo, hi, n) for k, m, lo, hi, n in _at_lags(t, a, b, sorted({0, lag}))}
    if lag not in found:
        return (
            head + f"no {label(a)} and {label(b)} pair at lag {lag}",
            "inconclusive",
        )
    parts = [
        f"at lag {k}{' (regime)' if k == lag else ''}: {_fmt(*v[:3])} (n={v[3]})" for k, v in found.items()
    ]
    text = (head + f"regime = lag {lag} (largest routing share of Var log-ratio, "
            f"{share.loc[lag]:.3g}, where GSPO still gains over the cold start); {label(a)} − {label(b)} final "
            f"pass@1 " + "; ".join(parts))  # fmt: skip
    _, lo, hi, _ = found[lag]
    return text, verdict("diff", lo, hi, sign)


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
        return head + "none of GRPO without replay", "inconclusive"
    n = t[t.run == "grpo"].groupby("lag").seed.nunique()
    cells = [f"lag {lag}: share {r.share:.3g}, flips {r.flip_token:.2%} token / {r.flip_seq:.2%} seq, volatility "
             f"{r.vol:.2%} (n={n.loc[lag]})" for lag, r in g.iterrows()]  # fmt: skip
    return head + "; ".join(cells), "measured"


CORRECTIONS = {
    "bf16_recompute": "none",
    "bf16_tis": "token TIS",
    "bf16_mis": "sequence MIS",
    "bf16_icepop": "IcePop",
}


def _changed(base: str, per: dict[str, str]) -> str:
    """Which corrections turn the uncorrected verdict `base` into another, as text."""
    moved = [f"{CORRECTIONS[c]} ({v})" for c, v in per.items() if c != "bf16_recompute" and v != base]
    return "changed by " + ", ".join(moved) if moved else "no correction changes it"


def _correction_precision(study: Study):
    """§5.4 beside the corrections (figure 10): the bypass (rollout log-probs as π_old) against recomputed π_old
    with no correction and with each correction, final pass@1 paired by seed, "no harm" verdict per pair, for
    GSPO and for GRPO + R2. The verdict is GSPO's uncorrected one (claim 6 at figure 10's runs); the text says
    which correction, if any, gives another."""
    texts, verdicts = [], {}
    for obj in ("gspo", "grpo_r2"):
        per = {}
        for c in CORRECTIONS:
            text, per[c] = difference(study, final_pass, f"{obj}_bf16_rollout", f"{obj}_{c}",
                                      f"bypass − recompute ({CORRECTIONS[c]})", "no_harm", +1)  # fmt: skip
            texts.append(f"{label(obj)}: {text} → {per[c]}")
        verdicts[obj] = per
        texts.append(f"{label(obj)}: {_changed(per['bf16_recompute'], per)}")
    head = _runs_found(study)
    return head + "; ".join(texts), verdicts["gspo"]["bf16_recompute"]


def _correction_replay(study: Study):
    """R2 vs R3 beside the corrections (figure 10): GRPO + R3 − GRPO + R2 final pass@1 paired by seed, with R2's
    π_old recomputed and no correction (figure 7's comparison) and with each correction. R3 paper's sign: R3
    ahead under a mismatched rollout engine. The verdict is the uncorrected pair's; the text says which
    correction changes it, and each correction's masked token fraction."""
    texts, per = [], {}
    for c in CORRECTIONS:
        text, per[c] = difference(study, final_pass, "grpo_r3_bf16", f"grpo_r2_{c}", f"R3 − R2 ({CORRECTIONS[c]})",
                                  "diff", +1)  # fmt: skip
        masked = training_mean("correction/masked_frac/token")(study, f"grpo_r2_{c}").mean()
        masked_text = "" if math.isnan(masked) else f", R2's masked tokens {masked:.3%}"
        texts.append(f"{text}{masked_text} → {per[c]}")
    k3_r2, k3_r3 = (
        training_mean("mismatch/k3")(study, r).mean() for r in ("grpo_r2_bf16_recompute", "grpo_r3_bf16")
    )
    texts.append(f"k3 mismatch R2 {k3_r2:.3g}, R3 {k3_r3:.3g}")
    texts.append(_changed(per["bf16_recompute"], per))
    head = _runs_found(study)
    return head + "; ".join(texts), per["bf16_recompute"]


# ------------------------------------------------------------------------------------- figure 11: the long horizon
LONG_ARMS = {"grpo": "grpo_bf16_recompute", "grpo_r2": "grpo_r2_bf16_recompute", "grpo_r3": "grpo_r3_bf16",
             "gspo": "gspo_bf16_recompute"}  # fmt: skip
TARGET_HALF_WIDTH = 0.05  # the gap in final pass@1 the long-horizon comparison is sized to see (issue 32 §3)
BEFORE = 25  # steps of the instrument's readings before a collapse (or the run's last steps without one)
READINGS = {"k3": "mismatch/k3", "F(2)": "mismatch/f_tau_2", "routing gap": "moe/train_infer_routing/tokens_any_changed",
            "R2 share": "moe/route/r2_removed_share", "grad norm": "train/grad_norm"}  # fmt: skip


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
    return f"half-width {half:.3f} > {TARGET_HALF_WIDTH}: underpowered; SD {d.std(ddof=1):.3f} needs {need} seeds"


def _long_claim(study: Study, a: str, b: str, sign: int):
    """A − B final pass@1 paired by seed on figure 11's runs, with the interval's half-width and the seeds it
    would take to reach TARGET_HALF_WIDTH; verdict as every difference row."""
    ra, rb = LONG_ARMS[a], LONG_ARMS[b]
    d = (final_pass(study, ra) - final_pass(study, rb)).dropna()
    text, v = difference(study, final_pass, ra, rb, "final pass@1", "diff", sign)
    return _runs_found(study) + f"{text}; {_powered(d)}", v


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
    the BEFORE steps before it (over each arm's last BEFORE steps when none did). Verdict: "reproduces" when GRPO
    without replay collapses in at least half its runs and GRPO + R2 in none, "not reproduced" when no GRPO
    without replay run collapses, else "inconclusive"."""
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
        texts.append(f"{label(run)}: {len(down)} of {len(found)} collapsed" + (f" ({when})" if when else "") +
                     f" in {horizon} steps; {'before it' if down else f'last {BEFORE} steps'}: {readings}")  # fmt: skip
    if "grpo" not in counts:
        return _runs_found(study) + "none of GRPO without replay", "inconclusive"
    k, n = counts["grpo"]
    k2 = counts.get("grpo_r2", (0, 0))[0]
    v = "reproduces" if 2 * k >= n and k2 == 0 and k > 0 else "not reproduced" if k == 0 else "inconclusive"
    return _runs_found(study) + "; ".join(texts), v


CLAIMS = [
    Claim("RL improves on the cold start (precondition for the claims below)", "steady gains with "
          "training compute (Fig. 1)", ("gspo",), _improves),
    Claim("GSPO trains more efficiently than GRPO + R2 (Fig. 1)", "higher reward and benchmark scores "
          "at equal training compute", ("gspo", "grpo_r2"), _efficiency),
    Claim("GSPO clips about 100× more tokens than GRPO (Fig. 2)",
          f"{PAPER_CLIP_FRAC['gspo']} vs {PAPER_CLIP_FRAC['grpo_r2']}", ("gspo", "grpo_r2"), _clipping),
    Claim("GRPO without Routing Replay fails to converge normally on MoE (Fig. 3)", "lower reward and "
          "scores than GRPO + R2", ("grpo", "grpo_r2"), _replay),
    Claim("Expert volatility: ~10% of activated experts change per update (§5.3)", f"~{PAPER_VOLATILITY} "
          "(48-layer Qwen3-30B-A3B, one update)", ("gspo", "grpo"), _volatility),
    Claim("GSPO tolerates precision mismatch: rollout log-probs need no recompute (§5.4)", "no loss "
          "(no number reported)", (), _precision, figure=6),
    Claim("Where routing moves, GRPO without replay falls behind GSPO and GRPO + R2 (Fig. 8, ours)",
          "§5.3: GRPO without replay fails on MoE; replay or GSPO fixes it", (), _sweep, figure=8),
    Claim("Where routing is most of the ratio (policy lag, Fig. 9, ours), GRPO without replay falls behind "
          "GRPO + R2 (claim 4 at the regime)", "§5.3; Qwen arXiv 2512.01374: replay needed as staleness grows",
          (), _lag, figure=9),
    Claim("GSPO trains more efficiently than GRPO + R2 at that regime (claim 2 at the regime, Fig. 9)",
          "higher reward and scores (Fig. 1, at lag 0)", (), _lag_efficiency, figure=9),
    Claim("How much of the importance ratio is routing (the instrument, Fig. 9, ours)", "R2 removes the routing "
          "term (§5.3); no number reported", (), _instrument, figure=9),
    Claim("§5.4 beside the train–inference corrections (Fig. 10, ours): rollout log-probs are no worse than "
          "recomputed π_old, with token TIS, sequence MIS or IcePop", "no loss (§5.4); TRL, verl, slime correct by "
          "default", (), _correction_precision, figure=10),
    Claim("R3 ahead of R2 under a bf16 rollout engine, with and without a correction on R2 (Fig. 10, ours)",
          "R3 paper (arXiv 2510.11370): R3 fixes the mismatch R2 leaves", (), _correction_replay, figure=10),
    Claim("GRPO without replay collapses over ≥ 300 steps under a bf16 rollout engine, GRPO + R2 does not (Fig. 11, "
          "ours; collapse rule: analysis/collapse.py)", "R3 paper: 3 of 3 GRPO baselines collapsed (k3 ≈ 1.5e-3); "
          "IcePop, Miles, VeXact: after ≈ 150–320 steps", (), _collapse, figure=11),
    Claim("GRPO without Routing Replay falls behind GRPO + R2 at the long horizon (claim 4, Fig. 11)",
          "lower reward and scores than GRPO + R2 (Fig. 3)", (), _long_replay, figure=11),
    Claim("GSPO trains more efficiently than GRPO + R2 at the long horizon (claim 2, Fig. 11)",
          "higher reward and scores (Fig. 1)", (), _long_efficiency, figure=11),
]  # fmt: skip


# ------------------------------------------------------------------------------------------------ report
def _commit() -> str:
    try:
        cmd = ["git", "rev-parse", "--short", "HEAD"]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=5, cwd=Path(__file__).parent)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def rows(study: Study, sweeps: dict[int, Study], claims=None) -> list[tuple[str, str, str, str]]:
    """(claim, paper, ours, verdict) per claim (`claims`: all); "not run" where a run or seed is missing."""
    absent = {run for run, _, _ in study.missing}
    out = []
    for c in CLAIMS if claims is None else claims:
        if c.figure is not None:
            sweep = sweeps[c.figure]
            out.append((c.text, c.paper, *c.measure(sweep)) if sweep.runs else
                       (c.text, c.paper, f"missing: all runs of figure {c.figure}", "not run"))  # fmt: skip
            continue
        gone = [r for r in c.runs if r in absent]
        if gone:
            seeds = sorted({s for r, s, _ in study.missing if r in gone})
            out.append((c.text, c.paper, f"missing: {', '.join(gone)} (seeds {seeds})", "not run"))
            continue
        ours, v = c.measure(study)
        out.append((c.text, c.paper, ours, v))
    return out


def _shown_uri(uri: str) -> str:
    """A sqlite store under the repository (or the working directory) named relative to it, not by this machine's
    absolute path; any other URI as it is."""
    if not uri.startswith("sqlite:///"):
        return uri
    path = Path(uri.removeprefix("sqlite:///"))
    for root in (Path(__file__).resolve().parents[1], Path.cwd().resolve()):
        try:
            return f"sqlite:///{path.resolve().relative_to(root)}"
        except ValueError:
            continue
    return uri


def render(
    study: Study, sweeps: dict[int, Study], scale: str, seeds: list[int], figure: int | None = None
) -> str:
    runs = [*study.runs, *(r for sweep in sweeps.values() for r in sweep.runs)]
    commits = sorted({r.tags.get("git_commit", "unknown")[:12] for r in runs}) or ["(no runs)"]
    claims = CLAIMS if figure is None else [c for c in CLAIMS if c.figure == figure]
    title = f"# Reproduction report: scale `{scale}`" + (
        f", the claims measured on figure {figure}'s sweep" if figure else ""
    )
    lines = [
        title,
        "",
        f"- seeds: {', '.join(map(str, seeds))}",
        f"- git commit(s) of the runs: {', '.join(commits)}; report drawn at {_commit()}",
        f"- date: {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC",
        f"- runs: MLflow experiment `{study.experiment}` at `{_shown_uri(study.uri)}`",
        "",
        "| # | claim (GSPO paper) | paper | ours (mean [95% CI]) | verdict |",
        "|---|---|---|---|---|",
    ]
    for c, row in zip(claims, rows(study, sweeps, claims)):
        lines.append(f"| {CLAIMS.index(c) + 1} | " + " | ".join(x.replace("|", "\\|") for x in row) + " |")
    rule = __doc__.split("Per-seed measures:", 1)[1].split("The REPORT.md", 1)[0]
    return "\n".join(lines) + "\n\n## How the numbers and verdicts are computed\n\nPer-seed measures:" + rule


def make_report(scale: str, seeds: list[int], overrides=(), figure: int | None = None) -> Path:
    """REPORT.md (every claim), or with `figure` REPORT-figure-N.md: only the claims measured on that figure's
    sweep, from its runs alone (e.g. where the base runs of claims 1–5 are not in this store)."""
    claims = CLAIMS if figure is None else [c for c in CLAIMS if c.figure == figure]
    if not claims:
        raise ConfigError(f"bad figure {figure!r}; allowed: one whose sweep a claim is measured on "
                          f"({', '.join(str(c.figure) for c in CLAIMS if c.figure is not None)})")  # fmt: skip
    runs = list(dict.fromkeys(r for c in claims for r in c.runs))
    figs = {c.figure for c in claims if c.figure is not None}
    sweeps = {f: load(figure_configs(f, scale, seeds, tuple(overrides))) for f in figs}
    study = (load([(r, run_config(scale, r, s, tuple(overrides))) for r in runs for s in seeds]) if runs
             else sweeps[figure])  # fmt: skip
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
    path.write_text(render(study, sweeps, scale, seeds, figure))
    if study.runs:
        log_outputs(study, "report", {"report": scale, "seeds": ",".join(map(str, seeds))}, [path])
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scale", default="cpu", help="smoke | cpu | paper")
    p.add_argument("--seeds", help="e.g. 1,2,3 (default: the scale's default seeds)")
    p.add_argument(
        "--figure", type=int, help="only the claims measured on this figure's sweep (REPORT-figure-N.md)"
    )
    p.add_argument("overrides", nargs="*", help="key.sub=value overrides for every run (e.g. results_dir=)")
    args = p.parse_args(argv)
    try:
        path = make_report(args.scale, parse_seeds(args.seeds, args.scale), args.overrides, args.figure)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
