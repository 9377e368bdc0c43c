"""Standard HF checkpoint directories (safetensors + config + tokenizer), written atomically.

A checkpoint is first written to a temporary sibling directory and renamed into place, so a killed
process never leaves a half-written checkpoint under the final name. Loading uses safetensors only.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer, Qwen3MoeForCausalLM
from transformers.utils import logging as hf_logging

hf_logging.disable_progress_bar()  # per-shard bars would bury our own progress bar and one-line errors

COMPLETE_MARKER = "CHECKPOINT_COMPLETE"


class CheckpointError(ValueError):
    """A model path that is missing, incomplete, or not a Qwen3-MoE checkpoint."""


def save_pretrained(
    model, tokenizer, path: str | Path, extra: dict[str, Any] | None = None, state_dict: dict | None = None
) -> Path:
    """Write `model` + `tokenizer` (+ `extra` tensors/JSON files) to `path` atomically; `state_dict`: the
    weights to write when the model's own parameters are not whole (ZeRO-3 partitions them)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    for p in state_dict.values() if state_dict is not None else model.parameters():
        if not torch.isfinite(p).all():
            raise CheckpointError(f"refusing to write checkpoint {path}: model has non-finite weights")
    with atomic_directory(path) as tmp:
        model.save_pretrained(tmp, safe_serialization=True, state_dict=state_dict)
        tokenizer.save_pretrained(tmp)
        for name, obj in (extra or {}).items():
            if name.endswith(".json"):
                (tmp / name).write_text(json.dumps(obj, indent=1, sort_keys=True))
            elif callable(obj):  # a writer, e.g. of a safetensors file: obj(path)
                obj(tmp / name)
            else:
                torch.save(obj, tmp / name)
    return path


@contextmanager
def atomic_directory(path: str | Path) -> Iterator[Path]:
    """Yield a temporary sibling of `path` to fill; on success mark it complete and rename it to `path` (a
    previous `path` is replaced, via `.old`); on any error delete it. A kill leaves what
    `finish_interrupted_save` settles."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    try:
        yield tmp
        (tmp / COMPLETE_MARKER).write_text("ok\n")
        old = path.with_name(f".{path.name}.old")
        if path.exists():
            shutil.rmtree(old, ignore_errors=True)
            path.rename(old)
        tmp.rename(path)
        shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def finish_interrupted_save(path: str | Path) -> None:
    """Settle what a killed `save_pretrained(..., path)` left: killed between its two renames, `path` is gone
    and the new checkpoint waits complete in a temporary directory (else the previous one in `.old`) — it
    is moved into place; temporary directories and `.old` left over are deleted. Call it only where no other
    process can be saving to `path` (the trainer holds the run's lock)."""
    path = Path(path)
    if not path.parent.is_dir():
        return
    temps = sorted(path.parent.glob(f".{path.name}.tmp-*"), key=lambda p: p.stat().st_mtime)
    old = path.with_name(f".{path.name}.old")
    if not path.exists():
        for candidate in [*reversed(temps), old]:  # the newest complete one
            if (candidate / COMPLETE_MARKER).is_file():
                candidate.rename(path)
                break
    for leftover in [*temps, old]:  # incomplete ones always; complete ones once `path` holds a checkpoint
        if path.exists() or not (leftover / COMPLETE_MARKER).is_file():
            shutil.rmtree(leftover, ignore_errors=True)


def fingerprint(path: str | Path) -> str:
    """16 hex digits identifying a checkpoint directory's contents cheaply (also for 60 GB checkpoints): the
    names and sizes of its files and the bytes of its small JSON files (config, SFT log with its timings), so
    a retrained cold start at the same path gets a new fingerprint."""
    import hashlib

    h = hashlib.sha256()
    for f in sorted(p for p in Path(path).rglob("*") if p.is_file()):
        h.update(f"{f.relative_to(path)}:{f.stat().st_size};".encode())
        if f.suffix == ".json" and f.stat().st_size < 1 << 20:
            h.update(f.read_bytes())
    return h.hexdigest()[:16]


def is_complete(path: str | Path) -> bool:
    path = Path(path)
    return (path / COMPLETE_MARKER).is_file() or (
        (path / "config.json").is_file()
        and any(path.glob("*.safetensors"))
        and not (path / ".partial").exists()
    )


def load_pretrained(
    path: str | Path, dtype: torch.dtype = torch.float32, experts_implementation: str | None = None
):
    """(model, tokenizer) from a local Qwen3-MoE directory; a clear error for anything else."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"model path not found: {path}")
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise CheckpointError(f"{path} is not a Hugging Face checkpoint (no config.json)")
    try:
        model_type = json.loads(cfg_file.read_text()).get("model_type")
    except json.JSONDecodeError:
        raise CheckpointError(f"{cfg_file} is not valid JSON") from None
    if model_type != "qwen3_moe":
        raise CheckpointError(
            f"{path} holds model_type {model_type!r}; a Qwen3-MoE checkpoint ('qwen3_moe') is required"
        )
    if not is_complete(path):
        raise CheckpointError(f"{path} is an incomplete checkpoint (no weights or completion marker)")
    kwargs: dict[str, Any] = {"dtype": dtype}
    if experts_implementation:
        kwargs["experts_implementation"] = experts_implementation
    try:
        model = Qwen3MoeForCausalLM.from_pretrained(path, local_files_only=True, **kwargs)
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except MemoryError:
        raise
    except Exception as exc:  # noqa: BLE001 - safetensors, json and OS errors of a damaged directory
        detail = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise CheckpointError(f"{path} cannot be loaded ({type(exc).__name__}: {detail[:200]})") from None
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return model, tokenizer
