"""SIGTERM (what a cluster scheduler sends before SIGKILL): a run stops at its next safe point within one step,
checkpointed, its MLflow run marked KILLED, one line on stderr, exit 143; a sweep forwards it to its workers;
the rerun resumes and finishes with every step logged once and the numbers of an uninterrupted run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import torch
from mlflow import MlflowClient

from gspo_study import stopping
from gspo_study.config import load_config
from gspo_study.trainer import train
from tests.test_reliability_table import _each_step_once, _same_history, _store_runs
from tests.test_trainer import history, weights

SMOKE = "experiments/smoke/base.yaml"
ENV = {**os.environ, "TQDM_DISABLE": "1", "OMP_NUM_THREADS": "1"}


def test_sigterm_stops_a_run_at_a_safe_point_and_the_rerun_resumes(smoke_results, tmp_path):
    init = smoke_results / "smoke/checkpoints/coldstart"
    args = ["train.steps=8", "train.checkpoint_every=5", "eval.every=4", f"init_checkpoint={init}"]
    ref = load_config(SMOKE, [f"results_dir={tmp_path / 'ref'}", f"tracking.uri=sqlite:///{tmp_path}/ref.db", *args])
    train(ref)
    over = [f"results_dir={tmp_path / 't'}", f"tracking.uri=sqlite:///{tmp_path}/t.db", *args]
    # The SIGTERM a scheduler sends, as a real signal to the child, on its entry into step 2's telemetry pass
    # (`stopping.INJECT_ENV`): polling the store for a logged step and signalling from here raced a fast CPU, which
    # finished all 8 smoke steps between two polls (exit 0 on CI).
    started = time.time()
    proc = subprocess.run(
        [sys.executable, "-m", "gspo_study", "train", SMOKE, *over],
        env={**ENV, stopping.INJECT_ENV: "telemetry@2"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        timeout=240,
    )
    took, err = time.time() - started, proc.stderr
    lines = [line for line in err.strip().splitlines() if line]
    assert proc.returncode == 143, err
    assert lines[-1].startswith("stopped: SIGTERM:") and "marked KILLED" in lines[-1] and "Traceback" not in err
    assert took < 120, f"{took:.1f} s in all"  # the setup, three smoke steps and a checkpoint, not a hang
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
    # The SIGTERM a scheduler sends to the sweep's process only (a worker's entry into step 2's telemetry pass sends
    # it there, `stopping.INJECT_ENV`), which forwards it to its workers. Polling the store for a logged step and
    # signalling from here raced a fast CPU: both 8-step runs finished between two polls (exit 0 on CI, stop 60).
    proc = subprocess.Popen(
        [*argv, "--jobs", "2"],
        env={**ENV, stopping.INJECT_ENV: "telemetry@2"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
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


# ------------------------------------------------------------------------------------------ inside long phases
def _stop_in(monkeypatch, capsys, argv: list[str], at: str, grace: float | None, then: int | None = None):
    """`main(argv)` in this process with the SIGTERM a scheduler sends arriving on entry into a phase (`at`:
    <phase>@<n>, `stopping.INJECT_ENV`), and optionally a second signal `then` right after it: (exit status,
    seconds from the SIGTERM to the return, the last stderr line)."""
    from gspo_study.cli import main

    sent: list[float] = []
    inject = stopping._inject

    def timed(name: str, count: int) -> None:  # the real injection, timed (and followed by `then`)
        if f"{name}@{count}" == at:
            sent.append(time.monotonic())
        inject(name, count)
        if sent and then is not None and len(sent) == 1:
            sent.append(sent[0])
            signal.raise_signal(then)  # to this thread: os.kill may land on another thread, and a stop point can
            # then see the first SIGTERM before the main thread runs this one's handler (a flaky 143 for 130)

    monkeypatch.setattr(stopping, "_inject", timed)
    before = signal.signal(signal.SIGINT, signal.default_int_handler)  # an earlier test in this worker may have
    # replaced Python's SIGINT handler; a scheduler's SIGINT meets the default one
    monkeypatch.setenv(stopping.INJECT_ENV, at)
    monkeypatch.setenv(stopping.GRACE_ENV, str(grace or stopping.DEFAULT_GRACE_S))
    capsys.readouterr()
    rc = main(argv)
    signal.signal(signal.SIGINT, before)
    took = time.monotonic() - sent[0] if sent else float("nan")
    monkeypatch.delenv(stopping.INJECT_ENV)
    err = [line for line in capsys.readouterr().err.splitlines() if line and "Warning" not in line]
    return rc, took, err[-1] if err else ""


# (SIGTERM on entry into, grace, what follows it, exit status, the stop's line); each resumes the one before.
# train.steps=5, evaluations at 0, 2, 4, 5, checkpoints at 3 and 5, 4 micro-batches per no-grad pass. A grace of
# 1 ms: a smoke rollout or update can end inside 50 ms on a fast CPU, and then the stop falls to the next stop point.
PHASES = [
    ("evaluation@1", None, None, 143, "inside the start's evaluation (at a stop point), no step finished yet"),
    ("rollout@2", 0.001, None, 143, "inside step 2's rollout (the 0.001 s grace ran out), checkpointed at step 1"),
    ("update@2", 0.001, None, 143, "inside step 3's update (the 0.001 s grace ran out), its checkpoint of step 1 "
     "stands (the rerun redoes steps 2-2, logging each once)"),
    ("evaluation@1", None, None, 143, "inside step 2's evaluation (at a stop point), checkpointed at step 1"),
    ("telemetry@2", None, None, 143, "stopped after step 3 of 5, checkpointed"),  # step 3 ends first: no loss
    ("old_policy@1", None, signal.SIGTERM, 143, "a second SIGTERM: stopped at once"),
    ("route_baseline@1", None, signal.SIGINT, 130, "interrupted"),
]  # fmt: skip


def test_sigterm_inside_each_long_phase_stops_within_the_grace_and_resumes(
    smoke_results, tmp_path, monkeypatch, capsys
):
    """A SIGTERM inside a long evaluation (between batches), a long rollout (one generate call: the grace), an update
    and the π_old and telemetry passes: exit 143 within the grace, the run KILLED, checkpointed where that is
    consistent; a second SIGTERM or SIGINT stops at once. Rerun after each, the run ends with every step logged
    once and the numbers of an uninterrupted run."""
    init = smoke_results / "smoke/checkpoints/coldstart"
    args = ["train.steps=5", "train.checkpoint_every=3", "eval.every=2", "eval.batch_size=1"]
    args += ["train.micro_batch_size=4", f"init_checkpoint={init}"]
    ref = load_config(SMOKE, [f"results_dir={tmp_path / 'ref'}", f"tracking.uri=sqlite:///{tmp_path}/ref.db", *args])
    train(ref)
    over = [f"results_dir={tmp_path / 't'}", f"tracking.uri=sqlite:///{tmp_path}/t.db", *args]
    monkeypatch.setattr(stopping, "SAME_NOTICE_S", 0.0)  # the second signal comes at once
    for at, grace, then, code, fragment in PHASES:
        rc, took, line = _stop_in(monkeypatch, capsys, ["train", SMOKE, *over], at, grace, then)
        assert rc == code and fragment in line and ("marked KILLED" in line or then), (at, rc, line)
        assert took < (grace or stopping.DEFAULT_GRACE_S) + 5, f"{at}: {took:.1f} s from SIGTERM to exit"
        client, (run,) = _store_runs(f"sqlite:///{tmp_path}/t.db", "study-smoke")
        assert run.info.status == "KILLED", at
    cfg = load_config(SMOKE, over)
    train(cfg)
    assert MlflowClient(cfg.tracking.uri).get_run(run.info.run_id).info.status == "FINISHED"
    _same_history(history(ref), history(cfg))
    _each_step_once(cfg.tracking.uri, "study-smoke")


# (SIGTERM on entry into, grace, the stop's line): train 30 steps checking pass@1 every 10; each resumes the last.
SFT_STOPS = [
    ("SFT step@12", None, "inside its SFT (at a stop point) at step 12 of 30, its state after step 12 saved"),
    ("SFT check@1", None, "inside its SFT check (at a stop point) at step 20 of 30, its state after step 20 saved"),
    ("SFT step@3", 0.001, "inside its SFT step (the 0.001 s grace ran out) at step 22 of 30, the state saved before"),
]


def test_sigterm_stops_an_sft_and_the_rerun_resumes_it(tmp_path, monkeypatch, capsys):
    """A cold-start SFT stopped between steps, inside its pass@1 check and (by the grace) inside a step: exit 143,
    its state saved where consistent; the rerun resumes it (it used to start again from step 1) to the weights and
    log of an SFT never stopped."""
    from gspo_study.sft import partial_path, run_sft

    args = ["sft.steps=30", "sft.target_pass1=0.999", "sft.check_every=10"]
    run_sft(load_config(SMOKE, [f"results_dir={tmp_path / 'ref'}", *args]))
    over = [f"results_dir={tmp_path / 's'}", *args]
    out = tmp_path / "s/smoke/checkpoints/coldstart"
    for at, grace, fragment in SFT_STOPS:
        rc, took, line = _stop_in(monkeypatch, capsys, ["sft", SMOKE, *over], at, grace)
        assert rc == 143 and fragment in line, (at, rc, line)
        assert took < (grace or stopping.DEFAULT_GRACE_S) + 5, f"{at}: {took:.1f} s from SIGTERM to exit"
        assert partial_path(out).is_dir() and not out.exists()
    run_sft(load_config(SMOKE, over))
    a, b = tmp_path / "ref/smoke/checkpoints/coldstart", out
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    logs = [json.loads((p / "sft_log.json").read_text())["log"] for p in (a, b)]
    assert [{k: e[k] for k in e if k != "seconds"} for e in logs[0]] == [
        {k: e[k] for k in e if k != "seconds"} for e in logs[1]
    ]
    assert sum("pass@1" in e for e in logs[1]) == 3  # every check made once
    assert sorted(p.name for p in out.parent.iterdir()) == ["coldstart"]  # the stopped state is gone


def test_a_bad_grace_is_one_line(tmp_path, monkeypatch, capsys):
    from gspo_study.cli import main

    monkeypatch.setenv(stopping.GRACE_ENV, "soon")
    assert main(["train", SMOKE, f"results_dir={tmp_path}", f"tracking.uri=sqlite:///{tmp_path}/m.db"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "error: bad value 'soon' for GSPO_STUDY_STOP_GRACE_S; allowed: a number of seconds > 0", err
    assert not (tmp_path / "m.db").exists()


def test_sigterm_in_the_update_phase_stops_between_two_updates_and_the_step_is_redone(
    smoke_results, tmp_path, monkeypatch, capsys
):
    """Between two of a step's updates is a stop point: with the last finished step checkpointed, a SIGTERM there
    stops at the next one (not at the step's end, nor by the grace), and the rerun redoes that step from its start
    with the numbers of an uninterrupted run, each step logged once."""
    init = smoke_results / "smoke/checkpoints/coldstart"
    args = ["train.steps=3", "train.checkpoint_every=1", "eval.every=3", f"init_checkpoint={init}"]
    ref = load_config(SMOKE, [f"results_dir={tmp_path / 'ref'}", f"tracking.uri=sqlite:///{tmp_path}/ref.db", *args])
    train(ref)
    over = [f"results_dir={tmp_path / 't'}", f"tracking.uri=sqlite:///{tmp_path}/t.db", *args]
    rc, took, line = _stop_in(monkeypatch, capsys, ["train", SMOKE, *over], "update@2", None)
    assert rc == 143 and "inside step 2's update (at a stop point), checkpointed at step 1" in line, line
    assert took < stopping.DEFAULT_GRACE_S
    cfg = load_config(SMOKE, over)
    train(cfg)
    _same_history(history(ref), history(cfg))
    _each_step_once(cfg.tracking.uri, "study-smoke")
