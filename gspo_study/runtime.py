"""Process-level setup shared by every command: seeding, threads, and loading the policy."""

from __future__ import annotations

import random

import torch

from gspo_study.models import build_char_tokenizer, build_model, load_pretrained
from gspo_study.models.checkpoint import CheckpointError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def seed_everything(seed: int, threads: int | None = None) -> None:
    if threads:
        torch.set_num_threads(threads)
    random.seed(seed)
    torch.manual_seed(seed)


def load_policy(cfg, path: str | None = None):
    """(model, tokenizer): from `path` (a local Qwen3-MoE checkpoint) or, when None, a fresh preset model."""
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
        return model.to(DTYPES[m.dtype]), tokenizer
    model, tokenizer = load_pretrained(path, dtype=DTYPES[m.dtype], experts_implementation=m.experts_implementation)
    return model, tokenizer


__all__ = ["seed_everything", "load_policy", "CheckpointError"]
