"""Stopping when asked: a scheduler's SIGTERM, the points where a job may stop, and the grace that bounds the wait.

A job (an RL run, a cold-start SFT) runs inside `on_sigterm()`. The first SIGTERM asks it to stop, and it stops at
the first of:
- a stop point (`stop_point()`, between two batches of a long phase: evaluation batches, a step's updates, the
  π_old and telemetry passes' micro-batches, SFT steps) where stopping loses no finished work — the job says where
  that holds (`Job.free`); under DeepSpeed every rank stops at the same one (`Job.agree`);
- the end of the step it is in (the trainer's own safe point, which checkpoints the step);
- the grace (`GSPO_STUDY_STOP_GRACE_S` seconds, default 20) running out, whatever it is doing — e.g. inside the one
  generate call of a huge rollout: `Stop` is raised there (from SIGALRM, between two decode steps), unless it is
  inside an `uncut()` section (a checkpoint or a metrics write), which finishes first.
Each job catches `Stop`, saves what is consistent at that point, and ends as `Terminated` (exit 143). A second
SIGTERM (more than 2 s after the first: one notice delivered twice is the same notice) or SIGINT stops at once; the
job resumes from its last checkpoint.

`GSPO_STUDY_SIGTERM_IN=<phase>@<n>` (tests) sends the SIGTERM a scheduler would, on the n-th entry into a phase:
to this process, and under torchrun to the launcher too (which forwards it to every rank); in a sweep's worker to
the sweep's process only (which forwards it to every worker).
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from gspo_study.errors import ConfigError, Terminated

GRACE_ENV = "GSPO_STUDY_STOP_GRACE_S"
DEFAULT_GRACE_S = 20.0  # under Slurm's default KillWait (30 s) and torchrun's 30 s to its workers, with a save
SAME_NOTICE_S = 2.0  # a second SIGTERM within this many seconds of the first is the same notice arriving twice
INJECT_ENV = "GSPO_STUDY_SIGTERM_IN"
_sweep_worker = False  # this process runs one run of a sweep (`sweep_worker()`)


class Stop(Terminated):
    """Raised inside a job once a stop was asked: at a stop point (`late` False) or where the grace ran out."""

    def __init__(self, phase: str, late: bool, grace: float):
        self.phase, self.late, self.grace = phase, late, grace
        how = f"the {grace:g} s grace ran out" if late else "a stop point"
        super().__init__(f"SIGTERM: stopped inside {phase or 'its setup'} ({how}); rerun the same command to resume")


@dataclass
class Job:
    """The job running inside `on_sigterm`, as the stop points see it."""

    grace: float
    free: Callable[[], bool] = lambda: True  # does stopping now lose no finished work? (set by the job)
    agree: Callable[[bool], bool] = lambda mine: mine  # every rank's answer to "stop?" (DeepSpeed: any rank)
    asked_at: float | None = None
    phase: str = ""
    uncut: int = 0
    late_due: bool = False  # the grace ran out inside an uncut section: stop when it ends
    entries: Counter = field(default_factory=Counter)


_job: Job | None = None


def grace_seconds() -> float:
    """`GSPO_STUDY_STOP_GRACE_S`, or the default; a one-line error for anything but a positive number."""
    raw = os.environ.get(GRACE_ENV, "")
    try:
        grace = float(raw) if raw.strip() else DEFAULT_GRACE_S
    except ValueError:
        grace = math.nan
    if not (math.isfinite(grace) and grace > 0):
        raise ConfigError(f"bad value {raw!r} for {GRACE_ENV}; allowed: a number of seconds > 0")
    return grace


def _disarm() -> None:
    signal.setitimer(signal.ITIMER_REAL, 0)
    if _job is not None:
        _job.late_due = False


def _on_sigterm(signum, frame) -> None:
    job = _job
    now = time.monotonic()
    if job.asked_at is None:
        job.asked_at = now
        signal.setitimer(signal.ITIMER_REAL, job.grace)
    elif now - job.asked_at > SAME_NOTICE_S:
        _disarm()
        raise Terminated("a second SIGTERM: stopped at once; the run resumes from its last checkpoint")


def _on_alarm(signum, frame) -> None:
    job = _job
    if job.uncut:
        job.late_due = True
        return
    raise Stop(job.phase, late=True, grace=job.grace)


@contextlib.contextmanager
def on_sigterm() -> Iterator[Job]:
    """While inside, SIGTERM asks the job to stop (module docstring). Outside the main thread: never asked."""
    global _job
    grace = grace_seconds()
    if threading.current_thread() is not threading.main_thread():
        yield Job(grace)
        return
    outer, _job = _job, Job(grace)
    previous = signal.signal(signal.SIGTERM, _on_sigterm), signal.signal(signal.SIGALRM, _on_alarm)
    try:
        yield _job
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGTERM, previous[0])
        signal.signal(signal.SIGALRM, previous[1])
        _job = outer


def asked() -> bool:
    """Whether this process got SIGTERM since its job began."""
    return _job is not None and _job.asked_at is not None


def settle() -> None:
    """The job is stopping at a safe point of its own: the grace no longer applies."""
    if _job is not None:
        _disarm()


def stop_point() -> None:
    """Between two batches: raise `Stop` when a stop was asked (on any rank) and stopping here loses nothing."""
    job = _job
    if job is None or not job.free():
        return
    if job.agree(job.asked_at is not None):
        _disarm()
        raise Stop(job.phase, late=False, grace=job.grace)


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """The job is inside phase `name` (what a stop names, what `Job.free` may read)."""
    job = _job
    if job is None:
        yield
        return
    outer, job.phase = job.phase, name
    job.entries[name] += 1
    _inject(name, job.entries[name])
    try:
        yield
    finally:
        job.phase = outer


def current_phase() -> str:
    return "" if _job is None else _job.phase


@contextlib.contextmanager
def uncut() -> Iterator[None]:
    """A section the grace does not cut (a checkpoint, a metrics write): a grace that runs out inside it stops
    the job when it ends. A second SIGTERM still stops at once."""
    job = _job
    if job is None:
        yield
        return
    job.uncut += 1
    try:
        yield
    finally:
        job.uncut -= 1
    if not job.uncut and job.late_due:
        job.late_due = False
        raise Stop(job.phase, late=True, grace=job.grace)


def sweep_worker() -> None:
    """This process is a sweep's worker: a scheduler signals the sweep's process, which forwards it here."""
    global _sweep_worker
    _sweep_worker = True


def _inject(name: str, count: int) -> None:
    """Tests: `GSPO_STUDY_SIGTERM_IN=<phase>@<n>` sends SIGTERM on the n-th entry into `phase`, as a scheduler does:
    to this process and, under torchrun, to the launcher, which forwards it to every rank (rank 0 sends it); in a
    sweep's worker to the sweep only, which forwards it to every worker. Not once the notice came (the sweep's
    other workers reach the same phase too)."""
    want = os.environ.get(INJECT_ENV, "")
    if want != f"{name}@{count}" or os.environ.get("RANK", "0") != "0" or asked():
        return
    if _sweep_worker:
        os.kill(os.getppid(), signal.SIGTERM)
        return
    os.kill(os.getpid(), signal.SIGTERM)
    if "TORCHELASTIC_RUN_ID" in os.environ:
        os.kill(os.getppid(), signal.SIGTERM)
