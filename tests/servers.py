"""Helpers for tests that start real servers on loopback (mlflow server, mlflow ui through make)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM the process's whole group (a server and its workers), SIGKILL if it lingers."""
    for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
            proc.wait(timeout=wait)
            return
        except ProcessLookupError:
            return
        except subprocess.TimeoutExpired:
            continue


def wait_ready(url: str, proc: subprocess.Popen, log, what: str, seconds: float) -> None:
    """Poll `url`/health until it answers 200; fail naming `what` (with its log's tail) if `proc` exits first
    or `seconds` pass."""
    import time
    import urllib.request

    import pytest

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"{what} exited ({proc.returncode}): {log.read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    pytest.fail(f"{what} not ready after {seconds} s: {log.read_text()[-2000:]}")
