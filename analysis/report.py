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
from pathlib import Path

from analysis.claims import CLAIMS, Claim
from analysis.drawing import log_outputs
from analysis.figures import depth
from analysis.rules import (
    ALPHA,
    COLLAPSE_RATE,
    MARGIN,
    MOVING,
    POWER,
    ROUTE,
    VOL_UPDATE,
    WITHIN,
    Estimate,
    Result,
    Verdict,
)
from analysis.runs import Study, load
from analysis.stats import clopper_pearson
from gspo_study.archive import draw_notice
from gspo_study.config import ConfigError
from gspo_study.run import run_key, sqlite_path
from gspo_study.study import drawn_at, figure_configs, figures, parse_seeds, run_config
from gspo_study.tracking import git_commit

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
            if sweep is None:
                out.append(Result(f"figure {c.figure} has no runs at this scale", otherwise=Verdict.NOT_RUN))
                continue
            if not sweep.runs:
                out.append(Result(f"missing: all runs of figure {c.figure}", otherwise=Verdict.NOT_RUN))
                continue
            others = {f: sweeps[f] for f in c.also if sweeps.get(f) is not None}
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
        rs = sweeps[c.figure].runs if sweeps.get(c.figure) is not None else []
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
    runs = [*study.runs, *(r for sweep in sweeps.values() if sweep is not None for r in sweep.runs)]
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
    for f in (f for f in FIGURES if drawn_at(f, scale)):  # the frontier runs at the smoke and cpu scales
        own = seeds if seeds is not None else parse_seeds(None, scale, f)
        configs = figure_configs(f, scale, own, tuple(overrides))
        planned |= {run_key(c) for _, c in configs}  # a run shared by both figures (dose 0) is planned once
        studies[f] = load(configs)
    return (*section(studies, planned=len(planned)), studies) if studies else ("", {}, {})


def _mechanism(scale: str, seeds: list[int] | None, overrides, frontier: dict[int, Study]) -> tuple[str, dict]:
    """Axis R's section and records (analysis/mechanism.py) from figure 17's finished runs, its cause-of-death table
    joined by the frontier's collapsed runs; ("", {}) where none has finished."""
    from analysis import frontier as fr
    from analysis import mechanism

    configs = {}  # the stages' runs, each once (a run shared by two stages, e.g. dose 0, has one key)
    for f in (f for f in mechanism.FIGURES if f"figure-{f}" in figures() and drawn_at(f, scale)):
        own = seeds if seeds is not None else parse_seeds(None, scale, f)
        configs.update({run_key(c): (r, c) for r, c in figure_configs(f, scale, own, tuple(overrides))})
    if not configs:
        return "", {}
    study = load(list(configs.values()))
    plan = fr.load_plan()
    dead = [(s, fr.outcomes(s, plan, decisive=True)) for s in frontier.values() if s.runs]
    return mechanism.section(study, frontier=dead)


def _dppo(scale: str, seeds: list[int] | None, overrides) -> tuple[str, dict]:
    """The DPPO arm's section and records (analysis/dppo.py) from figure 18's finished runs; ("", {}) before any
    DPPO run finished."""
    from analysis import dppo

    if not drawn_at(dppo.FIGURE, scale):
        return "", {}
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
    if figure is not None and not drawn_at(figure, scale):
        raise ConfigError(f"bad figure {figure} at scale {scale!r}; allowed: a scale its sweep lists")
    sweeps = {  # None: the figure has no runs at this scale (its sweep lists others)
        f: load(figure_configs(f, scale, per_figure[f], tuple(overrides))) if drawn_at(f, scale) else None
        for f in sorted(figs)
    }
    found_sweeps = [w for w in sweeps.values() if w is not None]
    study = (
        load([(r, run_config(scale, r, s, tuple(overrides))) for r in runs for s in seeds]) if runs else sweeps[figure]
    )
    path = study.out_dir / ("REPORT.md" if figure is None else f"REPORT-figure-{figure}.md")
    if not study.runs and not any(s.runs for s in found_sweeps):  # e.g. a fresh clone: no store shipped
        raise ConfigError(
            f"no tracked runs of scale {scale!r} (seeds {', '.join(map(str, seeds))}) in {study.uri}; train them "
            f"first (make reproduce-figure-N SCALE={scale}); {path} is left as it is"
        )
    used = {run_key(r.cfg): r.tags for r in [*study.runs, *(r for w in found_sweeps for r in w.runs)]}
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
    if figure is None:  # the same results as numbers, for text written from them (analysis/doc_blocks.py)
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
