"""The `deepspeed` training backend: ZeRO-2 / ZeRO-3 data parallelism over torchrun ranks.

Division of work: every rank holds the whole rollout batch (see Rollouts below), computes π_old and
telemetry on all of it, and updates on its share of each minibatch (rows rank::world). The loss of a
micro-batch is divided by the *whole minibatch's* response (or token) count and multiplied by the world
size, because DeepSpeed averages gradients over ranks: the summed gradient then equals the single-process gradient,
whatever the world size or micro-batch size (PAPER.md pitfalls). DeepSpeed's own loss scaling by gradient-accumulation
steps is turned off (`scale_wrt_gas=False`) for the same reason.

Rollouts: with `rollout.sharded` each rank generates its share of the batch (every response from its own
random stream) and the shares are gathered, so every rank holds the whole batch, identical to what one
process generates; without it every rank generates the whole batch from one stream.

Non-finite updates: DeepSpeed's ZeRO optimizers (≥ 0.19, fp32 and bf16 with overflow checks) discard a step
whose global grad norm is not finite and report the norm as inf; `step` returns it for the trainer to count
as a skipped update, and stops the run (NonFiniteError) if the optimizer did not flag the overflow.

Checkpoints: ZeRO state is partitioned across ranks, so every rank writes its partition with DeepSpeed's
own `save_checkpoint` under `<run dir>/zero/<tag>` before rank 0 commits the run checkpoint that names the
tag; resuming loads that tag on every rank (weights and Adam moments), so a resumed run continues exactly.
DeepSpeed reads those files with `torch.load(weights_only=False)`, which runs whatever a pickle says; we
hand its checkpoint engine a loader with `weights_only=True` that admits, besides tensors and containers,
only the few DeepSpeed classes its own files hold (`ZERO_SAFE_GLOBALS`): anything else is refused with a
one-line CheckpointError and nothing in the file runs.
"""

from __future__ import annotations

import contextlib
import math
import pickle
import re
import warnings
from pathlib import Path

import torch

from gspo_study.errors import NonFiniteError
from gspo_study.models.checkpoint import CheckpointError
from gspo_study.train.torch_backend import param_groups, scaled_lrs

# What DeepSpeed's ZeRO-2/3 files hold besides tensors and containers (read with
# torch.serialization.get_unsafe_globals_in_checkpoint from fp32 ZeRO-2 and ZeRO-3 files of DeepSpeed 0.19); a
# class not listed (another version or precision) is refused in one line that names it.
ZERO_SAFE_GLOBALS = (
    "deepspeed.utils.tensor_fragment.fragment_address",
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.zero.config.ZeroStageEnum",
)


def _safe_globals() -> list:
    import importlib

    out = []
    for name in ZERO_SAFE_GLOBALS:
        module, _, attr = name.rpartition(".")
        with contextlib.suppress(ImportError, AttributeError):  # another DeepSpeed version: fewer classes
            out.append(getattr(importlib.import_module(module), attr))
    return out


def safe_load(path: str, map_location=None):
    """`torch.load` of a DeepSpeed checkpoint file without running arbitrary pickled code: `weights_only=True`
    plus `ZERO_SAFE_GLOBALS`; anything else is a CheckpointError naming the file."""
    try:
        with torch.serialization.safe_globals(_safe_globals()):
            return torch.load(path, map_location=map_location, weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, OSError, ValueError) as exc:
        found = re.search(r"(?:Unsupported global: GLOBAL|unsupported GLOBAL) (\S+)", str(exc))
        detail = f"{found.group(1)} is not allowed" if found else (str(exc).strip().splitlines() or [""])[0][:160]
        raise CheckpointError(
            f"refusing ZeRO checkpoint file {path}: it holds objects a checkpoint never needs ({detail}); delete "
            "the run's checkpoint directory to start the run over"
        ) from None


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
    sharded = True  # every rank saves and loads its ZeRO partition (`save_sharded` / `load_sharded`)

    def __init__(self, model, cfg, rank: int, world: int, rows_per_rank: int):
        import deepspeed

        self.rank, self.world = rank, world
        micro = cfg.train.micro_batch_size or rows_per_rank
        self.engine, self.optimizer, _, _ = deepspeed.initialize(
            model=model,
            model_parameters=param_groups(model, cfg.train.router_lr_scale),
            config=ds_config(cfg, micro, math.ceil(rows_per_rank / micro)),
        )
        self.model = self.engine.module
        self.train_module = self.engine  # update forwards go through the engine (its micro-step bookkeeping)

    def backward(self, loss: torch.Tensor, last: bool = True) -> None:
        """Accumulate `loss`'s gradient; `last` marks the minibatch's last micro-batch on this rank, the
        accumulation boundary at which ZeRO reduces the accumulated gradients (set on every micro-batch: a
        boundary on each one keeps only the last micro-batch's gradient under ZeRO-3, and breaks ZeRO-2)."""
        self.engine.set_gradient_accumulation_boundary(last)
        self.engine.backward(loss * self.world, scale_wrt_gas=False)

    def step(self, lr: float) -> float:
        scaled_lrs(self.optimizer, lr)
        self.engine.set_gradient_accumulation_boundary(True)
        self.engine.step()
        norm = self.engine.get_global_grad_norm()
        norm = float(norm) if norm is not None else float("nan")
        if not math.isfinite(norm) and not getattr(self.optimizer, "overflow", False):
            raise NonFiniteError(
                f"DeepSpeed applied an update with a non-finite gradient (norm {norm}); lower train.lr"
            )
        return norm  # non-finite: the ZeRO optimizer skipped the step (overflow) and dropped the gradients

    # ---- checkpoints: every rank writes / reads its own partition --------------------------------------
    def state_dict(self) -> None:
        return None  # nothing for rank 0 to write: see save_sharded

    def load_state_dict(self, state: dict | None) -> None:
        warnings.warn("a deepspeed run checkpoint without ZeRO state: resuming with a fresh optimizer", stacklevel=2)

    def save_sharded(self, directory: Path, tag: str) -> None:
        """Collective: every rank writes its ZeRO partition (weights and Adam state) as `directory/tag`."""
        self.engine.save_checkpoint(str(directory), tag=tag, save_latest=False)

    def load_sharded(self, directory: Path, tag: str) -> None:
        """Collective: every rank reads its partition of `directory/tag` back (weights and Adam state), through
        `safe_load` (never DeepSpeed's own unpickling loader)."""
        engine = self.engine.checkpoint_engine
        engine.load = safe_load  # an instance attribute: this engine only
        path, _ = self.engine.load_checkpoint(
            str(directory), tag=tag, load_optimizer_states=True, load_lr_scheduler_states=False
        )
        if path is None:
            raise FileNotFoundError(f"no ZeRO checkpoint {directory / tag}")

    def full_state_dict(self) -> dict | None:
        """Collective. Under ZeRO-3 the model's whole state dict, gathered one layer at a time onto rank 0's CPU
        (what DeepSpeed's own 16-bit model save does; None on the other ranks); None under ZeRO-2, whose ranks
        each hold the whole weights already."""
        if self.engine.zero_optimization_stage() == 3:
            return self.engine._zero3_consolidated_16bit_state_dict()
        return None

    def gathered_parameters(self):
        """Context in which every rank sees full parameters (ZeRO-3 partitions them)."""
        import contextlib

        import deepspeed

        if self.engine.zero_optimization_stage() == 3:
            return deepspeed.zero.GatheredParameters(list(self.model.parameters()), modifier_rank=None)
        return contextlib.nullcontext()
