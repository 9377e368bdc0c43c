"""What the suite needs on a GPU machine that has only Python, torch (and the image's numpy, pandas, matplotlib,
seaborn, pyarrow, scipy) and no network, in one file that travels with the tree.

    python -m benchmarks.gpu_bundle --dest gpu_bundle [--python-version 3.12]     # `make gpu-bundle`

Takes the packages the suite's train, evaluate, figure and report commands and the GPU check import (ROOTS: MLflow's
client and SQL store included) and everything they require, read from this environment's installed metadata (extras
left out, markers evaluated for Linux x86-64 at the target Python), minus the image's own packages (PREINSTALLED and
what they require) and the ones nothing here imports (UNUSED, proven by `benchmarks/gpu_bundle_proof.sh`), at the
versions installed here — so the GPU runs the code the CPU tests ran. Each is fetched as a binary wheel for the target
(`pip download --no-deps --only-binary=:all:`, manylinux x86-64), or, where the package publishes only a source archive
(a pure-Python one such as antlr4-python3-runtime), built here with `pip wheel`. The wheels are unpacked into one
folder (a wheel install is an unzip) and packed as `<dest>/site.tar.xz` (xz holds in about half of what the wheels'
zip does), beside `<dest>/REQUIREMENTS.txt` (name==version, one a line); it fails if the tree that travels to the
device (the tracked files) and the bundle together outgrow the 64 MiB the device tool carries.
`benchmarks/gpu_check.sh` unpacks it there.
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

# What the suite's train, evaluate, figure and report commands import beyond the GPU image's own packages, MLflow's
# client and SQL store included (mlflow-skinny: the same `mlflow` package without the server's web UI, 4 MiB instead
# of 12), and pytest for the check's vLLM tests.
ROOTS = ("transformers", "tokenizers", "safetensors", "omegaconf", "pyyaml", "tqdm", "filelock", "math-verify",
         "mlflow-skinny", "sqlalchemy", "alembic", "cryptography", "pytest")  # fmt: skip
# (cryptography: MLflow's SQL store imports it, though mlflow-skinny does not require it)
# The GPU image's preinstalled packages (H200 image: torch and its stack, numpy, pandas, matplotlib, seaborn, pyarrow,
# scipy), and everything they require: never bundled.
PREINSTALLED = ("torch", "numpy", "pandas", "matplotlib", "seaborn", "pyarrow", "scipy")
SKIP_PREFIXES = ("torch", "nvidia-", "triton", "cuda-")  # the GPU machine's own torch stack
# Required by a package above but imported by none of the suite's commands on the GPU (Google auth of MLflow's
# Databricks client, the Hugging Face hub's download accelerator): the proof runs without them. (transformers needs
# `kernels` to load a checkpoint whose config names an experts implementation.)
UNUSED = ("google-auth", "pyasn1", "pyasn1-modules", "hf-xet")
CARRIED_MB = 64.0  # what the device tool carries: the tracked tree and the bundle together
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64")


def closure(
    roots: tuple[str, ...], python_version: str, skip: frozenset[str] = frozenset(), prefixes=SKIP_PREFIXES
) -> dict[str, str]:
    """name -> installed version for `roots` and everything they require on the target, but `skip` and names
    starting with `prefixes`."""
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
        if name in found or name in skip or name.startswith(prefixes):
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


def unpack(wheels: list[Path], site: Path) -> None:
    """Each wheel's files into `site`, as pip installs them (its `.data/purelib` and `/platlib` at the top)."""
    import zipfile

    for wheel in wheels:
        with zipfile.ZipFile(wheel) as z:
            z.extractall(site)
    for data in site.glob("*.data"):
        for lib in ("purelib", "platlib"):
            if (data / lib).is_dir():
                shutil.copytree(data / lib, site, dirs_exist_ok=True)
        shutil.rmtree(data)


def tracked_mb(root: Path) -> float:
    files = subprocess.run(["git", "ls-files", "-z"], cwd=root, capture_output=True, check=True).stdout.split(b"\0")
    return sum((root / f.decode()).stat().st_size for f in files if f and (root / f.decode()).is_file()) / 2**20


def main(argv: list[str] | None = None) -> int:
    import tarfile
    import tempfile

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dest", default="gpu_bundle", help="folder for site.tar.xz and REQUIREMENTS.txt (emptied first)")
    p.add_argument("--python-version", default="3.12", help="the GPU machine's Python (H200 image: 3.12)")
    p.add_argument("--image", action="store_true", help="print the image's packages as pins (for the proof) and exit")
    args = p.parse_args(argv)
    if args.image:  # this checkout's versions, without a local build tag (torch's +cpu)
        print(" ".join(f"{n}=={metadata.version(n).split('+')[0]}" for n in PREINSTALLED))
        return 0
    dest = Path(args.dest)
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    image = frozenset(closure(PREINSTALLED, args.python_version, prefixes=()))
    pins = closure(ROOTS, args.python_version, image | {canonicalize_name(n) for n in UNUSED})
    with tempfile.TemporaryDirectory() as tmp:
        wheels_dir, site = Path(tmp) / "wheels", Path(tmp) / "site"
        wheels_dir.mkdir()
        for name, version in pins.items():
            fetch(name, version, wheels_dir, args.python_version)
        wheels = sorted(wheels_dir.glob("*.whl"))
        if len(wheels) != len(pins):
            print(f"error: {len(pins)} packages but {len(wheels)} wheels", file=sys.stderr)
            return 1
        unpack(wheels, site)
        with tarfile.open(dest / "site.tar.xz", "w:xz", preset=9) as tar:
            tar.add(site, arcname=".", filter=lambda t: None if "__pycache__" in t.name else t)
        zipped = sum(w.stat().st_size for w in wheels) / 2**20
    (dest / "REQUIREMENTS.txt").write_text("".join(f"{n}=={v}\n" for n, v in pins.items()))
    mb = (dest / "site.tar.xz").stat().st_size / 2**20
    tree = tracked_mb(Path(__file__).resolve().parents[1])
    print(
        f"{dest}/site.tar.xz: {len(pins)} packages for Python {args.python_version}, {mb:.1f} MiB ({zipped:.1f} MiB "
        f"as wheels; torch and the image's packages not included); with the tracked tree's {tree:.1f} MiB: "
        f"{mb + tree:.1f} of the {CARRIED_MB:g} MiB the device carries"
    )
    if mb + tree > CARRIED_MB:
        print(f"error: the bundle and the tree are {mb + tree:.1f} MiB, over {CARRIED_MB:g} MiB", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
