"""The `torch` training backend: one process, AdamW, global grad-norm clipping, non-finite guard."""

from __future__ import annotations

import math

import torch


class TorchBackend:
    def __init__(self, model, lr: float, weight_decay: float, grad_clip: float):
        self.model = model
        self.grad_clip = grad_clip
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self, lr: float) -> float:
        """Clip and apply the accumulated gradient; returns the pre-clip grad norm. A non-finite norm
        skips the update (gradients dropped) and is returned as is, for the caller to count."""
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip).item()
        if math.isfinite(norm):
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state)
