"""The report's verdict rules (analysis/report.py's docstring), one case per branch."""

from __future__ import annotations

import math

import pytest

from analysis.report import ORDER_OF_MAGNITUDE, combine, verdict

NAN = math.nan


@pytest.mark.parametrize(
    ("kind", "lo", "hi", "sign", "paper", "want"),
    [
        ("diff", 0.01, 0.2, +1, NAN, "reproduces"),  # interval above 0, the paper's side
        ("diff", -0.2, -0.01, +1, NAN, "not reproduced"),  # wholly on the other side
        ("diff", -0.1, 0.1, +1, NAN, "inconclusive"),
        ("diff", -0.2, -0.01, -1, NAN, "reproduces"),  # the paper says A < B
        ("diff", NAN, NAN, +1, NAN, "inconclusive"),  # fewer than 2 seeds: no interval
        ("no_harm", -0.3, -0.01, +1, NAN, "not reproduced"),  # wholly below 0
        ("no_harm", -0.3, 0.2, +1, NAN, "consistent"),
        ("no_harm", 0.01, 0.2, +1, NAN, "consistent"),
        ("magnitude", 0.02, 0.5, +1, 0.1, "reproduces"),  # within [value/10, value*10]
        ("magnitude", 0.001, 0.005, +1, 0.1, "not reproduced"),  # wholly below value/10
        ("magnitude", 0.005, 0.05, +1, 0.1, "inconclusive"),  # straddles value/10
    ],
)
def test_verdict(kind, lo, hi, sign, paper, want):
    assert verdict(kind, lo, hi, sign, paper) == want


def test_magnitude_band_edges_are_inside():
    assert verdict("magnitude", 0.1 / ORDER_OF_MAGNITUDE, 0.1 * ORDER_OF_MAGNITUDE, +1, 0.1) == "reproduces"


def test_combine():
    assert combine(["reproduces", "reproduces"]) == "reproduces"
    assert combine(["consistent", "consistent"]) == "consistent"
    assert combine(["reproduces", "consistent"]) == "reproduces"
    assert combine(["reproduces", "inconclusive"]) == "inconclusive"
    assert combine(["inconclusive", "not reproduced", "reproduces"]) == "not reproduced"
