"""Writes that fail part-way: the disk fills up under a run, an SFT, the MLflow store and an export.
A small tmpfs is mounted for each case (root; CI runs as root) and filled the moment the job is past its free-space
check. Each must end with one line (exit 4), leave the previous checkpoint / cold start / store / archive intact,
and its rerun, with space again, must complete with the numbers of a job that never failed."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from gspo_study.config import load_config
from gspo_study.models.checkpoint import fingerprint, verify
from gspo_study.trainer import train
from tests.test_reliability_table import _each_step_once, _same_history, _store_runs
from tests.test_trainer import history

SMOKE = "experiments/smoke/base.yaml"
ENV = {**os.environ, "TQDM_DISABLE": "1", "OMP_NUM_THREADS": "1"}


@pytest.fixture
def disk(tmp_path):
    """A 72 MiB tmpfs (above the suite's 64 MiB free-space floor), unmounted afterwards."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=72M", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("mounting a tmpfs needs root (CI runs as root)")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def fill(mnt: Path, leave: int = 64 << 10) -> Path:
    """Take all but `leave` bytes of the tmpfs (fallocate: instant). The job writes meanwhile, so the free space
    can shrink between the measure and the fallocate (ENOSPC): then measured again, with what is taken kept."""
    filler = mnt / "filler"
    with open(filler, "wb") as f:
        for _ in range(50):
            st = os.statvfs(mnt)
            free = st.f_bavail * st.f_frsize
            try:
                os.posix_fallocate(f.fileno(), 0, os.fstat(f.fileno()).st_size + max(free - leave, 1))
                return filler
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
    return filler


def run_until_full(argv: list[str], ready, mnt: Path, leave: int = 64 << 10) -> tuple[int, str]:
    """Start the CLI, fill the disk once `ready()` holds (the job is past its checks), return (rc, stderr)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "gspo_study", *argv],
        env=ENV,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )

    def watch():
        deadline = time.time() + 240
        while proc.poll() is None and time.time() < deadline:
            if ready():
                fill(mnt, leave)
                return
            time.sleep(0.01)

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    _, err = proc.communicate(timeout=300)
    t.join(10)
    return proc.returncode, err


def one_line(err: str) -> str:
    lines = [line for line in err.strip().splitlines() if line]
    assert "Traceback" not in err and lines, err
    return lines[-1]


def test_checkpoint_write_fails_midway(smoke_results, tmp_path, disk):
    init = smoke_results / "smoke/checkpoints/coldstart"
    args = ["train.steps=6", "train.checkpoint_every=3", "eval.every=3", f"init_checkpoint={init}"]
    ref = load_config(SMOKE, [f"results_dir={tmp_path / 'ref'}", f"tracking.uri=sqlite:///{tmp_path}/ref.db", *args])
    train(ref)
    over = [f"results_dir={disk}", f"tracking.uri=sqlite:///{tmp_path}/m.db", *args]
    cfg = load_config(SMOKE, over)
    ckpt = Path(cfg.out_dir) / "runs"
    ready = lambda: any(ckpt.glob("*/checkpoint/CHECKPOINT_COMPLETE"))  # noqa: E731 - step 3's checkpoint
    rc, err = run_until_full(["train", SMOKE, *over], ready, disk)
    line = one_line(err)
    assert rc == 4 and line.startswith("error: a write failed (") and "No space left on device" in one_line(err), err
    (kept,) = list(ckpt.glob("*/checkpoint"))
    verify(kept)  # the previous checkpoint is whole (its manifest) and is step 3's
    assert '"step": 3' in (kept / "trainer_state.json").read_text()
    assert not list(kept.parent.glob(".checkpoint.tmp-*"))  # the failed one left nothing
    (disk / "filler").unlink()
    train(cfg)
    _same_history(history(ref), history(cfg))
    _each_step_once(cfg.tracking.uri, "study-smoke")


def test_cold_start_write_fails_midway(tmp_path, disk):
    from gspo_study.models.checkpoint import is_complete
    from gspo_study.run import lock_file
    from gspo_study.sft import run_sft

    ref = run_sft(load_config(SMOKE, [f"results_dir={tmp_path / 'ref'}", "sft.steps=60"]))
    over = [f"results_dir={disk}", "sft.steps=60"]
    checkpoints = disk / "smoke" / "checkpoints"
    # the cold start's lock is taken after the free-space probe and before the 60 steps; the checkpoint's own
    # directory appears only as it is written, too late on a fast machine (the save takes milliseconds)
    locked = lock_file(f"coldstart:{(checkpoints / 'coldstart').resolve()}")
    locked.unlink(missing_ok=True)  # a lock file outlives its lock: an earlier run at this path would fire it now
    rc, err = run_until_full(["sft", SMOKE, *over], locked.exists, disk)
    assert (
        rc == 4 and one_line(err).startswith("error: a write failed (") and "No space left on device" in one_line(err)
    ), err
    assert not is_complete(checkpoints / "coldstart") and not list(checkpoints.glob(".coldstart.tmp-*"))
    (disk / "filler").unlink()
    out = run_sft(load_config(SMOKE, over))
    assert fingerprint(out) == fingerprint(ref)  # the same cold start as one that never failed


def test_store_write_fails_midway(smoke_results, tmp_path, disk):
    init = smoke_results / "smoke/checkpoints/coldstart"
    args = ["train.steps=6", "train.checkpoint_every=2", "eval.every=3", f"init_checkpoint={init}"]
    ref = load_config(SMOKE, [f"results_dir={tmp_path / 'ref'}", f"tracking.uri=sqlite:///{tmp_path}/ref.db", *args])
    train(ref)
    uri = f"sqlite:///{disk}/m.db"
    over = [f"results_dir={tmp_path / 'res'}", f"tracking.uri={uri}", *args]
    runs = tmp_path / "res" / "smoke" / "runs"
    ready = lambda: any(runs.glob("*/checkpoint/CHECKPOINT_COMPLETE"))  # noqa: E731 - step 2 logged and saved
    rc, err = run_until_full(["train", SMOKE, *over], ready, disk, leave=0)
    assert rc == 4 and "the MLflow store could not be written" in one_line(err), err
    (disk / "filler").unlink()
    _each_step_once(uri, "study-smoke")  # the store opens, and what it committed is whole
    cfg = load_config(SMOKE, over)
    train(cfg)
    _same_history(history(ref), history(cfg))
    _each_step_once(uri, "study-smoke")
    _, (run,) = _store_runs(uri, "study-smoke")
    assert run.info.status == "FINISHED"


def test_export_write_fails_midway(smoke_results, tmp_path, disk):
    init = smoke_results / "smoke/checkpoints/coldstart"
    common = [
        f"results_dir={tmp_path}",
        f"tracking.uri=sqlite:///{tmp_path}/m.db",
        "train.steps=2",
        f"init_checkpoint={init}",
    ]
    from gspo_study.cli import main
    from gspo_study.study import run_figure

    run_figure(1, "smoke", [1], common)  # the runs to export, trained in this process
    out = disk / "runs.parquet"
    export = [
        "export-study",
        "--scale",
        "smoke",
        "--seeds",
        "1",
        "--figures",
        "1",
        "--out",
        str(out),
        *common,
    ]
    assert main(export) == 0
    before = out.read_bytes()
    fill(disk, leave=0)
    res = subprocess.run([sys.executable, "-m", "gspo_study", *export], env=ENV, capture_output=True, text=True)
    assert res.returncode == 4 and one_line(res.stderr).startswith("error: a write failed"), res.stderr
    assert out.read_bytes() == before and sorted(p.name for p in disk.iterdir()) == ["filler", "runs.parquet"]
    (disk / "filler").unlink()
    assert main(export) == 0  # in this process: the same command as the failed one
    assert out.read_bytes() == before
