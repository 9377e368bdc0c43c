"""Speed levers tried on the model itself, each timed against the suite's default on the same batch.

    .venv/bin/python -m benchmarks.bench_levers --threads 2 [--compile] --out results/bench_levers.json

`make bench` (bench_rl.py) shows that our RL step and TRL's, given the same model code, spend nearly all their
time in the model's own forward and backward passes, so a trainer alone cannot be 2x faster than TRL there.
This script measures what changing the model's computation would buy, on the bench's batch (16 prompts x 8
responses, max 40 new tokens, the 8-layer cold start or a random-init `qwen3-moe-tiny`):

- `attn=eager`: transformers' eager attention instead of SDPA (PyTorch's CPU flash-attention kernel);
- `experts=bmm_pad`: the experts as two `torch.bmm` over rows padded to the busiest expert's count, one
  batched GEMM per projection instead of one GEMM per expert (the kernel is defined here, not in the suite);
- `compile` (with `--compile`, several minutes): `torch.compile(dynamic=True)` of the model, Inductor's C++
  backend; the first call's compile time is reported separately.

Each case is timed on two workloads, interleaved with the default (grouped_mm_index experts, SDPA) in every
repeat: `update` = 4 minibatches of forward + backward (the update phase's model work, no optimizer step) and
`rollout` = one `HFEngine.generate` of the batch. Reported: median seconds, the paired median ratio default /
case (> 1: the case is faster), the largest |log-prob difference| on response tokens, and whether the rollout
drew the same tokens.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from benchmarks.bench_rl import COLDSTART, GROUP, MAX_NEW, MINIBATCHES, PROMPTS, SEED
from benchmarks.common import load_average, median, print_table, timed

ROOT = Path(__file__).resolve().parents[1]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--checkpoint", type=Path, default=None, help="8-layer checkpoint (default: the cold start)")
    p.add_argument("--repeats", type=int, default=7, help="timed repeats per case (after one warm-up)")
    p.add_argument("--compile", action="store_true", help="also time torch.compile (minutes of compiling)")
    p.add_argument("--out", type=Path, default=ROOT / "results" / "bench_levers.json")
    return p.parse_args(argv)


def bmm_pad_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """Experts via padded batched GEMMs: rows grouped by expert, each expert's block padded to the largest."""
    import torch

    num_tokens, hidden = hidden_states.shape
    k, experts = top_k_index.size(-1), self.num_experts
    expert_ids, perm = torch.sort(top_k_index.reshape(-1), stable=True)
    counts = torch.bincount(expert_ids, minlength=experts)
    cap = int(counts.max())
    slot = torch.arange(expert_ids.numel()) - (torch.cumsum(counts, 0) - counts).index_select(0, expert_ids)
    dest = expert_ids * cap + slot
    x = hidden_states.index_select(0, perm // k)
    x = x.new_zeros(experts * cap, hidden).index_copy(0, dest, x).view(experts, cap, hidden)
    h = self._apply_gate(torch.bmm(x, self.gate_up_proj.transpose(1, 2)))
    h = torch.bmm(h, self.down_proj.transpose(1, 2)).reshape(experts * cap, hidden).index_select(0, dest)
    h = h * top_k_weights.reshape(-1).index_select(0, perm).unsqueeze(-1)
    return torch.zeros_like(hidden_states).index_add_(0, perm // k, h)


def load(args):
    import torch
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    from gspo_study.models import build_char_tokenizer, build_model, load_pretrained

    ALL_EXPERTS_FUNCTIONS.register("bmm_pad", bmm_pad_experts_forward)
    path = args.checkpoint or (COLDSTART if COLDSTART.is_dir() else None)
    if path is not None:
        model, tok = load_pretrained(path, experts_implementation="grouped_mm_index")
    else:
        tok = build_char_tokenizer()
        model = build_model("qwen3-moe-tiny", tok, SEED, experts_implementation="grouped_mm_index")
    assert not model.model.layers[0].mlp.experts.is_transposed  # bmm_pad assumes (experts, out, in) weights
    torch.manual_seed(SEED)
    return model, tok, str(path or "random init")


def set_experts(model, name: str) -> None:
    for config in {id(m.config): m.config for m in model.modules() if hasattr(m, "config")}.values():
        config._experts_implementation = name


def main() -> None:
    args = parse_args()
    import torch

    from gspo_study.rollout.hf import HFEngine
    from gspo_study.tasks.arith import ArithTask
    from gspo_study.train.forward import token_logprobs

    torch.set_num_threads(args.threads)
    model, tok, source = load(args)
    problems = ArithTask().sample_train(PROMPTS, random.Random(SEED))
    prompts = [p.prompt for p in problems for _ in range(GROUP)]
    base_engine = HFEngine(model, tok)

    def rollout(engine):
        return engine.generate(prompts, MAX_NEW, generator=torch.Generator().manual_seed(SEED))

    batch = rollout(base_engine)
    seqs, mask, resp = batch.sequences, batch.attention_mask, batch.response_mask
    minibatches = torch.arange(len(seqs)).chunk(MINIBATCHES)

    def update(m):
        m.train()
        for rows in minibatches:
            lp, _ = token_logprobs(m, seqs[rows], mask[rows])
            lp.sum().backward()
        model.zero_grad(set_to_none=True)

    def logprobs(m):
        with torch.no_grad():
            return token_logprobs(m, seqs, mask)[0][resp]

    base_lp = logprobs(model)
    compiled = torch.compile(model, dynamic=True) if args.compile else None
    cases = {
        # name: (switch on, switch off, the module to run)
        "attn=eager": (
            lambda: model.set_attn_implementation("eager"),
            lambda: model.set_attn_implementation("sdpa"),
            model,
        ),
        "experts=bmm_pad": (
            lambda: set_experts(model, "bmm_pad"),
            lambda: set_experts(model, "grouped_mm_index"),
            model,
        ),
    }
    if compiled is not None:
        cases["compile"] = (lambda: None, lambda: None, compiled)

    def measure(on, off, module) -> dict:
        engine = HFEngine(model, tok)
        engine.model = module
        work = {
            "update": (lambda: update(model), lambda: update(module)),
            "rollout": (lambda: rollout(base_engine), lambda: rollout(engine)),
        }
        on()
        first = {}
        for name, (_, case_fn) in work.items():
            first[name] = timed(case_fn)[0]  # warm-up; for `compile` this call compiles
        max_dlogp = (logprobs(module) - base_lp).abs().max().item()
        same_tokens = torch.equal(rollout(engine).sequences, seqs)
        off()
        times = {f"{w}_{side}": [] for w in work for side in ("default", "case")}
        for _ in range(args.repeats):
            for name, (base_fn, case_fn) in work.items():
                times[f"{name}_default"].append(timed(base_fn)[0])
                on()
                times[f"{name}_case"].append(timed(case_fn)[0])
                off()
        return {
            "seconds": times,
            "median_s": {k: median(v) for k, v in times.items()},
            "speedup": {w: median([d / c for d, c in zip(times[f"{w}_default"], times[f"{w}_case"])]) for w in work},
            "first_call_s": first,
            "max_abs_dlogprob": max_dlogp,
            "same_rollout_tokens": same_tokens,
        }

    results = {}
    for name, case in cases.items():
        results[name] = measure(*case)
        print(f"{name}: done", flush=True)
    out = {
        "config": {
            "threads": args.threads,
            "checkpoint": source,
            "repeats": args.repeats,
            "batch": {
                "prompts": PROMPTS,
                "group": GROUP,
                "max_new_tokens": MAX_NEW,
                "minibatches": MINIBATCHES,
            },
            "torch": torch.__version__,
            "load": load_average(),
        },
        "cases": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1))
    rows = [
        [
            name,
            r["median_s"]["update_default"],
            r["median_s"]["update_case"],
            r["speedup"]["update"],
            r["median_s"]["rollout_default"],
            r["median_s"]["rollout_case"],
            r["speedup"]["rollout"],
            r["first_call_s"]["update"] + r["first_call_s"]["rollout"],
            r["max_abs_dlogprob"],
            r["same_rollout_tokens"],
        ]
        for name, r in results.items()
    ]
    print_table(
        [
            "case",
            "upd s",
            "upd s case",
            "upd x",
            "roll s",
            "roll s case",
            "roll x",
            "1st calls s",
            "max|dlogp|",
            "same tokens",
        ],
        rows,
        f"levers on the model ({source}, {args.threads} threads, median of {args.repeats}; x = default / case, paired)",
    )


if __name__ == "__main__":
    main()
