"""The report's verdict rules (analysis/report.py's `METHOD`), each on data built to pass it and data built to
fail it: a harmful difference inside the no-harm margin and one outside, an interval too wide to see the gap it
tests for, a magnitude within and outside the window, and the pooled, collapse and multiplicity rules."""

from __future__ import annotations

import math

import pandas as pd
import pytest

from analysis.report import (
    METHOD,
    WITHIN,
    Verdict,
    collapse_verdict,
    combine,
    estimate,
    factor,
    verdict,
)

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


def test_combine():
    assert combine([V.REPRODUCES, V.REPRODUCES]) == V.REPRODUCES
    assert combine([V.CONSISTENT, V.CONSISTENT]) == V.CONSISTENT
    assert combine([V.REPRODUCES, V.CONSISTENT]) == V.REPRODUCES
    assert combine([V.REPRODUCES, V.INCONCLUSIVE]) == V.INCONCLUSIVE
    assert combine([V.INCONCLUSIVE, V.UNDERPOWERED]) == V.UNDERPOWERED
    assert combine([V.INCONCLUSIVE, V.NOT_REPRODUCED, V.REPRODUCES]) == V.NOT_REPRODUCED


def test_collapse_verdict():
    assert collapse_verdict(0, 3, 0) == V.NOT_REPRODUCED  # GRPO without replay never collapsed
    assert collapse_verdict(2, 3, 0) == V.REPRODUCES
    assert collapse_verdict(2, 3, 1) == V.INCONCLUSIVE  # R2 collapsed too
    assert collapse_verdict(1, 3, 0) == V.INCONCLUSIVE  # fewer than half


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


def test_sweep_pools_by_seed_and_sets_collapsed_cells_apart():
    """Figure 8's rule on a constructed sweep: 2 moving cells, one where every algorithm collapses. The pooled Δ
    is over seeds (n = 3), not (cell, seed) pairs, and the collapsed cell is named, not pooled."""
    from analysis import report

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

    orig = report.sweep_table
    report.sweep_table = lambda s: pd.DataFrame(rows)
    try:
        text, v, _ = report._sweep(Fake())
    finally:
        report.sweep_table = orig
    assert "every algorithm collapses at B" in text and "mean over 1 cells" in text and "(n=3)" in text
    assert v == V.REPRODUCES  # GSPO +0.1, R2 +0.05 in cell A at every seed
