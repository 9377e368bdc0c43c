"""Tiny Qwen3-MoE presets, shaped like Qwen3-30B-A3B in miniature (many layers, many experts, top-k routing).

Qwen3-30B-A3B has 48 layers, 128 experts, 8 active. `qwen3-moe-tiny` keeps the shape that makes routing
matter — depth, a wide expert pool, several active experts — at a size that trains in minutes on two CPU
cores. `qwen3-moe-mini` has Qwen3-30B-A3B's routing shape itself (48 layers, 128 experts, top-8) at a small
width: the GPU scale's model and the GPU check's. `qwen3-moe-smoke` is for tests: a forward+backward takes
milliseconds.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

PRESETS: dict[str, dict[str, Any]] = {
    "qwen3-moe-tiny": dict(
        num_hidden_layers=8,
        hidden_size=128,
        intermediate_size=256,  # dense-MLP width, used only by layers listed in mlp_only_layers
        moe_intermediate_size=64,
        num_experts=32,
        num_experts_per_tok=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=256,
    ),
    "qwen3-moe-smoke": dict(
        num_hidden_layers=2,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_experts=8,
        num_experts_per_tok=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=256,
    ),
    "qwen3-moe-mini": dict(
        num_hidden_layers=48,
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=64,
        num_experts=128,
        num_experts_per_tok=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=256,
    ),
}

COMMON: dict[str, Any] = dict(
    norm_topk_prob=True,  # as Qwen3-30B-A3B
    decoder_sparse_step=1,
    mlp_only_layers=[],
    tie_word_embeddings=True,
    rope_theta=10000.0,
    router_aux_loss_coef=0.001,
    output_router_logits=False,
)


def build_config(preset: str, vocab_size: int, special_ids: dict[str, int], **overrides: Any) -> Qwen3MoeConfig:
    """A `Qwen3MoeConfig` for a preset; `None` overrides are ignored."""
    if preset not in PRESETS:
        raise ValueError(f"unknown model preset {preset!r}; allowed: {', '.join(PRESETS)}")
    kwargs = {**COMMON, **PRESETS[preset], **{k: v for k, v in overrides.items() if v is not None}}
    return Qwen3MoeConfig(vocab_size=vocab_size, **special_ids, **kwargs)


def build_model(preset: str, tokenizer, seed: int, **overrides: Any) -> Qwen3MoeForCausalLM:
    """A freshly initialised preset model (deterministic for a seed), sized to the tokenizer."""
    special = dict(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    impl = overrides.pop("experts_implementation", None)
    config = build_config(preset, len(tokenizer), special, **overrides)
    if impl:
        config._experts_implementation = impl
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3MoeForCausalLM(config)
    return model


def moe_layer_indices(config: Qwen3MoeConfig) -> list[int]:
    """Decoder layers that hold a sparse MoE block (same rule as transformers' Qwen3MoeDecoderLayer)."""
    return [
        i
        for i in range(config.num_hidden_layers)
        if i not in config.mlp_only_layers and config.num_experts > 0 and (i + 1) % config.decoder_sparse_step == 0
    ]


def active_params(config: Qwen3MoeConfig) -> int:
    """Parameters touched per token (non-embedding): attention + active experts + routers + dense MLPs.

    Used for the compute axis: FLOPs ≈ 2 · active_params · tokens (forward), 6 · … (forward+backward).
    """
    h, hd = config.hidden_size, config.head_dim
    attn = h * hd * (config.num_attention_heads * 2 + config.num_key_value_heads * 2)
    moe = set(moe_layer_indices(config))
    total = 0
    for i in range(config.num_hidden_layers):
        if i in moe:
            mlp = config.num_experts_per_tok * 3 * h * config.moe_intermediate_size + config.num_experts * h
        else:
            mlp = 3 * h * config.intermediate_size
        total += attn + mlp
    return total + h * config.vocab_size  # LM head
