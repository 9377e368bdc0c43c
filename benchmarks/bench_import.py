"""import-study's metric write timed both ways, alternating, each into a fresh sqlite store: MLflow's `log_batch` in
its batches (the path before the bulk write, still the path to a tracking server) against `archive._bulk_metrics`.

    python -m benchmarks.bench_import N REPS    # the N runs of the shipped CPU archive with the longest histories
"""

import sys
import tempfile
import time
from pathlib import Path

from mlflow.entities import Metric

import gspo_study.archive as A
from gspo_study.archive import import_study, read_archive, write_archive

n = int(sys.argv[1])
rows = read_archive(Path(__file__).resolve().parents[1] / "results" / "cpu" / "study-runs.parquet")
rows = sorted(rows, key=lambda r: -len(r["metrics"]))[:n]
print("runs", len(rows), "metric points", sum(len(r["metrics"]) for r in rows))
src = Path(tempfile.mkdtemp()) / "some.parquet"
write_archive(rows, src)
orig = A._bulk_metrics


def old(store, rid, metrics):  # what _write did before: log_batch in MLflow's batches
    ms = [Metric(m["key"], m["value"], m["timestamp"], m["step"]) for m in metrics]
    for i in range(0, len(ms), A.METRIC_BATCH):
        store.log_batch(rid, metrics=ms[i : i + A.METRIC_BATCH], params=[], tags=[])


for rep in range(int(sys.argv[2])):
    for name, fn in (("log_batch", old), ("bulk", orig)):
        A._bulk_metrics = fn
        d = tempfile.mkdtemp()
        t = time.perf_counter()
        done, uri = import_study("cpu", (f"results_dir={d}",), src)
        print(name, rep, f"{time.perf_counter() - t:.1f} s", done)
