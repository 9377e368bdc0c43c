"""What the routing telemetry costs, and what its row subsample (`telemetry.route_rows`) costs in accuracy.

    .venv/bin/python -m benchmarks.bench_telemetry \
        --checkpoint results/cpu/checkpoints/coldstart-L4 --out results/bench_telemetry.json

GRPO without replay on the CPU base's batch (32 prompts x 8 responses, 4 minibatches) with the 4-layer model and
the bf16 rollout engine (figure 11's runs). Each step is timed whole with the telemetry at every row
(`telemetry` is the trainer's function: its two extra forwards of the updated policy); after the step, on the same
batch and weights, the telemetry is run again at each subsample share for DRAWS seeded row draws. Reported: the
telemetry's share of a step (at every row, and at each share: its time over the step's training time plus it),
and per reading the estimator's standard error — the SD over draws — and its bias against the whole batch's value,
averaged over steps.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import machine

ROOT = Path(__file__).resolve().parents[1]
SHARES = (0.25, 0.5)
DRAWS = 8
READINGS = (
    "moe/routing_volatility/overall",
    "moe/route/var_share",
    "moe/route/r2_removed_share",
    "moe/route/seq_r2_removed_share",
    "moe/route/clip_flip_token",
    "moe/route/abs_mean",
)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", type=Path, default=ROOT / "results/cpu/checkpoints/coldstart-L4")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    if not (args.checkpoint / "config.json").is_file():
        print(
            f"error: no 4-layer cold start at {args.checkpoint} (benchmarks/bench_memory.py says how)",
            file=sys.stderr,
        )
        return 2
    os.environ["TQDM_DISABLE"] = "1"
    from gspo_study import trainer
    from gspo_study.config import load_config
    from gspo_study.run import resolve_run

    tmp = tempfile.mkdtemp()
    cfg = load_config(
        [ROOT / "experiments/cpu/base.yaml", ROOT / "experiments/runs/grpo_bf16_recompute.yaml"],
        [
            f"init_checkpoint={args.checkpoint}",
            "model.num_hidden_layers=4",
            f"results_dir={tmp}",
            f"tracking.uri=sqlite:///{tmp}/m.db",
            f"threads={args.threads}",
            "telemetry.route_rows=1",  # the step's own telemetry at every row: the reference each share is read against
        ],
    )
    ctx = trainer.setup(resolve_run(cfg))
    seen: dict = {}
    steps = []
    for step in range(1, args.steps + 2):
        watch, start = trainer.Stopwatch(), time.perf_counter()  # the step's own phase timings
        full = trainer.rl_step(ctx, step, on_update=lambda inputs, i, result: seen.update(inputs=inputs), watch=watch)
        total = time.perf_counter() - start
        if step == 1:  # warm-up
            continue
        row = {"step_s": total, "telemetry_s": watch.spans["telemetry"], "shares": {}}
        for share in SHARES:
            ctx.cfg.telemetry.route_rows = share
            times, values = [], {k: [] for k in READINGS}
            for d in range(DRAWS):
                t0 = time.perf_counter()
                out = trainer.telemetry(ctx, seen["inputs"], 10_000 * step + d)  # another seeded row draw per d
                times.append(time.perf_counter() - t0)
                for k in READINGS:
                    values[k].append(out[k])
            ctx.cfg.telemetry.route_rows = 1.0
            row["shares"][share] = {
                "telemetry_s": statistics.median(times),
                "se": {k: statistics.stdev(v) for k, v in values.items()},
                "bias": {k: statistics.mean(v) - full[k] for k, v in values.items()},
                "full": {k: full[k] for k in READINGS},
            }
        steps.append(row)
    train_s = [s["step_s"] - s["telemetry_s"] for s in steps]
    summary = {"telemetry_share_of_step": {"1.0": statistics.median(s["telemetry_s"] / s["step_s"] for s in steps)}}
    for share in SHARES:
        summary["telemetry_share_of_step"][str(share)] = statistics.median(
            s["shares"][share]["telemetry_s"] / (t + s["shares"][share]["telemetry_s"]) for s, t in zip(steps, train_s)
        )
        summary[f"se_at_{share}"] = {k: statistics.mean(s["shares"][share]["se"][k] for s in steps) for k in READINGS}
        summary[f"bias_at_{share}"] = {
            k: statistics.mean(s["shares"][share]["bias"][k] for s in steps) for k in READINGS
        }
    summary["full_value_mean"] = {
        k: statistics.mean(s["shares"][SHARES[0]]["full"][k] for s in steps) for k in READINGS
    }
    print(json.dumps(summary, indent=1))
    if args.out:
        args.out.write_text(
            json.dumps(
                {
                    "machine": machine(),
                    "threads": args.threads,
                    "summary": summary,
                    "steps": steps,
                },
                indent=1,
            )
            + "\n"
        )
    return 0


def table(d: dict) -> str:
    """docs/METRICS.md: the telemetry's share of a step at each `telemetry.route_rows`, and each reading's standard
    error and bias at the subsample shares against its whole-batch value (results/bench_telemetry.json)."""
    s = d["summary"]
    shares = sorted(s["telemetry_share_of_step"], key=float, reverse=True)
    cost = ", ".join(f"{float(k):g}: {s['telemetry_share_of_step'][k]:.1%}" for k in shares)
    lines = [
        f"The telemetry's share of a step (`benchmarks/bench_telemetry.py`, {len(d['steps'])} steps of figure 11's "
        f"GRPO at the CPU base's batch, {d['threads']} thread(s), {d['machine']}), by `route_rows`: {cost}.",
        "",
        "| reading | whole-batch mean | " + " | ".join(f"SE at {k} | bias at {k}" for k in shares if k != "1.0") + " |",
        "|---|---|" + "---|---|" * (len(shares) - 1),
    ]
    for k in READINGS:
        cells = [f"{s[f'se_at_{x}'][k]:.2g} | {s[f'bias_at_{x}'][k]:+.2g}" for x in shares if x != "1.0"]
        lines.append(f"| `{k}` | {s['full_value_mean'][k]:.3g} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
