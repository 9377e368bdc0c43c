"""Run checkpoints: model + tokenizer (safetensors), optimizer state, and the loop's counters.

Written atomically by `models.checkpoint.save_pretrained` (temporary directory, then rename); a checkpoint
with non-finite weights is never written. Loading never unpickles arbitrary objects: weights come from
safetensors and the optimizer state through `torch.load(weights_only=True)`. A partial or corrupt
checkpoint is skipped with a warning and the run restarts from its initial checkpoint.
"""

from __future__ import annotations

import json
import math
import shutil
import warnings
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
from omegaconf import OmegaConf

from gspo_study.config import PRESET_OVERRIDES, Config, ConfigError
from gspo_study.models import finish_interrupted_save, load_pretrained, save_pretrained
from gspo_study.models.checkpoint import CheckpointError
from gspo_study.run import RunSetup, require_start
from gspo_study.runtime import DTYPES, place
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


def settle_interrupted_save(run: RunSetup) -> None:
    """Before anyone reads the run's checkpoint: rank 0, holding the run lock, finishes or clears what a killed
    save left (`finish_interrupted_save`); the other ranks of a DeepSpeed job wait for it at a barrier."""
    rank, world = init_distributed() if run.cfg.train.backend == "deepspeed" else (0, 1)
    if rank == 0:
        finish_interrupted_save(run.checkpoint)
    if world > 1:
        torch.distributed.barrier()


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


def load_run_checkpoint(run: RunSetup, mlflow_run_id: str | None, logged_upto: int | None = None):
    """(model, tokenizer, RunState, optimizer state or None): the run's last checkpoint, else its start.

    A checkpoint is resumed only by the MLflow run that wrote it (`mlflow_run_id`; None for a run not yet
    tracked): resuming another store's checkpoint would leave this run's early steps unlogged. It is saved
    after its step is logged, so a checkpoint ahead of the store's last logged step (`logged_upto`) did not
    come from this run's history and is not resumed either (its steps would never be logged). A checkpoint
    that fails its manifest, holds non-finite weights or a malformed state is skipped as damaged.
    """
    ckpt = run.checkpoint
    if ckpt.exists():
        try:
            model, tokenizer, state, optim = _resume(run.cfg, ckpt)
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
    model, tokenizer = _load_model(run.cfg, require_start(run))
    return model, tokenizer, RunState(), None


def save_run_checkpoint(ctx) -> Path:
    """Rank 0 writes; under ZeRO-3 every rank first joins in gathering the full weights (layer by layer)."""
    path, zero = ctx.run.checkpoint, ctx.run.dir / "zero"
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
