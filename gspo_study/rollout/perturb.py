"""Rollout-only perturbations: the routing frontier's doses, applied to the rollout engine's own copy of the policy
and never to the trainer's forwards.

- Axis M, realistic (`rollout.router_precision`): the copy's routers compute at a lower precision — their weights,
  inputs and logits rounded to bfloat16, float16 or float8-e4m3 (simulated by casting and back) before top-k, as an
  engine that keeps its routers in bf16 does (prime-rl PR #3524 moved k3 from 0 to 0.055 with bf16 router weights
  alone). Near-ties between experts break the other way.
- Axis M, continuous (`rollout.router_noise` = σ): seeded Gaussian noise N(0, σ²) added to the copy's router logits
  before top-k (and before the gate softmax, so the engine's gate weights move with its choices).
- The control (`rollout.head_noise` = σ): seeded Gaussian noise N(0, σ²) on the copy's LM-head logits before
  sampling. It moves μ (the rollout log-probs, so k3) and no routing decision: routing at a position depends only on
  the tokens before it, which the trainer's forward sees unchanged. R3 cannot remove it.

The noise draws come from one generator per `generate` call, seeded from the call's sampling generator, so a run's
rollouts are reproducible and every arm of a seed sees the same noise stream. Evaluation builds its own engine
without a perturbation: held-out pass@1 measures the trained policy, not the perturbed copy.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F

from gspo_study.moe import routers

PRECISIONS = {
    "none": None,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float8_e4m3": torch.float8_e4m3fn,
}
NOISE_SALT = 0x5EED_A11E  # the noise stream's seed is the sampling stream's, xor this: the two never coincide


@dataclass(frozen=True)
class Perturbation:
    """What the rollout copy computes differently from the trainer (the config's `rollout.router_precision`,
    `rollout.router_noise`, `rollout.head_noise`); the default perturbs nothing."""

    router_precision: str = "none"
    router_noise: float = 0.0
    head_noise: float = 0.0

    def __post_init__(self):
        if self.router_precision not in PRECISIONS:
            raise ValueError(f"bad router precision {self.router_precision!r}; allowed: {', '.join(PRECISIONS)}")
        for name in ("router_noise", "head_noise"):
            value = getattr(self, name)
            if not value >= 0.0:
                raise ValueError(f"bad {name} {value!r}; allowed: a number >= 0")

    @property
    def routes(self) -> bool:
        """Whether the copy's routers are perturbed (axis M)."""
        return self.router_precision != "none" or self.router_noise > 0

    @property
    def active(self) -> bool:
        return self.routes or self.head_noise > 0

    @classmethod
    def from_config(cls, rollout) -> Perturbation:
        return cls(rollout.router_precision, rollout.router_noise, rollout.head_noise)


def rounded(x: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """`x` rounded to `dtype` and back (None: unchanged). float8-e4m3 saturates at ±448, as torch's cast does."""
    return x if dtype is None else x.to(dtype).to(x.dtype)


def perturbed_routing(
    router, hidden: torch.Tensor, dtype: torch.dtype | None, sigma: float, noise: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logits, scores, indices) of a Qwen3MoeTopKRouter whose arithmetic runs at `dtype` and whose logits carry
    N(0, σ²) noise; mirrors `Qwen3MoeTopKRouter.forward` line for line otherwise."""
    hidden = hidden.reshape(-1, router.hidden_dim)
    logits = rounded(F.linear(rounded(hidden, dtype), rounded(router.weight, dtype)), dtype)
    if sigma > 0:
        logits = logits + sigma * torch.randn(logits.shape, generator=noise, dtype=torch.float32).to(logits)
    probs = F.softmax(logits, dtype=torch.float, dim=-1)
    top, indices = torch.topk(probs, router.top_k, dim=-1)
    if router.norm_topk_prob:
        top = top / top.sum(dim=-1, keepdim=True)
    return logits, top.to(logits.dtype), indices


class PerturbedCopy:
    """The hooks that perturb a rollout copy's routers (prepended, so routing recorders see the perturbed choices)
    and the noise generator both perturbations draw from; `reseed` before each `generate`."""

    def __init__(self, model, perturbation: Perturbation):
        self.perturbation = perturbation
        self.noise = torch.Generator()
        self._hooks = []
        if perturbation.routes:
            dtype = PRECISIONS[perturbation.router_precision]
            for _, router in routers(model):
                hook = partial(self._route, dtype)
                self._hooks.append(router.register_forward_hook(hook, prepend=True))

    def reseed(self, generator) -> None:
        if isinstance(generator, list):  # one stream per row (sharded rollouts): refused by the config
            raise ValueError("a rollout perturbation needs one random stream per batch (rollout.sharded=false)")
        seed = generator.initial_seed() if generator is not None else 0
        self.noise.manual_seed(seed ^ NOISE_SALT)

    def _route(self, dtype, router, args, output):
        return perturbed_routing(router, args[0], dtype, self.perturbation.router_noise, self.noise)

    def head(self, logits: torch.Tensor) -> torch.Tensor:
        """The LM-head logits [B, V] (float32, on the CPU) the engine samples from."""
        sigma = self.perturbation.head_noise
        return logits if sigma == 0 else logits + sigma * torch.randn(logits.shape, generator=self.noise)

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()
