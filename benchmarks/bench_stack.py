"""Several seeds in one process (issue 65's first lever), measured before it is built into the trainer.

    .venv/bin/python -m benchmarks.bench_stack [--seeds 2 4] [--threads 1] [--repeats 5] --out results/bench_stack.json

S seeds of one configuration as one model: every weight stacked along a leading seed dimension, the dense layers as
`torch.bmm` over it, attention over S x rows as one batch, each token's experts offset by seed x E into one grouped
expert kernel of S x E groups (`stacked_logprobs`, a functional forward of transformers' Qwen3-MoE, written here).
At the routing frontier's shape (4 layers, 16 prompts x 8, 40 new tokens, 4 minibatches, 1 thread) it times the two
workloads that make a step:

- `update`: the 4 minibatches' forward + backward for S seeds, as S models one after another (today) and as one
  stacked forward + backward. Per seed: default / stacked (> 1: stacking is faster). Before timing, the stacked
  log-probs and gradients are compared with the S models' own (max |difference|).
- `decode`: the most a stacked rollout could gain, measured without building it: one model's `HFEngine.generate` of
  the batch (128 rows) S times against one `generate` of S x 128 rows (a stacked decode step costs at least what
  one model's step over S x the rows costs: the same GEMM rows, plus the seed dimension). Per seed: S x t(128) /
  t(S x 128), an upper bound.

The S models are the 4-layer CPU cold start (results/cpu/checkpoints/coldstart-L4-s3, or a random init without it),
seed s's copy with N(0, 1e-3) added to every weight, so their routing differs as separate seeds' would.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from benchmarks.common import load_average, machine, median, print_table, timed

ROOT = Path(__file__).resolve().parents[1]
COLDSTART = ROOT / "results" / "cpu" / "checkpoints" / "coldstart-L4-s3"
PROMPTS, GROUP, MAX_NEW, MINIBATCHES, SEED, LAYERS = 16, 8, 40, 4, 1, 4


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[2, 4], help="seeds per process to time (S)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=5, help="timed repeats per case (after one warm-up)")
    p.add_argument("--out", type=Path, default=ROOT / "results" / "bench_stack.json")
    return p.parse_args(argv)


def stacked_logprobs(params: dict, config, sequences, attention_mask):
    """log π_s(sequences[s, :, t+1] | ≤ t) for each seed s: `[S, B, L-1]`, as `train.forward.token_logprobs` gives
    for seed s's model alone. `params`: transformers' parameter names -> `[S, ...]` tensors; `sequences`,
    `attention_mask`: `[S, B, L]`, left-padded (positions skip the padding, keys mask it)."""
    import torch
    import torch.nn.functional as F
    from transformers.integrations.moe import _grouped_linear

    from gspo_study.rollout.base import position_ids_from_mask

    ids, mask = sequences[..., :-1], attention_mask[..., :-1]
    S, B, T = ids.shape
    H, E, k = config.hidden_size, config.num_experts, config.num_experts_per_tok
    heads, kv_heads, d, eps = (
        config.num_attention_heads,
        config.num_key_value_heads,
        config.head_dim,
        config.rms_norm_eps,
    )

    def rms(x, w):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    def linear(x, w):  # x [S, N, in], w [S, out, in]
        return torch.bmm(x, w.transpose(1, 2))

    emb = params["model.embed_tokens.weight"]  # [S, V, H]
    V = emb.shape[1]
    seed_rows = torch.arange(S).view(S, 1, 1)
    x = emb.reshape(S * V, H).index_select(0, (ids + seed_rows * V).reshape(-1)).view(S, B * T, H)
    pos = position_ids_from_mask(mask.reshape(S * B, T))
    inv = 1.0 / (config.rope_parameters["rope_theta"] ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    freqs = pos[..., None].float() * inv
    angles = torch.cat((freqs, freqs), -1)[:, None]  # [S*B, 1, T, d]
    cos, sin = angles.cos(), angles.sin()
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    # a padding query sees itself only (no row of the mask is empty); the log-probs that matter are the response's
    allowed = ((causal & mask.reshape(S * B, 1, T).bool()) | torch.eye(T, dtype=torch.bool))[:, None]

    def rotate(x):
        a, b = x.chunk(2, -1)
        return x * cos + torch.cat((-b, a), -1) * sin

    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        h = rms(x, params[p + "input_layernorm.weight"].unsqueeze(1))

        def project(name, n, norm=None, h=h, p=p):
            y = linear(h, params[p + f"self_attn.{name}.weight"]).view(S, B, T, n, d)
            if norm is not None:
                y = rms(y, params[p + f"self_attn.{norm}.weight"].view(S, 1, 1, 1, d))
            return y.reshape(S * B, T, n, d).transpose(1, 2)

        q, key = rotate(project("q_proj", heads, "q_norm")), rotate(project("k_proj", kv_heads, "k_norm"))
        v = project("v_proj", kv_heads)
        a = F.scaled_dot_product_attention(q, key, v, attn_mask=allowed, enable_gqa=True, scale=d**-0.5)
        x = x + linear(a.transpose(1, 2).reshape(S, B * T, heads * d), params[p + "self_attn.o_proj.weight"])
        h = rms(x, params[p + "post_attention_layernorm.weight"].unsqueeze(1))
        probs = linear(h, params[p + "mlp.gate.weight"]).softmax(-1)  # [S, N, E]
        top, idx = probs.topk(k, -1)
        top = top / top.sum(-1, keepdim=True)
        groups = (idx + seed_rows * E).reshape(-1)  # seed s's expert e is group s*E + e
        order = torch.sort(groups)[1]
        rows = h.reshape(S * B * T, H).index_select(0, order // k)
        counts = torch.bincount(groups, minlength=S * E)
        offsets = torch.cumsum(counts, 0, dtype=torch.int32)
        gate_up = params[p + "mlp.experts.gate_up_proj"].flatten(0, 1)  # [S*E, 2I, H]
        y = _grouped_linear(rows, gate_up, offsets, is_transposed=False)
        g, u = y.chunk(2, -1)
        y = _grouped_linear(F.silu(g) * u, params[p + "mlp.experts.down_proj"].flatten(0, 1), offsets, False)
        y = y * top.reshape(-1).index_select(0, order).unsqueeze(-1)
        back = torch.empty_like(order)
        back[order] = torch.arange(order.numel())
        x = x + y.index_select(0, back).view(S, B * T, k, H).sum(2)
    x = rms(x, params["model.norm.weight"].unsqueeze(1))
    logits = linear(x, emb).view(S, B, T, V)
    return torch.log_softmax(logits.float(), -1).gather(-1, sequences[..., 1:, None]).squeeze(-1)


def seed_models(S: int):
    import torch

    from gspo_study.models import build_char_tokenizer, build_model, load_pretrained

    def fresh():
        if COLDSTART.is_dir():
            return load_pretrained(COLDSTART, experts_implementation="grouped_mm_index")
        tok = build_char_tokenizer()
        return build_model(
            "qwen3-moe-tiny", tok, SEED, experts_implementation="grouped_mm_index", num_hidden_layers=LAYERS
        ), tok

    base, tok = fresh()
    models = []
    for s in range(S):
        model, _ = fresh()
        gen = torch.Generator().manual_seed(1000 + s)
        with torch.no_grad():
            for w in model.parameters():
                w.add_(torch.randn(w.shape, generator=gen) * 1e-3)
        models.append(model.train())
    return base, tok, models


def measure(S: int, prompts: list[str], repeats: int) -> dict:
    """One S: the stacked update against S models one after another, and the decode bound (module doc)."""
    import torch

    from gspo_study.rollout.hf import HFEngine
    from gspo_study.train.forward import token_logprobs

    base, tok, models = seed_models(S)
    engine = HFEngine(base.eval(), tok)

    def rollout(times: int):
        return engine.generate(prompts * times, MAX_NEW, generator=torch.Generator().manual_seed(SEED))

    batch = rollout(1)
    seqs, mask, resp = batch.sequences, batch.attention_mask, batch.response_mask
    minibatches = torch.arange(len(seqs)).chunk(MINIBATCHES)
    params = {
        name: torch.stack([dict(m.named_parameters())[name].detach() for m in models]).requires_grad_()
        for name, _ in models[0].named_parameters()
    }

    def separate():
        out = []
        for m in models:
            out.append([token_logprobs(m, seqs[r], mask[r])[0] for r in minibatches])
            for lp, r in zip(out[-1], minibatches):
                (lp * resp[r]).sum().backward()
        return out

    def stacked():
        out = []
        for r in minibatches:
            lp = stacked_logprobs(params, models[0].config, seqs[r].expand(S, -1, -1), mask[r].expand(S, -1, -1))
            (lp * resp[r]).sum().backward()
            out.append(lp)
        return out

    for m in models:
        m.zero_grad(set_to_none=True)
    ref, mine = separate(), stacked()
    max_dlp = max(
        (mine[j][s] - ref[s][j])[resp[r]].abs().max().item() for s in range(S) for j, r in enumerate(minibatches)
    )
    max_dgrad = max(
        (params[n].grad[s] - w.grad).abs().max().item() for s, m in enumerate(models) for n, w in m.named_parameters()
    )
    times = {"update_separate": [], "update_stacked": [], "decode_1x": [], "decode_Sx": []}
    for rep in range(repeats + 1):  # repeat 0 warms up
        got = {
            "update_separate": timed(separate)[0],
            "update_stacked": timed(stacked)[0],
            "decode_1x": timed(lambda: rollout(1))[0],
            "decode_Sx": timed(lambda: rollout(S))[0],
        }
        for m in models:
            m.zero_grad(set_to_none=True)
        for w in params.values():
            w.grad = None
        if rep:
            for key, value in got.items():
                times[key].append(value)
    return {
        "seconds": times,
        "median_s": {k: median(v) for k, v in times.items()},
        "update_per_seed_x": median([a / b for a, b in zip(times["update_separate"], times["update_stacked"])]),
        "decode_per_seed_x_bound": median([S * a / b for a, b in zip(times["decode_1x"], times["decode_Sx"])]),
        "max_abs_dlogprob": max_dlp,
        "max_abs_dgrad": max_dgrad,
    }


def main() -> None:
    args = parse_args()
    import torch

    from gspo_study.tasks.arith import ArithTask

    torch.set_num_threads(args.threads)
    problems = ArithTask().sample_train(PROMPTS, random.Random(SEED))
    prompts = [p.prompt for p in problems for _ in range(GROUP)]
    results = {}
    for S in args.seeds:
        results[str(S)] = measure(S, prompts, args.repeats)
        print(f"S={S}: done", flush=True)
    out = {
        "config": {
            "threads": args.threads,
            "checkpoint": str(COLDSTART) if COLDSTART.is_dir() else "random init",
            "repeats": args.repeats,
            "batch": {"prompts": PROMPTS, "group": GROUP, "max_new_tokens": MAX_NEW, "minibatches": MINIBATCHES},
            "machine": machine(),
            "torch": torch.__version__,
            "load": load_average(),
        },
        "seeds": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1))
    rows = [
        [
            S,
            r["median_s"]["update_separate"],
            r["median_s"]["update_stacked"],
            r["update_per_seed_x"],
            r["median_s"]["decode_1x"],
            r["median_s"]["decode_Sx"],
            r["decode_per_seed_x_bound"],
            r["max_abs_dlogprob"],
            r["max_abs_dgrad"],
        ]
        for S, r in results.items()
    ]
    print_table(
        [
            "S",
            "upd S models s",
            "upd stacked s",
            "upd x/seed",
            "gen 128 s",
            "gen Sx128 s",
            "gen x/seed (bound)",
            "max|dlogp|",
            "max|dgrad|",
        ],
        rows,
        f"S seeds in one process ({out['config']['checkpoint']}, {args.threads} thread(s), median of {args.repeats};"
        " x = separate / stacked per seed, paired)",
    )


if __name__ == "__main__":
    main()
