"""When a run collapsed: one documented rule over its curves, so that "k of n runs collapsed" (as the papers report,
shared/COLLAPSE.md) is computed, never judged by eye.

A run **collapsed** at step s when either
- *pass@1*: its held-out pass@1 falls below the cold start's (step 0) by more than `PASS_MARGIN` at an evaluation
  s and stays there at every later evaluation (so it ends below the cold start); or
- *reward*: its training reward, smoothed by a trailing mean over `WINDOW` steps, first gained at least `MIN_GAIN`
  over its start (the mean of its first `WINDOW` steps), then lost at least `LOSS_SHARE` of that gain from its
  running peak at step s, and never climbed back above that line afterwards (peak − LOSS_SHARE · gain), for at
  least `PERSIST` steps — a crash that does not recover. A loss in a run's last `PERSIST` steps is censored: it
  cannot be told from a noisy plateau's last dip (seen at seed 4 of figure 11). That is version 2 of the rule.
The collapse step is the earlier of the two. A noisy plateau, a dip that recovers and a run that never learned do
not count. Pure functions over (step, value) arrays; `tests/test_collapse.py` builds curves that must and must not
trip each rule, under each version.

The rule has **versions** (`RULES`; `VERSION` is the one in force), kept as code so that what each flags in the
archive can be shown side by side (REPORT row 13 does):
- version 1, in force when REPORT row 13 was introduced (70f9977, rule from 0e53b31): the reward rule's start is
  the smoothed reward's first value (a one-step start), and a loss counts from the step it appears (no
  persistence);
- version 2 (2e659c1): the start is the first full window's mean and the loss must last `PERSIST` steps.
  Revised *after* seeing the data it judges: version 1 flagged seed 4 of figure 11 near its last step in four
  arms at once, a shared end-of-run dip of one seed's prompts.
- version 3 (written for the axis-R stage's plan, before its runs; earlier rows keep the version they were judged
  by): the reward rule's start is the cold start's level measured before any update — its held-out pass@1 at step 0
  (4,000 samples; the training reward's own first window already holds a crash when a run breaks in its first
  steps, and version 2 then read a run that never learned as one that lost a gain) — and a pass@1 drop must hold at
  `PASS_PERSIST` evaluations, the last included (a single dip at the final evaluation is censored); and the gain is
  read on a `PERSIST`-step trailing mean (a sustained gain: measured from the exact cold-start level, a 10-step mean's
  noise excursions on a plateau reach the 0.05 threshold — the shared tests' noisy plateau tripped it). Both artefacts
  were seen in the frontier's runs (issue 62): at router lr ×170-×1000 version 2 fired at steps 2-4 on runs that never
  learned, and GRPO + R2's two ×60 "collapses" were single dips at the final evaluation.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

PASS_MARGIN = 0.05  # pass@1 below the cold start by more than this (≈ 2 standard errors of one evaluation)
WINDOW = 10  # steps of the trailing mean that smooths the training reward
MIN_GAIN = 0.05  # the smoothed reward must first have gained this much for a loss of it to mean anything
LOSS_SHARE = 0.5  # share of the gain lost from the running peak
PERSIST = 25  # steps the loss must last (a dip in the last PERSIST steps is not a collapse)
PASS_PERSIST = 2  # version 3: evaluations a pass@1 drop must hold (the last included)


@dataclass(frozen=True)
class Rule:
    """One version of the reward rule (the pass@1 rule is the same in every version)."""

    version: int
    window_start: bool  # the start is the first full window's mean (else the smoothed reward's first value)
    persist: int  # steps a loss must last; 0: counts from the step it appears
    since: str  # the commit that brought it in
    what: str  # how it differs, in words
    why: str = ""  # why it replaced the version before it
    cold_start: bool = False  # the start is the cold start's held-out pass@1 at step 0 (version 3)
    gain_window: int = WINDOW  # the trailing mean whose running peak the gain is read on
    pass_persist: int = 1  # evaluations a pass@1 drop must hold, the last included


RULES = {
    1: Rule(1, False, 0, "0e53b31", "one-step start, no persistence"),
    2: Rule(
        2,
        True,
        PERSIST,
        "2e659c1",
        f"start = first {WINDOW}-step mean, a loss must last {PERSIST} steps",
        "version 1 had flagged one seed near its runs' end in several arms at once: a shared end-of-run dip of one "
        "seed's prompts, which a noisy plateau's last steps cannot be told from",
    ),
    3: Rule(
        3,
        True,
        PERSIST,
        "axis-R plan",
        f"start = the cold start's held-out pass@1 (step 0), the gain read on a {PERSIST}-step mean; a pass@1 drop "
        f"must hold at {PASS_PERSIST} evaluations",
        "version 2 read a crash in a run's first steps as a lost gain (its start window already held the crash) and "
        "counted a single dip at the final evaluation",
        cold_start=True,
        pass_persist=PASS_PERSIST,
        gain_window=PERSIST,
    ),
}
VERSION = 2  # the version in force for the rows judged so far; a stage's plan names its own (the axis-R stage: 3)


def rule(version: int) -> Rule:
    if version not in RULES:
        raise ValueError(f"bad collapse rule version {version!r}; allowed: {', '.join(map(str, RULES))}")
    return RULES[version]


@dataclass(frozen=True)
class Collapse:
    step: int | None  # the collapse step, None when the run did not collapse
    rule: str  # "pass@1", "reward" or "" (no collapse)

    @property
    def collapsed(self) -> bool:
        return self.step is not None


def smooth(values: np.ndarray, window: int = WINDOW) -> np.ndarray:
    """Trailing mean over the last `window` values (fewer at the start)."""
    v = np.asarray(values, dtype=float)
    c = np.cumsum(np.insert(v, 0, 0.0))
    idx = np.arange(1, len(v) + 1)
    lo = np.maximum(idx - window, 0)
    return (c[idx] - c[lo]) / (idx - lo)


def pass_collapse(steps, values, margin: float = PASS_MARGIN, persist: int = 1) -> int | None:
    """The first evaluation step from which pass@1 stays below step 0's by more than `margin`, when it stays there
    for at least `persist` evaluations (the last included), or None."""
    steps, values = np.asarray(steps), np.asarray(values, dtype=float)
    if len(values) < 2:
        return None
    below = values < values[0] - margin  # never true at step 0 itself
    if not below[-1]:
        return None
    last_above = int(np.flatnonzero(~below)[-1])
    if len(values) - 1 - last_above < persist:
        return None
    return int(steps[last_above + 1])


def reward_collapse(
    steps,
    values,
    window: int = WINDOW,
    min_gain: float = MIN_GAIN,
    loss_share: float = LOSS_SHARE,
    persist: int | None = None,
    version: int = VERSION,
    cold_start: float | None = None,
) -> int | None:
    """The step at which the smoothed reward lost `loss_share` of its gain from its running peak without climbing
    back above that line, or None; `version`'s start and persistence (`persist` overrides the latter). Version 3
    starts from `cold_start` (the cold start's held-out pass@1), and needs it."""
    r = rule(version)
    persist = r.persist if persist is None else persist
    steps = np.asarray(steps)
    s = smooth(values, window)
    if len(s) == 0:
        return None
    if r.cold_start:
        if cold_start is None or not np.isfinite(cold_start):
            raise ValueError(f"collapse rule version {version} starts from the cold start's pass@1; none was given")
        start = float(cold_start)
    else:  # version 2: the first full window's mean, not one step's reward
        start = s[min(window, len(s)) - 1] if r.window_start else s[0]
    peak = np.maximum.accumulate(s if r.gain_window == window else smooth(values, r.gain_window))
    gain = peak - start
    line = peak - loss_share * gain
    for i in range(len(s) - persist):
        if gain[i] >= min_gain and s[i] < line[i] and (s[i:] <= line[i]).all():
            return int(steps[i])
    return None


def collapse(reward_steps, reward, pass_steps, pass1, version: int = VERSION) -> Collapse:
    """Both rules on one run's curves (as of `version`); the earlier collapse step wins."""
    r = rule(version)
    p = np.asarray(pass1, dtype=float)
    cold = float(p[0]) if len(p) and int(np.asarray(pass_steps)[0]) == 0 else None
    if r.cold_start and cold is None:  # no step-0 evaluation: the reward rule has no start; pass@1's has none either
        return Collapse(None, "")
    found = [
        (s, which)
        for s, which in (
            (pass_collapse(pass_steps, pass1, persist=r.pass_persist), "pass@1"),
            (reward_collapse(reward_steps, reward, version=version, cold_start=cold), "reward"),
        )
        if s is not None
    ]
    if not found:
        return Collapse(None, "")
    step, which = min(found)
    return Collapse(step, which)
