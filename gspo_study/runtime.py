"""Process-level setup shared by every command: seeding, threads, the device and precision, loading the policy.

Placement (`train.device`): the model lives on one device; rollout batches, advantages and the objective's math
stay on the host, and every forward moves its inputs to the model's device (`train.forward.token_logprobs`, the
HF engine's decode, routing replay's indices), so the same code runs on a CPU and on a GPU. Precision: on CUDA an
fp32 model's training forwards run under bf16 autocast over the fp32 master weights (`autocast`); a bf16 model
and every CPU forward run as they are, so the CPU path is bit-identical to a run before the knob existed.
"""

from __future__ import annotations

import contextlib
import hashlib
import random

import torch

from gspo_study.errors import ConfigError
from gspo_study.models import build_char_tokenizer, build_model, load_pretrained
from gspo_study.models.checkpoint import CheckpointError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def seed_everything(seed: int, threads: int | None = None) -> None:
    if threads:
        torch.set_num_threads(threads)
    random.seed(seed)
    torch.manual_seed(seed)


def resolve_device(spec: str) -> torch.device:
    """`train.device` as a torch device: auto is CUDA when torch sees a GPU, else the CPU; a CUDA device torch
    does not see is a one-line error."""
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if spec.startswith("cuda"):
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        index = int(spec.partition(":")[2] or 0)
        if index >= count:
            seen = f"{count} CUDA device(s)" if count else f"no CUDA GPU (torch {torch.__version__})"
            raise ConfigError(f"train.device={spec!r} but torch sees {seen}; allowed here: train.device=cpu or auto")
    return torch.device(spec)


def training_device(cfg) -> torch.device | None:
    """Where this run puts its model: `train.device` for the torch backend; None under DeepSpeed (each rank's
    engine places it)."""
    return resolve_device(cfg.train.device) if cfg.train.backend == "torch" else None


def place(cfg, model):
    """`model` on the run's device (no copy when it is there already)."""
    device = training_device(cfg)
    return model if device is None else model.to(device)


def precision_text(device: torch.device, dtype: torch.dtype) -> str:
    """The training forwards' precision on `device` for weights of `dtype` (the provenance.precision tag)."""
    if device.type == "cuda" and dtype == torch.float32:
        return "bf16 autocast, fp32 weights"
    return {torch.float32: "fp32", torch.bfloat16: "bf16"}.get(dtype, str(dtype))


def device_text(device: torch.device) -> str:
    """A device for the provenance.device tag: `cpu`, or e.g. `cuda:0 (NVIDIA H200)`."""
    if device.type != "cuda":
        return device.type
    return f"cuda:{device.index or 0} ({torch.cuda.get_device_name(device)})"


def autocast(model):
    """The training forward's precision context: bf16 autocast for an fp32 model on CUDA, else nothing."""
    p = next(model.parameters())
    if p.device.type == "cuda" and p.dtype == torch.float32:
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def load_policy(cfg, path: str | None = None):
    """(model, tokenizer) on the run's device (`place`): from `path` (a local Qwen3-MoE checkpoint) or, when None,
    a fresh preset model."""
    m = cfg.model
    if path is None:
        tokenizer = build_char_tokenizer()
        model = build_model(
            m.preset,
            tokenizer,
            seed=cfg.seed,
            num_hidden_layers=m.num_hidden_layers,
            num_experts=m.num_experts,
            num_experts_per_tok=m.num_experts_per_tok,
            experts_implementation=m.experts_implementation,
        )
        return place(cfg, model.to(DTYPES[m.dtype])), tokenizer
    model, tokenizer = load_pretrained(path, dtype=DTYPES[m.dtype], experts_implementation=m.experts_implementation)
    return place(cfg, model), tokenizer


__all__ = ["seed_everything", "load_policy", "place", "resolve_device", "autocast", "CheckpointError"]


def derive_seed(seed: int, step: int, purpose: str) -> int:
    """The seed of one random draw, keyed by (seed, step, purpose): for a seed every algorithm sees the same prompts
    and sampling streams, and a resumed run needs no saved RNG state."""
    return int.from_bytes(hashlib.sha256(f"{seed}/{step}/{purpose}".encode()).digest()[:8], "little") >> 1
