"""Cost of routing record/replay: forward+backward with and without replay, forward with and without record.

    .venv/bin/python -m benchmarks.bench_replay --out results/bench_replay.json

Cases run round-robin inside each repeat, so drift on a shared machine hits them alike. Overhead is the
median over repeats of (case time / baseline time in the same repeat) - 1: paired, so robust to load
changes between repeats. Entering/exiting the context is inside the timing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.common import machine
from gspo_study.models.presets import build_model
from gspo_study.models.tokenizer import build_char_tokenizer
from gspo_study.moe import record_routing, replay_routing


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="qwen3-moe-tiny")
    p.add_argument("--experts-implementation", default="grouped_mm_index")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seq", type=int, default=48)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    return p.parse_args()


def make_cases(model, ids, mask) -> dict[str, Callable[[], None]]:
    with torch.no_grad(), record_routing(model) as trace:
        model(ids, attention_mask=mask)

    def fwd_bwd():
        model(ids, attention_mask=mask).logits.float().logsumexp(-1).mean().backward()

    def fwd_bwd_replay():
        with replay_routing(model, trace):
            fwd_bwd()

    def fwd_bwd_replay_natural():
        with replay_routing(model, trace, record_natural=True):
            fwd_bwd()

    @torch.no_grad()
    def fwd():
        model(ids, attention_mask=mask)

    def fwd_record():
        with record_routing(model):
            fwd()

    return {
        "fwd_bwd": fwd_bwd,
        "fwd_bwd_replay": fwd_bwd_replay,
        "fwd_bwd_replay_natural": fwd_bwd_replay_natural,
        "fwd": fwd,
        "fwd_record": fwd_record,
    }


BASELINE = {"fwd_bwd_replay": "fwd_bwd", "fwd_bwd_replay_natural": "fwd_bwd", "fwd_record": "fwd"}


def time_cases(cases: dict[str, Callable[[], None]], warmup: int, repeats: int, device: str) -> dict[str, list]:
    def timed(fn) -> float:
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        return time.perf_counter() - start

    times: dict[str, list[float]] = {name: [] for name in cases}
    for rep in range(warmup + repeats):
        for name, fn in cases.items():
            elapsed = timed(fn)
            if rep >= warmup:
                times[name].append(elapsed)
    return times


def summarise(times: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    rows = {}
    for name, ts in times.items():
        rows[name] = {"median_ms": 1e3 * statistics.median(ts), "min_ms": 1e3 * min(ts)}
        if name in BASELINE:
            ratios = [t / b for t, b in zip(ts, times[BASELINE[name]])]
            rows[name]["overhead_pct"] = 100 * (statistics.median(ratios) - 1)
    return rows


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    tok = build_char_tokenizer()
    model = build_model(args.preset, tok, 0, experts_implementation=args.experts_implementation).to(args.device)
    model.train()
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(4, len(tok), (args.batch, args.seq), generator=gen).to(args.device)
    mask = torch.ones_like(ids)
    rows = summarise(time_cases(make_cases(model, ids, mask), args.warmup, args.repeats, args.device))

    print(
        f"{args.preset} ({args.experts_implementation}), batch {args.batch}x{args.seq}, {args.device}, "
        f"{args.repeats} repeats after {args.warmup} warm-up, torch threads {torch.get_num_threads()}"
    )
    print(f"{'case':<24}{'median ms':>11}{'min ms':>10}{'overhead':>10}")
    for name, row in rows.items():
        over = f"{row['overhead_pct']:+.1f}%" if "overhead_pct" in row else ""
        print(f"{name:<24}{row['median_ms']:>11.2f}{row['min_ms']:>10.2f}{over:>10}")

    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        meta = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
        meta |= {
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "machine": machine(),
        }
        args.out.write_text(json.dumps({"config": meta, "results": rows}, indent=2) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
