"""The collapse rule (analysis/collapse.py) on curves built to trip it and curves built not to, under each of its
versions: both flag a crash and pass a plateau, a recovered dip and a run that never learned; only version 1 flags a
plateau's last dip (seed 4 of figure 11) or a first step far below the plateau; only version 3 starts from the cold
start's held-out pass@1 (a crash in the first steps is no lost gain) and censors a single dip at the last evaluation.
The shared tests give every version the curve's own starting level as the cold start's."""

from __future__ import annotations

import numpy as np
import pytest

from analysis.collapse import PASS_MARGIN, RULES, VERSION, collapse, pass_collapse, reward_collapse, smooth

VERSIONS = pytest.mark.parametrize("version", sorted(RULES))


def noisy(values, seed=0, sd=0.02):
    return np.asarray(values, dtype=float) + np.random.default_rng(seed).normal(0, sd, len(values))


def test_smooth_is_a_trailing_mean():
    assert smooth([1, 2, 3, 4], window=2).tolist() == [1.0, 1.5, 2.5, 3.5]


@VERSIONS
def test_reward_crash_after_learning_collapses_at_the_crash(version):
    steps = np.arange(1, 301)
    curve = np.where(steps <= 200, 0.4 + 0.3 * steps / 200, 0.1)  # learns to 0.7, crashes at 201 and stays
    step = reward_collapse(steps, noisy(curve), version=version, cold_start=0.4)
    assert step is not None and 201 <= step <= 201 + 10  # within the smoothing window of the crash


@VERSIONS
def test_a_dip_that_recovers_or_a_plateau_or_no_learning_is_not_a_collapse(version):
    steps = np.arange(1, 301)
    dip = 0.4 + 0.3 * np.minimum(steps, 150) / 150
    dip[160:190] -= 0.3  # loses all its gain for 30 steps, then recovers
    assert reward_collapse(steps, noisy(dip), version=version, cold_start=0.4) is None
    plateau = noisy(np.full(300, 0.5), sd=0.05)  # noise, a plateau
    assert reward_collapse(steps, plateau, version=version, cold_start=0.5) is None
    decline = 0.5 - 0.3 * steps / 300  # never gained: a failure to learn, not a collapse by this rule
    assert reward_collapse(steps, noisy(decline, sd=0.005), version=version, cold_start=0.5) is None


@VERSIONS
def test_losing_less_than_half_the_gain_is_not_a_collapse(version):
    steps = np.arange(1, 301)
    curve = np.where(steps <= 150, 0.4 + 0.2 * steps / 150, 0.52)  # keeps 60 % of its 0.2 gain
    assert reward_collapse(steps, noisy(curve, sd=0.005), version=version, cold_start=0.4) is None
    curve = np.where(steps <= 150, 0.4 + 0.2 * steps / 150, 0.48)  # keeps 40 %: collapsed
    assert reward_collapse(steps, noisy(curve, sd=0.005), version=version, cold_start=0.4) is not None


def test_pass_at_1_ending_below_the_cold_start():
    steps = [0, 50, 100, 150, 200, 250, 300]
    assert pass_collapse(steps, [0.5, 0.55, 0.6, 0.3, 0.35, 0.2, 0.1]) == 150  # below from 150 to the end
    assert pass_collapse(steps, [0.5, 0.55, 0.3, 0.6, 0.35, 0.2, 0.1]) == 200  # the final stretch below counts
    assert pass_collapse(steps, [0.5, 0.3, 0.3, 0.3, 0.3, 0.3, 0.52]) is None  # recovered by the end
    assert pass_collapse(steps, [0.5] + [0.5 - PASS_MARGIN / 2] * 6) is None  # within the margin: noise
    assert pass_collapse([0], [0.5]) is None


def test_the_earlier_rule_wins():
    steps = np.arange(1, 301)
    reward = noisy(np.where(steps <= 100, 0.4 + 0.3 * steps / 100, 0.1))
    c = collapse(steps, reward, [0, 100, 200, 300], [0.5, 0.6, 0.2, 0.1])
    assert c.collapsed and c.rule == "reward" and 101 <= c.step <= 111
    c = collapse(steps, noisy(np.full(300, 0.5)), [0, 100, 200, 300], [0.5, 0.6, 0.2, 0.1])
    assert (c.step, c.rule) == (200, "pass@1")
    assert not collapse(steps, noisy(np.full(300, 0.5)), [0, 300], [0.5, 0.55]).collapsed


def test_a_last_dip_of_a_noisy_plateau_is_censored():
    """Figure 11's seed 4: a small gain, then the smoothed reward sagging under the loss line in the run's last
    9 steps — a plateau's noise, not a crash (version 2); version 1 flags it, as it did in the archive. The same
    sag lasting PERSIST steps is a collapse under both."""
    from analysis.collapse import PERSIST

    steps = np.arange(1, 301)
    curve = np.where(steps <= 180, 0.62 + 0.1 * steps / 180, 0.7)
    late = curve.copy()
    late[291:] = 0.6
    assert reward_collapse(steps, noisy(late, sd=0.005)) is None
    assert VERSION == 2 and reward_collapse(steps, noisy(late, sd=0.005), version=1) is not None
    lasting = curve.copy()
    lasting[300 - PERSIST - 5 :] = 0.6
    for version in RULES:
        assert reward_collapse(steps, noisy(lasting, sd=0.005), version=version, cold_start=0.62) is not None


def test_version_1_starts_from_one_step():
    """A first step below a flat run: version 1 reads the step up from it as a gain of 0.1, so a lasting sag of
    0.06 is a "collapse"; version 2's start is the first window's mean (0.39), and a 0.01 gain is no gain."""
    steps = np.arange(1, 301)
    curve = np.full(300, 0.4)
    curve[0] = 0.3  # one low first reward
    curve[200:] = 0.34
    assert reward_collapse(steps, curve, version=1) is not None
    assert reward_collapse(steps, curve, version=2) is None


def test_version_3_reads_an_early_crash_as_a_crash_and_censors_a_last_dip():
    """The frontier's two artefacts of version 2 (issue 62). A run that crashes at its third step from the cold start
    (pass@1 0.58) and never learns: version 2's start window holds the crash, so it reads the first steps as a gain
    lost at step 4; version 3 starts from the cold start's pass@1, sees no gain, and the run counts as collapsed by
    the pass@1 rule at the first evaluation below. A single dip at the last evaluation: version 2 counts it,
    version 3 censors it; held for two evaluations, both count it."""
    steps = np.arange(1, 301)
    crash = np.where(steps <= 2, 0.55, 0.1)
    evals, fell = [0, 50, 100, 150, 200, 250, 300], [0.58, 0.1, 0.08, 0.1, 0.09, 0.1, 0.1]
    assert reward_collapse(steps, crash, version=2) == 4
    assert reward_collapse(steps, crash, version=3, cold_start=0.58) is None
    assert collapse(steps, crash, evals, fell, version=2) == collapse(steps, crash, evals, fell, version=2)
    c2, c3 = collapse(steps, crash, evals, fell, version=2), collapse(steps, crash, evals, fell, version=3)
    assert (c2.step, c2.rule) == (4, "reward") and (c3.step, c3.rule) == (50, "pass@1")
    flat = noisy(np.full(300, 0.6), sd=0.01)
    last = [0.58, 0.6, 0.61, 0.6, 0.59, 0.6, 0.5]
    assert collapse(steps, flat, evals, last, version=2).step == 300
    assert not collapse(steps, flat, evals, last, version=3).collapsed
    held = [0.58, 0.6, 0.61, 0.6, 0.59, 0.5, 0.5]
    assert collapse(steps, flat, evals, held, version=3).step == 250 == collapse(steps, flat, evals, held, 2).step
    # a gain over the cold start, then lost: version 3 flags it like version 2
    learned = np.where(steps <= 150, 0.58 + 0.2 * steps / 150, 0.6)
    assert reward_collapse(steps, noisy(learned, sd=0.005), version=3, cold_start=0.58) is not None
    with pytest.raises(ValueError, match="starts from the cold start's pass@1"):
        reward_collapse(steps, crash, version=3)


def test_a_bad_version_is_refused():
    with pytest.raises(ValueError, match="bad collapse rule version 4; allowed: 1, 2, 3"):
        collapse([1, 2], [0.1, 0.2], [0], [0.5], version=4)
