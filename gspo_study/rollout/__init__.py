"""Rollout engines: `hf` (KV-cached sampling on the HF model, CPU or GPU), `vllm` (in-process vLLM: a GPU, or
vLLM's CPU build in `.venv-vllm`, `make vllm-env`) and `vllm_server` (a pool of vLLM servers with their own
devices, the trainer's weights pushed to them)."""

from __future__ import annotations

from gspo_study.rollout.base import RolloutBatch, encode_prompts, position_ids_from_mask
from gspo_study.rollout.hf import HFEngine
from gspo_study.rollout.perturb import Perturbation


def make_engine(
    name: str,
    model,
    tokenizer,
    dtype: str = "float32",
    gpu_memory_utilization: float = 0.4,
    server=None,
    weight_dir=None,
    perturbation: Perturbation | None = None,
):
    """The rollout engine named in `rollout.engine` (`gpu_memory_utilization`: vllm's share of the GPU;
    `server`, `weight_dir`: vllm_server's pool (`rollout.server`) and where its pushes go by default;
    `perturbation`: the rollout copy's doses, hf only)."""
    if name == "hf":
        return HFEngine(model, tokenizer, dtype=dtype, perturbation=perturbation)
    if perturbation is not None and perturbation.active:
        raise ValueError(f"a rollout perturbation ({perturbation}) needs rollout.engine=hf; got {name!r}")
    if name == "vllm":
        from gspo_study.rollout.vllm_engine import VLLMEngine  # optional GPU extra

        return VLLMEngine(model, tokenizer, dtype=dtype, gpu_memory_utilization=gpu_memory_utilization)
    if name == "vllm_server":
        from gspo_study.config import ServerConfig
        from gspo_study.rollout.vllm_server import VLLMServerEngine

        return VLLMServerEngine(model, tokenizer, dtype, server or ServerConfig(), weight_dir or "server-weights")
    raise ValueError(f"unknown rollout engine {name!r}; allowed: hf, vllm, vllm_server")


__all__ = ["RolloutBatch", "HFEngine", "Perturbation", "make_engine", "encode_prompts", "position_ids_from_mask"]
