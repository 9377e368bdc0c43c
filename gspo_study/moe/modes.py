"""Routing-replay modes (`algo.routing_replay`), one record each: what a mode records, what it replays, and
whether its π_old pass is training compute. The trainer reads only these fields, so a new mode is one entry
here (plus, if it replays a new source, that source in `trainer.old_policy`).

- none: routers route freely in every forward.
- r2 (the GSPO paper's Routing Replay): π_θ's forwards replay the experts recorded while the training engine
  computed π_old on the rollout batch.
- r3 (Rollout Routing Replay, arXiv 2510.11370): the rollout engine records the experts it used; the π_old
  and π_θ forwards replay them.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ReplayMode:
    name: str  # the value of `algo.routing_replay`
    abbrev: str  # in run names (`grpo-r2-s1`)
    records_rollout: bool  # the rollout engine records each token's experts (prefill and every decode step)
    replays: str | None  # π_θ's forwards are forced to: None, "old" (the π_old pass's routing), "rollout"
    old_pass_trains: bool  # the π_old pass's routing is replayed in training, so the pass is training
    # compute even when the objective takes the rollout engine's log-probs (`algo.old_logprobs: rollout`)
    doc: str


REPLAY_MODES: dict[str, ReplayMode] = {
    m.name: m
    for m in (
        ReplayMode("none", "nr", False, None, False, "no replay: routers route freely"),
        ReplayMode("r2", "r2", False, "old", True, "replay π_old's routing (GSPO paper §5.3)"),
        ReplayMode("r3", "r3", True, "rollout", False, "replay the rollout's routing (arXiv 2510.11370)"),
    )
}
