"""What the trainer asks of a training backend (`torch`, `deepspeed`; `make_backend` builds them), as the rollout
engines' `RolloutEngine` says what it asks of them."""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:  # annotations only: naming the protocol imports no torch
    import torch


class TrainingBackend(Protocol):
    """A backend owns the optimizer and the update forwards' module. `sharded`: the optimizer state lives in per-rank
    files, which such a backend also saves and loads (`save_sharded(directory, tag)`, `load_sharded(directory, tag)`;
    DeepSpeed's ZeRO) instead of `state_dict` / `load_state_dict`."""

    model: torch.nn.Module  # the policy itself (its parameters: whole, or this rank's ZeRO-3 partition)
    train_module: Any  # what update forwards call: the model, or an engine wrapping it
    sharded: bool

    def backward(self, loss: torch.Tensor, last: bool = True) -> None:
        """Accumulate `loss`'s gradient (`last`: the minibatch's last micro-batch on this rank)."""

    def step(self, lr: float) -> float:
        """Apply the accumulated gradient at `lr`; the pre-clip grad norm (non-finite: the update was skipped)."""

    def state_dict(self) -> dict | None:
        """The optimizer state rank 0 writes with a run checkpoint (None: a sharded backend writes its own)."""

    def load_state_dict(self, state: dict | None) -> None: ...

    def gathered_parameters(self) -> AbstractContextManager:
        """A context in which every rank holds the whole parameters (for an in-process rollout engine)."""

    def full_state_dict(self) -> dict | None:
        """Collective: the whole weights on rank 0's CPU where the ranks do not hold them, else None."""
