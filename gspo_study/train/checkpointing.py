"""Run checkpoints: model + tokenizer (safetensors), optimizer state, and the loop's counters.

Written atomically by `models.checkpoint.save_pretrained` (temporary directory, then rename); a checkpoint
with non-finite weights is never written. Loading never unpickles arbitrary objects: weights come from
safetensors and the optimizer state through `torch.load(weights_only=True)`. A partial or corrupt
checkpoint is skipped with a warning and the run restarts from its initial checkpoint.
"""

from __future__ import annotations

import contextlib
import getpass
import hashlib
import json
import math
import os
import shutil
import tempfile
import warnings
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
from filelock import FileLock, Timeout
from omegaconf import OmegaConf

from gspo_study.config import PRESET_OVERRIDES, Config, ConfigError, coldstart_name
from gspo_study.models import finish_interrupted_save, load_pretrained, save_pretrained
from gspo_study.models.checkpoint import CheckpointError
from gspo_study.runtime import DTYPES, place
from gspo_study.tracking import run_identity, run_key, sqlite_path, tracking_uri
from gspo_study.train.dist import init_distributed
from gspo_study.train.lag import SNAPSHOTS

RUN_CONFIG = "run_config.json"  # the run's whole config, in each run checkpoint (JSON is YAML: a config file)


@dataclass
class RunState:
    step: int = 0  # RL steps completed
    flops: float = 0.0  # cumulative estimated training FLOPs
    seconds: float = 0.0  # cumulative training wall seconds
    nonfinite_streak: int = 0  # consecutive skipped updates
    nonfinite_total: int = 0  # skipped updates so far
    mlflow_run_id: str = ""
    zero_tag: str = ""  # deepspeed: the ZeRO checkpoint (<run dir>/zero/<tag>) saved with this state

    def note_update(self, grad_norm: float) -> None:
        if math.isfinite(grad_norm):
            self.nonfinite_streak = 0
        else:
            self.nonfinite_streak += 1
            self.nonfinite_total += 1


def run_dir(cfg: Config) -> Path:
    """`<results>/<scale>/runs/<run name>-<run key>`; a run renamed since (same key) keeps its directory."""
    return run_identity(cfg).dir


def store_identity(cfg: Config) -> str:
    """Where the run's MLflow run lives: its store (a sqlite path resolved, so two spellings of one file are one
    store), experiment and `run_key` — two processes with these equal would log into one MLflow run."""
    uri = tracking_uri(cfg)
    db = sqlite_path(uri)
    uri = uri if db is None else f"sqlite:///{db.resolve()}"
    return f"{uri}\n{cfg.tracking.experiment}\n{run_key(cfg)}"


def lock_file(name: str) -> Path:
    """`<temp dir>/gspo_study-locks-<user>/<hash of name>.lock`: where the suite's OS file locks live (outside
    `results_dir`, which bad input must leave untouched)."""
    locks = Path(tempfile.gettempdir()) / f"gspo_study-locks-{getpass.getuser()}"  # per user: no shared modes
    locks.mkdir(exist_ok=True)
    return locks / f"{hashlib.sha256(name.encode()).hexdigest()[:16]}.lock"


def _exclusive(name: str, stack: contextlib.ExitStack, busy: str) -> None:
    lock = FileLock(lock_file(name))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        raise ConfigError(f"{busy} (it holds {lock.lock_file}); wait for it to finish or stop it") from None
    stack.callback(lock.release)


@contextlib.contextmanager
def run_lock(cfg: Config):
    """Held while a process trains this run (rank 0 of a distributed job; the other ranks follow it): a second
    process on the same run is refused instead of logging every step twice and overwriting its checkpoints.
    Two OS file locks, so a killed process releases them: one on the run's identity in its MLflow store
    (`store_identity`: the same run from two results dirs would log every step twice into one MLflow run), one
    on its checkpoint directory (the same run into two stores would overwrite one checkpoint). The files are
    in `<temp dir>/gspo_study-locks-<user>/`, named by hashes, because bad input must write nothing under
    `results_dir`. Taking them, rank 0 first checks that it can write the results and the store
    (`check_writable`): a read-only or full disk stops here, before the run is tracked."""
    if int(os.environ.get("RANK", "0")) != 0:
        yield
        return
    check_writable(cfg)
    name = run_dir(cfg).name
    with contextlib.ExitStack() as stack:
        _exclusive(
            "store:" + store_identity(cfg),
            stack,
            f"run {name} is being trained by another process into the same MLflow run (experiment "
            f"{cfg.tracking.experiment!r} in {tracking_uri(cfg)})",
        )
        _exclusive(
            f"dir:{cfg.out_dir.resolve()}:{run_key(cfg)}",
            stack,
            f"run {name} is being trained by another process into the same directory {run_dir(cfg)}",
        )
        yield


MIN_FREE_BYTES = 64 << 20  # below this a checkpoint or a metric write can fail half-way


def check_writable(cfg: Config) -> None:
    """A one-line ConfigError unless the run can create files under `<results>/<scale>/runs` (the nearest
    existing ancestor, probed with a real file: read-only, immutable and permission-less directories all fail
    it) with room for three copies of its start checkpoint (its run checkpoint, a save's temporary copy and
    the optimizer state) plus MIN_FREE_BYTES. The MLflow store is checked when it is opened
    (`tracking._connect`)."""
    target = cfg.out_dir / "runs"
    start = init_checkpoint(cfg)
    need = MIN_FREE_BYTES + 3 * sum(f.stat().st_size for f in start.rglob("*") if f.is_file())
    probe_directory(target, need, "results_dir", cfg.results_dir)


def probe_directory(target: Path, need: int, key: str, value: str) -> None:
    """Raise ConfigError unless a file can be created in `target` (or its nearest existing ancestor, where
    `target` would be created) and `need` bytes are free there."""
    where = target
    while not where.exists() and where != where.parent:
        where = where.parent
    if not where.is_dir():
        raise ConfigError(f"bad value {value!r} for '{key}': {where} is not a directory; allowed: a directory")
    try:
        fd, probe = tempfile.mkstemp(prefix=".gspo_study-probe-", dir=where)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise ConfigError(
            f"bad value {value!r} for '{key}': cannot write in {where} ({exc.strerror}); allowed: a writable directory"
        ) from None
    free = shutil.disk_usage(where).free
    if free < need:
        raise ConfigError(
            f"bad value {value!r} for '{key}': {where} has {free >> 20} MiB free, this needs {need >> 20} MiB; "
            "allowed: a directory with room"
        )


def settle_interrupted_save(cfg: Config) -> None:
    """Before anyone reads the run's checkpoint: rank 0, holding the run lock, finishes or clears what a killed
    save left (`finish_interrupted_save`); the other ranks of a DeepSpeed job wait for it at a barrier."""
    rank, world = init_distributed() if cfg.train.backend == "deepspeed" else (0, 1)
    if rank == 0:
        finish_interrupted_save(run_dir(cfg) / "checkpoint")
    if world > 1:
        torch.distributed.barrier()


def init_checkpoint(cfg: Config) -> Path:
    return Path(cfg.init_checkpoint) if cfg.init_checkpoint else cfg.out_dir / "checkpoints" / coldstart_name(cfg)


def require_model_path(cfg: Config) -> None:
    """A `model.path` that is not a directory is a one-line error before anything is tracked or trained."""
    path = cfg.model.path
    if path is not None and not Path(path).expanduser().is_dir():
        raise ConfigError(
            f"bad value {path!r} for 'model.path': no such directory; allowed: a local Hugging Face Qwen3-MoE "
            "checkpoint directory, or null (the preset, model.preset)"
        )


def require_start(cfg: Config) -> Path:
    """The run's initial checkpoint; a one-line error naming the command that makes it when it is missing."""
    start = init_checkpoint(cfg)
    if not start.exists():
        from gspo_study.config import coldstart_overrides

        shape = " ".join(coldstart_overrides(cfg))
        raise ConfigError(
            f"initial checkpoint not found: {start}; run `make coldstart SCALE={cfg.scale}"
            + (f" OVERRIDES='{shape}'" if shape else "")
            + "` or set init_checkpoint"
        )
    return start


def _load_model(cfg: Config, path: Path):
    model, tokenizer = load_pretrained(
        path, dtype=DTYPES[cfg.model.dtype], experts_implementation=cfg.model.experts_implementation
    )
    check_shape(cfg, model, path)
    return place(cfg, model), tokenizer  # on train.device (torch backend), before the optimizer state is loaded


def check_shape(cfg: Config, model, path: Path) -> None:
    """The config must describe the model it trains: a preset override (`model.num_hidden_layers=4`) the
    checkpoint does not have would be recorded in MLflow but never trained, and rollouts longer than the
    model's positions cannot be generated."""
    for key in PRESET_OVERRIDES:
        want, have = getattr(cfg.model, key), getattr(model.config, key, None)
        if want is not None and have != want:
            raise ConfigError(
                f"model.{key}={want} but checkpoint {path} has {key}={have}; allowed: the checkpoint's own "
                f"value (drop the override) or a checkpoint of that shape"
            )
    limit = model.config.max_position_embeddings
    if cfg.rollout.max_new_tokens >= limit:
        raise ConfigError(
            f"bad value {cfg.rollout.max_new_tokens} for 'rollout.max_new_tokens'; allowed: fewer than the "
            f"model's {limit} positions (max_position_embeddings of {path}), prompt included"
        )


def _state(data: object) -> RunState:
    """A RunState from trainer_state.json, every field of its declared type (a string step is damage)."""
    if not isinstance(data, dict):
        raise ValueError(f"trainer state is a {type(data).__name__}, not an object")
    out = RunState()
    unknown = set(data) - {f.name for f in fields(RunState)}
    if unknown:
        raise ValueError(f"trainer state has unknown fields {sorted(unknown)}")
    for f in fields(RunState):
        if f.name not in data:  # a field added since this checkpoint was written: its default
            continue
        v, kind = data[f.name], type(getattr(out, f.name))
        ok = isinstance(v, kind) and not isinstance(v, bool) or kind is float and isinstance(v, int)
        if not ok or (kind is not str and v < 0):
            raise ValueError(f"trainer state {f.name}={v!r} is not a non-negative {kind.__name__}")
        setattr(out, f.name, kind(v))
    return out


def _resume(cfg: Config, path: Path):
    model, tokenizer = _load_model(cfg, path)  # verified against its manifest first
    if not all(torch.isfinite(p).all() for p in model.parameters()):
        raise CheckpointError(f"{path} has non-finite weights")
    state = _state(json.loads((path / "trainer_state.json").read_text()))
    if state.step > cfg.train.steps:
        raise ValueError(f"its step {state.step} is beyond train.steps={cfg.train.steps}")
    optim_file = path / "optimizer.pt"
    optim = (
        torch.load(optim_file, map_location="cpu", weights_only=True)
        if optim_file.exists() or cfg.train.backend == "torch"
        else None
    )
    return model, tokenizer, state, optim


def load_run_checkpoint(cfg: Config, mlflow_run_id: str | None, logged_upto: int | None = None):
    """(model, tokenizer, RunState, optimizer state or None): the run's last checkpoint, else its start.

    A checkpoint is resumed only by the MLflow run that wrote it (`mlflow_run_id`; None for a run not yet
    tracked): resuming another store's checkpoint would leave this run's early steps unlogged. It is saved
    after its step is logged, so a checkpoint ahead of the store's last logged step (`logged_upto`) did not
    come from this run's history and is not resumed either (its steps would never be logged). A checkpoint
    that fails its manifest, holds non-finite weights or a malformed state is skipped as damaged.
    """
    ckpt = run_dir(cfg) / "checkpoint"
    if ckpt.exists():
        try:
            model, tokenizer, state, optim = _resume(cfg, ckpt)
            if state.mlflow_run_id != mlflow_run_id:
                why = f"belongs to MLflow run {state.mlflow_run_id!r}, not to this store's run {mlflow_run_id!r}"
            elif logged_upto is not None and state.step > logged_upto:
                why = f"is at step {state.step}, beyond its MLflow run's last logged step {logged_upto}"
            else:
                return model, tokenizer, state, optim
            warnings.warn(f"checkpoint {ckpt} {why}; starting over", stacklevel=2)
        except ConfigError:
            raise
        except Exception as exc:  # noqa: BLE001 - any unreadable checkpoint is skipped, never half-loaded
            warnings.warn(
                f"skipping unreadable checkpoint {ckpt} ({type(exc).__name__}: {exc}); starting over",
                stacklevel=2,
            )
    start = require_start(cfg)
    model, tokenizer = _load_model(cfg, start)
    return model, tokenizer, RunState(), None


def save_run_checkpoint(ctx) -> Path:
    """Rank 0 writes; under ZeRO-3 every rank first joins in gathering the full weights (layer by layer)."""
    path = run_dir(ctx.cfg) / "checkpoint"
    zero = run_dir(ctx.cfg) / "zero"
    ctx.state.mlflow_run_id = ctx.tracker.run_id
    if hasattr(ctx.backend, "save_sharded"):  # every rank writes its ZeRO partition first, under a new tag
        ctx.state.zero_tag = f"step{ctx.state.step:08d}"
        ctx.backend.save_sharded(zero, ctx.state.zero_tag)
    optim = ctx.backend.state_dict()
    extra = {
        "trainer_state.json": asdict(ctx.state),
        RUN_CONFIG: OmegaConf.to_container(OmegaConf.structured(ctx.cfg)),  # what `eval --checkpoint` reads
        **({"optimizer.pt": optim} if optim is not None else {}),
        **({SNAPSHOTS: ctx.lag.save} if getattr(ctx, "lag", None) is not None else {}),  # stale policies
    }
    # ZeRO-3: the whole weights, gathered layer by layer onto rank 0's CPU (a collective: every rank joins)
    full = ctx.backend.full_state_dict() if hasattr(ctx.backend, "full_state_dict") else None
    if ctx.rank == 0:  # atomic: the commit point
        save_pretrained(ctx.model, ctx.tokenizer, path, extra=extra, state_dict=full)
    if ctx.world > 1:
        torch.distributed.barrier()  # nobody deletes or resumes before the commit
    if ctx.rank == 0 and ctx.state.zero_tag:  # older tags are no longer referenced
        for old in zero.iterdir():
            if old.name != ctx.state.zero_tag and old.is_dir():
                shutil.rmtree(old, ignore_errors=True)
    return path
