"""CPU RL performance side by side with Hugging Face: our rollout engine and RL step vs `generate` and TRL.

    .venv/bin/python -m benchmarks.bench_rl --threads 2 --out results/bench.json

On the `qwen3-moe-tiny` preset at its own depth, 8 layers (the cold-start checkpoint when
`results/cpu/checkpoints/coldstart` exists, else a random-init checkpoint saved to a temp dir; `--checkpoint`
picks another 8-layer one), with 16 prompts x 8 responses, max 40 new tokens, temperature 1 — the shape the
bench has measured since it was written; the CPU study itself now runs 16 layers and 32 prompts per step — it
measures:

(a) rollout: generated tokens/s of `HFEngine.generate` vs `model.generate` (do_sample, KV cache), the two
    interleaved in each repeat; the ratio is the paired median;
(b) one RL step (rollout, pi_old, 4 minibatch updates) in response tokens/s: `trainer.rl_step` for gspo,
    grpo+R2 (and, with `--parts ...,ours-grpo`, plain grpo) vs TRL's `GRPOTrainer` with the equivalent
    config (sequence-level IS for GSPO, token-level for GRPO: TRL has no routing replay, so our grpo-r2 is
    compared with TRL's plain grpo). TRL runs twice: on transformers' stock `grouped_mm` experts kernel (what a
    TRL user gets) and on ours (`trl-*@grouped_mm_index`: the same model code on both sides, so that ratio
    measures the trainers alone, without our kernel's gain). The RL runs are separate processes run in
    lockstep: they take turns one unit at a time (our RL step, TRL's generation batch = 4 optimizer steps)
    while the others block, so unit k of every run sees the same machine load, and the ours/TRL ratio is the
    median of per-unit ratios;
(c) routing-replay (R2) overhead: the update phase (4 optimizer steps) on one batch with and without replay,
    interleaved, paired median; also the cost of recording routing in the pi_old pass;
(d) peak RSS (`ru_maxrss`) of each part: every part runs in its own subprocess, so its peak is its own
    (the orchestrating parent never imports torch);
(e) the compute floor: the machine's fp32 matrix-multiply rate at the model's shapes (a dense projection of one
    update minibatch, and one expert's share of it), against the step's useful work, 2·N_active FLOPs per fed
    token per forward-equivalent pass (rollout 1, pi_old 1, updates 3): how far each step is from what its
    matrix multiplies alone would take, and what a 2x-TRL step would have to reach.

Warm-up is excluded everywhere: the first rollout/update per case, our first RL step, and TRL's first
generation batch (its 4 optimizer steps). Ours is timed per `rl_step` (its telemetry forward is reported
separately and excluded from the headline tokens/s, as our `perf/tokens_per_s` does); TRL per generation
batch, from a callback timestamp when the batch may start (on_step_end of step 4k) to on_step_end of step
4k+4, so trainer construction, `train()` set-up and tear-down never count. Every part uses `--threads`
torch threads. Results: JSON at `--out` (every timing, per unit) and the tables printed at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

from benchmarks.common import load_average, machine, median, paired_overhead_pct, peak_rss_mb, print_table, timed

ROOT = Path(__file__).resolve().parents[1]
BASE_CONFIG = ROOT / "experiments" / "cpu" / "base.yaml"
COLDSTART = ROOT / "results" / "cpu" / "checkpoints" / "coldstart"
PROMPTS, GROUP, MAX_NEW, MINIBATCHES, SEED, LAYERS = 16, 8, 40, 4, 1, 8
# (objective, routing replay) of our runs, (TRL loss label, importance_sampling_level, epsilon, epsilon_high)
OURS = {"ours-gspo": ("gspo", "none"), "ours-grpo-r2": ("grpo", "r2"), "ours-grpo": ("grpo", "none")}
TRL = {"trl-gspo": ("sequence", 3e-4, 4e-4), "trl-grpo": ("token", 0.2, 0.27)}
# `<trl part>@<kernel>`: TRL on a model loaded with another experts kernel than --trl-experts-implementation;
# `@grouped_mm_index` gives TRL our kernel, so that pair measures the trainers alone, on the same model code
INDEX = "@grouped_mm_index"
TRL_PARTS = [*TRL, *(t + INDEX for t in TRL)]
PAIRS = [("ours-gspo", "trl-gspo"), ("ours-grpo-r2", "trl-grpo"), ("ours-grpo", "trl-grpo")]
PAIRS += [(ours, trl + INDEX) for ours, trl in PAIRS]
DEFAULT_PARTS = f"rollout,ours-gspo,trl-gspo,trl-gspo{INDEX},ours-grpo-r2,trl-grpo,trl-grpo{INDEX},replay,floor"
# useful forward-equivalent passes over the fed tokens in one RL step: rollout 1, pi_old 1, updates 3 (fwd + bwd)
PASSES = {"rollout": 1, "old_policy": 1, "update": 3}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads in every part")
    p.add_argument("--checkpoint", type=Path, default=None, help="Qwen3-MoE checkpoint (default: see above)")
    p.add_argument("--steps", type=int, default=10, help="timed RL steps / TRL generation batches per run")
    p.add_argument("--warmup", type=int, default=1, help="untimed RL steps / TRL generation batches first")
    p.add_argument("--repeats", type=int, default=21, help="timed repeats per case in (a) and (c)")
    p.add_argument("--preset", default="qwen3-moe-tiny", help="model preset of the random-init checkpoint")
    p.add_argument(
        "--experts-implementation",
        default="grouped_mm_index",
        help="our experts kernel (default: the suite's, gspo_study/models/experts.py)",
    )
    p.add_argument(
        "--trl-experts-implementation",
        default="grouped_mm",
        help="the experts kernel TRL's model gets (default: transformers' stock grouped_mm)",
    )
    p.add_argument("--parts", default=DEFAULT_PARTS, help=f"comma list out of {DEFAULT_PARTS},ours-grpo")
    p.add_argument("--out", type=Path, default=ROOT / "results" / "bench.json")
    p.add_argument("--workdir", type=Path, default=None, help="scratch dir (default: a fresh temp dir)")
    p.add_argument("--part", default=None, help=argparse.SUPPRESS)  # child mode: run one part
    p.add_argument("--ctl-fd", type=int, default=None, help=argparse.SUPPRESS)  # child: lockstep pipe
    return p.parse_args(argv)


# ------------------------------------------------------------------------------------------ child parts
class Gate:
    """Lockstep with the parent: `ready()` says set-up or a unit of work is done, `wait()` blocks (no CPU)
    until the parent says go. Without a control fd (a part run on its own) both are no-ops."""

    def __init__(self, fd: int | None):
        self.out = os.fdopen(fd, "w", buffering=1) if fd is not None else None

    def ready(self) -> None:
        if self.out:
            self.out.write("ready\n")
            self.out.flush()

    def wait(self) -> None:
        if self.out and not sys.stdin.readline():
            raise SystemExit("bench parent went away")


def _init_torch(args):
    import torch

    torch.set_num_threads(args.threads)
    torch.manual_seed(SEED)
    return torch


def _load(args, impl: str | None = None):
    from gspo_study.models import load_pretrained

    return load_pretrained(args.checkpoint, experts_implementation=impl or args.experts_implementation)


def _prompts() -> list:
    import random

    from gspo_study.tasks.arith import ArithTask

    problems = ArithTask().sample_train(PROMPTS, random.Random(SEED))
    return [p for p in problems for _ in range(GROUP)]


def part_prepare(args) -> dict:
    """Save a random-init preset checkpoint (used when there is no cold start)."""
    _init_torch(args)
    from gspo_study.models import build_char_tokenizer, build_model, save_pretrained

    tok = build_char_tokenizer()
    model = build_model(args.preset, tok, SEED, experts_implementation=args.experts_implementation)
    save_pretrained(model, tok, args.checkpoint)
    return {"checkpoint": str(args.checkpoint)}


def _completion_tokens(gen, eos: int):
    """Tokens up to and including the first EOS in each row of `gen` [B, N] (all N when there is none)."""
    import torch

    is_eos = gen == eos
    first = torch.where(is_eos.any(1), is_eos.int().argmax(1) + 1, torch.full_like(gen[:, 0], gen.shape[1]))
    return int(first.sum())


def part_rollout(args) -> dict:
    """(a) HFEngine.generate vs model.generate on the same left-padded batch, interleaved."""
    torch = _init_torch(args)
    from transformers import GenerationConfig

    from gspo_study.rollout.hf import HFEngine, encode_prompts

    model, tok = _load(args)
    rss = {"after_setup": peak_rss_mb()}
    prompts = [p.prompt for p in _prompts()]
    engine = HFEngine(model, tok)
    seq, mask = encode_prompts(tok, prompts)
    gen_cfg = GenerationConfig(
        do_sample=True,
        max_new_tokens=MAX_NEW,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        use_cache=True,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        bos_token_id=tok.bos_token_id,
    )

    def ours(rep: int):
        batch = engine.generate(prompts, MAX_NEW, 1.0, torch.Generator().manual_seed(rep))
        return int(batch.response_lengths.sum()), batch.sequences.shape[1] - batch.prompt_len

    @torch.no_grad()
    def hf(rep: int):
        torch.manual_seed(rep)
        model.eval()
        out = model.generate(input_ids=seq, attention_mask=mask, generation_config=gen_cfg)
        gen = out[:, seq.shape[1] :]
        return _completion_tokens(gen, tok.eos_token_id), gen.shape[1]

    cases = {"ours_hf_engine": ours, "hf_generate": hf}
    rows = {name: {"seconds": [], "tokens": [], "decode_steps": []} for name in cases}
    for rep in range(1 + args.repeats):
        for name, fn in cases.items():
            seconds, (tokens, steps) = timed(lambda fn=fn, rep=rep: fn(rep))
            if rep >= 1:  # the first repeat of each case is warm-up
                for key, v in zip(("seconds", "tokens", "decode_steps"), (seconds, tokens, steps)):
                    rows[name][key].append(v)
    out = {}
    for name, r in rows.items():
        out[name] = {
            **r,
            "median_s": median(r["seconds"]),
            "tokens_per_s": median([t / s for t, s in zip(r["tokens"], r["seconds"])]),
            "ms_per_decode_step": 1e3 * median([s / n for s, n in zip(r["seconds"], r["decode_steps"])]),
        }
    ratio = [
        (t_o / s_o) / (t_h / s_h)
        for t_o, s_o, t_h, s_h in zip(
            rows["ours_hf_engine"]["tokens"],
            rows["ours_hf_engine"]["seconds"],
            rows["hf_generate"]["tokens"],
            rows["hf_generate"]["seconds"],
        )
    ]
    out["ratio_tokens_per_s_ours_over_hf"] = median(ratio)
    out["rss_mb_by_phase"] = rss
    return out


def _ours_config(args, objective: str, replay: str, name: str):
    from gspo_study.config import load_config

    work = args.workdir / name
    return load_config(
        BASE_CONFIG,
        [
            f"results_dir={work}",
            f"init_checkpoint={args.checkpoint}",
            f"tracking.uri=sqlite:///{work}/mlflow.db",
            f"threads={args.threads}",
            f"seed={SEED}",
            f"algo.objective={objective}",
            f"algo.routing_replay={replay}",
            f"model.experts_implementation={args.experts_implementation}",
            f"model.num_hidden_layers={LAYERS}",
            f"rollout.prompts_per_step={PROMPTS}",
            f"rollout.group_size={GROUP}",
            f"rollout.max_new_tokens={MAX_NEW}",
            f"train.num_minibatches={MINIBATCHES}",
        ],
    )


def part_ours(args, name: str) -> dict:
    """(b) our RL step: `trainer.rl_step` timed as a whole, its phases by the trainer's own Stopwatch spans (rollout
    with scoring, old_policy, route_baseline, update, telemetry), the batch read through its `on_update` hook."""
    _init_torch(args)
    from gspo_study import trainer
    from gspo_study.run import resolve_run

    objective, replay = OURS[name]
    ctx = trainer.setup(resolve_run(_ours_config(args, objective, replay, name)))
    rss: dict[str, float] = {"after_setup": peak_rss_mb()}
    seen: dict[str, object] = {}

    class Watch(trainer.Stopwatch):
        """The trainer's Stopwatch, also noting the peak RSS after each phase of the first step."""

        @contextmanager
        def span(self, name: str, training: bool = True):
            with super().span(name, training):
                yield
            rss.setdefault(f"after_{name}", peak_rss_mb())

    gate = Gate(args.ctl_fd)
    gate.ready()
    steps = []
    for step in range(1, 1 + args.warmup + args.steps):
        gate.wait()
        watch = Watch()
        hook = lambda inputs, i, result: seen.update(batch=inputs.batch)  # noqa: E731
        seconds, metrics = timed(lambda step=step, w=watch, h=hook: trainer.rl_step(ctx, step, on_update=h, watch=w))
        gate.ready()
        if step > args.warmup:
            batch = seen["batch"]
            steps.append(
                {
                    "seconds": seconds,
                    "phases": dict(watch.spans),
                    "response_tokens": int(batch.response_lengths.sum()),
                    "fed_tokens": int(batch.attention_mask[:, :-1].sum()),
                    "padded_len": int(batch.sequences.shape[1]),
                    "reward_mean": metrics["rollout/reward/mean"],
                }
            )
    return _summarise_ours(steps, rss)


def _summarise_ours(steps: list[dict], rss: dict) -> dict:
    tokens = [s["response_tokens"] for s in steps]
    train_s = [s["seconds"] - s["phases"].get("telemetry", 0.0) for s in steps]
    for s, t in zip(steps, train_s):
        s["tokens_per_s"] = s["response_tokens"] / t
        s["tokens_per_s_with_telemetry"] = s["response_tokens"] / s["seconds"]
    return {
        "steps": steps,
        "median_step_s": median([s["seconds"] for s in steps]),
        "median_train_s": median(train_s),
        "median_phase_s": {p: median([s["phases"][p] for s in steps]) for p in steps[0]["phases"]},
        "median_update_s_per_optimizer_step": median([s["phases"]["update"] / MINIBATCHES for s in steps]),
        "response_tokens_mean": sum(tokens) / len(tokens),
        "fed_tokens_mean": sum(s["fed_tokens"] for s in steps) / len(steps),
        # training throughput excludes telemetry (diagnostic forward, as `perf/tokens_per_s` does)
        "tokens_per_s": median([t / s for t, s in zip(tokens, train_s)]),
        "tokens_per_s_with_telemetry": median([t / s["seconds"] for t, s in zip(tokens, steps)]),
        "rss_mb_by_phase": rss,
    }


def part_trl(args, name: str) -> dict:
    """(b) TRL's GRPOTrainer on the same weights, tokenizer, prompts, batch shape and clip ranges."""
    torch = _init_torch(args)
    import trl
    from datasets import Dataset
    from transformers import TrainerCallback

    from gspo_study.config import load_config
    from gspo_study.tasks.arith import ArithTask
    from gspo_study.tasks.base import Problem

    base, _, kernel = name.partition("@")
    level, eps_low, eps_high = TRL[base]
    model, tok = _load(args, kernel or args.trl_experts_implementation)
    task = ArithTask()
    import random

    n_prompts = PROMPTS * (args.warmup + args.steps + 1)
    problems = task.sample_train(n_prompts, random.Random(SEED))
    # "<bos>" is a special token, so TRL's plain `tokenizer(text)` gives the exact ids our engine feeds
    data = Dataset.from_dict(
        {"prompt": [tok.bos_token + p.prompt for p in problems], "answer": [p.answer for p in problems]}
    )
    calls: list[dict] = []

    def arith_reward(completions, completion_ids, answer, **_):
        calls.append({"tokens": sum(len(c) for c in completion_ids), "threads": torch.get_num_threads()})
        return [
            task.reward(text, Problem("", ans, "")) if tok.eos_token_id in ids else 0.0  # truncated: 0
            for text, ids, ans in zip(completions, completion_ids, answer)
        ]

    batches = args.warmup + args.steps
    gate = Gate(args.ctl_fd)
    go: dict[int, float] = {}  # generation batch k -> when it was allowed to start
    end: dict[int, float] = {}  # optimizer step -> when it ended

    class Clock(TrainerCallback):
        def on_train_begin(self, *a, **k):
            gate.wait()
            go[0] = time.perf_counter()

        def on_step_end(self, a, state, *rest, **k):
            end[state.global_step] = time.perf_counter()
            if state.global_step % MINIBATCHES == 0:  # a generation batch (unit of lockstep) is done
                gate.ready()
                k = state.global_step // MINIBATCHES
                if k < batches:
                    gate.wait()
                    go[k] = time.perf_counter()

    config = trl.GRPOConfig(
        output_dir=str(args.workdir / name),
        use_cpu=True,
        bf16=False,
        fp16=False,
        gradient_checkpointing=False,
        seed=SEED,
        # batch: a generation batch of 16 prompts x 8 completions, split into 4 optimizer steps of 32
        num_generations=GROUP,
        per_device_train_batch_size=PROMPTS * GROUP // MINIBATCHES,
        gradient_accumulation_steps=1,
        steps_per_generation=MINIBATCHES,
        num_iterations=1,
        max_steps=MINIBATCHES * batches,
        max_completion_length=MAX_NEW,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        # objective: clipped IS ratio, no KL, per-response token mean then mean over responses (our seq_mean)
        importance_sampling_level=level,
        epsilon=eps_low,
        epsilon_high=eps_high,
        beta=0.0,
        loss_type="grpo",
        scale_rewards="group",
        router_aux_loss_coef=0.0,  # our trainer adds no load-balancing loss
        # optimizer as ours: AdamW, our constant lr, no weight decay, clip 1.0
        learning_rate=load_config(BASE_CONFIG).train.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        optim="adamw_torch",
        use_vllm=False,
        report_to="none",
        logging_strategy="no",
        save_strategy="no",
        disable_tqdm=True,
        log_completions=False,
        dataloader_num_workers=0,
    )
    trainer = trl.GRPOTrainer(
        model=model,
        reward_funcs=arith_reward,
        args=config,
        train_dataset=data,
        processing_class=tok,
        callbacks=[Clock()],
    )
    rss = {"after_setup": peak_rss_mb()}
    gate.ready()
    trainer.train()
    batch_s, first_s, update_s = [], [], []
    for k in range(args.warmup, batches):  # generation batch k = optimizer steps 4k+1 .. 4k+4
        batch_s.append(end[MINIBATCHES * (k + 1)] - go[k])
        first_s.append(end[MINIBATCHES * k + 1] - go[k])  # generation + scoring + pi_old + update 1
        update_s.append(median([end[MINIBATCHES * k + i + 1] - end[MINIBATCHES * k + i] for i in (1, 2, 3)]))
    tokens = [c["tokens"] for c in calls[args.warmup : batches]]
    return {
        "trl_version": trl.__version__,
        "generation_batches": [
            {
                "seconds": s,
                "response_tokens": t,
                "tokens_per_s": t / s,
                "first_optimizer_step_s": f,
                "update_s": u,
            }
            for s, t, f, u in zip(batch_s, tokens, first_s, update_s)
        ],
        "median_step_s": median(batch_s),
        "median_phase_s": {
            "rollout+score+old_policy": median([f - u for f, u in zip(first_s, update_s)]),
            "update": median([MINIBATCHES * u for u in update_s]),
        },
        "median_update_s_per_optimizer_step": median(update_s),
        "response_tokens_mean": sum(tokens) / len(tokens),
        "tokens_per_s": median([t / s for t, s in zip(tokens, batch_s)]),
        "threads_during_train": sorted({c["threads"] for c in calls}),
        "rss_mb_by_phase": rss,
    }


def part_replay(args) -> dict:
    """(c) update phase with and without R2 on one batch; pi_old forward with and without routing record. The
    batch, advantages and π_old are those of the trainer's own first step (read through its `on_update` hook)."""
    torch = _init_torch(args)
    from gspo_study import trainer
    from gspo_study.run import resolve_run
    from gspo_study.train.forward import token_logprobs

    ctx = trainer.setup(resolve_run(_ours_config(args, "grpo", "r2", "replay")))
    rss = {"after_setup": peak_rss_mb()}
    seen: dict[str, trainer.StepInputs] = {}
    trainer.rl_step(ctx, 1, on_update=lambda inputs, i, result: seen.update(inputs=inputs))
    inputs = seen["inputs"]
    batch, old = inputs.batch, inputs.old
    temp = ctx.cfg.rollout.temperature

    @torch.no_grad()
    def plain_forward():
        token_logprobs(ctx.model, batch.sequences, batch.attention_mask, temp)

    cases = {
        # the model moves a little with every update; the trace stays pi_old's (timing is unaffected)
        # natural=None: neither update records routing for the per-update volatility
        "update_none": lambda: trainer.update(ctx, replace(inputs, old=replace(old, natural=None, replay=None)), 1),
        "update_r2": lambda: trainer.update(ctx, replace(inputs, old=replace(old, natural=None)), 1),
        "pi_old_plain": plain_forward,
        "pi_old_record": lambda: trainer.policy_pass(ctx, batch, None),
    }
    times: dict[str, list[float]] = {k: [] for k in cases}
    for rep in range(1 + args.repeats):
        for name, fn in cases.items():
            seconds, _ = timed(fn)
            if rep >= 1:
                times[name].append(seconds)
    return {
        "padded_len": int(batch.sequences.shape[1]),
        "response_tokens": int(batch.response_lengths.sum()),
        "seconds": times,
        "median_s": {k: median(v) for k, v in times.items()},
        "r2_update_overhead_pct": paired_overhead_pct(times["update_r2"], times["update_none"]),
        "record_overhead_pct": paired_overhead_pct(times["pi_old_record"], times["pi_old_plain"]),
        "rss_mb_by_phase": rss,
    }


def part_floor(args) -> dict:
    """(e) fp32 matmul rate at the model's shapes, the model's active parameters, the batch's prompt tokens."""
    torch = _init_torch(args)
    from gspo_study.models.presets import active_params
    from gspo_study.rollout.hf import encode_prompts

    model, tok = _load(args)
    cfg = model.config
    _, prompt_mask = encode_prompts(tok, [p.prompt for p in _prompts()])
    tokens = PROMPTS * GROUP // MINIBATCHES * 34  # one update minibatch (the batch is ~34 tokens wide)
    shapes = {
        "dense": (tokens, cfg.hidden_size, cfg.hidden_size),
        "expert": (
            tokens * cfg.num_experts_per_tok // cfg.num_experts,
            cfg.hidden_size,
            2 * cfg.moe_intermediate_size,
        ),
    }
    out = {"active_params": active_params(cfg), "prompt_tokens": int(prompt_mask.sum()), "gemm": {}}
    for name, (m, k, n) in shapes.items():
        # into one preallocated output: a fresh 0.5 MB result per call is an mmap + page faults in glibc's malloc,
        # whose cost depends on the allocator's history (this rate read 100-240 GFLOP/s from run to run that way)
        a, b, c = torch.randn(m, k), torch.randn(k, n), torch.empty(m, n)
        reps = max(10, int(2e9 / (2 * m * k * n)))  # ~2 GFLOP per timing
        seconds = []
        for rep in range(11):
            t, _ = timed(lambda a=a, b=b, c=c, reps=reps: [torch.mm(a, b, out=c) for _ in range(reps)])
            if rep:
                seconds.append(t / reps)
        out["gemm"][name] = {"shape": [m, k, n], "gflops": 2 * m * k * n / median(seconds) / 1e9}
    return out


def floor_summary(parts: dict) -> dict:
    """Useful GFLOP per step and the fraction of the dense-GEMM rate each run's step (and our phases) reach;
    `at_2x["<ours> / <trl>"]`: the step time that would be 2x that TRL run's throughput, and the fraction of the
    rate it needs."""
    fl = parts.get("floor", {})
    if "gemm" not in fl:
        return {}
    rate = fl["gemm"]["dense"]["gflops"]
    out = {"gemm_gflops": rate, "runs": {}, "at_2x": {}}
    for name in [*OURS, *TRL_PARTS]:
        r = parts.get(name, {})
        if "median_step_s" not in r:
            continue
        # TRL's fed tokens: the same prompts and its own completions
        fed = r.get("fed_tokens_mean", fl["prompt_tokens"] + r["response_tokens_mean"])
        per_pass = 2 * fl["active_params"] * fed / 1e9  # GFLOP of one forward over the fed tokens
        gflop = per_pass * sum(PASSES.values())
        step_s = r.get("median_train_s", r["median_step_s"])
        run = {"gflop": gflop, "step_s": step_s, "floor_s": gflop / rate, "efficiency": gflop / rate / step_s}
        if "median_train_s" in r:
            run["phase_efficiency"] = {p: per_pass * k / rate / r["median_phase_s"][p] for p, k in PASSES.items()}
        out["runs"][name] = run
    for ours, theirs in PAIRS:
        if ours in out["runs"] and theirs in out["runs"]:
            target = out["runs"][theirs]["step_s"] / 2
            out["at_2x"][f"{ours} / {theirs}"] = {
                "vs": theirs,
                "step_s": target,
                "efficiency": out["runs"][ours]["floor_s"] / target,
            }
    return out


def run_part(args) -> None:
    if args.part == "prepare":
        out = part_prepare(args)
    elif args.part == "rollout":
        out = part_rollout(args)
    elif args.part in OURS:
        out = part_ours(args, args.part)
    elif args.part in TRL_PARTS:
        out = part_trl(args, args.part)
    elif args.part == "replay":
        out = part_replay(args)
    elif args.part == "floor":
        out = part_floor(args)
    else:
        raise SystemExit(f"unknown part {args.part!r}; allowed: prepare, {DEFAULT_PARTS},ours-grpo")
    out["peak_rss_mb"] = peak_rss_mb()
    (args.workdir / f"{args.part}.json").write_text(json.dumps(out, indent=1))


# ------------------------------------------------------------------------------------- parent: orchestrate
def _child(args, part: str) -> tuple[list[str], dict]:
    cmd = [sys.executable, "-m", "benchmarks.bench_rl", "--part", part]
    cmd += [
        "--threads",
        str(args.threads),
        "--checkpoint",
        str(args.checkpoint),
        "--workdir",
        str(args.workdir),
    ]
    cmd += ["--steps", str(args.steps), "--warmup", str(args.warmup), "--repeats", str(args.repeats)]
    cmd += ["--experts-implementation", args.experts_implementation, "--preset", args.preset]
    cmd += ["--trl-experts-implementation", args.trl_experts_implementation]
    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(args.threads),
        "MKL_NUM_THREADS": str(args.threads),
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_VERBOSITY": "error",
        "PYTHONHASHSEED": "0",
        "PYTHONWARNINGS": "ignore",
    }
    return cmd, env


def _collect(args, part: str, code: int, seconds: float) -> dict:
    log = args.workdir / f"{part}.log"
    result = args.workdir / f"{part}.json"
    if code != 0 or not result.is_file():
        tail = "\n".join(log.read_text().strip().splitlines()[-15:]) if log.is_file() else ""
        print(f"[bench] {part} FAILED (exit {code}) after {seconds:.0f}s:\n{tail}", flush=True)
        return {"error": tail, "wall_s": seconds}
    out = json.loads(result.read_text())
    out["wall_s"] = seconds
    print(f"[bench] {part} done in {seconds:.0f}s (peak RSS {out['peak_rss_mb']:.0f} MiB)", flush=True)
    return out


def spawn(args, part: str) -> dict:
    """Run one part in its own process (output in <workdir>/<part>.log)."""
    cmd, env = _child(args, part)
    print(f"[bench] {part} ...", flush=True)
    with open(args.workdir / f"{part}.log", "w") as log:
        seconds, proc = timed(lambda: subprocess.run(cmd, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT))
    return _collect(args, part, proc.returncode, seconds)


def lockstep(args, parts: list[str]) -> dict[str, dict]:
    """Run RL parts in separate processes that take turns one unit at a time (our RL step, TRL's generation
    batch), in ABBA order, so every part's unit k sees the same machine load; a waiting process blocks on a
    pipe and uses no CPU. Set-up runs concurrently; each process's peak RSS stays its own."""
    print(
        f"[bench] lockstep {', '.join(parts)} ({args.warmup} warm-up + {args.steps} timed units) ...",
        flush=True,
    )
    start = time.perf_counter()
    procs = {}
    for part in parts:
        cmd, env = _child(args, part)
        r, w = os.pipe()
        with open(args.workdir / f"{part}.log", "w") as log:
            proc = subprocess.Popen(
                [*cmd, "--ctl-fd", str(w)],
                env=env,
                cwd=ROOT,
                stdin=subprocess.PIPE,
                stdout=log,
                stderr=subprocess.STDOUT,
                pass_fds=(w,),
                text=True,
            )
        os.close(w)
        procs[part] = (proc, os.fdopen(r))

    def ready(part: str) -> bool:
        return procs[part][1].readline() == "ready\n"

    alive = [p for p in parts if ready(p)]  # set-up done
    for unit in range(args.warmup + args.steps):
        for part in list(alive if unit % 2 == 0 else alive[::-1]):
            try:
                procs[part][0].stdin.write("go\n")
                procs[part][0].stdin.flush()
                ok = ready(part)
            except BrokenPipeError:
                ok = False
            if not ok:
                alive.remove(part)
            else:
                print(f"[bench]   unit {unit}: {part} done", flush=True)
    out = {}
    for part, (proc, ctl) in procs.items():
        proc.stdin.close()
        code = proc.wait()
        ctl.close()
        out[part] = _collect(args, part, code, time.perf_counter() - start)
    return out


def _versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for pkg in ("torch", "transformers", "trl", "accelerate"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = None
    return out


def report(res: dict) -> None:
    parts, cfg = res["parts"], res["config"]
    print(
        f"\n{cfg['preset']} ({cfg['checkpoint_kind']}), batch {PROMPTS}x{GROUP}, max_new_tokens {MAX_NEW}, "
        f"{MINIBATCHES} minibatches, torch threads {cfg['threads']}, load before/after {cfg['load_before']} / "
        f"{cfg['load_after']}, torch {cfg['versions']['torch']}, trl {cfg['versions']['trl']}\non {cfg['machine']}"
    )
    ro = parts.get("rollout", {})
    if "ours_hf_engine" in ro:
        rows = [
            [
                name,
                r["median_s"],
                sum(r["tokens"]) / len(r["tokens"]),
                r["tokens_per_s"],
                r["ms_per_decode_step"],
            ]
            for name, r in ((n, ro[n]) for n in ("ours_hf_engine", "hf_generate"))
        ]
        print_table(
            ["engine", "median s", "gen tokens", "tokens/s", "ms/decode step"],
            rows,
            f"(a) rollout, median of {len(ro['hf_generate']['seconds'])} — ours/HF tokens/s (paired): "
            f"{ro['ratio_tokens_per_s_ours_over_hf']:.2f}x",
        )
    rows = []
    for name in [*OURS, *TRL_PARTS]:
        r = parts.get(name)
        if not r or "error" in r:
            continue
        ph = r["median_phase_s"]
        gen = ph.get("rollout", ph.get("rollout+score+old_policy"))
        rows.append(
            [
                name,
                r["median_step_s"],
                gen,
                ph.get("old_policy"),
                ph["update"],
                ph.get("telemetry"),
                r["response_tokens_mean"],
                r["tokens_per_s"],
                r.get("tokens_per_s_with_telemetry"),
                r["peak_rss_mb"],
            ]
        )
    if rows:
        print_table(
            [
                "run",
                "step s",
                "rollout s",
                "pi_old s",
                "4 upd s",
                "telem s",
                "resp tok",
                "tok/s",
                "tok/s+tel",
                "RSS MiB",
            ],
            rows,
            "(b) one RL step, median (TRL: 'rollout s' = generation + scoring + pi_old)",
        )
    for key, val in res["ratios"].items():
        print(f"  tokens/s {key}: {val:.2f}x (median over lockstep units)")
    rp = parts.get("replay", {})
    if "median_s" in rp:
        m = rp["median_s"]
        print_table(
            ["case", "median s", "overhead (paired)"],
            [
                ["update x4, no replay", m["update_none"], ""],
                ["update x4, R2 replay", m["update_r2"], f"{rp['r2_update_overhead_pct']:+.1f}%"],
                ["pi_old fwd, plain", m["pi_old_plain"], ""],
                ["pi_old fwd, record", m["pi_old_record"], f"{rp['record_overhead_pct']:+.1f}%"],
            ],
            f"(c) routing replay on one batch ({rp['response_tokens']} response tokens, padded len {rp['padded_len']})",
        )
    fl = res.get("floor", {})
    if fl.get("runs"):
        gemm = parts["floor"]["gemm"]
        rows = [
            [name, r["gflop"], r["step_s"], r["floor_s"], 100 * r["efficiency"]]
            + [100 * r.get("phase_efficiency", {}).get(p, float("nan")) for p in PASSES]
            for name, r in fl["runs"].items()
        ]
        print_table(
            ["run", "GFLOP", "step s", "at GEMM rate s", "% of rate", "rollout %", "pi_old %", "upd %"],
            rows,
            f"(e) compute floor: fp32 matmul {gemm['dense']['gflops']:.0f} GFLOP/s at {gemm['dense']['shape']} "
            f"(one expert's share {gemm['expert']['shape']}: {gemm['expert']['gflops']:.0f}); useful work = "
            f"2 N_active x fed tokens x {sum(PASSES.values())} passes",
        )
        for pair, r in fl["at_2x"].items():
            print(f"  2x for {pair}: step <= {r['step_s']:.3f} s, i.e. {100 * r['efficiency']:.0f}% of the GEMM rate")
    print_table(
        ["part", "peak RSS MiB", "after set-up MiB"],
        [[k, v.get("peak_rss_mb"), v.get("rss_mb_by_phase", {}).get("after_setup")] for k, v in parts.items()],
        "(d) peak resident memory (ru_maxrss) per part, one subprocess each; 'after set-up' = imports + model",
    )


def main() -> None:
    args = parse_args()
    if args.part:
        run_part(args)
        return
    args.workdir = args.workdir or Path(tempfile.mkdtemp(prefix="bench_rl-"))
    args.workdir.mkdir(parents=True, exist_ok=True)
    load_before = load_average()
    parts: dict[str, dict] = {}
    if args.checkpoint is None and (COLDSTART / "config.json").is_file():
        args.checkpoint, kind = COLDSTART, "cold start"
    elif args.checkpoint is None:
        args.checkpoint, kind = args.workdir / "init", "random init"
        parts["prepare"] = spawn(args, "prepare")
    else:
        kind = str(args.checkpoint)
    wanted = [p.strip() for p in args.parts.split(",") if p.strip()]
    rl = [p for p in wanted if p in OURS or p in TRL_PARTS]
    for part in wanted:
        if part in rl and rl:
            parts.update(lockstep(args, rl))
            rl = []
        elif part not in parts:
            parts[part] = spawn(args, part)
    ratios = {}
    for ours, theirs in PAIRS:
        a, b = parts.get(ours, {}), parts.get(theirs, {})
        if "tokens_per_s" in a and "tokens_per_s" in b:
            units = zip(a["steps"], b["generation_batches"])  # the same lockstep unit: same machine load
            ratios[f"{ours} / {theirs}"] = median([x["tokens_per_s"] / y["tokens_per_s"] for x, y in units])
            units = zip(a["steps"], b["generation_batches"])
            ratios[f"{ours} (incl. telemetry) / {theirs}"] = median(
                [x["tokens_per_s_with_telemetry"] / y["tokens_per_s"] for x, y in units]
            )
    res = {
        "config": {
            **{k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k != "part"},
            "checkpoint_kind": kind,
            "batch": {
                "layers": LAYERS,
                "prompts": PROMPTS,
                "group": GROUP,
                "max_new_tokens": MAX_NEW,
                "minibatches": MINIBATCHES,
            },
            "versions": _versions(),
            "machine": machine(),
            "cpus": os.cpu_count(),
            "load_before": load_before,
            "load_after": load_average(),
        },
        "parts": parts,
        "ratios": ratios,
        "floor": floor_summary(parts),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1) + "\n")
    report(res)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
