"""Axis R's analysis (analysis/mechanism.py) on synthetic runs built to pass and to fail each reading of its plan: the
remedy's stand-ins and their check, the plan's three readings, the cause-of-death table, and figure 17 drawn in range.
No training: a few seconds."""

from __future__ import annotations

import functools
import math

import pandas as pd
import pytest

from analysis import mechanism, mechanism_figures
from analysis.drawing import draw
from analysis.runs import PASS1, REWARD, Study, TrackedRun
from gspo_study.study import figure_configs

PLAN = mechanism.load_plan()
STEPS = 300
SEEDS = [3, 4, 5]  # the pilot's and one more: a paired reading needs 3


def _history(run_id: str, run: str, seed: int, crash: int | None, final: float, share: float) -> list[tuple]:
    """Reward every step, pass@1 every 50 steps (0.6 at the cold start), the objective's routing reading every step."""
    rows = []
    for step in range(1, STEPS + 1):
        reward = 0.6 + 0.2 * step / STEPS if crash is None or step < crash else 0.0
        rows.append((run, run, seed, run_id, step, REWARD, reward, float(step)))
        for metric, v in (("pol_var", 1.0 - share), ("total_var", 1.0), ("flips", share / 5), ("mb_0/flips", 0.0)):
            rows.append((run, run, seed, run_id, step, f"moe/route_obj/{metric}", v, float(step)))
    for step in range(0, STEPS + 1, 50):
        p = 0.6 if step == 0 else (final if crash is None or step < crash else 0.0)
        rows.append((run, run, seed, run_id, step, PASS1, p, float(step)))
    return rows


@functools.cache
def configs(seeds: tuple[int, ...]) -> list:
    return figure_configs(17, "cpu", list(seeds))


def study(outcome, seeds=SEEDS) -> Study:
    """Figure 17's runs at `seeds`, each run's history from `outcome(cfg, run, seed)` → (crash step or None, final)."""
    runs, rows = [], []
    for i, (run, cfg) in enumerate(configs(tuple(seeds))):
        rid = f"r17-{i}"
        runs.append(TrackedRun(run, cfg.seed, cfg, rid, {"git_commit": "0" * 40}))
        share = min(0.95, 0.25 + 2 * cfg.train.route_noise) if not cfg.train.route_random else 1.0
        rows += _history(rid, run, cfg.seed, *outcome(cfg, run, cfg.seed), share if run != "grpo_r2" else 0.0)
    frame = pd.DataFrame(rows, columns=["run", "label", "seed", "run_id", "step", "metric", "value", "flops"])
    return Study(runs, frame, "sqlite:///unused", "study-cpu", runs[0].cfg.out_dir, "steps")


def r2_matters(cfg, run, seed):
    """GRPO without replay falls behind by 0.2 where the noise is in the ratio (σ ≥ 0.1) and dies under random top-k;
    its remedy and the sham never."""
    t = cfg.train
    if run == "grpo" and t.route_random:
        return 200, 0.7  # learns, then crashes at step 200
    if run == "grpo" and not t.route_sham and t.route_noise >= 0.1:
        return None, 0.58 + 0.002 * seed  # behind its remedy by 0.12, within δ of the cold start: no collapse
    return None, 0.7 + 0.002 * seed


def nothing_matters(cfg, run, seed):
    """Every arm at every dose the same, except that random top-k kills GRPO without replay (the detector works)."""
    if run == "grpo" and cfg.train.route_random:
        return 30, 0.0
    return None, 0.7 + 0.002 * seed


def test_the_remedys_stand_ins_and_their_check():
    s = study(nothing_matters, seeds=[3, 4])
    out = mechanism.outcomes(s, PLAN)
    r2 = out[out.arm == "grpo_r2"]
    assert set(r2[r2.stand_in].seed) == {4} and len(r2[r2.stand_in]) == 4  # three doses and the positive control
    check = mechanism.remedy_check(s, PLAN)
    assert len(check) == 4 and all(c["equal"] and c["seed"] == 3 for c in check)  # same histories: bit-identical
    moved = s.frame.copy()
    trained = next(r.run_id for r in s.runs if r.run == "grpo_r2" and r.cfg.train.route_noise == 0.1)
    moved.loc[(moved.run_id == trained) & (moved.metric == REWARD) & (moved.step == 7), "value"] += 1e-12
    s2 = Study(s.runs, moved, s.uri, s.experiment, s.out_dir, s.x)
    assert [c["equal"] for c in mechanism.remedy_check(s2, PLAN)].count(False) == 1  # one value in one run: caught


def test_the_plans_three_readings_can_each_be_reached():
    out = mechanism.outcomes(study(r2_matters), PLAN)
    summ, comp = mechanism.summary(out), mechanism.comparisons(out, PLAN)
    assert mechanism.verdict(summ, comp, PLAN)[0] == "R2 matters"
    out = mechanism.outcomes(study(nothing_matters), PLAN)
    summ, comp = mechanism.summary(out), mechanism.comparisons(out, PLAN)
    assert mechanism.verdict(summ, comp, PLAN)[0] == "R2 does not matter here"
    # the detector blind (random top-k harms nobody): no "does not matter", however equivalent the doses
    out = mechanism.outcomes(study(lambda cfg, run, seed: (None, 0.7 + 0.002 * seed)), PLAN)
    summ, comp = mechanism.summary(out), mechanism.comparisons(out, PLAN)
    assert mechanism.verdict(summ, comp, PLAN)[0] == "underpowered"
    # the deficit also under the sham: noisy routing, not the mismatch, would be the cause — not "R2 matters"
    sham_too = lambda cfg, run, seed: (None, 0.5) if run == "grpo" and cfg.train.route_noise >= 0.1 else (None, 0.7)  # noqa: E731
    out = mechanism.outcomes(study(sham_too), PLAN)
    summ, comp = mechanism.summary(out), mechanism.comparisons(out, PLAN)
    assert mechanism.verdict(summ, comp, PLAN)[0] != "R2 matters"


def test_collapses_under_both_rule_versions_and_the_cause_of_death_table():
    s = study(r2_matters, seeds=[3, 4])
    out = mechanism.outcomes(s, PLAN)
    dead = out[out.collapsed]
    assert set(dead.arm) == {"grpo"} and set(dead.kind) == {"positive"} and dead.collapsed_v2.all()
    table = mechanism.cause_of_death(s, out, "figure 17")
    assert len(table) == 2 and table.reward.eq(0.0).all() and table["reward before"].gt(0.6).all()
    assert math.isnan(table["max expert share"].iloc[0])  # not logged: shown as absent, not zero
    lines = mechanism.death_table(table)
    assert len(lines) == 4 and "—" in lines[2]


def test_figure_17_draws_in_range(tmp_path):
    cal = tmp_path / "calibration.csv"
    rows = [
        dict(axis="R", dial="train.route_noise", dose=x, measure=m, mean=v, sd=v / 3, n=4)
        for m in ("route_share", "route_flips")
        for x, v in [(0.0, 0.2), (0.03, 0.4), (0.1, 0.7), (0.3, 0.9)]
    ]
    pd.DataFrame(rows).to_csv(cal, index=False)
    s = study(r2_matters, seeds=[3, 4])
    panels = mechanism_figures.panels(s, PLAN, cal)
    fig, drawn = draw(s, 17, "t", panels)
    shares = drawn[drawn.metric.isin([PASS1, "frontier/collapsed"])]
    assert shares[["line", "band_lower", "band_upper"]].stack().dropna().between(0, 1).all()
    pilot = drawn[(drawn.metric == PASS1) & (drawn.kind == "point")]
    assert len(pilot) and pilot.band_lower.isna().all()  # two seeds: points, no t-interval
    assert any("pilot, n = 2: means only" in p.title for p in panels)
    survival = drawn[drawn.metric == "frontier/survival"]
    assert survival.groupby("run").line.max().nunique() == survival.run.nunique()  # offset: no curve hides another
    text, records = mechanism.section(s, PLAN)
    assert "the plan's reading" in text and records["remedy_check"] and "Cause of death" in text


def test_figure_20_draws_the_frozen_router_beside_its_trained_twin():
    """Figure 20's cells built so that R2 matters with the routers frozen (GRPO 0.2 behind) and not with them trained:
    panel (b) shows +0.2 and 0 with intervals (3 seeds), panel (c) the frozen cell's lower drift, and the plan's frozen
    reading says so."""
    drift = "moe/routing_volatility/per_update/overall"
    runs, rows = [], []
    for i, (run, cfg) in enumerate(figure_configs(20, "cpu", SEEDS)):
        rid, frozen = f"r20-{i}", cfg.train.router_lr_scale == 0
        runs.append(TrackedRun(run, cfg.seed, cfg, rid, {"git_commit": "0" * 40}))
        final = (0.5 if run == "grpo" and frozen else 0.7) + 0.002 * cfg.seed
        rows += _history(rid, run, cfg.seed, None, final, 0.0 if run == "grpo_r2" else 0.3)
        rows += [(run, run, cfg.seed, rid, t, drift, 0.01 if frozen else 0.05, float(t)) for t in range(1, STEPS + 1)]
    frame = pd.DataFrame(rows, columns=["run", "label", "seed", "run_id", "step", "metric", "value", "flops"])
    s = Study(runs, frame, "sqlite:///unused", "study-cpu", runs[0].cfg.out_dir, "steps")
    panels = mechanism_figures.frozen_panels(s, PLAN)
    assert [p.title[:3] for p in panels] == ["(a)", "(b)", "(c)", "(d)"]
    _, drawn = draw(s, 20, "t", panels)
    delta = drawn[(drawn.metric == "eval/pass@1 difference") & (drawn.kind == "point") & (drawn.run == "grpo_r2")]
    assert delta.sort_values("x").line.round(9).tolist() == [0.2, 0.0] and delta.band_lower.notna().all()
    moved = drawn[drawn.metric == drift].sort_values("x")
    assert moved.line.iloc[:3].max() < moved.line.iloc[3:].min()  # frozen (x≈0) below trained (x≈1), every arm
    out = mechanism.outcomes(s, PLAN)
    word, _ = mechanism.frozen_reading(mechanism.comparisons(out, PLAN), PLAN)
    assert word == "R2 matters through hidden-state drift alone"


@pytest.mark.parametrize("which", ["sham", "positive", "frozen", "minibatches", "R"])
def test_cells(which):
    from gspo_study.config import load_config

    over = {
        "sham": ["train.route_noise=0.3", "train.route_sham=true"],
        "positive": ["train.route_random=true"],
        "frozen": ["train.router_lr_scale=0", "train.num_minibatches=16"],
        "minibatches": ["train.num_minibatches=16"],  # the frozen cell's twin: not dose 0
        "R": ["train.route_noise=0.1"],
    }[which]
    c = mechanism.cell(load_config("experiments/cpu/base.yaml", over))
    want = {"sham": 0.3, "positive": math.inf, "frozen": 16.0, "minibatches": 16.0, "R": 0.1}[which]
    assert c.kind == which and c.dose == want


def test_a_comparison_never_mixes_numerics_versions():
    from analysis.runs import check_numerics
    from gspo_study.errors import ConfigError

    runs = study(nothing_matters, seeds=[3]).runs
    check_numerics(runs)  # one version (every run so far): fine
    runs[1].numerics = 2
    with pytest.raises(ConfigError, match="mix numerics versions .numerics 1: e.g. .*; numerics 2: e.g. "):
        check_numerics(runs)


def test_the_frozen_stages_reading_can_be_reached_and_fail():
    """Figure 20's cells: R2 ahead of GRPO by 0.1 in the frozen-router cell reads "matters"; the arms level reads
    "does not matter there"; a gap of 0.045 (its interval above 0, its mean and one-sided bound across δ) reads
    neither."""

    def frozen(gap):
        def outcome(cfg, run, seed):
            ahead = run == "grpo_r2" and cfg.train.router_lr_scale == 0
            jitter = {3: -0.015, 4: 0.015, 5: -0.005, 6: 0.005}[seed]  # the gap's spread over seeds (SD 0.013)
            return None, 0.6 + 0.004 * seed + (gap + jitter if ahead else 0.0)

        return outcome

    seeds = [3, 4, 5, 6]
    for gap, word in ((0.1, "R2 matters through hidden-state drift alone"), (0.0, "R2 does not matter there"),
                      (0.045, "inconclusive")):  # fmt: skip
        runs, rows = [], []
        for i, (run, cfg) in enumerate(figure_configs(20, "cpu", seeds)):
            runs.append(TrackedRun(run, cfg.seed, cfg, f"f{i}", {"git_commit": "0" * 40}))
            rows += _history(f"f{i}", run, cfg.seed, *frozen(gap)(cfg, run, cfg.seed), 0.0)
        frame = pd.DataFrame(rows, columns=["run", "label", "seed", "run_id", "step", "metric", "value", "flops"])
        s = Study(runs, frame, "sqlite:///unused", "study-cpu", runs[0].cfg.out_dir, "steps")
        out = mechanism.outcomes(s, PLAN)
        assert set(out.kind) == {"frozen", "minibatches"}
        assert mechanism.frozen_reading(mechanism.comparisons(out, PLAN), PLAN)[0] == word


def _staged(outcome) -> Study:
    """The pilot's runs (figure 17, seeds 3-4) and the decisive stage's (figure 19, seeds 3-10), each run once."""
    from gspo_study.run import run_key

    seen, runs, rows = set(), [], []
    for figure, seeds in ((17, [3, 4]), (19, list(range(3, 11)))):
        for run, cfg in figure_configs(figure, "cpu", seeds):
            if run_key(cfg) in seen:
                continue
            seen.add(run_key(cfg))
            rid = f"s{len(runs)}"
            runs.append(TrackedRun(run, cfg.seed, cfg, rid, {"git_commit": "0" * 40}))
            share = min(0.95, 0.25 + 2 * cfg.train.route_noise) if not cfg.train.route_random else 1.0
            rows += _history(rid, run, cfg.seed, *outcome(cfg, run, cfg.seed), share if run != "grpo_r2" else 0.0)
    frame = pd.DataFrame(rows, columns=["run", "label", "seed", "run_id", "step", "metric", "value", "flops"])
    return Study(runs, frame, "sqlite:///unused", "study-cpu", runs[0].cfg.out_dir, "steps")


def test_reading_rule_2_reads_the_decisive_cells_and_can_fail():
    """plan_r.yaml's reading rule v2 (history of 2026-12-07): on the decisive stage's cells. Built so that GRPO without
    replay falls 0.12 behind at σ 0.3 over 8 seeds while the pilot's 2-seed doses are non-monotone (−0.10 at 0.03,
    0 at 0.1): rule 1 (every dose pooled) cannot say "R2 matters", rule 2 does. The same deficit under the sham too
    (noisy routing, not the mismatch) fails rule 2; every arm level at σ 0.3 over 8 seeds reads "does not matter" under
    rule 2, while rule 1 stays underpowered on the pilot's two noisy seeds."""
    assert mechanism.reading_rule(PLAN) == (2, 0.3)
    jitter = {3: -0.01, 4: 0.01, 5: -0.004, 6: 0.004, 7: 0.0, 8: 0.002, 9: -0.002, 10: 0.0}

    def deficit(at_sham: bool):
        def outcome(cfg, run, seed):
            t = cfg.train
            if run == "grpo" and t.route_random:
                return 200, 0.7
            behind = {0.03: 0.10, 0.1: 0.0, 0.3: 0.12}.get(t.route_noise, 0.0) if not t.route_sham or at_sham else 0
            return None, 0.7 + jitter[seed] - (behind if run == "grpo" else 0.0)

        return outcome

    out = mechanism.outcomes(_staged(deficit(False)), PLAN)
    by = mechanism.readings(out, PLAN)
    assert by[2][0] == "R2 matters" and by[1][0] != "R2 matters", by
    assert set(mechanism.decisive_cells(out, PLAN).dose) == {0.0, 0.3, math.inf}
    assert mechanism.readings(mechanism.outcomes(_staged(deficit(True)), PLAN), PLAN)[2][0] != "R2 matters"

    def level(cfg, run, seed):
        if run == "grpo" and cfg.train.route_random:
            return 30, 0.0  # the detector fires
        noise = cfg.train.route_noise in (0.03, 0.1) and run == "grpo"  # the pilot's doses: two seeds ±0.03 apart
        return None, 0.7 + jitter[seed] + ((0.03 if seed == 3 else -0.03) if noise else 0.0)

    by = mechanism.readings(mechanism.outcomes(_staged(level), PLAN), PLAN)
    assert by[2][0] == "R2 does not matter here" and by[1][0] == "underpowered", by


def test_a_reading_before_the_decisive_stage_is_complete_says_interim():
    """At 4 of the 8 decisive seeds the section labels the plan's reading interim and names the count."""
    s = _staged(lambda cfg, run, seed: (None, 0.7))
    keep = [r for r in s.runs if r.seed <= 6]
    part = Study(keep, s.frame[s.frame.run_id.isin({r.run_id for r in keep})], s.uri, s.experiment, s.out_dir, s.x)
    text, records = mechanism.section(part, PLAN)
    assert "(interim: 4 of 8 decisive seeds finished; the plan reads at all 8)" in text
    assert records["interim"] and records["decisive_seeds_done"] == [3, 4, 5, 6]
    assert not mechanism.section(s, PLAN)[1]["interim"]
