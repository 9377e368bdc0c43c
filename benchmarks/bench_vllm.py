"""Rollout speed of the real vLLM engine (its CPU build) against the HF engine, at the bench batch.

    .venv-vllm/bin/python -m benchmarks.bench_vllm --threads 1 --out results/bench_vllm.json   # make bench

The bench batch of bench_rl.py: 16 prompts x 8 responses, up to 40 new tokens, temperature 1, on the 8-layer
preset (`qwen3-moe-tiny`: head_dim 32, expert width 64, both fine for vLLM's CPU kernels), from the CPU cold
start when there is one (results/cpu/checkpoints/coldstart), else a random init. Cases, each in its own
process (vLLM patches its process; one engine per process): `hf-float32` (HFEngine, the trainer's default),
`vllm-float32` and `vllm-bfloat16` (VLLMEngine, as `rollout.engine=vllm rollout.dtype=...` runs it: weights
pushed by `sync`, eager mode). Reported: response tokens/s (the tokens the RL step trains on, EOS included)
per timed repeat, median, after one warm-up rollout; engine start-up (import, start) is timed apart.
Cases run one after the other, so a changing machine load shifts them; the load average is recorded.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import load_average, machine, median, peak_rss_mb, print_table

ROOT = Path(__file__).resolve().parents[1]
COLDSTART = ROOT / "results" / "cpu" / "checkpoints" / "coldstart"
PROMPTS, GROUP, MAX_NEW, SEED, PRESET = 16, 8, 40, 1, "qwen3-moe-tiny"
CASES = ("hf-float32", "vllm-float32", "vllm-bfloat16")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (both engines)")
    p.add_argument("--repeats", type=int, default=5, help="timed rollouts per case (after one warm-up)")
    p.add_argument("--cases", default=",".join(CASES), help=f"comma-separated subset of {','.join(CASES)}")
    p.add_argument("--checkpoint", type=Path, default=None, help="model directory (default: the CPU cold start)")
    p.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    p.add_argument("--case", default=None, help=argparse.SUPPRESS)  # internal: run one case in this process
    return p.parse_args(argv)


def run_case(args) -> dict:
    import random

    import torch

    torch.set_num_threads(args.threads)
    from gspo_study.evaluate import score
    from gspo_study.models import load_pretrained
    from gspo_study.rollout import make_engine
    from gspo_study.tasks.arith import ArithTask

    model, tok = load_pretrained(args.checkpoint)
    task = ArithTask()
    rows_problems = [p for p in task.sample_train(PROMPTS, random.Random(SEED)) for _ in range(GROUP)]
    prompts = [p.prompt for p in rows_problems]
    name, dtype = args.case.split("-")
    start = time.perf_counter()
    engine = make_engine(name, model, tok, dtype)
    engine.sync(model)
    rows = {"seconds": [], "tokens": [], "reward_mean": []}
    for rep in range(1 + args.repeats):
        t0 = time.perf_counter()
        batch = engine.generate(prompts, MAX_NEW, 1.0, torch.Generator().manual_seed(rep))
        seconds = time.perf_counter() - t0
        if rep == 0:  # warm-up; for vLLM this first call also imports and starts the engine
            first_s = time.perf_counter() - start
            continue
        rows["seconds"].append(seconds)
        rows["tokens"].append(int(batch.response_lengths.sum()))
        rows["reward_mean"].append(score(task, rows_problems, batch)[0].mean().item())  # sane rollouts
    out = {
        **rows,
        "tokens_per_s": median([t / s for t, s in zip(rows["tokens"], rows["seconds"])]),
        "median_s": median(rows["seconds"]),
        "first_rollout_with_start_s": first_s,
        "threads_after": torch.get_num_threads(),
        "peak_rss_mb": peak_rss_mb(),
    }
    if hasattr(engine, "timings"):
        out.update({f"engine_{k}": v for k, v in engine.timings.items()})
    return out


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.case:
        print(json.dumps(run_case(args)))
        return {}
    cases = [c for c in args.cases.split(",") if c]
    unknown = sorted(set(cases) - set(CASES))
    if unknown:
        sys.exit(f"unknown cases {unknown}; allowed: {', '.join(CASES)}")
    with tempfile.TemporaryDirectory(prefix="bench-vllm-") as tmp:
        checkpoint = args.checkpoint or (COLDSTART if (COLDSTART / "config.json").is_file() else None)
        source = "cold start" if checkpoint else f"random init of {PRESET} (no cold start at {COLDSTART})"
        if checkpoint is None:
            checkpoint = Path(tmp) / "model"
            code = (
                "from gspo_study.models import build_char_tokenizer, build_model, save_pretrained\n"
                "tok = build_char_tokenizer()\n"
                f"save_pretrained(build_model({PRESET!r}, tok, {SEED}), tok, {str(checkpoint)!r})"
            )
            subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
        env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "HF_HUB_OFFLINE": "1", "TQDM_DISABLE": "1"}
        results = {}
        for case in cases:
            cmd = [sys.executable, "-m", "benchmarks.bench_vllm", "--case", case, "--threads", str(args.threads)]
            cmd += ["--repeats", str(args.repeats), "--checkpoint", str(checkpoint)]
            done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
            if done.returncode:
                sys.exit(f"case {case} failed:\n{done.stderr[-3000:]}")
            results[case] = json.loads(done.stdout.strip().splitlines()[-1])
            results[case]["load_average_after"] = load_average()
    hf = results.get("hf-float32", {}).get("tokens_per_s")
    report = {
        "batch": {"prompts": PROMPTS, "group": GROUP, "max_new_tokens": MAX_NEW, "temperature": 1.0},
        "model": source,
        "threads": args.threads,
        "repeats": args.repeats,
        "machine": machine(),
        "load_average_before": load_average(),
        "cases": results,
        "speedup_over_hf_float32": {c: r["tokens_per_s"] / hf for c, r in results.items() if hf},
    }
    rows = [
        [
            c,
            r["tokens_per_s"],
            r["median_s"],
            r["first_rollout_with_start_s"],
            report["speedup_over_hf_float32"].get(c),
        ]
        for c, r in results.items()
    ]
    print_table(
        ["case", "response tok/s", "median s", "first rollout (with start) s", "x hf-float32"],
        rows,
        title=f"rollout at the bench batch ({PROMPTS}x{GROUP}, <= {MAX_NEW} new tokens), {args.threads} thread(s)",
    )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
