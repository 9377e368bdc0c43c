"""The prepared GPU check: in one command, what the CPU tests cannot prove, written to one folder.

    python -m benchmarks.gpu_check --out DIR                      # one CUDA GPU, ≤ 8 minutes
    python -m benchmarks.gpu_check --out DIR --device cpu --tiny  # the same code at a tiny size (tests)
    bash benchmarks/gpu_check.sh DIR   # a bare GPU machine (Python + torch + driver): installs gpu_bundle/ first

Parts (each is recorded as ok / skipped / failed with its numbers; one failing does not stop the others):
- `env`: torch, CUDA device, bf16 support, versions; whether vllm and deepspeed import.
- `coldstart`: a short SFT of a deep, wide miniature Qwen3-MoE — 48 layers, 128 experts, top-8, like
  Qwen3-30B-A3B, with hidden size 128 — on the smoke task (2-term 1-digit addition), so RL has a signal.
- `hf_engine`: the HF rollout engine on CUDA in bf16 (its own bf16 copy of the fp32 trainer weights, as
  `rollout.dtype: bfloat16`): tokens/s, peak memory, the same seed giving the same tokens, rollout log-probs
  against the training forward (the §5.4 mismatch: k3, extreme-token share), and the routing recorded during
  generation (R3) against the training forward's routing.
- `rl`: GSPO, GRPO + R2, GRPO + R3 and GRPO from the same cold start, a few RL steps each: the trainer's own
  Context (`trainer.build_context`) and step (`trainer.rl_step`, 4 minibatches per rollout batch, every metric
  it logs kept); training forwards in bf16 autocast over fp32 master weights. Through the step's `on_update`
  hook, routing volatility is measured after *every update* (the routers' free choices on the step's rollout,
  before vs after that one optimizer step: the paper's ≈ 10 % "after one gradient update" for the 48-layer
  model) as well as per RL step (π_old vs after the step's 4 updates), with the router calls that replayed a
  trace: a replay run that replayed none fails.
- `suite`: the suite's own commands on the device — `python -m gspo_study sft` and `train` (GSPO, GRPO + R2, a
  few steps) at the gpu scale (experiments/gpu/; `--tiny`: its smoke shape, GRPO + R2 only) with an MLflow store
  in DIR/suite,
  checked for parameters on the device (the runs' provenance.device tag), changed weights and finite metrics,
  with seconds per step and peak GPU memory; then `make reproduce-figure-1 SCALE=smoke` on the device; on CUDA
  tests/test_device.py. Skipped with one line where MLflow or the analysis packages are missing (the bundle).
- `vllm`: `tests/test_vllm_engine.py -k GPU` (the real engine in bf16, weight sync, R3 routing) when vllm and
  pytest import; else skipped with one line.
- `vllm_server`: the `vllm_server` rollout engine against a real vLLM server it starts (bf16 log-probs vs the
  trainer's forward, a weight push, on a GPU R3's routed experts over HTTP vs the training forward's routing);
  skipped with one line where no vLLM imports.
- `deepspeed`: not part of this check (the suite's DeepSpeed paths run under torchrun and log to MLflow); the
  line says whether deepspeed imports.

Writes DIR/results.json (everything) and DIR/summary.txt (a few lines). Needs no MLflow, no network.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import os
import platform
import random
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

from gspo_study.config import load_config
from gspo_study.evaluate import score
from gspo_study.models import build_char_tokenizer, build_model
from gspo_study.models.presets import PRESETS, active_params
from gspo_study.moe import mismatch_metrics, record_routing, routing_volatility
from gspo_study.rollout import HFEngine
from gspo_study.rollout.base import teacher_forced_batch
from gspo_study.run import resolve_run, run_key
from gspo_study.runtime import autocast
from gspo_study.sft import lr_lambda, sft_loss
from gspo_study.tasks import get_task
from gspo_study.tracking import find_run, mlflow_key, open_client
from gspo_study.train.forward import token_logprobs

ROOT = Path(__file__).resolve().parents[1]
PAPER_VOLATILITY_PER_UPDATE = 0.10  # §5.3: ~10% of activated experts differ after one update (48 layers)

# The miniature: Qwen3-30B-A3B's routing shape (48 layers, 128 experts, top-8) at a small width.
SHAPES = {
    "mini": dict(PRESETS["qwen3-moe-mini"]),  # the gpu scale's model (experiments/gpu/base.yaml)
    "tiny": dict(
        num_hidden_layers=4,
        num_experts=8,
        num_experts_per_tok=2,
        hidden_size=32,
        moe_intermediate_size=32,  # 32 and head_dim 32: shapes vLLM's CPU kernels take (the server part on CPU)
        intermediate_size=64,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
    ),
}
# Sizes per shape: cold-start steps and batch, RL steps, prompts × group, lr, HF-engine batch.
SIZES = {
    "mini": dict(sft_steps=300, sft_batch=64, sft_lr=2e-3, rl_steps=20, prompts=16, group=8, lr=1e-4, gen_batch=256),
    "tiny": dict(sft_steps=150, sft_batch=32, sft_lr=1e-2, rl_steps=2, prompts=8, group=4, lr=1e-3, gen_batch=16),
}
RUNS = ("gspo", "grpo_r2", "grpo_r3", "grpo")  # experiments/runs/<name>.yaml
VLLM_RESERVE_S = 270.0  # seconds kept for the vLLM parts when vllm is installed (engine and server start-up included)
EXPERTS_FALLBACK = ("grouped_mm_index", "grouped_mm", "batched_mm", "eager")


# ---------------------------------------------------------------------------------------------- helpers
class Check:
    """Runs the parts, keeps their results, writes them."""

    def __init__(self, out: Path, budget_s: float):
        self.out, self.budget_s, self.start = out, budget_s, time.time()
        self.results: dict[str, dict] = {}

    def left(self) -> float:
        return self.budget_s - (time.time() - self.start)

    def part(self, name: str, fn, *args):
        t0 = time.time()
        say(f"[{name}] ...")
        try:
            res = fn(*args)
            status = res.pop("status", "ok")
        except Exception as exc:  # noqa: BLE001 - a failed part is a result, the next part still runs
            res = {
                "error": f"{type(exc).__name__}: {exc}".splitlines()[0][:500],
                "trace": traceback.format_exc(),
            }
            status = "failed"
        res = {"status": status, "seconds": round(time.time() - t0, 2), **res}
        self.results[name] = res
        say(
            f"[{name}] {status} in {res['seconds']:.1f} s"
            + (f": {res.get('reason') or res.get('error')}" if status != "ok" else "")
        )
        self.write()
        return res

    def write(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "results.json").write_text(json.dumps(self.results, indent=1, default=float))
        (self.out / "summary.txt").write_text(summary(self.results))


def say(text: str) -> None:
    print(text, flush=True)


def peak_gb(device: torch.device) -> float | None:
    return round(torch.cuda.max_memory_allocated(device) / 2**30, 3) if device.type == "cuda" else None


def config(run: str, sizes: dict, overrides: list[str]):
    base = ROOT / "experiments" / "smoke" / "base.yaml"
    return load_config(
        [base, ROOT / "experiments" / "runs" / f"{run}.yaml"],
        [
            f"rollout.prompts_per_step={sizes['prompts']}",
            f"rollout.group_size={sizes['group']}",
            "rollout.dtype=bfloat16",
            f"train.lr={sizes['lr']}",
            "train.num_minibatches=4",
            f"train.steps={sizes['rl_steps']}",
            *overrides,
        ],
    )


def build(shape: str, device: torch.device, seed: int, experts: str):
    tok = build_char_tokenizer()
    model = build_model("qwen3-moe-smoke", tok, seed, experts_implementation=experts, **SHAPES[shape])
    return model.to(device), tok


def pick_experts_kernel(shape: str, device: torch.device, wanted: str) -> tuple[str, list[str]]:
    """The first experts kernel (from `wanted` on) whose forward + backward runs here under autocast."""
    tried = []
    order = [wanted, *[k for k in EXPERTS_FALLBACK if k != wanted]]
    for impl in order:
        try:
            model, _ = build(shape, device, 0, impl)
            ids = torch.randint(4, 25, (2, 8), device=device)
            with autocast(model):  # the training forward and backward, as token_logprobs runs them
                model(ids).logits.float().sum().backward()
            with torch.no_grad():  # the rollout engine's bf16 copy
                copy.deepcopy(model).to(torch.bfloat16)(ids)
            return impl, tried
        except Exception as exc:  # noqa: BLE001 - a kernel this torch/GPU lacks: try the next
            tried.append(f"{impl}: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
    raise RuntimeError(f"no experts kernel runs here: {tried}")


# ---------------------------------------------------------------------------------------------- parts
def part_env(device: torch.device) -> dict:
    import transformers

    out = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": str(device),
        "vllm_importable": importlib.util.find_spec("vllm") is not None,
        "deepspeed_importable": importlib.util.find_spec("deepspeed") is not None,
        "mlflow_importable": importlib.util.find_spec("mlflow") is not None,
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        out.update(
            gpu=props.name,
            capability=f"{props.major}.{props.minor}",
            memory_gb=round(props.total_memory / 2**30, 1),
            bf16=torch.cuda.is_bf16_supported(),
            cuda=torch.version.cuda,
        )
    return out


def part_coldstart(state: dict) -> dict:
    """SFT from scratch on the smoke task's correct traces; leaves the weights in `state['weights']`."""
    device, sizes, seed = state["device"], state["sizes"], state["seed"]
    model, tok = build(state["shape"], device, seed, state["experts"])
    task = get_task(config("gspo", sizes, []).task)
    opt = torch.optim.AdamW(model.parameters(), lr=sizes["sft_lr"])
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(min(20, sizes["sft_steps"] // 5), sizes["sft_steps"]))
    losses, t0 = [], time.time()
    steps = sizes["sft_steps"]
    for step in range(steps):
        if time.time() - t0 > state["sft_budget_s"]:
            break
        probs = task.sample_train(sizes["sft_batch"], random.Random(seed * 100_003 + step))
        batch = teacher_forced_batch(tok, [p.prompt for p in probs], [task.sft_target(p) for p in probs])
        loss = sft_loss(model, batch)  # bf16 autocast on CUDA: the suite's own (runtime.autocast)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    state["weights"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    state["tokenizer"] = tok
    engine = HFEngine(model, tok, dtype="bfloat16")
    held = task.sample_train(64, random.Random(-seed))  # fresh draws (the smoke task holds out only ~11)
    gen = torch.Generator().manual_seed(seed)
    batch = engine.generate([p.prompt for p in held], 12, 1.0, gen)
    pass1 = score(task, held, batch)[0].mean().item()
    state["coldstart_pass1"] = pass1
    return {
        "steps": len(losses),
        "loss_first": losses[0],
        "loss_last": losses[-1],
        "sampled_pass@1_64_fresh_prompts": pass1,
        "params_total": sum(p.numel() for p in model.parameters()),
        "params_active_per_token": active_params(model.config),
        "experts_implementation": state["experts"],
        "peak_gpu_gb": peak_gb(device),
    }


def _gen(engine, prompts, seed, capture_routing=False):
    return engine.generate(prompts, 12, 1.0, torch.Generator().manual_seed(seed), capture_routing=capture_routing)


def part_hf_engine(state: dict) -> dict:
    device, sizes = state["device"], state["sizes"]
    model, tok = build(state["shape"], device, state["seed"], state["experts"])
    model.load_state_dict(state["weights"])
    task = get_task(config("gspo", sizes, []).task)
    probs = task.sample_train(sizes["gen_batch"], random.Random(7))
    prompts = [p.prompt for p in probs]
    engine = HFEngine(model, tok, dtype="bfloat16")  # bf16 copy of the fp32 trainer weights
    _gen(engine, prompts[:8], 0)  # warm-up (kernels, allocator)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.time()
    batch = _gen(engine, prompts, 1, capture_routing=True)
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.time() - t0
    again = _gen(engine, prompts, 1)
    mask = batch.response_mask
    same = torch.equal(batch.sequences, again.sequences)
    with torch.no_grad(), record_routing(model) as train_routing:  # the trainer's forward (autocast on CUDA)
        train_lp, _ = token_logprobs(model, batch.sequences, batch.attention_mask)
    with torch.no_grad(), record_routing(engine.model) as engine_routing:
        engine_lp, _ = token_logprobs(engine.model, batch.sequences, batch.attention_mask)
    valid = mask.sum().item()
    return {
        "batch": len(prompts),
        "response_tokens": int(batch.response_lengths.sum()),
        "seconds": round(seconds, 3),
        "tokens_per_s": round(batch.response_lengths.sum().item() / seconds, 1),
        "same_seed_same_tokens": same,
        "rollout_vs_bf16_forward_logprob_maxabs": _maxabs(batch.rollout_logprobs, engine_lp, mask),
        "mismatch_vs_train_forward": mismatch_metrics(train_lp, batch.rollout_logprobs, mask),
        "r3_trace_vs_bf16_forward_changed": routing_volatility(batch.routing, engine_routing, mask)["overall"],
        "r3_trace_vs_train_forward_changed": routing_volatility(batch.routing, train_routing, mask)["overall"],
        "valid_tokens": int(valid),
        "peak_gpu_gb": peak_gb(device),
    }


def _maxabs(a, b, mask) -> float:
    return float(torch.where(mask, (a - b).abs(), torch.zeros_like(a)).max())


def rl_context(run: str, state: dict):
    """The trainer's own Context (`trainer.build_context`: its task, checks, backend, engine and objective, from
    the run's config) around the cold start in memory, on the check's device."""
    from gspo_study import trainer

    extra = [f"seed={state['seed']}", f"model.experts_implementation={state['experts']}"]
    cfg = config(run, state["sizes"], [*extra, f"train.device={state['device'].type}"])
    model, tok = build(state["shape"], state["device"], state["seed"], state["experts"])
    model.load_state_dict(state["weights"])
    return trainer.build_context(resolve_run(cfg), model, tok)


class EveryUpdate:
    """The trainer's `on_update` hook: after each optimizer update of a step, the routers' natural (free) choices on
    the step's rollout, one more no-grad forward, against those before that update — for update 1, π_old's free
    routing (the trainer's `route_baseline`) — and the router calls of the update's forwards that replayed a trace
    (the proof that R2 / R3 replayed)."""

    def __init__(self, ctx):
        self.ctx, self.updates, self.before, self.last = ctx, [], None, None

    def __call__(self, inputs, i: int, result) -> None:
        from gspo_study.trainer import policy_pass

        if i == 0:
            self.before = self.last = inputs.baseline[1]
        _, after = policy_pass(self.ctx, inputs.batch, None)
        vol = routing_volatility(self.last, after, inputs.batch.response_mask)
        self.updates.append(_volatility(vol) | {"replayed_router_calls": result.replayed_calls})
        self.last, self.mask = after, inputs.batch.response_mask

    def step(self) -> dict:
        """π_old's free routing against the routing after the step's last update."""
        return _volatility(routing_volatility(self.before, self.last, self.mask))


def _volatility(vol: dict) -> dict:
    """Overall, tokens with any changed choice, and the first and last quarter of the MoE layers: volatility
    grows with depth (§5.3)."""
    layers = sorted(k for k in vol if k.startswith("layer_"))
    q = max(1, len(layers) // 4)
    mean = lambda ks: sum(vol[k] for k in ks) / len(ks)  # noqa: E731
    out = {k: vol[k] for k in ("overall", "tokens_any_changed")}
    return out | {"first_quarter": mean(layers[:q]), "last_quarter": mean(layers[-q:])}


def check_step(ctx, step: int) -> dict:
    """One RL step, the trainer's (`trainer.rl_step`), with the routing read after every update."""
    from gspo_study import trainer

    hook, t0 = EveryUpdate(ctx), time.time()
    metrics = trainer.rl_step(ctx, step, on_update=hook)
    return {
        "reward": metrics["rollout/reward/mean"],
        "clip_frac_token": metrics["policy/clip_frac/token"],
        "volatility_per_update": hook.updates,
        "volatility_step": hook.step(),
        "seconds": round(time.time() - t0, 2),
        "metrics": metrics,  # everything the trainer logs for the step
    }


def rl_run(run: str, state: dict, budget_s: float) -> dict:
    """Up to `sizes['rl_steps']` steps of one run, stopping before a step that would overrun `budget_s`. A run
    whose replay mode replays and whose updates replayed no router call fails (it would be reported as R2 / R3)."""
    from gspo_study.trainer import replay_mode

    ctx, steps, t0 = rl_context(run, state), [], time.time()
    for step in range(1, state["sizes"]["rl_steps"] + 1):  # 1-based, as the trainer counts
        if steps and (time.time() - t0) * (len(steps) + 1) / len(steps) > budget_s:
            break  # the next step would overrun this run's share of the time left
        steps.append(check_step(ctx, step))
        say(
            f"  {run} step {step}: reward {steps[-1]['reward']:.3f}, volatility per update "
            f"{[round(u['overall'], 4) for u in steps[-1]['volatility_per_update']]}"
        )
    replayed = sum(u["replayed_router_calls"] for s in steps for u in s["volatility_per_update"])
    mode = replay_mode(ctx.cfg)
    if mode.replays is not None and replayed == 0:
        raise RuntimeError(f"{run}: routing_replay={mode.name} but no router call replayed a trace")
    per_update = [u["overall"] for s in steps for u in s["volatility_per_update"]]
    return {
        "routing_replay": mode.name,
        "replayed_router_calls": replayed,
        "steps": steps,
        "mean_volatility_per_update": sum(per_update) / len(per_update),
        "mean_volatility_per_step": sum(s["volatility_step"]["overall"] for s in steps) / len(steps),
        "reward_first": steps[0]["reward"],
        "reward_last": steps[-1]["reward"],
    }


def part_rl(state: dict) -> dict:
    device, out = state["device"], {}
    for i, run in enumerate(RUNS):
        budget = (state["check"].left() - state["reserve_s"]) / (len(RUNS) - i) - 5
        out[run] = rl_run(run, state, budget)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    out["paper_volatility_per_update"] = PAPER_VOLATILITY_PER_UPDATE
    out["peak_gpu_gb"] = peak_gb(device)
    return out


def part_vllm(state: dict) -> dict:
    if importlib.util.find_spec("vllm") is None:
        return {
            "status": "skipped",
            "reason": "vllm is not installed (pip install '.[gpu]' on the GPU machine)",
        }
    if importlib.util.find_spec("pytest") is None:
        return {
            "status": "skipped",
            "reason": "pytest is not installed (it runs tests/test_vllm_engine.py -k GPU)",
        }
    if state["device"].type != "cuda":
        return {"status": "skipped", "reason": "the vLLM engine needs a CUDA GPU"}
    timeout = max(60.0, state["check"].left())
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "tests/test_vllm_engine.py",
        "-k",
        "GPU",
        "-q",
        "-p",
        "no:cacheprovider",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    tail = (proc.stdout + proc.stderr)[-3000:]
    return {
        "status": "ok" if proc.returncode == 0 else "failed",
        "returncode": proc.returncode,
        "output_tail": tail,
    }


def part_vllm_server(state: dict) -> dict:
    """`rollout.engine: vllm_server` against a real vLLM server started on this machine (this interpreter's vLLM,
    or `--vllm-python`): bf16 rollouts of the cold start and their log-probs against the trainer's forward, a
    push of perturbed weights (disk + /collective_rpc), and on a GPU R3's routed experts returned over HTTP
    against the training forward's routing — the paths the CPU tests cannot reach (GPU build, R3)."""
    from gspo_study.config import ServerConfig
    from gspo_study.rollout.vllm_server import VLLMServerEngine, has_vllm, is_cpu_build

    python = state.get("vllm_python") or sys.executable
    if "weights" not in state:
        return {"status": "skipped", "reason": "no cold start (the coldstart part did not finish)"}
    if not has_vllm(python):
        return {
            "status": "skipped",
            "reason": f"{python} has no vLLM (pip install '.[gpu]', or --vllm-python)",
        }
    cpu = is_cpu_build(python)
    device = state["device"]
    if not cpu and device.type != "cuda":
        return {"status": "skipped", "reason": "the GPU build of vLLM needs a CUDA GPU"}
    model, tok = build(state["shape"], device, state["seed"], state["experts"])
    model.load_state_dict(state["weights"])
    prompts = [p.prompt for p in get_task(config("gspo", state["sizes"], []).task).sample_train(64, random.Random(9))]
    args = ["--max-model-len", "256"] + ([] if cpu else ["--gpu-memory-utilization", "0.3", "--enforce-eager"])
    server = ServerConfig(python=python, args=args, start_timeout_s=max(60.0, state["check"].left() - 30))
    engine = VLLMServerEngine(model, tok, "bfloat16", server, state["check"].out / "vllm-server")
    routing = not cpu  # vLLM returns routed experts on a GPU only

    def forward(batch):
        seq, att = batch.sequences.to(device), batch.attention_mask.to(device)
        with torch.no_grad(), record_routing(model) as trace:
            lp, _ = token_logprobs(model, seq, att)
        return lp.float().cpu(), trace.to("cpu")

    try:
        t0 = time.time()
        batch = _gen(engine, prompts, 1, capture_routing=routing)
        first_s = time.time() - t0
        train_lp, train_trace = forward(batch)
        out = {
            "cpu_build": cpu,
            "start_s": round(engine.timings.get("start_s", float("nan")), 1),
            "first_rollout_s": round(first_s, 2),
            "response_tokens": int(batch.response_lengths.sum()),
            "mismatch_vs_train_forward": mismatch_metrics(train_lp, batch.rollout_logprobs, batch.response_mask),
        }
        if routing:
            out["r3_server_vs_train_forward_changed"] = routing_volatility(
                batch.routing, train_trace, batch.response_mask
            )["overall"]
        with torch.no_grad():
            for param in model.parameters():
                param.add_(0.02 * torch.randn_like(param))
        engine.sync(model)
        t0 = time.time()
        after = _gen(engine, prompts, 2)
        out["push_and_rollout_s"] = round(time.time() - t0, 3)
        out["push"] = {k: v for k, v in engine.last_push.items() if k != "workers"}
        out["mismatch_after_push"] = mismatch_metrics(forward(after)[0], after.rollout_logprobs, after.response_mask)
        out["same_seed_same_tokens"] = torch.equal(_gen(engine, prompts, 2).sequences, after.sequences)
    finally:
        engine.close()
    return out


def part_deepspeed(state: dict) -> dict:
    there = importlib.util.find_spec("deepspeed") is not None
    return {
        "status": "skipped",
        "reason": f"deepspeed {'imports' if there else 'is not installed'}; its GPU path (torchrun, MLflow) is "
        "not part of this check",
    }


# ---------------------------------------------------------------------------------------------- the suite
SUITE_RUNS = ("gspo", "grpo_r2", "grpo")  # figure 1's and 3's arms, trained by `python -m gspo_study train`
# --tiny trains the one with replay (the other is the same command) and a shorter smoke cold start for the figure:
# the CPU test of this part is the suite's longest test, and its time is process start-ups
TINY_SUITE_RUNS = ("grpo_r2",)
SUITE_RESERVE_S = {"cuda": 240.0, "cpu": 150.0}  # seconds kept for the suite part (its commands start processes)
# --tiny: the gpu scale's files with the smoke shape, task and batch (the CPU test of this part)
TINY_SUITE = [
    "model.preset=qwen3-moe-smoke",
    "task.num_terms=2",
    "task.digits=1",
    "rollout.prompts_per_step=8",
    "rollout.group_size=4",
    "train.lr=1e-3",
    "rollout.max_new_tokens=12",
    "eval.num_prompts=4",
    "eval.batch_size=16",
    "threads=1",
]


def suite_missing() -> list[str]:
    """What the suite part needs and this interpreter lacks (then it is skipped, and no time is kept for it)."""
    return [m for m in ("mlflow", "pandas", "matplotlib") if importlib.util.find_spec(m) is None]


def vllm_importable() -> bool:
    return importlib.util.find_spec("vllm") is not None


def reserve_s(device: torch.device, vllm_python: str | None) -> float:
    """Seconds the RL part leaves for the parts after it: only for those that will run (a suite part that is skipped
    for want of MLflow once took 240 s from the RL part, leaving it 1–3 steps)."""
    vllm = device.type == "cuda" and (vllm_importable() or vllm_python is not None)
    suite = 0.0 if suite_missing() else SUITE_RESERVE_S[device.type]
    return (VLLM_RESERVE_S if vllm else 10.0) + suite


def _suite(args: list[str], timeout: float, make: bool = False) -> tuple[subprocess.CompletedProcess, float]:
    """One of the suite's commands in a child process: (its result, wall seconds)."""
    env = {**os.environ, "TQDM_DISABLE": "1", "HF_HUB_OFFLINE": "1", "PYTHONHASHSEED": "0"}
    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{env['PYTHONPATH']}" if env.get("PYTHONPATH") else str(ROOT)
    cmd = args if make else [sys.executable, "-m", "gspo_study", *args]
    t0 = time.time()
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=max(60.0, timeout))
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, cmd[:6]))} … exited {done.returncode}: {done.stderr[-1500:]}")
    return done, round(time.time() - t0, 2)


def _finite(values) -> bool:
    return all(v == v and abs(v) != float("inf") for v in values)


def part_suite(state: dict) -> dict:
    """The suite's own commands on the check's device: `python -m gspo_study sft` then `train` for GSPO and
    GRPO + R2 at the gpu scale (experiments/gpu/; --tiny: its smoke shape), with an MLflow store in the output
    folder — the runs' parameters on the device (their provenance.device tag), changed, and every metric
    finite, per-step time and peak memory — then `make reproduce-figure-1 SCALE=smoke` on the device, and on
    CUDA tests/test_device.py (every forward's inputs on the model's device)."""
    import resource

    from gspo_study.config import load_config as load

    missing = suite_missing()
    if missing:
        return {
            "status": "skipped",
            "reason": f"the suite's commands need {', '.join(missing)} (`make install` with a CUDA torch: "
            "make install TORCH_SPEC='torch>=2.6')",
        }
    from safetensors.torch import load_file

    device, tiny, check = state["device"], state["shape"] == "tiny", state["check"]
    root = check.out / "suite"
    store = f"sqlite:///{root}/mlflow.db"
    common = [f"results_dir={root}", f"tracking.uri={store}", f"train.device={device.type}", f"seed={state['seed']}"]
    common += TINY_SUITE if tiny else []
    sft = [
        "sft.target_pass1=null",
        "sft.check_every=10",  # the default: a check interval without a target is refused as inert
        *(["sft.steps=100", "sft.batch_size=32", "sft.lr=1e-2"] if tiny else ["sft.steps=150"]),
    ]
    train = ["train.steps=3", "eval.every=0", "train.checkpoint_every=0", "eval.num_prompts=" + ("4" if tiny else "64")]
    base, coldstart = "experiments/gpu/base.yaml", "experiments/gpu/coldstart.yaml"
    runs = TINY_SUITE_RUNS if tiny else SUITE_RUNS
    out = {"device": str(device), "overrides": common, "runs": list(runs)}
    _, out["sft_s"] = _suite(["sft", coldstart, *common, *sft], check.left())
    ckpt = resolve_run(load([ROOT / coldstart], [*common, *sft])).coldstart
    out["sft"] = json.loads((ckpt / "sft_log.json").read_text())["meta"]
    before = load_file(str(next(ckpt.glob("*.safetensors"))))
    client = open_client(store)
    for run in runs:
        files = [base, f"experiments/runs/{run}.yaml"]
        over = [*common, *train, f"init_checkpoint={ckpt}"]
        _, seconds = _suite(["train", *files, *over], check.left())
        cfg = load([ROOT / f for f in files], over)
        found = find_run(client, client.get_experiment_by_name(cfg.tracking.experiment).experiment_id, run_key(cfg))
        metrics, tags = found.data.metrics, found.data.tags
        signal = [
            m.value for m in client.get_metric_history(found.info.run_id, mlflow_key("rollout/zero_std_group_frac"))
        ]
        after = load_file(str(next(resolve_run(cfg).checkpoint.glob("*.safetensors"))))
        changed = sum(not torch.equal(before[k], after[k]) for k in before if k in after)
        steps = cfg.train.steps
        out[run] = {
            "wall_s": seconds,
            "seconds_per_step": round(metrics["compute/seconds"] / steps, 3),
            "provenance_device": tags.get("provenance.device"),
            "provenance_precision": tags.get("provenance.precision"),
            "params_on_device": tags.get("provenance.device", "").startswith(device.type),
            "tensors_changed": changed,
            "metrics_finite": _finite(metrics.values()),
            "eval_pass@1_end": metrics.get(mlflow_key("eval/pass@1")),
            "peak_gpu_memory_gb": metrics.get(mlflow_key("perf/peak_gpu_memory_gb")),
            "steps_with_signal": sum(v < 1 for v in signal),  # a step whose every group has one reward: no gradient
        }
        moved = changed > 0 or out[run]["steps_with_signal"] == 0
        if not (out[run]["params_on_device"] and moved and out[run]["metrics_finite"]):
            raise RuntimeError(f"{run}: {out[run]}")
    if state.get("report"):  # figure 1 and the REPORT at the gpu scale, from the runs just trained
        over = [*common, *train, f"init_checkpoint={ckpt}", f"tracking.uri={store}"]
        seeds = ["--scale", "gpu", "--seeds", str(state["seed"])]
        py = [sys.executable, "-m"]
        _, out["figure_1_gpu_s"] = _suite([*py, "analysis.figures", "--figure", "1", *seeds, "--partial", *over],
                                          check.left(), make=True)  # fmt: skip
        _, out["report_gpu_s"] = _suite([*py, "analysis.report", *seeds, *over], check.left(), make=True)
        drawn = (root / "gpu").iterdir() if (root / "gpu").is_dir() else ()
        out["gpu_outputs"] = sorted(f.name for f in drawn if f.name.startswith("figure-1.") or f.name == "REPORT.md")
        if not {"figure-1.png", "REPORT.md"} <= set(out["gpu_outputs"]):
            raise RuntimeError(f"figure 1 / REPORT.md at the gpu scale not written under {root / 'gpu'}")
    figure = check.out / "figure-1"
    over = f"train.device={device.type} results_dir={figure} tracking.uri=sqlite:///{figure}/mlflow.db train.steps=2"
    over += " sft.steps=50" if tiny else ""
    make = ["make", "-o", "install", "reproduce-figure-1", f"PY={sys.executable}", "SCALE=smoke", "SEEDS=1", "JOBS=1"]
    _, out["reproduce_figure_1_s"] = _suite([*make, f"OVERRIDES={over}"], check.left(), make=True)
    out["figure_files"] = sorted(p.name for p in figure.rglob("figure-1*.png"))
    if not out["figure_files"]:
        raise RuntimeError(f"make reproduce-figure-1 drew no figure-1 PNG under {figure}")
    out["peak_rss_children_gb"] = round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20, 2)
    if device.type == "cuda" and importlib.util.find_spec("pytest") is not None:
        cmd = [sys.executable, "-m", "pytest", "tests/test_device.py", "-q", "-p", "no:cacheprovider"]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=max(60.0, check.left()))
        out["device_tests"] = {"returncode": proc.returncode, "tail": (proc.stdout + proc.stderr)[-1500:]}
    return out


# ---------------------------------------------------------------------------------------------- summary
def summary(results: dict) -> str:
    lines = []
    env = results.get("env", {})
    if env:
        lines.append(
            f"env: {env.get('gpu', env.get('device'))}, torch {env.get('torch')}, "
            f"transformers {env.get('transformers')}"
        )
    for name, res in results.items():
        if res.get("status") != "ok":
            lines.append(f"{name}: {res.get('status')} — {res.get('reason') or res.get('error')}")
    cs = results.get("coldstart", {})
    if cs.get("status") == "ok":
        lines.append(
            f"coldstart: {cs['steps']} SFT steps, loss {cs['loss_first']:.3f} → {cs['loss_last']:.3f}, sampled pass@1 "
            f"{cs['sampled_pass@1_64_fresh_prompts']:.3f}; {cs['params_total'] / 1e6:.1f} M params "
            f"({cs['params_active_per_token'] / 1e6:.2f} M active), experts kernel {cs['experts_implementation']}"
        )
    hf = results.get("hf_engine", {})
    if hf.get("status") == "ok":
        mm = hf["mismatch_vs_train_forward"]
        lines.append(
            f"hf_engine: {hf['tokens_per_s']:.0f} tokens/s ({hf['batch']} prompts), same seed same tokens "
            f"{hf['same_seed_same_tokens']}, bf16 rollout vs train forward k3 {mm['k3']:.2e}, R3 trace vs training "
            f"forward: {100 * hf['r3_trace_vs_train_forward_changed']:.2f} % of choices differ"
        )
    rl = results.get("rl", {})
    if rl.get("status") == "ok":
        for run in RUNS:
            r = rl[run]
            replay = "" if r["routing_replay"] == "none" else f", {r['replayed_router_calls']} router calls replayed"
            lines.append(
                f"rl {run}: {len(r['steps'])} steps, reward {r['reward_first']:.3f} → {r['reward_last']:.3f}, routing "
                f"volatility {100 * r['mean_volatility_per_update']:.2f} % per update, "
                f"{100 * r['mean_volatility_per_step']:.2f} % per step (paper: ≈ 10 % per update){replay}"
            )
    suite = results.get("suite", {})
    if suite.get("status") == "ok":
        runs = ", ".join(
            f"{r} {suite[r]['seconds_per_step']:.2f} s/step"
            + (f", {suite[r]['peak_gpu_memory_gb']:.2f} GB peak" if suite[r].get("peak_gpu_memory_gb") else "")
            for r in suite["runs"]
        )
        lines.append(
            f"suite: sft {suite['sft_s']:.0f} s; train on {suite[suite['runs'][0]]['provenance_device']} "
            f"({suite[suite['runs'][0]]['provenance_precision']}): {runs}; make reproduce-figure-1 SCALE=smoke "
            f"{suite['reproduce_figure_1_s']:.0f} s"
            + (
                f"; figure 1 and REPORT.md at the gpu scale from those runs {suite['figure_1_gpu_s']:.0f} s and "
                f"{suite['report_gpu_s']:.0f} s"
                if "report_gpu_s" in suite
                else ""
            )
        )
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="folder for results.json and summary.txt")
    p.add_argument("--device", default="cuda", help="cuda (default) | cpu")
    p.add_argument("--tiny", action="store_true", help="4 layers, 8 experts: the CPU test of this script")
    p.add_argument("--budget-s", type=float, default=420.0, help="wall-clock budget; RL runs shorten to fit")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--suite-report", action="store_true", help="with --tiny: also draw figure 1 and write REPORT.md "
                   "at the gpu scale from the trained runs (on a GPU always)")  # fmt: skip
    p.add_argument("--vllm-python", help="interpreter with vLLM for the server part (default: this one)")
    p.add_argument("--experts", default="grouped_mm_index", help="experts kernel tried first")
    p.add_argument("--lr", type=float, help="RL learning rate (default: 1e-4 for the miniature, as the CPU study)")
    p.add_argument("--rl-steps", type=int, help="RL steps per run (default 20; fewer if the budget runs out)")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print(
            "error: --device cuda but torch sees no CUDA GPU (use --device cpu --tiny to test the script)",
            file=sys.stderr,
        )
        return 2
    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    shape = "tiny" if args.tiny else "mini"
    check = Check(Path(args.out), args.budget_s)
    sizes = dict(SIZES[shape])
    sizes.update({k: v for k, v in (("lr", args.lr), ("rl_steps", args.rl_steps)) if v is not None})
    state = dict(device=device, shape=shape, sizes=sizes, seed=args.seed, check=check)
    state["report"] = not args.tiny or args.suite_report
    check.part("env", part_env, device)
    check.results["env"]["sizes"] = sizes
    state["experts"], tried = pick_experts_kernel(shape, device, args.experts)
    check.results["env"]["experts_kernels_failed"] = tried
    state["sft_budget_s"] = 0.25 * args.budget_s
    state["reserve_s"] = reserve_s(device, args.vllm_python)
    if check.part("coldstart", part_coldstart, state)["status"] == "ok":
        check.part("hf_engine", part_hf_engine, state)
        check.part("rl", part_rl, state)
    check.part("suite", part_suite, state)
    check.part("vllm", part_vllm, state)
    state["vllm_python"] = args.vllm_python
    check.part("vllm_server", part_vllm_server, state)
    check.part("deepspeed", part_deepspeed, state)
    check.write()
    say(summary(check.results))
    failed = [k for k, v in check.results.items() if v["status"] == "failed"]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
