"""The report's verdict rules (analysis/report.py's `METHOD`), each on data built to pass it and data built to
fail it: a harmful difference inside the no-harm margin and one outside, an interval too wide to see the gap it
tests for, a magnitude within and outside the window, a count against its exact interval, and the pooled and
multiplicity rules; and the one-primary-measure rule: a row's verdict is its primary measure's alone, on
constructed runs and in the shipped REPORT.json."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pandas as pd
import pytest

from analysis import claims, report, rules
from analysis.claims import CLAIMS, Claim
from analysis.report import METHOD
from analysis.rules import (
    WITHIN,
    Result,
    Verdict,
    collapse_verdict,
    count,
    estimate,
    factor,
    fisher_verdict,
    verdict,
)
from analysis.runs import PASS1, REWARD, Study, TrackedRun

ROOT = Path(__file__).resolve().parents[1]

NAN = math.nan
V = Verdict


@pytest.mark.parametrize(
    ("kind", "lo", "hi", "sign", "paper", "want"),
    [
        # difference rows (δ = MARGIN = 0.05)
        ("diff", 0.01, 0.2, +1, NAN, V.REPRODUCES),  # excludes 0 on the paper's side
        ("diff", 0.001, 0.04, +1, NAN, V.REPRODUCES),  # the sign, however small
        ("diff", -0.2, -0.01, +1, NAN, V.NOT_REPRODUCED),  # wholly on the other side
        ("diff", -0.04, 0.04, +1, NAN, V.NOT_REPRODUCED),  # excludes every gap ≥ δ on the paper's side
        ("diff", -0.25, 0.03, +1, NAN, V.NOT_REPRODUCED),  # wide, but still below δ on the paper's side
        ("diff", -0.1, 0.1, +1, NAN, V.UNDERPOWERED),  # half-width 0.1 > δ: cannot see a 0.05 gap
        ("diff", -0.01, 0.07, +1, NAN, V.INCONCLUSIVE),  # half-width 0.04 ≤ δ, still reaches δ
        ("diff", -0.2, -0.01, -1, NAN, V.REPRODUCES),  # the paper says A < B
        ("diff", 0.01, 0.2, -1, NAN, V.NOT_REPRODUCED),  # A > B where the paper says A < B
        ("diff", NAN, NAN, +1, NAN, V.INCONCLUSIVE),  # fewer than 2 seeds: no interval
        # no-harm rows: the non-inferiority margin δ
        ("no_harm", -0.03, 0.02, +1, NAN, V.CONSISTENT),  # a harm inside the margin
        ("no_harm", 0.01, 0.2, +1, NAN, V.CONSISTENT),
        ("no_harm", -0.3, -0.06, +1, NAN, V.NOT_REPRODUCED),  # a harm beyond the margin
        (
            "no_harm",
            -0.104,
            0.124,
            +1,
            NAN,
            V.UNDERPOWERED,
        ),  # claim 6's shipped interval: cannot rule harm out
        ("no_harm", -0.08, 0.0, +1, NAN, V.INCONCLUSIVE),  # narrow, but reaching below −δ
        # magnitude rows: within a factor WITHIN of the paper's value
        ("magnitude", 0.05, 0.2, +1, 0.1, V.REPRODUCES),
        ("magnitude", 0.0013, 0.0018, +1, 0.1, V.NOT_REPRODUCED),  # ≈ 65× lower
        ("magnitude", 0.02, 0.05, +1, 0.1, V.INCONCLUSIVE),  # straddles value/3
        ("magnitude", 0.5, 0.9, +1, 0.1, V.NOT_REPRODUCED),  # wholly above value·3
    ],
)
def test_verdict(kind, lo, hi, sign, paper, want):
    assert verdict(kind, lo, hi, sign, paper) == want


def test_magnitude_window_edges_are_inside_and_the_old_tenfold_window_is_gone():
    assert verdict("magnitude", 0.1 / WITHIN, 0.1 * WITHIN, +1, 0.1) == V.REPRODUCES
    assert verdict("magnitude", 0.012, 0.015, +1, 0.1) == V.NOT_REPRODUCED  # inside 10×, outside 3×


def test_factor_says_how_far_off():
    assert factor(0.001, 0.002, 0.1) == "≈ 66.7× lower at this scale"
    assert factor(0.5, 0.7, 0.1) == "≈ 6× higher at this scale"
    assert factor(0.05, 0.2, 0.1) == ""


def test_the_tested_effect_is_a_parameter():
    # claim 3's δ is the paper's own difference (0.15 − 0.0013): half-width 0.125 can see it, not a 0.05 gap
    assert verdict("diff", -0.05, 0.2, +1, effect=0.1487) == V.INCONCLUSIVE
    assert verdict("diff", -0.05, 0.2, +1) == V.UNDERPOWERED
    assert verdict("diff", -0.05, 0.1, +1, effect=0.1487) == V.NOT_REPRODUCED  # excludes the paper's gap


def test_combine_is_gone():
    """No rule folds several measures into a row's verdict any more."""
    assert not hasattr(report, "combine") and "`combine`" not in METHOD


def test_collapse_verdict_reads_the_exact_interval():
    assert collapse_verdict(0, 4) == V.UNDERPOWERED  # 0 of 4 still allows a rate up to 60 %
    assert collapse_verdict(0, 5) == V.UNDERPOWERED  # up to 52 %
    assert collapse_verdict(0, 6) == V.NOT_REPRODUCED  # up to 46 %: excludes half the runs collapsing
    assert collapse_verdict(1, 12) == V.NOT_REPRODUCED  # 1 of 12: up to 38 %
    assert collapse_verdict(2, 4) == V.REPRODUCES  # half of them
    assert collapse_verdict(3, 3) == V.REPRODUCES
    assert collapse_verdict(1, 4) == V.UNDERPOWERED  # fewer than half, interval still reaching it
    assert collapse_verdict(0, 0) == V.INCONCLUSIVE
    e = count("GRPO", 0, 4, judged=True)
    assert e.value() == "0 of 4 [0, 60 %]" and e.verdict == V.UNDERPOWERED
    assert count("R2", 0, 4, judged=False).verdict == V.MEASURED


def test_the_count_rules_old_version_is_kept_and_differs():
    """The count rule before 2026-12-04 (`collapse_verdict_v1`) stays in code, so row 13 can say what it reads; it
    calls 0 of 4 "not reproduced", which the rule in force does not."""
    assert rules.collapse_verdict_v1(0, 4, 0) == V.NOT_REPRODUCED != collapse_verdict(0, 4)
    assert rules.collapse_verdict_v1(2, 4, 0) == V.REPRODUCES and rules.collapse_verdict_v1(2, 4, 1) == V.INCONCLUSIVE


def test_fisher_verdict():
    assert fisher_verdict(3, 3, 0, 3) == V.REPRODUCES  # p = 0.05 exactly: the R3 paper's 3 of 3 vs 0 of 3
    assert fisher_verdict(0, 4, 0, 4) == V.INCONCLUSIVE  # p = 1, yet 4 of 4 vs 0 of 4 could have shown it
    assert fisher_verdict(2, 2, 0, 2) == V.UNDERPOWERED  # p = 1/6: no outcome at n = 2 reaches 0.05
    assert fisher_verdict(2, 3, 0, 3) == V.INCONCLUSIVE  # p = 0.2


def _study(finals: dict[str, list[float]], rewards: dict[str, list[float]]) -> Study:
    """Runs of `finals` keys at seeds 1..n: held-out pass@1 0.5 at step 0 and `finals` at step 10, the training
    reward `rewards` at every step 1..10 (so the final reward is that value)."""
    cfg = SimpleNamespace(train=SimpleNamespace(steps=10), eval=SimpleNamespace(every=5))
    rows, runs = [], []
    for run, values in finals.items():
        for seed, (final, reward) in enumerate(zip(values, rewards[run]), start=1):
            rid = f"{run}-{seed}"
            runs.append(TrackedRun(run, seed, cfg, rid, {}))
            rows += [(run, seed, rid, 0, PASS1, 0.5), (run, seed, rid, 10, PASS1, final)]
            rows += [(run, seed, rid, step, REWARD, reward) for step in range(1, 11)]
    frame = pd.DataFrame(rows, columns=["run", "seed", "run_id", "step", "metric", "value"])
    return Study(runs, frame, "sqlite:///none", "x", Path("."))


def test_a_row_is_judged_on_its_primary_measure_alone():
    """Claim 2 on runs built so that final pass@1 cannot see the gap (underpowered) while the final reward rules
    it out (not reproduced): the row reads "underpowered", the reward its own verdict beside it. The old
    `combine` rule would have read "not reproduced" here."""
    s = _study(
        {"gspo": [0.7, 0.4, 0.6], "grpo_r2": [0.5, 0.5, 0.5]},
        {"gspo": [0.60, 0.61, 0.60], "grpo_r2": [0.60, 0.60, 0.60]},
    )
    r = claims._efficiency(s)
    assert r.primary.measure == CLAIMS[1].primary and r.primary.verdict == V.UNDERPOWERED
    assert [e.verdict for e in r.secondary] == [V.NOT_REPRODUCED]
    assert r.verdict == V.UNDERPOWERED
    assert report.checked(CLAIMS[1], r) is r


def test_a_verdict_from_another_measure_is_refused():
    reward = estimate("final reward", pd.Series([0.0, 0.01, -0.01]), measure="final reward, GSPO − GRPO + R2")
    with pytest.raises(ValueError, match=r"judged on 'final reward, GSPO − GRPO \+ R2'; allowed: its primary"):
        report.checked(CLAIMS[1], Result(primary=reward))
    claim = Claim("x", "y", "final pass@1, GSPO − GRPO + R2", (), measure=lambda s: None)
    assert report.checked(claim, Result("a reading", otherwise=V.MEASURED)).verdict == V.MEASURED


def test_shipped_report_verdicts_are_their_primary_measures():
    """REPORT.json as shipped: each row's verdict is the verdict of its one primary estimate, which is the measure
    its claim declares; REPORT.md's first table shows the same verdicts and measures."""
    records = json.loads((ROOT / "results/cpu/REPORT.json").read_text())
    assert [r["claim"] for r in records] == list(range(1, len(CLAIMS) + 1))
    rows = report.sections((ROOT / "results/cpu/REPORT.md").read_text())
    for rec, claim in zip(records, CLAIMS):
        primary = [e for e in rec["estimates"] if e["role"] == "primary"]
        assert rec["primary_measure"] == claim.primary
        if primary:
            assert len(primary) == 1 and rec["estimates"][0] == primary[0]
            assert primary[0]["measure"] == claim.primary and rec["verdict"] == primary[0]["verdict"]
        else:
            assert rec["verdict"] in ("measured", "not run", "inconclusive")
        line = rows[rec["claim"]].splitlines()[0]
        assert report.verdict_of(line) == rec["verdict"] and claim.primary in line


def test_estimate_renders_its_half_width_once():
    e = estimate("final pass@1", pd.Series([0.1, 0.2, 0.15]))
    assert e.n == 3 and math.isclose(e.half_width, (e.hi - e.lo) / 2)
    assert f"±{e.half_width:.3g} (n=3)" in e.text() and e.text().startswith("final pass@1: Δ 0.15 [")
    assert e.verdict == verdict("diff", e.lo, e.hi)
    one = estimate("x", pd.Series([0.3]))
    assert "±" not in one.text() and one.verdict == V.INCONCLUSIVE


def test_method_states_the_margin_and_window():
    """The margin δ and the magnitude window that the printed method states (read from its text, as a reader
    would) are where `verdict`'s outcomes change."""
    import re

    delta = float(re.search(r"δ = ([0-9.]+)", METHOD)[1])
    window = float(re.search(r"\[value/([0-9.]+),", METHOD)[1])
    below, above = delta * 0.99, delta * 1.01
    assert verdict("diff", -0.01, below) == V.NOT_REPRODUCED and verdict("diff", -0.01, above) == V.INCONCLUSIVE
    assert verdict("no_harm", -below, 0.01) == V.CONSISTENT and verdict("no_harm", -above, 0.01) == V.INCONCLUSIVE
    paper = 0.1
    inside, outside = (paper / window * 1.01, paper * window * 0.99), (paper / window * 0.99, paper * window * 0.99)
    assert verdict("magnitude", *inside, paper=paper) == V.REPRODUCES
    assert verdict("magnitude", *outside, paper=paper) == V.INCONCLUSIVE
    assert verdict("magnitude", paper * window * 1.01, paper * window * 2, paper=paper) == V.NOT_REPRODUCED
    assert "One primary measure per claim" in METHOD


def test_sweep_pools_by_seed_and_sets_collapsed_cells_apart():
    """Figure 8's rule on a constructed sweep: 2 moving cells, one where every algorithm collapses. The pooled Δ
    is over seeds (n = 3), not (cell, seed) pairs, and the collapsed cell is named, not pooled."""
    rows = []
    for seed in (1, 2, 3):
        for cell, start, finals, vol in (
            ("A", 0.5, {"grpo": 0.5, "gspo": 0.6, "grpo_r2": 0.55}, 0.02),
            ("B", 0.6, {"grpo": 0.10, "gspo": 0.12, "grpo_r2": 0.11}, 0.02),
            ("C", 0.5, {"grpo": 0.5, "gspo": 0.5, "grpo_r2": 0.5}, 0.001),
        ):
            for run, final in finals.items():
                rows.append(dict(run=run, seed=seed, cell=cell, start=start, final=final + 0.01 * seed, vol=vol))

    class Fake:
        runs, missing = [object()] * 27, []

    orig = claims.sweep_table
    claims.sweep_table = lambda s: pd.DataFrame(rows)
    try:
        r = claims._sweep(Fake())
    finally:
        claims.sweep_table = orig
    assert "every algorithm collapses at B" in r.context
    assert "mean over 1 cells" in r.primary.name and r.primary.n == 3 and r.primary.measure == CLAIMS[6].primary
    assert r.verdict == V.REPRODUCES  # R2 +0.05 in cell A at every seed (primary); GSPO +0.1 beside it


def test_a_difference_carries_its_equivalence_reading_beside_its_verdict():
    """experiments/headline/plan.yaml: "equivalent within ±δ" when both one-sided 95 % bounds lie inside ±δ, shown
    beside the verdict (which stays the difference rule's), and absent where the bounds reach past δ."""
    tight = estimate("final pass@1", pd.Series([0.004, -0.003, 0.001, 0.0, 0.002, -0.001, 0.003, -0.002]))
    assert tight.equivalent is True and tight.verdict == V.NOT_REPRODUCED
    assert "equivalent within ±0.05 (both one-sided 95 % bounds inside)" in tight.text()
    wide = estimate("final pass@1", pd.Series([0.2, -0.2, 0.1]))
    assert wide.equivalent is False and "equivalent" not in wide.text() and wide.verdict == V.UNDERPOWERED
    assert estimate("x", pd.Series([0.01])).equivalent is None  # one seed: no reading


def test_the_headline_rows_say_whether_the_added_seeds_descend_from_their_plan():
    from analysis.frontier import plan_commit

    commit = plan_commit(claims.HEADLINE_PLAN)
    cfg = SimpleNamespace(seed=5)
    runs = [TrackedRun("gspo", s, cfg, f"r{s}", {"git_commit": c}) for s, c in ((1, "0" * 40), (5, commit))]
    study = Study(runs, pd.DataFrame(), "sqlite:///unused", "x", Path("."), "steps")
    said = claims.headline_check(study, "long_horizon")
    assert "the 1 runs of seeds added by experiments/headline/plan.yaml all descend from its commit" in said
    runs[1].tags["git_commit"] = "0" * 40  # a run older than the plan (not a commit of this repository)
    assert "not all descend" in claims.headline_check(study, "long_horizon")
    assert claims.headline_check(Study(runs[:1], pd.DataFrame(), "u", "x", Path("."), "steps"), "headline") == ""
