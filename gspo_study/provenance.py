"""Where a run's numbers came from: the machine and library draw, recorded as MLflow tags on every run.

A run's numbers are bit-identical for the same config, seed and thread count *on one machine with one set of
libraries*; another CPU model, instruction set, BLAS build or torch / transformers version rounds differently
and gives another draw (measured: a 16-layer cold start whose SFT loss leaves the committed one's in the 7th
digit at step 7; docs/RELIABILITY.md). The draw follows the CPU's kernel path — its vector extensions, above all:
a fresh clone on an AVX-512-BF16 machine redrew the first, AVX-512-drawn study digit for digit, and the study
redrawn on an AVX2-only machine differs from both. So every run is
tagged `provenance.*` (`tags`), and the figures and the report compare the runs they draw from with the shipped
study (`results/<scale>/study-runs.parquet`, gspo_study.archive) and say in one line when they differ
(`draw_notice`): a different draw, not an error.
"""

from __future__ import annotations

import platform
import re
from functools import cache
from pathlib import Path

PREFIX = "provenance."
# the instruction-set families that change which kernels torch, MKL and oneDNN run (the rest of /proc/cpuinfo's
# flags are about virtualisation, power management and errata)
SIMD = re.compile(r"^(sse\w*|ssse3|avx\w*|amx\w*|fma\w*|f16c|bmi\d|vnni\w*|sha_ni|aes|pclmulqdq)$")
# the tags that make two runs of one config the same draw (the others are recorded for the reader)
DRAW_KEYS = ("cpu", "cpu_flags", "threads", "torch", "transformers", "blas", "device", "precision")
# what a run tagged before a key existed was drawn with (every run before train.device was on the CPU, in fp32)
BEFORE = {"device": "cpu", "precision": "fp32"}


def _proc_cpuinfo() -> str | None:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return None


def cpu_vendor() -> str:
    """/proc/cpuinfo's vendor_id (e.g. AuthenticAMD, GenuineIntel); "unknown" elsewhere."""
    found = re.search(r"^vendor_id\s*:\s*(.+)$", _proc_cpuinfo() or "", re.M)
    return found[1].strip() if found else "unknown"


def cpu() -> tuple[str, str]:
    """(CPU model name, its SIMD flags sorted) from /proc/cpuinfo; the platform's processor name elsewhere."""
    text = _proc_cpuinfo()
    if text is None:
        return platform.processor() or "unknown", "unknown"
    model = re.search(r"^model name\s*:\s*(.+)$", text, re.M)
    flags = re.search(r"^(?:flags|Features)\s*:\s*(.+)$", text, re.M)
    simd = sorted({f for f in flags[1].split() if SIMD.match(f)}) if flags else []
    return (model[1].strip() if model else platform.processor() or "unknown"), " ".join(simd) or "unknown"


def _blas(config: str) -> str:
    """torch's BLAS and its version from `torch.__config__.show()`, e.g. `mkl: Intel(R) oneAPI Math Kernel
    Library Version 2024.2-Product Build 20240605`."""
    info = re.search(r"BLAS_INFO=([^,\s]+)", config)
    name = info[1] if info else "unknown"
    version = re.search(r"^\s*- (.*(?:Math Kernel Library|OpenBLAS|BLIS|Accelerate).*)$", config, re.M)
    return f"{name}: {version[1].split(' for ')[0].strip()}" if version else name


@cache
def _static() -> dict[str, str]:
    import torch
    import transformers

    model, flags = cpu()
    return {
        "cpu": model,
        "cpu_flags": flags,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),  # the kernels ATen dispatches to
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "blas": _blas(torch.__config__.show()),
        "python": platform.python_version(),
        "machine": platform.machine(),
    }


def tags(device: str, precision: str) -> dict[str, str]:
    """This process's provenance as MLflow tags (`provenance.cpu`, …); `threads` is torch's current intra-op
    thread count, so call it after the run's threads are set; `device` and `precision`: where the run's model
    trains and its forwards' precision (gspo_study.runtime.device_text, precision_text)."""
    import torch

    mine = {"threads": str(torch.get_num_threads()), "device": device, "precision": precision}
    return {PREFIX + k: v for k, v in {**_static(), **mine}.items()}


def draw(run_tags: dict[str, str]) -> dict[str, str]:
    """The draw-defining part of a run's tags, plus where it started from (`init_fingerprint`)."""
    out = {k: run_tags.get(PREFIX + k, BEFORE.get(k, "unrecorded")) for k in DRAW_KEYS}
    return {**out, "cold start": run_tags.get("init_fingerprint", "unrecorded")}


def draw_notice(used: dict[str, dict[str, str]], shipped: dict[str, dict[str, str]], what: str) -> str | None:
    """One line when the runs `used` (run_key → tags) are not the shipped study's runs (run_key → tags, from
    the archive) or come from another draw; None when they are the same runs or nothing was shipped.
    An imported run is the shipped run itself (its `archive.source_run_id` is the shipped run's id)."""
    if not shipped:
        return None
    differ: dict[str, set[str]] = {}
    others = 0  # runs that are not the shipped ones
    for key, mine in used.items():
        theirs = shipped.get(key)
        if theirs is None:
            continue
        if mine.get("archive.source_run_id") == theirs.get("archive.source_run_id"):
            continue  # the shipped run, imported
        others += 1
        a, b = draw(mine), draw(theirs)
        for k in a:
            if a[k] != b[k]:
                differ.setdefault(k, set()).add(f"{a[k]} here vs {b[k]} shipped")
    if not differ:  # the same draw (or neither side recorded it): the same numbers
        return None
    how = "; ".join(f"{k}: {', '.join(sorted(v)[:2])}" for k, v in differ.items() if k != "cpu_flags")
    cause = _likely_cause(used, shipped)
    return (
        f"note: {what} is another draw than the shipped study ({others} of {len(used)} runs not the shipped ones"
        f"{'; ' + how if how else ''}){cause}: a different draw, not an error — the numbers follow the CPU's "
        "kernel path and libraries, not the config alone (docs/RELIABILITY.md); `make import-study` loads the "
        "shipped runs"
    )


def _likely_cause(used: dict[str, dict[str, str]], shipped: dict[str, dict[str, str]]) -> str:
    """ "; likely cause: …" when the vector extensions the runs were drawn with differ from the shipped runs' (the
    kernel path torch, MKL and oneDNN take follows them: an AVX2-only and an AVX-512-BF16 machine draw different
    numbers from one config), else ""."""

    def exts(tag_sets) -> set[str]:
        return {f for t in tag_sets for f in t.get(PREFIX + "cpu_flags", "").split() if f.startswith(("avx", "amx"))}

    here, there = exts(used.values()), exts(t for k, t in shipped.items() if k in used)
    if here == there:
        return ""
    plus, minus = sorted(here - there), sorted(there - here)
    shown = ", ".join([*(f"+{f}" for f in plus[:4]), *(f"−{f}" for f in minus[:4])])
    return f"; likely cause: the CPU's vector extensions differ from the shipped runs' ({shown})"
