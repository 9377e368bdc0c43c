"""Wheels for the GPU check on a machine that has only Python, torch and a CUDA driver, and no network.

    python -m benchmarks.gpu_bundle --dest gpu_bundle [--python-version 3.12]     # `make gpu-bundle`

Takes the packages `benchmarks/gpu_check.py` imports (ROOTS) and everything they require, read from this
environment's installed metadata (extras left out, markers evaluated for Linux x86-64 at the target Python),
minus torch and its CUDA wheels (the GPU machine's own), at the versions installed here — so the GPU runs the
code the CPU tests ran. Each is fetched as a binary wheel for the target (`pip download --no-deps
--only-binary=:all:`, manylinux x86-64), or, where the package publishes only a source archive (a pure-Python
one such as antlr4-python3-runtime), built here with `pip wheel`. Writes `<dest>/REQUIREMENTS.txt`
(name==version, one a line) and fails if the folder outgrows MAX_MB (the device tool carries 64 MiB with the
working tree). `benchmarks/gpu_check.sh` installs it there.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOTS = ("transformers", "tokenizers", "safetensors", "omegaconf", "pyyaml", "tqdm", "filelock", "pytest")
SKIP_PREFIXES = ("torch", "nvidia-", "triton", "cuda-")  # the GPU machine's own torch stack
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64")
MAX_MB = 48.0


def closure(roots: tuple[str, ...], python_version: str) -> dict[str, str]:
    """name -> installed version for `roots` and everything they require on the target."""
    env = default_environment() | {
        "python_version": python_version,
        "python_full_version": f"{python_version}.0",
        "sys_platform": "linux",
        "platform_system": "Linux",
        "platform_machine": "x86_64",
        "extra": "",
    }
    found: dict[str, str] = {}
    todo = list(roots)
    while todo:
        name = canonicalize_name(todo.pop())
        if name in found or name.startswith(SKIP_PREFIXES):
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            raise SystemExit(f"error: {name} is required but not installed here; run make install first") from None
        found[name] = dist.version
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate(env):
                todo.append(req.name)
    return dict(sorted(found.items()))


def fetch(name: str, version: str, dest: Path, python_version: str) -> None:
    pins = f"{name}=={version}"
    platforms = [a for p in PLATFORMS for a in ("--platform", p)]
    download = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "-q",
        "--no-deps",
        "--only-binary=:all:",
        "-d",
        str(dest),
    ]
    target = ["--python-version", python_version, "--implementation", "cp", *platforms]
    if subprocess.run([*download, *target, pins], capture_output=True).returncode == 0:
        return
    # no binary wheel for the target: a source-only package, built here (pure Python ones work anywhere)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(dest), pins], check=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dest", default="gpu_bundle", help="folder for the wheels (emptied first)")
    p.add_argument("--python-version", default="3.12", help="the GPU machine's Python (H200 image: 3.12)")
    args = p.parse_args(argv)
    dest = Path(args.dest)
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    pins = closure(ROOTS, args.python_version)
    for name, version in pins.items():
        fetch(name, version, dest, args.python_version)
    (dest / "REQUIREMENTS.txt").write_text("".join(f"{n}=={v}\n" for n, v in pins.items()))
    mb = sum(f.stat().st_size for f in dest.iterdir()) / 2**20
    wheels = sorted(f.name for f in dest.glob("*.whl"))
    print(f"{dest}: {len(wheels)} wheels, {mb:.1f} MiB, for Python {args.python_version} (torch not included)")
    if len(wheels) != len(pins):
        print(f"error: {len(pins)} packages but {len(wheels)} wheels in {dest}", file=sys.stderr)
        return 1
    if mb > MAX_MB:
        print(
            f"error: {dest} is {mb:.1f} MiB, over {MAX_MB} MiB (the device carries 64 MiB in all)",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
