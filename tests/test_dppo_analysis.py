"""The DPPO arm's analysis (analysis/dppo.py) on synthetic runs built to pass and to fail each reading of its plan:
the per-comparison reading at its boundaries, the mismatch reading (untested where the dose costs GRPO nothing), and
figure 18 drawn in range. No training: a few seconds."""

from __future__ import annotations

import functools

import numpy as np
import pandas as pd
import pytest

from analysis import dppo
from analysis.drawing import draw
from analysis.runs import PASS1, REWARD, Study, TrackedRun
from gspo_study.study import figure_configs

PLAN = dppo.load_plan()
STEPS = 300
SEEDS = (3, 4, 5, 6)


def _history(run_id: str, run: str, seed: int, final: float) -> list[tuple]:
    rows = [(run, run, seed, run_id, s, REWARD, 0.6 + 0.2 * s / STEPS, float(s)) for s in range(1, STEPS + 1)]
    rows += [(run, run, seed, run_id, s, PASS1, 0.6 if s == 0 else final, float(s)) for s in range(0, STEPS + 1, 50)]
    return rows


@functools.cache
def configs(seeds: tuple[int, ...]) -> list:
    return figure_configs(18, "cpu", list(seeds))


def study(final, seeds=SEEDS) -> Study:
    """Figure 18's runs at `seeds`, each run's final pass@1 from `final(run, axis M's σ, seed)`."""
    runs, rows = [], []
    for i, (run, cfg) in enumerate(configs(tuple(seeds))):
        rid = f"r18-{i}"
        runs.append(TrackedRun(run, cfg.seed, cfg, rid, {"git_commit": "0" * 40}))
        rows += _history(rid, run, cfg.seed, final(run, cfg.rollout.router_noise, cfg.seed))
    frame = pd.DataFrame(rows, columns=["run", "label", "seed", "run_id", "step", "metric", "value", "flops"])
    return Study(runs, frame, "sqlite:///unused", "study-cpu", runs[0].cfg.out_dir, "steps")


@pytest.mark.parametrize(
    "diffs, word",
    [
        ([0.10, 0.11, 0.09, 0.10], "DPPO ahead"),
        ([0.045, 0.055, 0.035, 0.045], "inconclusive"),  # excludes 0 but not by δ, and not inside ±δ either
        ([-0.10, -0.11, -0.09, -0.10], "DPPO behind"),
        ([0.001, -0.002, 0.0, 0.001], "equivalent within ±0.05"),
        ([0.3, -0.3, 0.2, -0.25], "underpowered"),
    ],
)
def test_the_per_comparison_reading_at_its_boundaries(diffs, word):
    assert dppo.judge(np.array(diffs), 0.05)[0] == word


def test_the_mismatch_reading_is_untested_where_the_dose_costs_grpo_nothing():
    flat = study(lambda run, s, seed: 0.7 + 0.003 * seed)  # no arm pays for the dose
    out = dppo.outcomes(flat, PLAN)
    table, word = dppo.mismatch(out, PLAN)
    assert word == dppo.UNTESTED and len(table) == 4 and np.allclose(table.cost, 0)
    # the dose costs GRPO 0.15 and DPPO 0.15 too: tested, and the difference of differences is equivalent
    both = study(lambda run, s, seed: 0.7 + 0.003 * seed - (0.15 + 0.001 * seed if s > 0 else 0))
    assert "equivalent within" in dppo.mismatch(dppo.outcomes(both, PLAN), PLAN)[1]
    # the dose costs GRPO 0.15 and DPPO nothing: DPPO's cost − GRPO's is +0.15, "DPPO ahead"
    robust = study(lambda run, s, seed: 0.7 + 0.003 * seed - (0.15 + 0.001 * seed if s > 0 and run != "dppo" else 0))
    assert dppo.mismatch(dppo.outcomes(robust, PLAN), PLAN)[1].endswith("DPPO ahead")


def test_comparisons_pair_by_seed_and_the_section_and_figure_18_draw(tmp_path):
    s = study(lambda run, sigma, seed: (0.8 if run == "dppo" else 0.7) + 0.01 * seed)
    out = dppo.outcomes(s, PLAN)
    comp = dppo.comparisons(out, PLAN)
    assert len(comp) == 6 and np.allclose(comp.delta, 0.1) and (comp.reading == "DPPO ahead").all()  # 2 cells × 3
    text, records = dppo.section(s, PLAN)
    assert "DPPO against each arm" in text and records["mismatch_reading"] == dppo.UNTESTED
    fig, drawn = draw(s, 18, "t", dppo.panels(s, PLAN))
    shares = drawn[drawn.metric == PASS1]
    assert shares[["line", "band_lower", "band_upper"]].stack().dropna().between(0, 1).all()
    assert set(drawn.panel.dropna()) >= {"a", "b", "c"}
