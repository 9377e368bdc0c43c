"""Qwen3-MoE models: tiny presets built from `Qwen3MoeConfig`, local HF checkpoints, and the tokenizer."""

import gspo_study.models.experts  # noqa: F401 - registers the grouped_mm_index experts kernel
from gspo_study.models.checkpoint import finish_interrupted_save, load_pretrained, save_pretrained
from gspo_study.models.presets import PRESETS, build_model, moe_layer_indices
from gspo_study.models.tokenizer import build_char_tokenizer

__all__ = [
    "PRESETS",
    "build_model",
    "moe_layer_indices",
    "build_char_tokenizer",
    "finish_interrupted_save",
    "load_pretrained",
    "save_pretrained",
]
