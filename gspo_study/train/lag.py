"""Policy lag (`rollout.policy_lag: k`): rollouts and π_old come from the policy of k steps ago.

Asynchronous RL systems generate with a stale policy (prime-rl's `max_off_policy_steps`, Megatron-RL's
`--rl-generation-lag`, AReaL); Qwen's follow-up (arXiv 2512.01374) finds routing replay necessary as staleness
grows. Here the staleness is exact and deterministic: at RL step s the behaviour policy — the weights that
generate the rollout, give π_old's log-probs and, for R2, π_old's routing — is θ_{max(0, s−1−k)}, the trainer's
weights after step s−1−k (the start weights while fewer steps exist), while the updates move the current
θ_{s−1}. k = 0 is the synchronous loop (no copy is made). The last k weight snapshots are saved with every
run checkpoint (`policy_lag.safetensors`), so a resumed run uses the same stale weights.
"""

from __future__ import annotations

import copy
from collections import deque
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

SNAPSHOTS = "policy_lag.safetensors"  # in a run checkpoint: "<i>.<param name>", i = 0 oldest


class PolicyLag:
    """The behaviour policy `model` (a copy of the trainer's), holding θ_{max(0, s−1−k)} during step s."""

    def __init__(self, model: torch.nn.Module, lag: int, snapshots: list[dict[str, torch.Tensor]] = ()):
        if lag < 1:
            raise ValueError(f"PolicyLag needs a lag >= 1, got {lag}")
        self.lag = lag
        self.model = copy.deepcopy(model)
        self.model.requires_grad_(False)
        # θ_{s-1-k} … θ_{s-1} after `advance` at step s; k + 1 entries once enough steps exist
        self._queue: deque[dict[str, torch.Tensor]] = deque(snapshots, maxlen=lag + 1)

    def advance(self, current: torch.nn.Module) -> None:
        """Start of a step: remember the current weights θ_{s−1} and load the oldest remembered into `model`."""
        self._queue.append({n: p.detach().clone() for n, p in current.state_dict().items()})
        self.model.load_state_dict(self._queue[0])

    def snapshots(self) -> list[dict[str, torch.Tensor]]:
        """What a checkpoint after this step must keep: the last k entries (the next step adds θ_s)."""
        return list(self._queue)[-self.lag :]

    def save(self, path: Path) -> None:
        tensors = {f"{i}.{n}": t.contiguous() for i, snap in enumerate(self.snapshots()) for n, t in snap.items()}
        save_file(tensors, str(path))

    @staticmethod
    def load(path: Path) -> list[dict[str, torch.Tensor]]:
        """The snapshots saved by `save`, oldest first (empty when the file does not exist)."""
        if not path.exists():
            return []
        snaps: dict[int, dict[str, torch.Tensor]] = {}
        for key, tensor in load_file(str(path)).items():
            i, name = key.split(".", 1)
            snaps.setdefault(int(i), {})[name] = tensor
        return [snaps[i] for i in sorted(snaps)]
