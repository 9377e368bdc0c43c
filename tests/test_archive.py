"""Shipping the study's runs (gspo_study.archive) at the smoke scale: runs trained in one store are exported to
one Parquet file and imported into a fresh store with no cold start, where `make reproduce-figure-1` trains
nothing and every redrawn figure CSV is byte-identical; import is idempotent; runs carry their provenance
tags; a figure drawn from runs of another draw than the shipped study says so in one line."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import transformers
from mlflow import MlflowClient

from analysis import figures, report, summary
from gspo_study.archive import ARCHIVE, SOURCE, import_study, read_archive, study_configs, write_archive
from gspo_study.cli import main
from gspo_study.study import run_figure

ROOT = Path(__file__).resolve().parents[1]
FIGURES = (1, 2, 3, 4, 5)  # their three runs (gspo, grpo_r2, grpo) at seed 1: a few seconds each
RUNS = ("gspo", "grpo_r2", "grpo")


def store(root: Path) -> tuple[str, ...]:
    """Overrides for a study whose results and MLflow store live under `root` (made if missing), with the
    default cold start."""
    root.mkdir(parents=True, exist_ok=True)
    return (f"results_dir={root}", f"tracking.uri=sqlite:///{root}/mlflow.db")


def export_args(root: Path, *extra: str) -> list[str]:
    figs = ",".join(map(str, FIGURES))
    return ["export-study", "--scale", "smoke", "--seeds", "1", "--figures", figs, *extra, *store(root)]


def runs_of(root: Path) -> dict[str, object]:
    """run_key → MLflow run of every training run in the store."""
    client = MlflowClient(f"sqlite:///{root}/mlflow.db")
    exp = client.get_experiment_by_name("study-smoke")
    return {r.data.tags["run_key"]: r for r in client.search_runs([exp.experiment_id]) if "run_key" in r.data.tags}


def history(root: Path, run) -> list[tuple]:
    client = MlflowClient(f"sqlite:///{root}/mlflow.db")
    return sorted(
        (m.key, m.step, m.timestamp, m.value)
        for k in run.data.metrics
        for m in client.get_metric_history(run.info.run_id, k)
    )


def report_rows(root: Path) -> list[str]:
    """The claims table of the smoke report drawn from the store under `root` (not its date and commit lines)."""
    text = report.make_report("smoke", [1], store(root)).read_text()
    return [line for line in text.splitlines() if line.startswith("| ")]


@pytest.fixture(scope="module")
def shipped(smoke_results, tmp_path_factory):
    """(trained root, archive): the figures' runs trained under their default cold start (a copy of the session's,
    at the default path), drawn, and exported to `<root>/smoke/study-runs.parquet`."""
    root = tmp_path_factory.mktemp("trained")
    shutil.copytree(smoke_results / "smoke/checkpoints/coldstart", root / "smoke/checkpoints/coldstart")
    for f in FIGURES:
        run_figure(f, "smoke", [1], store(root))
        figures.make_figure(f, "smoke", [1], store(root))
    assert main(export_args(root)) == 0
    return root, root / "smoke" / ARCHIVE


def test_export_then_import_redraws_byte_identical(shipped, tmp_path, capsys):
    trained, archive = shipped
    fresh = tmp_path / "fresh"  # a fresh clone: no store, no cold start
    assert main(["import-study", "--scale", "smoke", "--file", str(archive), *store(fresh)]) == 0
    assert "3 runs added, 0 already there" in capsys.readouterr().out
    assert main(["import-study", "--scale", "smoke", "--file", str(archive), *store(fresh)]) == 0  # idempotent
    assert "0 runs added, 3 already there" in capsys.readouterr().out

    mine, theirs = runs_of(trained), runs_of(fresh)
    assert set(mine) == set(theirs) and len(mine) == 3
    for key, run in mine.items():
        copy = theirs[key]
        assert copy.info.run_name == run.info.run_name and copy.info.status == "FINISHED"
        assert (copy.info.start_time, copy.info.end_time) == (run.info.start_time, run.info.end_time)
        assert copy.data.params == run.data.params
        assert copy.data.tags.pop(SOURCE) == run.info.run_id and copy.data.tags == run.data.tags
        assert history(fresh, copy) == history(trained, run)  # every value, step and timestamp

    (fresh / "smoke").mkdir(exist_ok=True)
    shutil.copy(archive, fresh / "smoke" / ARCHIVE)  # shipped beside the figures, as in the repository
    done = subprocess.run(
        ["make", "reproduce-figure-1", "SCALE=smoke", "SEEDS=1", "OVERRIDES=" + " ".join(store(fresh))],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "all 2 runs already finished; nothing to train" in done.stdout
    assert "note:" not in done.stdout  # the imported runs are the shipped ones: the same draw
    assert not (fresh / "smoke" / "checkpoints").exists()  # no cold start was trained, no run resumed
    for f in FIGURES[1:]:
        run_figure(f, "smoke", [1], store(fresh))
        figures.make_figure(f, "smoke", [1], store(fresh))
    for f in FIGURES:
        name = f"figure-{f}.csv"
        assert (fresh / "smoke" / name).read_bytes() == (trained / "smoke" / name).read_bytes(), name
    assert not (fresh / "smoke" / "checkpoints").exists()

    assert summary.summary("smoke", list(RUNS), [1], (), store(fresh)) == summary.summary(
        "smoke", list(RUNS), [1], (), store(trained)
    )
    assert report_rows(fresh) == report_rows(trained)

    again = tmp_path / "again.parquet"  # the imported runs export to the same bytes
    assert main(["export-study", *export_args(fresh, "--out", str(again))[1:]]) == 0
    assert again.read_bytes() == archive.read_bytes()


def test_archive_holds_every_figure_run_compactly(shipped):
    trained, archive = shipped
    rows = read_archive(archive)
    keys = {r["tags"]["run_key"] for r in rows}
    want = study_configs("smoke", [1], store(trained), list(FIGURES))
    assert keys == set(runs_of(trained)) and len(want) == len(rows) == 3
    assert {r["run_name"] for r in rows} == {"gspo-nr-s1", "grpo-r2-s1", "grpo-nr-s1"}
    assert all(r["status"] == "FINISHED" and r["params"]["algo.objective"] for r in rows)
    n = sum(len(r["metrics"]) for r in rows)
    assert n > 300 and archive.stat().st_size < 60 * n  # compressed: well under the 8+ bytes a raw float takes × 7


def test_every_run_records_its_provenance(shipped):
    trained, _ = shipped
    cpuinfo = Path("/proc/cpuinfo").read_text()
    for run in runs_of(trained).values():
        tags = run.data.tags
        assert tags["provenance.torch"] == torch.__version__
        assert tags["provenance.transformers"] == transformers.__version__
        assert tags["provenance.threads"] == "1"  # the smoke scale's threads
        gpu = torch.cuda.is_available()  # train.device: auto
        assert tags["provenance.device"].startswith("cuda:0" if gpu else "cpu")
        assert tags["provenance.precision"] == ("bf16 autocast, fp32 weights" if gpu else "fp32")
        assert tags["provenance.cpu"] in cpuinfo
        assert tags["provenance.cpu_capability"] == torch.backends.cpu.get_cpu_capability()
        assert tags["provenance.blas"].startswith(re.search(r"BLAS_INFO=(\w+)", torch.__config__.show())[1])
        assert all(f in cpuinfo for f in tags["provenance.cpu_flags"].split())


def test_another_draw_is_said_in_one_line(shipped, tmp_path, capsys):
    trained, archive = shipped
    capsys.readouterr()
    figures.make_figure(1, "smoke", [1], store(trained))  # runs trained here, same machine: the same draw
    assert "note:" not in capsys.readouterr().out

    rows = read_archive(archive)
    for r in rows:  # the study as another machine would have shipped it
        r["tags"]["provenance.cpu"] = "Some Other CPU"
        r["tags"]["provenance.cpu_flags"] += " avx512_fake"  # a vector extension this machine lacks
        r["tags"]["init_fingerprint"] = "0123456789abcdef"
    other = tmp_path / "other.parquet"
    write_archive(rows, other)
    original = archive.read_bytes()
    shutil.copy(other, archive)  # shipped beside the figures: results/<scale>/study-runs.parquet
    try:
        figures.make_figure(1, "smoke", [1], store(trained))
        report.make_report("smoke", [1], store(trained))
    finally:
        archive.write_bytes(original)
    out = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("note:")]
    assert len(out) == 2 and out[0].startswith("note: figure 1 is another draw than the shipped study")
    assert "Some Other CPU shipped" in out[0] and "cold start: " in out[0] and "not an error" in out[0]
    assert "likely cause: the CPU's vector extensions differ from the shipped runs' (−avx512_fake)" in out[0]
    assert out[1].startswith("note: the smoke report is another draw")


def test_interrupted_import_is_finished_and_bad_archives_are_one_line(shipped, tmp_path, capsys):
    trained, archive = shipped
    fresh = tmp_path / "fresh"
    import_study("smoke", store(fresh), archive)
    client = MlflowClient(f"sqlite:///{fresh}/mlflow.db")
    run = next(iter(runs_of(fresh).values()))
    client.update_run(run.info.run_id, status="RUNNING")  # as an import killed before its last call leaves it
    done, _ = import_study("smoke", store(fresh), archive)
    assert (done.added, done.present) == (1, 2)
    assert all(r.info.status == "FINISHED" for r in runs_of(fresh).values()) and len(runs_of(fresh)) == 3

    capsys.readouterr()
    junk = tmp_path / "junk.parquet"
    junk.write_text("not parquet")
    for path in (tmp_path / "missing.parquet", junk):
        assert main(["import-study", "--scale", "smoke", "--file", str(path), *store(fresh)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and str(path) in err[0], err
    assert main([*export_args(trained)[:3], "--seeds", "2", *export_args(trained)[5:]]) == 2  # seed 2: untrained
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "3 run(s) of scale 'smoke' not finished" in err[0] and "reproduce-figure-N" in err[0]
    part = tmp_path / "part.parquet"  # --partial: the finished runs (seed 1), the others named and left out
    args = [
        *export_args(trained)[:3],
        "--seeds",
        "1,2",
        *export_args(trained)[5:],
        "--partial",
        "--out",
        str(part),
    ]
    assert main(args) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and "3 finished runs" in out[0] and "3 not finished, left out" in out[0], out
    assert sorted(r["run_id"] for r in read_archive(part)) == sorted(r["run_id"] for r in read_archive(archive))


def test_a_figures_own_runs_load_alone(shipped, tmp_path, capsys):
    """`import-study --figures 1` (what `make reproduce-figure-1` runs first): only the runs figure 1 draws; with
    `--if-present` and no archive, nothing to load and no error."""
    _, archive = shipped
    fresh = tmp_path / "one"
    done, _ = import_study("smoke", store(fresh), archive, figures=[1])
    assert (done.added, done.present) == (2, 0) and len(runs_of(fresh)) == 2  # gspo and grpo_r2, not grpo
    missing = ["import-study", "--scale", "smoke", "--figures", "1", "--if-present", *store(tmp_path / "none")]
    assert main(missing) == 0 and "no shipped study; nothing to load" in capsys.readouterr().out


def test_figure_pages_list_exactly_their_runs_matched_by_run_key(tmp_path):
    """Two shipped runs of one base name (`gspo-nr-s3`): figure 1's 16-layer run and the frontier's 4-layer base run.
    Tagged by run identity, each lists under its own figures only (by name, both matched every figure of that name)."""
    from gspo_study.archive import archive_path
    from gspo_study.mlflow_ui import tag_figures
    from gspo_study.run import run_key
    from gspo_study.study import figure_configs

    keys = {f: run_key(next(c for n, c in figure_configs(f, "cpu", [3]) if n == "gspo")) for f in (1, 17)}
    rows = [r for r in read_archive(archive_path("cpu")) if r["tags"]["run_key"] in keys.values()]
    assert len(rows) == 2 and {r["run_name"].split()[0] for r in rows} == {"gspo-nr-s3"}
    small = tmp_path / "two.parquet"
    write_archive(rows, small)
    over = (f"results_dir={tmp_path}", f"tracking.uri=sqlite:///{tmp_path}/mlflow.db")
    import_study("cpu", over, small)
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    exp = client.get_experiment_by_name("study-cpu")
    assert set(tag_figures(client, exp.experiment_id, "cpu")) >= {1, 15, 17}
    tagged = {r.data.tags["run_key"]: r.data.tags["figures"] for r in client.search_runs([exp.experiment_id])}
    assert ",1," in tagged[keys[1]] and not {",15,", ",17,"} & {f",{n}," for n in tagged[keys[1]].split(",")}
    assert ",15," in tagged[keys[17]] and ",17," in tagged[keys[17]] and ",1," not in tagged[keys[17]]


def test_the_bulk_import_writes_what_log_batch_writes(tmp_path):
    """A local store takes a run's history in one transaction (`archive._bulk_metrics`); it must hold what MLflow's
    `log_batch` stores: NaN and ±inf sanitised as MLflow does, a repeated point once, and per key the latest value by
    (step, timestamp, value) however the history is ordered."""
    import math

    from mlflow.entities import Metric

    from gspo_study.archive import _bulk_metrics

    history = [
        dict(key="a", value=1.5, timestamp=10, step=2),
        dict(key="a", value=0.5, timestamp=11, step=1),  # later in time, earlier in steps: not the latest
        dict(key="a", value=1.5, timestamp=10, step=2),  # the same point twice
        dict(key="b", value=math.nan, timestamp=5, step=0),
        dict(key="b", value=math.inf, timestamp=6, step=3),
        dict(key="c", value=-math.inf, timestamp=7, step=4),
        dict(key="c", value=2.0, timestamp=7, step=4),  # same step and time: the larger value is the latest
    ]
    seen = {}
    for how in ("bulk", "log_batch"):
        client = MlflowClient(f"sqlite:///{tmp_path / how}.db")
        rid = client.create_run(client.create_experiment("x")).info.run_id
        if how == "bulk":
            _bulk_metrics(client._tracking_client.store, rid, history)
        else:
            client.log_batch(rid, metrics=[Metric(m["key"], m["value"], m["timestamp"], m["step"]) for m in history])
        full = {
            k: sorted((h.step, h.timestamp, repr(h.value)) for h in client.get_metric_history(rid, k)) for k in "abc"
        }
        seen[how] = (full, client.get_run(rid).data.metrics)
    assert seen["bulk"] == seen["log_batch"]
    assert seen["bulk"][1]["a"] == 1.5 and seen["bulk"][1]["c"] == 2.0 and len(seen["bulk"][0]["a"]) == 2
