"""The routing frontier's analysis (analysis/frontier.py) on synthetic runs built to pass and to fail each reading: the
plan's cells and arms, collapse counts and their exact intervals, paired readings, Kaplan–Meier, the decisive-dose
rule, figures 13–15 drawn from it, and the REPORT section's plan check. No training: a few seconds."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from analysis import frontier, frontier_figures
from analysis.drawing import draw
from analysis.runs import PASS1, REWARD, Study, TrackedRun
from gspo_study.errors import ConfigError
from gspo_study.study import dropped, figure_configs

PLAN = frontier.load_plan()
STEPS = 300


def _history(run_id: str, run: str, seed: int, crash: int | None, final: float) -> list[tuple]:
    """A run's reward every step and pass@1 every 50 steps: a learner, or one that crashes at step `crash`."""
    rows = []
    for step in range(1, STEPS + 1):
        reward = 0.55 + 0.2 * step / STEPS if crash is None or step < crash else 0.0
        rows.append((run, run, seed, run_id, step, REWARD, reward, float(step)))
    for step in range(0, STEPS + 1, 50):
        p = 0.6 if step == 0 else (final if crash is None or step < crash else 0.0)
        rows.append((run, run, seed, run_id, step, PASS1, p, float(step)))
    return rows


def study(figure: int, outcome, seeds=(1, 2), configs=None) -> Study:
    """Figure `figure`'s planned runs at `seeds` (or the given `figure_configs`, built once for several outcomes),
    each run's history from `outcome(cfg, run, seed)` → (crash step or None, final pass@1)."""
    runs, rows = [], []
    for i, (run, cfg) in enumerate(configs or figure_configs(figure, "cpu", list(seeds))):
        rid = f"r{figure}-{i}"
        runs.append(TrackedRun(run, cfg.seed, cfg, rid, {"git_commit": "0" * 40}))
        rows += _history(rid, run, cfg.seed, *outcome(cfg, run, cfg.seed))
    frame = pd.DataFrame(rows, columns=["run", "label", "seed", "run_id", "step", "metric", "value", "flops"])
    return Study(runs, frame, "sqlite:///unused", "study-cpu", runs[0].cfg.out_dir, "steps")


def no_replay_fails_at_high_drift(cfg, run, seed):
    """GRPO without replay crashes from router lr 300 on, its remedy and GSPO never; the positive control: all."""
    if cfg.train.lr > 4e-5:
        return 40, 0.0
    if run == "grpo" and cfg.train.router_lr_scale >= 300:
        return 120, 0.0
    return None, 0.7 + 0.01 * seed


def test_cells_and_arms_follow_the_plan():
    out = frontier.outcomes(study(13, no_replay_fails_at_high_drift), PLAN)
    assert set(out.axis) == {"V", "M", "positive"}  # a base run is dose 0 of both axes
    assert set(out[out.axis == "M"].arm) == {"grpo", "gspo"}  # grpo_r2 is not an arm of axis M
    assert sorted(out[out.axis == "V"].dose.unique()) == PLAN["axes"]["V"]["doses"]


def test_counts_readings_and_the_decisive_dose():
    out = frontier.outcomes(study(13, no_replay_fails_at_high_drift), PLAN)
    summ = frontier.summary(out).set_index(["axis", "dose", "arm"])
    hit = summ.loc[("V", 300.0, "grpo")]
    assert (hit.collapsed, hit.runs) == (2, 2) and hit.collapsed_lo == pytest.approx(0.158, abs=1e-3)
    assert summ.loc[("V", 300.0, "grpo_r2")].collapsed == 0
    assert summ.loc[("positive", 1e-3, "gspo")].collapsed == 2  # the positive control fires in every arm
    comp = frontier.comparisons(out, PLAN).set_index(["axis", "dose", "arm"])
    assert comp.loc[("V", 300.0, "grpo_r2")].reading == "difference"  # +0.7 at both seeds
    assert comp.loc[("V", 1.0, "grpo_r2")].reading.startswith("equivalent")  # the same numbers
    assert comp.loc[("V", 300.0, "grpo_r2")].fisher_p == pytest.approx(1 / 6)  # 2 of 2 against 0 of 2
    assert frontier.decisive_dose(out, PLAN, "V") == 300.0  # the largest remedy − no-replay gap


def test_readings_can_fail():
    assert frontier.reading(np.array([0.3, -0.3]), 0.05)[0] == "underpowered"
    assert frontier.reading(np.array([0.04, 0.05, 0.045]), 0.05)[0] == "difference"
    assert frontier.reading(np.array([0.001, -0.001, 0.0]), 0.05)[0].startswith("equivalent")
    assert frontier.reading(np.array([-0.02, 0.0, 0.03, 0.03, 0.06, 0.08]), 0.05)[0] == "inconclusive"
    none = pd.DataFrame(columns=["axis", "dose", "arm", "seed", "pass_final"])
    assert frontier.decisive_dose(none, PLAN, "V") is None


def test_no_gap_takes_the_highest_dose():
    out = frontier.outcomes(study(13, lambda cfg, run, seed: (None, 0.7)), PLAN)
    assert frontier.decisive_dose(out, PLAN, "V") == max(PLAN["axes"]["V"]["doses"])


def test_kaplan_meier_against_hand_values():
    """Product-limit: 4 runs, events at 10 and 20, one censored at 15, one at 30: S = 3/4 after 10, then 3/4 · 1/2."""
    xs, ys = frontier.kaplan_meier([10, 15, 20, 30], [True, False, True, False])
    assert xs.tolist() == [0, 10, 20] and ys.tolist() == pytest.approx([1, 0.75, 0.375])
    xs, ys = frontier.kaplan_meier([300, 300], [False, False])
    assert ys.tolist() == [1.0]  # nothing collapsed: the curve stays at 1


def test_figures_13_and_14_draw_in_range(tmp_path):
    cal = tmp_path / "calibration.csv"
    rows = [
        dict(axis=a, dial=d, dose=x, measure=m, mean=v, sd=v / 3, n=4)
        for a, d, m in [("V", "train.router_lr_scale", "per_update"), ("M", "rollout.router_noise", "flips_per_layer"),
                        ("M", "rollout.router_noise", "k3"), ("control", "rollout.head_noise", "k3")]
        for x, v in [(0.0, 0.0), (0.1, 0.01), (1.0, 0.05), (10.0, 0.2)]
    ]  # fmt: skip
    pd.DataFrame(rows).to_csv(cal, index=False)
    for figure in (13, 14):
        s = study(figure, no_replay_fails_at_high_drift)
        panels = frontier_figures.panels(s, figure, PLAN, cal)
        fig, drawn = draw(s, figure, "t", panels)
        shares = drawn[drawn.metric.isin([PASS1, "frontier/collapsed", "frontier/survival"])]
        assert shares[["line", "band_lower", "band_upper"]].stack().dropna().between(0, 1).all()
        assert (drawn.kind == "reference").sum() >= 1  # the paper's level in the calibration panel
        assert ("positive control" if figure == 13 else "control (LM-head noise)") in panels[-1].title
        if figure == 13:  # the control's point is that every run collapsed: its bars are the share collapsed (1.0),
            # not a final pass@1 of 0 (the drawing that left panel (e) empty)
            bars = drawn[(drawn.panel == panels[-1].rows.panel.iloc[0]) & (drawn.kind == "bar")]
            assert set(bars.metric) == {"frontier/collapsed"} and (bars.line == 1.0).all()
        else:  # nothing collapsed on axis M: no Kaplan–Meier panel of flat lines; and one dial per x-axis
            assert not any("not yet collapsed" in p.title for p in panels)
            assert not any("control: LM-head" in str(s) for s in drawn.series)
        two = drawn[(drawn.metric == PASS1) & drawn.kind.isin(["point", "bar"])]
        assert two.band_lower.isna().all() and two.band_upper.isna().all()  # 2 seeds: means, no t-interval


def test_the_report_section_checks_the_plan_commit():
    s = {13: study(13, no_replay_fails_at_high_drift)}
    text, records = frontier.section(s, PLAN, planned=30)
    assert "runs finished: 30 of 30" in text and "do not descend from the plan's commit" in text  # commit 000…
    assert records["runs_not_after_plan"] == ["0" * 12]
    assert "the collapse rule fired in every run" in text
    assert "\n- deviations from the plan:\n  - runs at commits 000000000000 do not descend" in text  # one bullet each
    assert "dose 300: collapsed grpo 2/2, grpo_r2 0/2, gspo 0/2 (at steps 50–50)" in text  # pass@1 0 from step 50
    assert all(not (isinstance(v, float) and math.isnan(v)) for r in records["summary"] for v in r.values())


def test_figure_15_the_decisive_stage():
    """The decisive stage (figure 15: four arms, 8 paired seeds, dose 0 and each axis's decisive dose): every arm
    is read on both axes, the remedy's paired Δ is a difference with its bootstrap beside it, Fisher's test sees
    8 of 8 against 0 of 8, and the figure draws in range with the margin's two lines in each Δ panel."""
    s = study(15, no_replay_fails_at_high_drift, seeds=PLAN["decisive"]["seeds"])
    out = frontier.outcomes(s, PLAN, decisive=True)
    assert set(out[out.axis == "V"].arm) == set(out[out.axis == "M"].arm) == set(PLAN["decisive"]["arms"])
    comp = frontier.comparisons(out, PLAN).set_index(["axis", "dose", "arm"])
    top = comp.loc[("V", 300.0, "grpo_r2")]
    assert top.n == 8 and top.reading == "difference" and top.boot_lo > 0 and top.fisher_p < 1e-3
    assert comp.loc[("M", 0.3, "grpo_r3")].reading.startswith("equivalent")  # a per-seed offset shared by both arms
    panels = frontier_figures.decisive_panels(s, PLAN)
    fig, drawn = draw(s, 15, "t", panels)
    shares = drawn[drawn.metric.isin([PASS1, "frontier/collapsed", "frontier/survival"])]
    assert shares[["line", "band_lower", "band_upper"]].stack().dropna().between(0, 1).all()
    margins = drawn[drawn.kind == "reference"]
    assert len(margins) == 4 and set(margins.line.abs()) == {PLAN["margin"]}
    assert [p.title for p in panels if "collapsed, at" in p.title] == [
        "(d) axis V: not yet collapsed, at dose 300, arms offset",
        "(h) axis M: not yet collapsed, at dose 0.3, arms offset",
    ]
    text, _ = frontier.section({15: s}, PLAN)
    assert "the decisive stage (figure 15, seeds 1, 2, 3, 4, 5, 6, 7, 8): 92" in text  # 96 planned, 4 dropped
    assert "decisive dose per axis by the plan's rule" in text and "V 300 (gaps:" in text


def test_dropped_runs_are_neither_trained_nor_awaited():
    """figures.yaml's `dropped` (the plan's history: seeds 1-2's cold starts are lost) takes exactly its runs out of
    figure 15 — no sweep trains them, no count waits for them — and a bad entry is one line naming it."""
    every = [
        (cfg.seed, run, cfg.train.router_lr_scale, cfg.rollout.router_noise)
        for run, cfg in figure_configs(15, "cpu", list(range(1, 9)))
    ]
    assert len(every) == 92
    gone = {(s, "grpo_r3", 300.0, 0.0) for s in (1, 2)} | {(s, "grpo_r2", 1.0, 0.3) for s in (1, 2)}
    assert not gone & set(every) and {(3, "grpo_r3", 300.0, 0.0), (3, "grpo_r2", 1.0, 0.3)} <= set(every)
    assert len(figure_configs(15, "cpu", [3])) == 12 and len(figure_configs(15, "smoke", [1])) == 12
    spec = {"runs": ["grpo", "gspo"]}
    cells = [("train.router_lr_scale=1.0",), ("train.router_lr_scale=300.0",)]
    good = {"run": "grpo", "seeds": [1], "cell": {"train.router_lr_scale": 300.0}, "why": "lost"}
    assert dropped({**spec, "dropped": {"cpu": [good]}}, "cpu", cells) == [("grpo", {1}, cells[1])]
    for bad in (
        {**good, "run": "grpo_r9"},
        {**good, "cell": {"train.router_lr_scale": 30.0}},
        {k: v for k, v in good.items() if k != "why"},
        {**good, "seeds": "1"},
        {**good, "typo": 1},
    ):
        with pytest.raises(ConfigError, match="bad dropped entry") as err:
            dropped({**spec, "dropped": {"cpu": [bad]}}, "cpu", cells)
        assert "\n" not in str(err.value)


def test_figure_16_the_refinement_follows_its_plan_entry_and_its_reading_can_fail():
    """The refinement (figure 16, plan.yaml `refinement`): its runs are exactly the plan's doses, arms and seeds, inside
    (×30, ×300); its reading says replay moves the frontier when GRPO without replay collapses from ×100 and GRPO +
    R2 only from ×300 (4 of 4 against 0 of 4), and says it does not when every arm collapses from the same dose."""
    spec = PLAN["refinement"]
    every = {(cfg.seed, run, cfg.train.router_lr_scale) for run, cfg in figure_configs(16, "cpu", spec["seeds"])}
    assert every == {(s, a, float(d)) for s in spec["seeds"] for a in spec["arms"] for d in spec["doses"]}
    configs = {f: figure_configs(f, "cpu", spec["seeds"][:4]) for f in (15, 16)}  # 4 seeds: 4 of 4 vs 0 of 4
    assert all(30 < d < 300 for d in spec["doses"])

    def replay_helps(cfg, run, seed):
        v = cfg.train.router_lr_scale
        return (3, 0.0) if v >= (300 if run == "grpo_r2" else 100) else (None, 0.7 + 0.01 * seed)

    def same_wall(cfg, run, seed):
        return (3, 0.0) if cfg.train.router_lr_scale >= 170 else (None, 0.7 + 0.01 * seed)

    for outcome, says in ((replay_helps, "replay moves the frontier"), (same_wall, "replay does not move")):
        studies = {f: study(f, outcome, configs=configs[f]) for f in (15, 16)}
        text, _ = frontier.section(studies, PLAN)
        line = next(x for x in text.splitlines() if x.startswith("- refinement (figure 16"))
        assert says in line, line
        if outcome is replay_helps:
            assert "grpo ×100, grpo_r2 ×300, gspo ×100" in line and "least Fisher p 0.0143" in line
        else:
            assert "grpo ×170, grpo_r2 ×170, gspo ×170" in line
        assert (
            "the refinement (figure 16, seeds 3, 4, 5, 6, 7, 8): 36" in text
            and "(figure 16, seeds 3, 4, 5, 6 of" in line
        )
    panels = frontier_figures.decisive_panels(studies[16], PLAN)
    fig, drawn = draw(studies[16], 16, "t", panels)
    assert set(drawn[drawn.metric == PASS1].step) == {float(d) for d in spec["doses"]}
    # time to collapse at each of the three doses, one line style each (figure 15: its decisive dose alone)
    assert panels[-1].title == "(d) axis V: not yet collapsed, per dose (line style), arms offset"
    km = drawn[drawn.metric.str.startswith("frontier/survival")]
    assert set(km.metric) == {f"frontier/survival, dose {d:g}" for d in spec["doses"]}
    # the last outcome: every arm collapses from ×170 alone (each arm's curve drawn SURVIVAL_OFFSET below the last)
    km = km.assign(height=km.line + km.groupby("metric").run.transform(lambda r: pd.factorize(r)[0]) * 0.015)
    lowest = km.groupby("metric").height.min().round(9).to_dict()
    assert lowest == {"frontier/survival, dose 60": 1.0, "frontier/survival, dose 100": 1.0,
                      "frontier/survival, dose 170": 0.0}  # fmt: skip
    for _, g in km.groupby("metric"):  # no arm's curve lies on another's (figure 15's GRPO was hidden that way)
        values = [set(a.line.round(9)) for _, a in g.groupby("run")]
        assert all(not (a & b) for i, a in enumerate(values) for b in values[i + 1 :])
