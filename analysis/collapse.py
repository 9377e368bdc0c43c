"""When a run collapsed: one documented rule over its curves, so that "k of n runs collapsed" (as the papers report,
shared/COLLAPSE.md) is computed, never judged by eye.

A run **collapsed** at step s when either
- *pass@1*: its held-out pass@1 falls below the cold start's (step 0) by more than `PASS_MARGIN` at an evaluation
  s and stays there at every later evaluation (so it ends below the cold start); or
- *reward*: its training reward, smoothed by a trailing mean over `WINDOW` steps, first gained at least `MIN_GAIN`
  over its start (the mean of its first `WINDOW` steps), then lost at least `LOSS_SHARE` of that gain from its
  running peak at step s, and never climbed back above that line afterwards (peak − LOSS_SHARE · gain), for at
  least `PERSIST` steps — a crash that does not recover. A loss in a run's last `PERSIST` steps is censored: it
  cannot be told from a noisy plateau's last dip (seen at seed 4 of figure 11, docs/LOG.md 2026-12-02).
The collapse step is the earlier of the two. A noisy plateau, a dip that recovers and a run that never learned do
not count. Pure functions over (step, value) arrays; `tests/test_collapse.py` builds curves that must and must not
trip each rule.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

PASS_MARGIN = 0.05  # pass@1 below the cold start by more than this (≈ 2 standard errors of one evaluation)
WINDOW = 10  # steps of the trailing mean that smooths the training reward
MIN_GAIN = 0.05  # the smoothed reward must first have gained this much for a loss of it to mean anything
LOSS_SHARE = 0.5  # share of the gain lost from the running peak
PERSIST = 25  # steps the loss must last (a dip in the last PERSIST steps is not a collapse)


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


def pass_collapse(steps, values, margin: float = PASS_MARGIN) -> int | None:
    """The first evaluation step from which pass@1 stays below step 0's by more than `margin`, or None."""
    steps, values = np.asarray(steps), np.asarray(values, dtype=float)
    if len(values) < 2:
        return None
    below = values < values[0] - margin  # never true at step 0 itself
    if not below[-1]:
        return None
    last_above = int(np.flatnonzero(~below)[-1])
    return int(steps[last_above + 1])


def reward_collapse(
    steps,
    values,
    window: int = WINDOW,
    min_gain: float = MIN_GAIN,
    loss_share: float = LOSS_SHARE,
    persist: int = PERSIST,
) -> int | None:
    """The step at which the smoothed reward lost `loss_share` of its gain from its running peak without climbing
    back above that line, or None."""
    steps = np.asarray(steps)
    s = smooth(values, window)
    if len(s) == 0:
        return None
    start = s[min(window, len(s)) - 1]  # the first full window's mean, not one step's reward
    peak = np.maximum.accumulate(s)
    gain = peak - start
    line = peak - loss_share * gain
    for i in range(len(s) - persist):
        if gain[i] >= min_gain and s[i] < line[i] and (s[i:] <= line[i]).all():
            return int(steps[i])
    return None


def collapse(reward_steps, reward, pass_steps, pass1) -> Collapse:
    """Both rules on one run's curves; the earlier collapse step wins."""
    found = [
        (s, rule)
        for s, rule in ((pass_collapse(pass_steps, pass1), "pass@1"), (reward_collapse(reward_steps, reward), "reward"))
        if s is not None
    ]
    if not found:
        return Collapse(None, "")
    step, rule = min(found)
    return Collapse(step, rule)
