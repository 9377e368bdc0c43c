"""The `deepspeed` training backend: ZeRO-2 / ZeRO-3 data parallelism over torchrun ranks.

Division of work (first version, exact rather than fast): every rank holds the whole rollout batch
(generated identically from the same seed), computes π_old and telemetry on all of it, and updates on its
share of each minibatch (rows rank::world). The loss of a micro-batch is divided by the *whole
minibatch's* response (or token) count and multiplied by the world size, because DeepSpeed averages
gradients over ranks: the summed gradient then equals the single-process gradient, whatever the world
size or micro-batch size (PAPER.md pitfalls). DeepSpeed's own loss scaling by gradient-accumulation
steps is turned off (`scale_wrt_gas=False`) for the same reason.

Known limits: a non-finite update is detected from DeepSpeed's global grad norm after it was applied, so
the run stops (NonFiniteError) instead of skipping it; rollouts are not yet sharded across ranks; a resumed
DeepSpeed run reloads the weights but starts a fresh optimizer state (ZeRO state is partitioned and not
yet checkpointed), so it is not bit-identical to an uninterrupted run.
"""

from __future__ import annotations

import math
import warnings

import torch

from gspo_study.errors import NonFiniteError
from gspo_study.train.torch_backend import param_groups, scaled_lrs


def ds_config(cfg, micro_batch_size: int, accumulation: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": accumulation,
        "gradient_clipping": cfg.train.grad_clip,
        "zero_optimization": {"stage": cfg.train.zero_stage},
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": cfg.train.lr, "weight_decay": cfg.train.weight_decay, "torch_adam": True},
        },
        "bf16": {"enabled": cfg.model.dtype == "bfloat16"},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


class DeepSpeedBackend:
    def __init__(self, model, cfg, rank: int, world: int, rows_per_rank: int):
        import deepspeed

        self.rank, self.world = rank, world
        micro = cfg.train.micro_batch_size or rows_per_rank
        self.engine, self.optimizer, _, _ = deepspeed.initialize(
            model=model, model_parameters=param_groups(model, cfg.train.router_lr_scale),
            config=ds_config(cfg, micro, math.ceil(rows_per_rank / micro)),
        )  # fmt: skip
        self.model = self.engine.module

    def backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss * self.world, scale_wrt_gas=False)

    def step(self, lr: float) -> float:
        scaled_lrs(self.optimizer, lr)
        self.engine.set_gradient_accumulation_boundary(True)
        self.engine.step()
        norm = self.engine.get_global_grad_norm()
        norm = float(norm) if norm is not None else float("nan")
        if not math.isfinite(norm):  # already applied: DeepSpeed does not skip fp32 steps
            raise NonFiniteError(
                f"DeepSpeed applied an update with a non-finite gradient (norm {norm}); lower train.lr"
            )
        return norm

    def state_dict(self) -> None:
        return None  # ZeRO optimizer state is partitioned across ranks; not saved yet (module docstring)

    def load_state_dict(self, state: dict | None) -> None:
        warnings.warn(
            "the deepspeed backend resumes with a fresh optimizer state (not checkpointed yet)", stacklevel=2
        )

    def gathered_parameters(self):
        """Context in which every rank sees full parameters (ZeRO-3 partitions them)."""
        import contextlib

        import deepspeed

        if self.engine.zero_optimization_stage() == 3:
            return deepspeed.zero.GatheredParameters(list(self.model.parameters()), modifier_rank=None)
        return contextlib.nullcontext()
