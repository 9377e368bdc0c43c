"""Presets, tokenizer round trip, and checkpoints that standard HF loaders read back exactly."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3MoeForCausalLM

from gspo_study.models import PRESETS, build_char_tokenizer, build_model, load_pretrained, save_pretrained
from gspo_study.models.checkpoint import CheckpointError
from gspo_study.models.presets import moe_layer_indices


def test_tokenizer_round_trip():
    tok = build_char_tokenizer()
    text = "23+45+67=23+45=68,68+67=135#135"
    ids = tok(text, add_special_tokens=False).input_ids
    assert len(ids) == len(text) and tok.decode(ids) == text
    assert tok.unk_token_id not in ids and tok.pad_token_id != tok.eos_token_id


def test_tiny_preset_is_shaped_like_qwen3_moe():
    p = PRESETS["qwen3-moe-tiny"]
    assert p["num_hidden_layers"] >= 8 and p["num_experts"] >= 32 and p["num_experts_per_tok"] >= 4
    model = build_model("qwen3-moe-tiny", build_char_tokenizer(), seed=0)
    n = sum(x.numel() for x in model.parameters())
    assert 1e6 < n < 2e7
    assert len(moe_layer_indices(model.config)) == p["num_hidden_layers"]


def test_build_is_deterministic():
    tok = build_char_tokenizer()
    a, b = build_model("qwen3-moe-smoke", tok, seed=3), build_model("qwen3-moe-smoke", tok, seed=3)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))


def test_save_load_with_auto_classes(tmp_path):
    tok = build_char_tokenizer()
    model = build_model("qwen3-moe-smoke", tok, seed=0).eval()
    save_pretrained(model, tok, tmp_path / "ckpt")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt", local_files_only=True).eval()
    assert isinstance(loaded, Qwen3MoeForCausalLM)
    assert loaded.config.num_hidden_layers == model.config.num_hidden_layers
    assert loaded.config.num_experts == model.config.num_experts
    ids = torch.randint(4, len(tok), (3, 11))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=0)
    tok2 = AutoTokenizer.from_pretrained(tmp_path / "ckpt", local_files_only=True)
    assert tok2("12+3=").input_ids == tok("12+3=").input_ids


def test_load_errors(tmp_path):
    with pytest.raises(CheckpointError, match="model path not found"):
        load_pretrained(tmp_path / "missing")
    (tmp_path / "llama").mkdir()
    (tmp_path / "llama" / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(CheckpointError, match="Qwen3-MoE"):
        load_pretrained(tmp_path / "llama")


def test_non_finite_weights_never_written(tmp_path):
    tok = build_char_tokenizer()
    model = build_model("qwen3-moe-smoke", tok, seed=0)
    with torch.no_grad():
        next(model.parameters())[0, 0] = float("nan")
    with pytest.raises(CheckpointError, match="non-finite"):
        save_pretrained(model, tok, tmp_path / "bad")
    assert not (tmp_path / "bad").exists() and not list(tmp_path.iterdir())
