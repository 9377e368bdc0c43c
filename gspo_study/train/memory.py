"""Will a step fit? A peak-memory estimate of each phase of an RL step, checked against the machine before a run
is tracked, so that `rollout.group_size=100000000` is a one-line error instead of a run that sits at step 0.

The estimate is arithmetic over the config and the model's shapes (bytes; T = longest prompt + max_new_tokens):
- state: weights, gradients and AdamW's two moments, 16 bytes per parameter in float32 (4 per copy), plus the
  rollout engine's copy (a bf16 engine: 2 bytes per parameter) and the policy-lag copies (k + 2 whole models);
- rollout: the KV cache of the whole rollout batch, B · T · layers · 2 · kv_heads · head_dim at the engine's
  width, plus the recorded routing (B · T · MoE layers · top-k int64) and one step's logits;
- no-grad passes (π_old, telemetry): per chunk of `train.micro_batch_size` rows (the whole batch when unset),
  the logits and their log-softmax (2 · rows · T · vocab floats) and the widest layer's activations;
- updates: per micro-batch, every layer's saved activations (hidden states, attention scores, the experts'
  intermediates for top-k) and the logits with their log-softmax and gradient (3 · rows · T · vocab floats);
- evaluation: the rollout's terms for `eval.batch_size` rows.
Peak = state + a fixed workspace + ACTIVATION_FACTOR × the largest phase (both calibrated). Its error against
measured peaks (`make bench`'s peak RSS) is stated in docs/RELIABILITY.md; the check refuses only a step whose
estimate exceeds the memory available, so an estimate that
is high by its stated error still admits every step that fits with room to spare. The torch backend only:
ZeRO partitions state and vLLM holds its own cache (docs/SCALE.md sizes those by hand).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from gspo_study.errors import ConfigError

FLOAT = 4  # bytes of a float32
GIB = 2**30
# Calibrated against measured peaks (docs/RELIABILITY.md): the phase formulas below count the tensors a phase
# holds; the allocator, the backward's temporaries and the experts kernel's gathered copies about double them,
# and a step allocates ~128 MiB of workspace whatever its size.
ACTIVATION_FACTOR = 2.0
OVERHEAD = 128 * 2**20


@dataclass(frozen=True)
class Shapes:
    params: int
    layers: int
    moe_layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    top_k: int
    moe_intermediate: int

    @classmethod
    def of(cls, model) -> Shapes:
        c = model.config
        from gspo_study.models.presets import moe_layer_indices

        return cls(
            params=sum(p.numel() for p in model.parameters()),
            layers=c.num_hidden_layers,
            moe_layers=len(moe_layer_indices(c)),
            hidden=c.hidden_size,
            heads=c.num_attention_heads,
            kv_heads=c.num_key_value_heads,
            head_dim=getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
            vocab=c.vocab_size,
            top_k=getattr(c, "num_experts_per_tok", 1),
            moe_intermediate=getattr(c, "moe_intermediate_size", c.intermediate_size),
        )


def _generation(s: Shapes, rows: int, positions: int, width: int, routing: bool) -> float:
    kv = rows * positions * s.layers * 2 * s.kv_heads * s.head_dim * width
    trace = rows * positions * s.moe_layers * s.top_k * 8 if routing else 0
    return kv + trace + 2 * rows * s.vocab * FLOAT


def _forward_no_grad(s: Shapes, rows: int, positions: int) -> float:
    logits = 2 * rows * positions * s.vocab * FLOAT
    layer = rows * positions * (4 * s.hidden + s.heads * positions + 3 * s.top_k * s.moe_intermediate) * FLOAT
    return logits + layer


def _forward_backward(s: Shapes, rows: int, positions: int) -> float:
    per_layer = 10 * s.hidden + 2 * s.heads * positions + 4 * s.top_k * s.moe_intermediate
    return rows * positions * (s.layers * per_layer + 3 * s.vocab) * FLOAT


def estimate(cfg, shapes: Shapes, prompt_tokens: int) -> dict[str, float]:
    """Bytes per phase of one RL step at `cfg` (keys: state, rollout, no_grad, update, eval, peak)."""
    r, t = cfg.rollout, cfg.train
    positions = prompt_tokens + r.max_new_tokens
    batch = r.group_size * r.prompts_per_step
    micro = t.micro_batch_size or batch // t.num_minibatches
    engine = 2 if r.dtype == "bfloat16" and cfg.model.dtype != "bfloat16" else 0
    lag = (r.policy_lag + 2) * FLOAT if r.policy_lag else 0
    out = {
        "state": shapes.params * (4 * FLOAT + engine + lag),
        "rollout": _generation(shapes, batch, positions, 2 if r.dtype == "bfloat16" else FLOAT, True),
        "no_grad": _forward_no_grad(shapes, min(t.micro_batch_size or batch, batch), positions)
        + 8 * batch * positions * FLOAT,  # the step's log-prob tensors
        "update": _forward_backward(shapes, min(micro, batch), positions),
        "eval": _generation(shapes, cfg.eval.batch_size, positions, FLOAT, False),
    }
    out["peak"] = out["state"] + OVERHEAD + ACTIVATION_FACTOR * max(v for k, v in out.items() if k != "state")
    return out


def estimate_sft(cfg, shapes: Shapes, prompt_tokens: int) -> dict[str, float]:
    """Bytes of one cold-start SFT step: the training state and a forward + backward of `sft.batch_size` traces."""
    positions = prompt_tokens + cfg.rollout.max_new_tokens
    out = {
        "state": shapes.params * 4 * FLOAT,
        "update": _forward_backward(shapes, cfg.sft.batch_size, positions),
    }
    out["peak"] = out["state"] + OVERHEAD + ACTIVATION_FACTOR * out["update"]
    return out


def available_bytes(device=None) -> float:
    """Memory this process can still take on `device`: on a CUDA device its free memory plus what this process
    holds there already (the model placed on it, which the estimate's state counts); else MemAvailable (Linux),
    else inf (no check)."""
    if device is not None and device.type == "cuda":
        import torch

        free, _ = torch.cuda.mem_get_info(device)
        return float(free + torch.cuda.memory_allocated(device))
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return float(line.split()[1]) * 1024
    except OSError:
        pass
    return math.inf


def check_step_fits(
    cfg, model, prompt_tokens: int, available: float | None = None, sft: bool = False
) -> dict[str, float]:
    """One-line ConfigError when the estimated peak of an RL step (or, `sft`, an SFT step) exceeds the memory
    available; else the estimate."""
    shapes = Shapes.of(model)
    est = estimate_sft(cfg, shapes, prompt_tokens) if sft else estimate(cfg, shapes, prompt_tokens)
    device = next(model.parameters()).device
    have = available_bytes(device) if available is None else available
    if cfg.train.backend == "torch" and est["peak"] > have:
        phase = max((k for k in est if k not in ("state", "peak")), key=est.get)
        r = cfg.rollout
        batch = (
            f"sft.batch_size={cfg.sft.batch_size}"
            if sft
            else f"rollout.group_size={r.group_size} x rollout.prompts_per_step={r.prompts_per_step}"
        )
        raise ConfigError(
            f"a{'n SFT' if sft else 'n RL'} step needs ≈ {est['peak'] / GIB:,.1f} GiB (its {phase} phase ≈ "
            f"{est[phase] / GIB:,.1f} GiB, at {batch}, {prompt_tokens + r.max_new_tokens} positions), but "
            f"{'this machine' if device.type == 'cpu' else device} has {have / GIB:,.1f} GiB available; allowed: "
            "a smaller batch, train.micro_batch_size, "
            "eval.batch_size or rollout.max_new_tokens"
        )
    return est


def longest_prompt(task, tokenizer, eval_prompts: int, samples: int = 256) -> int:
    """Tokens (BOS included) of the longest prompt among the held-out ones and a seeded sample of training ones."""
    import random

    problems = [*task.eval_problems(eval_prompts), *task.sample_train(samples, random.Random(0))]
    bos = 1 if tokenizer.bos_token_id is not None else 0
    return bos + max(len(tokenizer(p.prompt, add_special_tokens=False).input_ids) for p in problems)


def check_positions(cfg, model, prompt_tokens: int) -> None:
    """Prompt plus response must fit the model's positions."""
    limit = model.config.max_position_embeddings
    need = prompt_tokens + cfg.rollout.max_new_tokens
    if need > limit:
        raise ConfigError(
            f"bad value {cfg.rollout.max_new_tokens} for 'rollout.max_new_tokens': with the task's longest prompt "
            f"({prompt_tokens} tokens) a sequence needs {need} positions, the model has {limit} "
            f"(max_position_embeddings); allowed: at most {limit - prompt_tokens}"
        )
