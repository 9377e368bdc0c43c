"""The real vLLM engine (its CPU build), started once, checked against the HF model: run by
tests/test_vllm_engine.py with the real-engine environment's python (`make vllm-env`), never inside pytest
(vLLM patches `torch.set_num_threads`, reseeds the global RNGs and edits `os.environ` in its process).

    .venv-vllm/bin/python tests/vllm_real/engine_checks.py OUT.json

writes the measurements as JSON; the tests judge them. Every number compares vLLM's rollout log-probs with an
fp32 HF forward (`token_logprobs`) of the very sequences vLLM sampled.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from gspo_study.config import ConfigError  # noqa: E402
from gspo_study.models import build_char_tokenizer, build_model  # noqa: E402
from gspo_study.rollout import make_engine  # noqa: E402
from gspo_study.rollout import vllm_engine as ve  # noqa: E402
from gspo_study.train.forward import token_logprobs  # noqa: E402

# vLLM's CPU kernels: attention head sizes 32, 64, 80, ...; the experts' GEMM pads the intermediate size to 32
VLLM_SMOKE = dict(head_dim=32, moe_intermediate_size=32)
PROMPTS = ["1+2=", "33+44=", "5=", "7+8=", "12+3=", "9="] * 2
TEMPERATURE = 0.9
MAX_NEW = 10
# parameter groups of the HF model, by name; each is perturbed in turn and pushed with `sync`
GROUPS = {
    "embeddings_and_tied_head": lambda n: n == "model.embed_tokens.weight",
    "attention": lambda n: ".self_attn." in n and n.endswith("_proj.weight"),
    "norms": lambda n: n.endswith("norm.weight"),
    "routers": lambda n: n.endswith("mlp.gate.weight"),
    "experts": lambda n: ".mlp.experts." in n,
}


def hf_logprobs(model, batch) -> torch.Tensor:
    with torch.no_grad():
        return token_logprobs(model, batch.sequences, batch.attention_mask, TEMPERATURE)[0]


def compare(engine, model, seed: int) -> dict:
    """Rollout with `seed`; |vLLM - HF| over its response tokens, and the batch."""
    batch = engine.generate(PROMPTS, MAX_NEW, TEMPERATURE, torch.Generator().manual_seed(seed))
    diff = (batch.rollout_logprobs - hf_logprobs(model, batch)).abs()[batch.response_mask]
    return {"mean": diff.mean().item(), "max": diff.max().item(), "tokens": int(diff.numel())}, batch


def perturb(model, keep, generator) -> list[str]:
    names = []
    with torch.no_grad():
        for name, p in model.named_parameters():
            if keep(name):
                scale = p.std() if p.numel() > 1 and p.std() > 0 else torch.tensor(1.0)  # norms start at 1
                p.add_(torch.randn(p.shape, generator=generator) * scale)
                names.append(name)
    return names


def main(out_path: str) -> None:
    res: dict = {"env": {"torch": torch.__version__}}
    tok = build_char_tokenizer()
    model = build_model("qwen3-moe-smoke", tok, 0, **VLLM_SMOKE).eval()
    engine = make_engine("vllm", model, tok, "float32")

    # -- what starting vLLM does to this process, with the engine keeping the trainer's state
    def seed_all():
        torch.manual_seed(123), random.seed(123), np.random.seed(123)

    def draws():
        return torch.rand(3).tolist(), random.random(), np.random.rand()

    seed_all()
    want = draws()
    torch.set_num_threads(1)
    seed_all()
    environ_before, affinity = dict(os.environ), sorted(os.sched_getaffinity(0))
    t0 = time.perf_counter()
    first, batch = compare(engine, model, seed=0)  # starts vLLM (import, engine, first push) and samples
    res["start_and_first_rollout_s"] = time.perf_counter() - t0
    res["process"] = {
        "rng_kept": draws() == want,
        "threads_after_start": torch.get_num_threads(),
        "affinity_kept": sorted(os.sched_getaffinity(0)) == affinity,
        "set_num_threads_works": (torch.set_num_threads(2), torch.get_num_threads())[1] == 2,
        "environ_added": sorted(set(os.environ) - set(environ_before)),
        "environ_changed": sorted(k for k in environ_before if os.environ.get(k) != environ_before[k]),
    }
    torch.set_num_threads(1)
    res["timings"] = dict(engine.timings)
    res["platform"] = engine.platform
    res["sleep_mode"] = engine._sleep_mode
    res["first_push"] = dict(engine.last_push)
    res["fp32_vs_hf"] = first

    # -- reproducibility: same generator seed, same tokens and log-probs; another seed, other tokens
    again = engine.generate(PROMPTS, MAX_NEW, TEMPERATURE, torch.Generator().manual_seed(0))
    other = engine.generate(PROMPTS, MAX_NEW, TEMPERATURE, torch.Generator().manual_seed(99))
    res["same_seed_same_tokens"] = torch.equal(again.sequences, batch.sequences)
    res["same_seed_same_logprobs"] = torch.equal(again.rollout_logprobs, batch.rollout_logprobs)
    res["other_seed_other_tokens"] = not torch.equal(other.sequences, batch.sequences)

    # -- a push of unchanged weights leaves the engine right (before the fix: mean |dlogp| ~2.7)
    t0 = time.perf_counter()
    engine.sync(model)
    res["push_s"] = time.perf_counter() - t0
    res["push"] = dict(engine.last_push)
    res["unchanged_sync"] = compare(engine, model, seed=0)[0]

    # -- every parameter group: perturb, sync, and vLLM follows the new weights
    g = torch.Generator().manual_seed(5)
    res["groups"] = {}
    for group, keep in GROUPS.items():
        _, before = compare(engine, model, seed=3)
        old = hf_logprobs(model, before)
        names = perturb(model, keep, g)
        engine.sync(model)
        stats, after = compare(engine, model, seed=3)
        stats["params"] = len(names)
        # how far the perturbation moved the HF log-probs of the old rollout: the check is not vacuous
        stats["hf_moved"] = (hf_logprobs(model, before) - old).abs()[before.response_mask].mean().item()
        res["groups"][group] = stats

    # -- control: the same push without the CPU kernel refresh is what the engine did before the fix
    real = ve.refresh_cpu_kernels
    ve.refresh_cpu_kernels = lambda m: 0
    try:
        perturb(model, GROUPS["experts"], g)
        engine.sync(model)
        res["without_refresh"] = compare(engine, model, seed=3)[0]
    finally:
        ve.refresh_cpu_kernels = real
    engine.sync(model)
    res["after_refresh_again"] = compare(engine, model, seed=3)[0]

    # -- R3 is GPU-only with vLLM: one line, before any engine starts
    r3 = make_engine("vllm", model, tok, "float32")
    try:
        r3.generate(PROMPTS[:2], 3, capture_routing=True)
        res["r3_error"] = None
    except ConfigError as err:
        res["r3_error"] = str(err)
    res["r3_started"] = r3._llm is not None
    engine.close()
    Path(out_path).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main(sys.argv[1])
