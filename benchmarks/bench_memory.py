"""The step-memory estimator (`gspo_study.train.memory`) against measured peaks: for each configuration, one RL
step in a fresh process, its peak RSS growth over the RSS before the step (weights already loaded) against the
estimate of the same (the estimated peak less the weights).

    .venv/bin/python -m benchmarks.bench_memory \
        --checkpoint results/cpu/checkpoints/coldstart-L4 --out results/bench_memory.json

Needs a 4-layer CPU-scale cold start (`make coldstart SCALE=cpu OVERRIDES=model.num_hidden_layers=4`, or the
sweep of figure 11 makes it). The estimate assumes every response reaches `rollout.max_new_tokens` (a bound); the
runs here stop at EOS after ~23 tokens of 40, so a larger max_new_tokens shows how loose the bound gets.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.common import machine

ROOT = Path(__file__).resolve().parents[1]
CASES = [
    ["rollout.prompts_per_step=16", "rollout.dtype=bfloat16"],
    ["rollout.prompts_per_step=64"],
    ["rollout.prompts_per_step=128", "train.micro_batch_size=32"],
    ["rollout.prompts_per_step=128", "rollout.group_size=16"],
    ["rollout.prompts_per_step=32", "rollout.max_new_tokens=80", "train.num_minibatches=2"],
]


def one(overrides: list[str]) -> dict:
    """In this process: set up the run, measure one step's peak RSS growth, and the estimate."""
    os.environ["TQDM_DISABLE"] = "1"
    from gspo_study import trainer
    from gspo_study.config import load_config
    from gspo_study.run import resolve_run
    from gspo_study.train.memory import Shapes, estimate, longest_prompt

    cfg = load_config(ROOT / "experiments" / "cpu" / "base.yaml", overrides)
    ctx = trainer.setup(resolve_run(cfg))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    trainer.rl_step(ctx, 1)
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    shapes = Shapes.of(ctx.model)
    est = estimate(cfg, shapes, longest_prompt(ctx.task, ctx.tokenizer, cfg.eval.num_prompts))
    measured, estimated = after - before, est["peak"] - shapes.params * 4
    return {
        "measured_step_mib": measured / 2**20,
        "estimated_step_mib": estimated / 2**20,
        "relative_error": estimated / measured - 1,
    }


def table(results: dict) -> str:
    """The markdown table of docs/RELIABILITY.md's `bench-memory` block (written there by analysis/doc_blocks.py)."""
    lines = ["| overrides (4-layer CPU cold start) | measured | estimated | error |", "|---|---|---|---|"]
    for c in results["cases"]:
        lines.append(
            f"| `{' '.join(c['overrides'])}` | {c['measured_step_mib']:.0f} MiB | "
            f"{c['estimated_step_mib']:.0f} MiB | {c['relative_error']:+.0%} |"
        )
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", type=Path, default=ROOT / "results/cpu/checkpoints/coldstart-L4")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--case", help=argparse.SUPPRESS)  # internal: run one case in this process
    args = p.parse_args()
    if args.case is not None:
        print(json.dumps(one(json.loads(args.case))))
        return 0
    if not (args.checkpoint / "config.json").is_file():
        print(
            f"error: no 4-layer cold start at {args.checkpoint} (see this script's docstring)",
            file=sys.stderr,
        )
        return 2
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        common = [
            f"init_checkpoint={args.checkpoint}",
            "model.num_hidden_layers=4",
            f"results_dir={tmp}",
            f"tracking.uri=sqlite:///{tmp}/m.db",
            "threads=1",
            "eval.num_prompts=16",
        ]
        for case in CASES:
            cmd = [sys.executable, "-m", "benchmarks.bench_memory", "--case", json.dumps([*common, *case])]
            out = (
                subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=True)
                .stdout.strip()
                .splitlines()[-1]
            )
            results.append({"overrides": case, **json.loads(out)})
            r = results[-1]
            print(
                f"{' '.join(case):60s} measured {r['measured_step_mib']:7.0f} MiB, estimated "
                f"{r['estimated_step_mib']:7.0f} MiB ({r['relative_error']:+.0%})"
            )
    if args.out:
        args.out.write_text(json.dumps({"machine": machine(), "cases": results}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
