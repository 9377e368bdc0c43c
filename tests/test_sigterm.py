"""SIGTERM (what a cluster scheduler sends before SIGKILL): a run stops at its next safe point within one step,
checkpointed, its MLflow run marked KILLED, one line on stderr, exit 143; a sweep forwards it to its workers;
the rerun resumes and finishes with every step logged once and the numbers of an uninterrupted run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from mlflow import MlflowClient

from gspo_study.config import load_config
from gspo_study.trainer import train
from tests.test_reliability_table import _each_step_once, _same_history, _store_runs
from tests.test_trainer import history

SMOKE = "experiments/smoke/base.yaml"
ENV = {**os.environ, "TQDM_DISABLE": "1", "OMP_NUM_THREADS": "1"}


def _wait_for_steps(uri: str, experiment: str, n: int, proc, timeout: float = 240) -> None:
    """Until some run of the store has logged RL step n (or the process ended)."""
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        try:
            client, runs = _store_runs(uri, experiment)
            if any(len(client.get_metric_history(r.info.run_id, "rollout/reward/mean")) >= n for r in runs):
                return
        except Exception:  # noqa: BLE001 - the store may not exist yet
            pass
        time.sleep(0.2)


def test_sigterm_stops_a_run_at_a_safe_point_and_the_rerun_resumes(smoke_results, tmp_path):
    init = smoke_results / "smoke/checkpoints/coldstart"
    args = ["train.steps=8", "train.checkpoint_every=5", "eval.every=4", f"init_checkpoint={init}"]
    ref = load_config(SMOKE, [f"results_dir={tmp_path / 'ref'}", f"tracking.uri=sqlite:///{tmp_path}/ref.db", *args])
    train(ref)
    over = [f"results_dir={tmp_path / 't'}", f"tracking.uri=sqlite:///{tmp_path}/t.db", *args]
    proc = subprocess.Popen(
        [sys.executable, "-m", "gspo_study", "train", SMOKE, *over],
        env=ENV,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    _wait_for_steps(f"sqlite:///{tmp_path}/t.db", "study-smoke", 2, proc)
    sent = time.time()
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    took = time.time() - sent
    lines = [line for line in err.strip().splitlines() if line]
    assert proc.returncode == 143, err
    assert lines[-1].startswith("stopped: SIGTERM:") and "marked KILLED" in lines[-1] and "Traceback" not in err
    assert took < 30, f"{took:.1f} s from SIGTERM to exit"  # one smoke step and a checkpoint, not the rest of the run
    client, (run,) = _store_runs(f"sqlite:///{tmp_path}/t.db", "study-smoke")
    assert run.info.status == "KILLED"
    steps = len(client.get_metric_history(run.info.run_id, "rollout/reward/mean"))
    assert 2 <= steps < 8  # stopped early, after the step it was in
    cfg = load_config(SMOKE, over)
    train(cfg)  # the rerun resumes
    assert MlflowClient(cfg.tracking.uri).get_run(run.info.run_id).info.status == "FINISHED"
    _same_history(history(ref), history(cfg))
    _each_step_once(cfg.tracking.uri, "study-smoke")


def _workers_left(session: int, wait: float = 10.0) -> list[str]:
    """Processes of the sweep's session still alive after `wait` s, multiprocessing's resource tracker aside."""
    deadline = time.time() + wait
    while True:
        out = subprocess.run(["pgrep", "-s", str(session)], capture_output=True, text=True).stdout.split()
        left = []
        for pid in out:
            try:
                cmd = open(f"/proc/{pid}/cmdline", "rb").read()
            except OSError:
                continue
            if b"resource_tracker" not in cmd:
                left.append(cmd.replace(b"\0", b" ").decode(errors="replace"))
        if not left or time.time() > deadline:
            return left
        time.sleep(0.2)


def test_sigterm_to_a_parallel_sweep_stops_its_workers(smoke_results, tmp_path):
    init = smoke_results / "smoke/checkpoints/coldstart"
    over = [
        f"results_dir={tmp_path}",
        f"tracking.uri=sqlite:///{tmp_path}/m.db",
        "train.steps=8",
        f"init_checkpoint={init}",
    ]
    argv = [sys.executable, "-m", "gspo_study", *"sweep --figure 1 --scale smoke --seeds 1".split(), *over]
    proc = subprocess.Popen(
        [*argv, "--jobs", "2"],
        env=ENV,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    _wait_for_steps(f"sqlite:///{tmp_path}/m.db", "study-smoke", 2, proc)
    proc.send_signal(signal.SIGTERM)  # the sweep's process only: it forwards the notice to its workers
    _, err = proc.communicate(timeout=180)
    lines = [line for line in err.strip().splitlines() if line]
    assert proc.returncode == 143 and lines[-1].startswith("stopped: SIGTERM:") and "Traceback" not in err, err
    client, runs = _store_runs(f"sqlite:///{tmp_path}/m.db", "study-smoke")
    assert "KILLED" in {r.info.status for r in runs} and "RUNNING" not in {r.info.status for r in runs}
    assert not _workers_left(proc.pid), "a worker outlived the sweep"
    from gspo_study.cli import main

    assert main(argv[3:]) == 0  # the rerun (what the command calls, in this process) finishes both
    _, runs = _store_runs(f"sqlite:///{tmp_path}/m.db", "study-smoke")
    assert sorted(r.info.status for r in runs) == ["FINISHED", "FINISHED"]
    _each_step_once(f"sqlite:///{tmp_path}/m.db", "study-smoke")
