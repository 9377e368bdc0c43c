"""Standard HF checkpoint directories (safetensors + config + tokenizer), written atomically.

A checkpoint is first written to a temporary sibling directory and renamed into place, so a killed
process never leaves a half-written checkpoint under the final name. Loading uses safetensors only.

Every checkpoint written here carries `MANIFEST.json`, the SHA-256 of each of its files; loading checks
them before anything is read, so flipped bytes, a swapped weights file or an edited `trainer_state.json`
are refused as damaged. A checkpoint written before manifests existed loads unchecked.
"""

from __future__ import annotations

import hashlib
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
MANIFEST = "MANIFEST.json"  # {"files": {relative path: {"sha256": hex, "bytes": n}}}
WEIGHTS_SUFFIX = ".safetensors"  # what `fingerprint` covers: the weights, not logs or optimizer state


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
        write_manifest(tmp)
        (tmp / COMPLETE_MARKER).write_text("ok\n")
        old = path.with_name(f".{path.name}.old")
        if path.exists() or path.is_symlink():
            _remove(old)  # a stray file or directory of that name never blocks a save
            path.rename(old)
        tmp.rename(path)
        _remove(old)
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
    if (path.exists() or path.is_symlink()) and not path.is_dir():
        _remove(path)  # a file where the checkpoint directory belongs: nothing to resume from
    temps = sorted(path.parent.glob(f".{path.name}.tmp-*"), key=lambda p: p.stat().st_mtime)
    old = path.with_name(f".{path.name}.old")
    if not path.exists():
        for candidate in [*reversed(temps), old]:  # the newest complete one
            if (candidate / COMPLETE_MARKER).is_file():
                candidate.rename(path)
                break
    for leftover in [*temps, old]:  # incomplete ones always; complete ones once `path` holds a checkpoint
        if path.exists() or not (leftover / COMPLETE_MARKER).is_file():
            _remove(leftover)


def _remove(path: Path) -> None:
    """Delete `path`, whatever it is (directory, file, link); absent is fine."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists() or path.is_symlink():
        path.unlink(missing_ok=True)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _payload(directory: Path) -> list[Path]:
    """The files a manifest covers: all of them but the manifest and the completion marker."""
    skip = {MANIFEST, COMPLETE_MARKER}
    return sorted(p for p in directory.rglob("*") if p.is_file() and p.name not in skip)


def write_manifest(directory: str | Path) -> None:
    directory = Path(directory)
    files = {
        str(f.relative_to(directory)): {"sha256": _sha256(f), "bytes": f.stat().st_size} for f in _payload(directory)
    }
    (directory / MANIFEST).write_text(json.dumps({"files": files}, indent=1, sort_keys=True))


def _manifest(path: Path) -> dict[str, dict] | None:
    """The checkpoint's manifest entries; None for a checkpoint written before manifests."""
    file = path / MANIFEST
    if not file.is_file():
        return None
    try:
        files = json.loads(file.read_text(encoding="utf-8"))["files"]
        assert isinstance(files, dict) and all(isinstance(v["sha256"], str) for v in files.values())
    except (ValueError, KeyError, TypeError, AssertionError):
        raise CheckpointError(f"{file} is damaged (not a manifest of file hashes)") from None
    return files


def verify(path: str | Path) -> None:
    """Check every file of a checkpoint against its manifest (CheckpointError naming the first mismatch);
    a file the manifest does not list that would be loaded (weights, pickles, JSON) is a mismatch too."""
    path = Path(path)
    files = _manifest(path)
    if files is None:
        return
    for name, want in sorted(files.items()):
        f = path / name
        if not f.is_file():
            raise CheckpointError(f"{path} is damaged: {name} is missing (listed in {MANIFEST})")
        if f.stat().st_size != want.get("bytes", f.stat().st_size) or _sha256(f) != want["sha256"]:
            raise CheckpointError(f"{path} is damaged: {name} does not match its hash in {MANIFEST}")
    for f in _payload(path):
        name = str(f.relative_to(path))
        if name not in files and f.suffix in (WEIGHTS_SUFFIX, ".pt", ".bin", ".json", ".pth"):
            raise CheckpointError(f"{path} is damaged: {name} is not listed in {MANIFEST}")


def fingerprint(path: str | Path) -> str:
    """16 hex digits identifying the weights a run starts from: the SHA-256 of each weights file (from the
    manifest, which loading verifies), so the same weights saved twice — a cold start retrained to identical
    tensors, whose log holds other timings — keep their fingerprint and a retrained cold start with other
    weights gets a new one. A checkpoint without a manifest (written before them) keeps its old fingerprint —
    names and sizes of its files and the bytes of its small JSON files — so runs already tracked from it keep
    resuming."""
    path = Path(path)
    files = _manifest(path)
    if files is not None:
        weights = sorted((k, v["sha256"]) for k, v in files.items() if k.endswith(WEIGHTS_SUFFIX))
        return hashlib.sha256(json.dumps(weights).encode()).hexdigest()[:16]
    h = hashlib.sha256()
    for f in sorted(p for p in Path(path).rglob("*") if p.is_file()):
        h.update(f"{f.relative_to(path)}:{f.stat().st_size};".encode())
        if f.suffix == ".json" and f.stat().st_size < 1 << 20:
            h.update(f.read_bytes())
    return h.hexdigest()[:16]


def is_complete(path: str | Path) -> bool:
    path = Path(path)
    return (path / COMPLETE_MARKER).is_file() or (
        (path / "config.json").is_file() and any(path.glob("*.safetensors")) and not (path / ".partial").exists()
    )


def load_pretrained(path: str | Path, dtype: torch.dtype = torch.float32, experts_implementation: str | None = None):
    """(model, tokenizer) from a local Qwen3-MoE directory; a clear error for anything else."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"model path not found: {path}")
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise CheckpointError(f"{path} is not a Hugging Face checkpoint (no config.json)")
    try:
        meta = json.loads(cfg_file.read_text(encoding="utf-8"))
    except ValueError:  # JSONDecodeError and UnicodeDecodeError
        raise CheckpointError(f"{cfg_file} is not valid UTF-8 JSON") from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"{cfg_file} must hold a JSON object, got a {type(meta).__name__}")
    model_type = meta.get("model_type")
    if model_type != "qwen3_moe":
        raise CheckpointError(
            f"{path} holds model_type {model_type!r}; a Qwen3-MoE checkpoint ('qwen3_moe') is required"
        )
    if not is_complete(path):
        raise CheckpointError(f"{path} is an incomplete checkpoint (no weights or completion marker)")
    verify(path)  # before anything is read
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
