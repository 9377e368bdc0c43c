"""Issue 50's three targets, read from the JSON files `make bench` just wrote, with the machine they ran on.

    .venv/bin/python -m benchmarks.targets --start  # first thing `make bench` does: stamps its start
    .venv/bin/python -m benchmarks.targets  # last thing: prints the table, writes results/bench_targets.json

- a study step (rollout, π_old, updates and the routing telemetry at the figures' `telemetry.route_rows`) against
  TRL's GRPOTrainer step on the same machine, model and batch (bench_rl.py): target ≥ 1.5×, both pairs;
- the rollout phase's share of the machine's fp32 GEMM rate (bench_rl.py's floor): target ≥ 15 %;
- the telemetry's share of a step at the figures' setting (bench_telemetry.py): target ≤ 5 %;
- and `make bench` itself, every part included, from the stamp to this call: target ≤ 15 min (the stamp is used
  once, so this call alone prints "not measured").

A number whose JSON is missing prints as "-" and reads "not measured"; nothing is carried over from another run.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from benchmarks.common import machine, print_table

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "results"
STAMP = RESULTS / ".bench-started"
VERDICT = {None: "not measured", True: "met", False: "not met"}  # a row's `met`, in words (here and in the docs)
PAIRS = {  # bench.json's ratio -> its row here
    "ours-gspo (incl. telemetry) / trl-gspo": "GSPO step incl. telemetry / TRL's",
    "ours-grpo-r2 (incl. telemetry) / trl-grpo": "GRPO + R2 step incl. telemetry / TRL's GRPO",
}


def _read(name: str) -> dict:
    path = RESULTS / name
    return json.loads(path.read_text()) if path.is_file() else {}


def figures_route_rows() -> str:
    """The figures' `telemetry.route_rows` (every tracked run's): the config's default, as bench_telemetry keys it."""
    from gspo_study.config import TelemetryConfig

    return str(TelemetryConfig().route_rows)


def readings(bench: dict, telemetry: dict, wall_s: float | None) -> list[dict]:
    """One row per target: what it is, the measured value (None: not measured), the bound and its direction."""
    ratios = bench.get("ratios", {})
    phase = bench.get("floor", {}).get("runs", {}).get("ours-gspo", {}).get("phase_efficiency", {})
    share = telemetry.get("summary", {}).get("telemetry_share_of_step", {})
    rows = [
        {"target": label, "value": ratios.get(pair), "bound": 1.5, "at_least": True} for pair, label in PAIRS.items()
    ]
    rows.append({"target": "rollout phase / GEMM rate", "value": phase.get("rollout"), "bound": 0.15, "at_least": True})
    rows_share = figures_route_rows()
    rows.append(
        {
            "target": f"telemetry / step at route_rows {rows_share}",
            "value": share.get(rows_share),
            "bound": 0.05,
            "at_least": False,
        }
    )
    rows.append({"target": "make bench wall seconds", "value": wall_s, "bound": 900.0, "at_least": False})
    for row in rows:
        v = row["value"]
        row["met"] = None if v is None else (v >= row["bound"] if row["at_least"] else v <= row["bound"])
    return rows


def bound_text(row: dict) -> str:
    return ("≥ " if row["at_least"] else "≤ ") + f"{row['bound']:g}"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--start", action="store_true", help="stamp the start of `make bench` and exit")
    p.add_argument("--out", type=Path, default=RESULTS / "bench_targets.json")
    args = p.parse_args(argv)
    if args.start:
        STAMP.parent.mkdir(parents=True, exist_ok=True)
        STAMP.write_text(f"{time.time()}\n")
        return
    wall = None
    if STAMP.is_file():  # read once: a later call alone has no start to time from
        wall = time.time() - float(STAMP.read_text())
        STAMP.unlink()
    bench, telemetry = _read("bench.json"), _read("bench_telemetry.json")
    rows = readings(bench, telemetry, wall)
    where = {
        "bench.json": bench.get("config", {}).get("machine"),
        "bench_telemetry.json": telemetry.get("machine"),
        "this process": machine(),
    }
    args.out.write_text(json.dumps({"machine": where, "targets": rows}, indent=1))
    print_table(
        ["target", "measured", "bound", "verdict"],
        [[r["target"], r["value"], bound_text(r), VERDICT[r["met"]].replace("not met", "NOT met")] for r in rows],
        f"issue 50's targets, on {where['this process']}",
    )
    if len({m for m in where.values() if m}) > 1:
        print("note: the JSON files were written on different machines (see results/bench_targets.json)")


if __name__ == "__main__":
    main()
