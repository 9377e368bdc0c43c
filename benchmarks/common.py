"""Small helpers shared by the benchmarks: timing, peak memory, machine load, table printing.

Nothing here imports torch, so a parent process that only orchestrates subprocesses stays small (its peak
RSS would otherwise leak into its children's `ru_maxrss` through vfork/exec on Linux).
"""

from __future__ import annotations

import os
import platform
import resource
import statistics
import time
from collections.abc import Callable, Sequence


def peak_rss_mb() -> float:
    """Peak resident set size of this process so far, in MiB (`ru_maxrss` is KiB on Linux, bytes on macOS)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / (1024 * 1024) if platform.system() == "Darwin" else rss / 1024


def machine() -> str:
    """The CPU a benchmark ran on, as its JSON and tables name it: model, logical CPUs and SIMD flags (the kernel
    path torch takes follows them), from the run tags' own reader (gspo_study.provenance.cpu)."""
    from gspo_study.provenance import cpu

    model, flags = cpu()
    return f"{model}, {os.cpu_count()} CPUs, {flags}"


def load_average() -> list[float]:
    """1/5/15-minute load averages (what `uptime` prints), or [] where unavailable."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def timed(fn: Callable[[], object]) -> tuple[float, object]:
    """(wall seconds, return value) of one call."""
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def paired_overhead_pct(case: Sequence[float], base: Sequence[float]) -> float:
    """Median over repeats of (case / base in the same repeat) - 1, in %: robust to load drift between repeats."""
    return 100 * (median([c / b for c, b in zip(case, base)]) - 1)


def print_table(headers: Sequence[str], rows: Sequence[Sequence[object]], title: str = "") -> None:
    """A plain left/right-aligned text table (first column left, the rest right)."""
    cells = [[str(h) for h in headers]] + [[_fmt(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    if title:
        print(f"\n{title}")
    for n, row in enumerate(cells):
        print("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))))
        if n == 0:
            print("  ".join("-" * w for w in widths))


def _fmt(value: object) -> str:
    if isinstance(value, float):
        if value != value:
            return "-"
        return f"{value:.3g}" if abs(value) < 10 else f"{value:.0f}" if abs(value) >= 1000 else f"{value:.1f}"
    return "-" if value is None else str(value)
