"""A run resolved once from its config (`resolve_run` → `RunSetup`): who it is, where it lives, where it starts, where
it is tracked, and the lock one process holds while it trains it. The trainer, the cold-start SFT and the sweep
read these fields instead of deriving them again.

- Identity: a hash of the flattened config minus the fields that do not change its numbers (`run_key`, MLflow
  tag `run_key`): the same config finds the same run, so sweeps skip finished runs and resume the others.
- Name: `run_name` (`gspo-nr-s1`), and `variant`: what sets it apart from its scale's base config.
- Directory: `<results>/<scale>/runs/<name>-<key>`; an existing directory with the key wins (a renamed run).
- Start: `init_checkpoint`, else its model's cold start `<results>/<scale>/checkpoints/<coldstart_name>`.
- Store: `tracking.uri`, else `$MLFLOW_TRACKING_URI`, else `sqlite:///<results_dir>/mlflow.db`.
"""

from __future__ import annotations

import contextlib
import functools
import getpass
import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from filelock import FileLock, Timeout

from gspo_study.config import (
    PRESET_OVERRIDES,
    Config,
    ConfigError,
    coldstart_name,
    coldstart_overrides,
    declared,
    load_config,
    to_flat_dict,
)


def non_identity(schema: type = Config) -> tuple[str, ...]:
    """The fields (and sections, "tracking.") that name or place a run but never change its numbers: declared
    `knob(identity="never")` on the field."""
    return tuple(d.covers for d in declared(schema) if d.rules.identity == "never")


def later_knobs(schema: type = Config) -> dict[str, Any]:
    """Knob → the value at which it is left out of `run_key`: its default, for the knobs declared
    `knob(identity="later")` (added after runs were tracked, so those runs keep their identity)."""
    return {d.key: d.default for d in declared(schema) if d.rules.identity == "later"}


NON_IDENTITY = non_identity()
LATER_KNOBS = later_knobs()

# Values that give bit-identical numbers share a run's identity (tests/test_moe.py proves each pair equal). For
# grouped_mm that holds at 1 thread (a sweep's runs at JOBS=2); at more threads its backward is nondeterministic
# on CPU, so a grouped_mm run does not reproduce even itself (gspo_study.models.experts).
SAME_NUMBERS = {"model.experts_implementation": {"grouped_mm_index": "grouped_mm"}}
# what `run_name` already says, and where a run starts from (its fingerprint is a tag): not in `variant`
IN_NAME = (
    "seed",
    "algo.objective",
    "algo.routing_replay",
    "rollout.dtype",
    "algo.old_logprobs",
    "algo.rollout_correction",
    "init_checkpoint",
)


@dataclass(frozen=True)
class RunSetup:
    """A run resolved once (`resolve_run`): every part of the suite that names, finds, places, starts or stores a run
    reads these fields."""

    cfg: Config
    key: str  # `run_key`: the hash of what changes the run's numbers (MLflow tag run_key)
    name: str  # `run_name`, e.g. gspo-nr-s1
    dir: Path  # <results>/<scale>/runs/<name>-<key>; an existing directory with the key wins (a renamed run)
    coldstart: Path  # its model's cold start, <results>/<scale>/checkpoints/<coldstart_name> (what SFT writes)
    start: Path  # what RL starts from: init_checkpoint, else the cold start
    store: str  # the MLflow tracking URI
    params: dict[str, Any]  # the whole config, flat (`to_flat_dict`): the MLflow run's params

    @property
    def checkpoint(self) -> Path:
        return self.dir / "checkpoint"

    @property
    def experiment(self) -> str:
        return self.cfg.tracking.experiment

    @functools.cached_property
    def variant(self) -> str:
        """What sets the run apart from its scale's base config, e.g. "train.lr=4e-05" (`variant`); computed when
        first read (naming a new MLflow run), since it loads the base config."""
        return variant(self.cfg)


_DIRS: dict[str, Path] = {}


def resolve_run(cfg: Config) -> RunSetup:
    """The run's setup. Its run directory is looked up on disk once per distinct config in a process (a run
    renamed since keeps it); its store is read afresh (`$MLFLOW_TRACKING_URI` may change)."""
    store, name, key = tracking_uri(cfg), run_name(cfg), run_key(cfg)
    params = to_flat_dict(cfg)
    whole = json.dumps(params, sort_keys=True, default=str)
    if whole not in _DIRS:
        runs = cfg.out_dir / "runs"
        existing = sorted(runs.glob(f"*-{key}")) if runs.is_dir() else []
        _DIRS[whole] = existing[0] if existing else runs / f"{name}-{key}"
    coldstart = cfg.out_dir / "checkpoints" / coldstart_name(cfg)
    start = Path(cfg.init_checkpoint) if cfg.init_checkpoint else coldstart
    return RunSetup(cfg, key, name, _DIRS[whole], coldstart, start, store, params)


def tracking_uri(cfg: Config) -> str:
    """Where the run is tracked; nothing is created (the store's directory is made when it is opened)."""
    if cfg.tracking.uri:
        return cfg.tracking.uri
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return os.environ["MLFLOW_TRACKING_URI"]
    return f"sqlite:///{Path(cfg.results_dir).resolve() / 'mlflow.db'}"


def sqlite_path(uri: str) -> Path | None:
    """The file of a `sqlite:///<path>` store (as written, not resolved), or None for any other store."""
    return Path(uri.removeprefix("sqlite:///")) if uri.startswith("sqlite:///") else None


def identity(cfg: Config) -> dict[str, Any]:
    """Everything in the config that changes a run's numbers, flat."""
    flat = {k: v for k, v in to_flat_dict(cfg).items() if not k.startswith(NON_IDENTITY)}
    if cfg.seed == 1:  # seed 1's own cold start is the shared one (trained with seed 1): the same checkpoint
        flat["sft.per_seed"] = LATER_KNOBS["sft.per_seed"]
    flat = {k: v for k, v in flat.items() if not (k in LATER_KNOBS and v == LATER_KNOBS[k])}
    return {k: SAME_NUMBERS[k].get(v, v) if k in SAME_NUMBERS else v for k, v in flat.items()}


def run_key(cfg: Config) -> str:
    """12 hex digits of the hash of `identity(cfg)`."""
    return hashlib.sha256(json.dumps(identity(cfg), sort_keys=True, default=str).encode()).hexdigest()[:12]


def run_name(cfg: Config) -> str:
    """`<objective>-<replay>-s<seed>`, e.g. `gspo-nr-s1`, `grpo-r2-s3` (override with tracking.run_name)."""
    if cfg.tracking.run_name:
        return cfg.tracking.run_name
    from gspo_study.moe.modes import REPLAY_MODES

    parts = [cfg.algo.objective.replace("_", "-"), REPLAY_MODES[cfg.algo.routing_replay].abbrev]
    if cfg.rollout.dtype != "float32":
        parts.append(cfg.rollout.dtype.replace("bfloat16", "bf16"))
    if cfg.algo.old_logprobs == "rollout":
        parts.append("rolloutlp")
    if cfg.algo.rollout_correction != "none":  # e.g. grpo-r2-bf16-token-truncate-s1
        parts.append(cfg.algo.rollout_correction.replace("_", "-"))
    return "-".join([*parts, f"s{cfg.seed}"])


def variant(cfg: Config) -> str:
    """What sets a run apart from its scale's base config beyond what `run_name` says, e.g.
    `model.num_hidden_layers=16 train.lr=4e-05` for a figure-8 cell: added to the MLflow run name and tagged
    `variant`, so that runs of a sweep or an ablation sharing a name (`gspo-nr-s1`) tell apart."""
    from gspo_study.paths import scale_base

    try:
        base = identity(load_config(scale_base(cfg.scale)))
    except ConfigError:  # a scale without experiments/<scale>/base.yaml
        return ""
    mine = identity(cfg)
    keys = sorted(k for k in mine.keys() | base.keys() if k not in IN_NAME and mine.get(k) != base.get(k))
    return " ".join(f"{k}={_effective(cfg, k, mine.get(k))}" for k in keys)


def _effective(cfg: Config, key: str, value: Any) -> Any:
    """A preset override left unset (None) shown as the preset's own value."""
    field = key.removeprefix("model.")
    if value is None and field in PRESET_OVERRIDES and cfg.model.path is None:
        from gspo_study.models import PRESETS

        return PRESETS[cfg.model.preset][field]
    return value


# ------------------------------------------------------------------------------------------------ the lock
def lock_file(name: str) -> Path:
    """`<temp dir>/gspo_study-locks-<user>/<hash of name>.lock`: where the suite's OS file locks live (outside
    `results_dir`, which bad input must leave untouched)."""
    locks = Path(tempfile.gettempdir()) / f"gspo_study-locks-{getpass.getuser()}"  # per user: no shared modes
    locks.mkdir(exist_ok=True)
    return locks / f"{hashlib.sha256(name.encode()).hexdigest()[:16]}.lock"


def store_identity(run: RunSetup) -> str:
    """Where the run's MLflow run lives: its store (a sqlite path resolved, so two spellings of one file are one
    store), experiment and key — two processes with these equal would log into one MLflow run."""
    db = sqlite_path(run.store)
    uri = run.store if db is None else f"sqlite:///{db.resolve()}"
    return f"{uri}\n{run.experiment}\n{run.key}"


def _exclusive(name: str, stack: contextlib.ExitStack, busy: str) -> None:
    lock = FileLock(lock_file(name))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        raise ConfigError(f"{busy} (it holds {lock.lock_file}); wait for it to finish or stop it") from None
    stack.callback(lock.release)


@contextlib.contextmanager
def run_lock(run: RunSetup):
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
    check_writable(run)
    with contextlib.ExitStack() as stack:
        _exclusive(
            "store:" + store_identity(run),
            stack,
            f"run {run.dir.name} is being trained by another process into the same MLflow run (experiment "
            f"{run.experiment!r} in {run.store})",
        )
        _exclusive(
            f"dir:{run.cfg.out_dir.resolve()}:{run.key}",
            stack,
            f"run {run.dir.name} is being trained by another process into the same directory {run.dir}",
        )
        yield


MIN_FREE_BYTES = 64 << 20  # below this a checkpoint or a metric write can fail half-way


def check_writable(run: RunSetup) -> None:
    """A one-line ConfigError unless the run can create files under `<results>/<scale>/runs` (the nearest
    existing ancestor, probed with a real file: read-only, immutable and permission-less directories all fail
    it) with room for three copies of its start checkpoint (its run checkpoint, a save's temporary copy and
    the optimizer state) plus MIN_FREE_BYTES. The MLflow store is checked when it is opened
    (`tracking._connect`)."""
    need = MIN_FREE_BYTES + 3 * sum(f.stat().st_size for f in run.start.rglob("*") if f.is_file())
    probe_directory(run.cfg.out_dir / "runs", need, "results_dir", run.cfg.results_dir)


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


# ------------------------------------------------------------------------------------------------ its start
def require_model_path(cfg: Config) -> None:
    """A `model.path` that is not a directory is a one-line error before anything is tracked or trained."""
    path = cfg.model.path
    if path is not None and not Path(path).expanduser().is_dir():
        raise ConfigError(
            f"bad value {path!r} for 'model.path': no such directory; allowed: a local Hugging Face Qwen3-MoE "
            "checkpoint directory, or null (the preset, model.preset)"
        )


def check_start(run: RunSetup) -> str:
    """Before the run is tracked: its model path, its start (unless it has a checkpoint to resume) and its device
    are refused in one line when they cannot work. Returns the start's fingerprint ("" for a start that is not a
    directory): a tracked run that started from another checkpoint is not silently resumed."""
    from gspo_study.models.checkpoint import fingerprint  # torch and transformers: not for what only names runs
    from gspo_study.runtime import training_device

    require_model_path(run.cfg)
    if not run.checkpoint.exists():
        require_start(run)  # a missing cold start writes nothing
    training_device(run.cfg)  # a CUDA device torch does not see
    return fingerprint(run.start) if run.start.is_dir() else ""


def require_start(run: RunSetup) -> Path:
    """The run's initial checkpoint; a one-line error naming the command that makes it when it is missing."""
    if not run.start.exists():
        shape = " ".join(coldstart_overrides(run.cfg))
        raise ConfigError(
            f"initial checkpoint not found: {run.start}; run `make coldstart SCALE={run.cfg.scale}"
            + (f" OVERRIDES='{shape}'" if shape else "")
            + "` or set init_checkpoint"
        )
    return run.start
