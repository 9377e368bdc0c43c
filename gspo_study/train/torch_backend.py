"""The `torch` training backend: one process, AdamW, global grad-norm clipping, non-finite guard."""

from __future__ import annotations

import contextlib
import math

import torch

ROUTER_SUFFIX = ".mlp.gate.weight"  # Qwen3-MoE router (the linear layer scoring experts per token)


def param_groups(model, router_lr_scale: float = 1.0) -> list[dict]:
    """Optimizer parameter groups; routers get `lr_scale = router_lr_scale` (the others 1). Every group's lr
    is `lr × lr_scale` at each step (`scaled_lrs`). At 0 the routers are frozen: they stop requiring a gradient
    and join no group, so they get no update, no optimizer state and no part in the grad norm."""
    named = list(model.named_parameters())
    if router_lr_scale == 1.0:
        return [{"params": [p for _, p in named], "lr_scale": 1.0}]
    routers = [p for n, p in named if n.endswith(ROUTER_SUFFIX)]
    rest = [p for n, p in named if not n.endswith(ROUTER_SUFFIX)]
    if router_lr_scale == 0.0:
        for p in routers:
            p.requires_grad_(False)
        return [{"params": rest, "lr_scale": 1.0}]
    return [{"params": rest, "lr_scale": 1.0}, {"params": routers, "lr_scale": router_lr_scale}]


def scaled_lrs(optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)


class TorchBackend:
    """One process, AdamW. The backends' common interface (`DeepSpeedBackend` too): `model`, `train_module`,
    `backward`, `step`, `state_dict` / `load_state_dict`, `sharded` (whether the optimizer state lives in
    per-rank files: `save_sharded` / `load_sharded`), `gathered_parameters` and `full_state_dict` (the whole
    weights, for a rollout engine)."""

    sharded = False

    def __init__(self, model, lr: float, weight_decay: float, grad_clip: float, router_lr_scale: float = 1.0):
        self.model = self.train_module = model  # train_module: what update forwards call
        self.grad_clip = grad_clip
        groups = param_groups(model, router_lr_scale)
        self.optimizer = torch.optim.AdamW(groups, lr=lr, weight_decay=weight_decay)

    def backward(self, loss: torch.Tensor, last: bool = True) -> None:
        """Accumulate `loss`'s gradient (`last`: the minibatch's last micro-batch; unused here)."""
        loss.backward()

    def step(self, lr: float) -> float:
        """Clip and apply the accumulated gradient; returns the pre-clip grad norm. A non-finite norm
        skips the update (gradients dropped) and is returned as is, for the caller to count."""
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip).item()
        if math.isfinite(norm):
            scaled_lrs(self.optimizer, lr)
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state)

    def gathered_parameters(self):
        """The parameters are whole already."""
        return contextlib.nullcontext()

    def full_state_dict(self) -> None:
        """None: the rollout engine reads the model's own weights."""
        return None
