"""import-study's metric write timed both ways, alternating, each into a fresh sqlite store: MLflow's `log_batch` in
its batches (the path before the bulk write, still the path to a tracking server) against `archive._bulk_metrics`.

    python -m benchmarks.bench_import [--runs N] [--reps R]   # the N shipped CPU runs with the longest histories
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import gspo_study.archive as archive
from gspo_study.archive import import_study, read_archive, write_archive

SHIPPED = Path(__file__).resolve().parents[1] / "results" / "cpu" / "study-runs.parquet"


def log_batch(store, run_id: str, metrics: list[dict]) -> None:
    """What the import did before the bulk write: MLflow's `log_batch`, in its batches."""
    from mlflow.entities import Metric

    ms = [Metric(m["key"], m["value"], m["timestamp"], m["step"]) for m in metrics]
    for i in range(0, len(ms), archive.METRIC_BATCH):
        store.log_batch(run_id, metrics=ms[i : i + archive.METRIC_BATCH], params=[], tags=[])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=8)
    p.add_argument("--reps", type=int, default=2)
    args = p.parse_args(argv)
    rows = sorted(read_archive(SHIPPED), key=lambda r: -len(r["metrics"]))[: args.runs]
    print(f"{len(rows)} runs, {sum(len(r['metrics']) for r in rows)} metric points")
    src = Path(tempfile.mkdtemp()) / "some.parquet"
    write_archive(rows, src)
    bulk = archive._bulk_metrics
    try:
        for rep in range(args.reps):
            for name, write in (("log_batch", log_batch), ("bulk", bulk)):
                archive._bulk_metrics = write
                t = time.perf_counter()
                done, _ = import_study("cpu", (f"results_dir={tempfile.mkdtemp()}",), src)
                print(f"{name} {rep}: {time.perf_counter() - t:.1f} s ({done.added} runs)")
    finally:
        archive._bulk_metrics = bulk
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
