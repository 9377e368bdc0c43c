"""What the installed libraries must do for the code to be right, checked where a too-old version would
otherwise fail silently: the transformers floor in pyproject.toml is what the HF engine needs."""

from __future__ import annotations

import re
from pathlib import Path

import tomllib
import torch
import transformers
from packaging.version import Version
from transformers import DynamicCache

from gspo_study.models import build_char_tokenizer, build_model
from gspo_study.rollout import HFEngine
from gspo_study.train.forward import token_logprobs

ROOT = Path(__file__).resolve().parents[1]


def _floor(package: str) -> Version:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    spec = next(d for d in deps if re.match(rf"{package}\b", d))
    return Version(re.search(r">=\s*([\d.]+)", spec).group(1))


def test_installed_transformers_meets_the_floor_the_code_needs():
    floor = _floor("transformers")
    assert floor >= Version("5.24"), "the HF engine passes `cache=` to the model, a keyword of transformers 5.24"
    have = Version(transformers.__version__)
    assert have >= floor, (
        f"transformers {have} is installed; pyproject.toml needs >= {floor} (older versions swallow the "
        "`cache=` keyword the HF engine passes, so generation runs without a KV cache): make install"
    )


def test_the_model_fills_the_kv_cache_the_hf_engine_passes():
    """transformers 5.20-5.23 take `cache=` into **kwargs and ignore it: every decode step then sees only
    its own token and rollouts are garbage (rewards 0), with no error. Here the cache must fill, and cached
    decoding must give a full forward's log-probs."""
    tok = build_char_tokenizer()
    model = build_model("qwen3-moe-smoke", tok, 0).eval()
    cache = DynamicCache(config=model.config)
    ids = torch.tensor([[tok.bos_token_id, 5, 6, 7]])
    with torch.no_grad():
        model(input_ids=ids, attention_mask=torch.ones_like(ids), cache=cache, use_cache=True)
    assert cache.get_seq_length() == 4, (
        f"transformers {transformers.__version__} ignored the `cache=` keyword (KV cache still empty); "
        f"the HF engine needs >= {_floor('transformers')}"
    )
    batch = HFEngine(model, tok).generate(["12+3=", "4="], 8, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full, _ = token_logprobs(model, batch.sequences, batch.attention_mask)
    diff = (batch.rollout_logprobs - full).abs()[batch.response_mask]
    assert diff.max() < 1e-4, f"KV-cached decoding differs from a full forward by {diff.max():.3g}"
