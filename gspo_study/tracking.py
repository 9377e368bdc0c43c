"""MLflow tracking: opening a run's store, finding or creating its MLflow run, and how a killed run continues.

- Store, name and identity (tag `run_key`) come from the run's setup (`gspo_study.run.resolve_run`); the
  experiment is `tracking.experiment` (one per study).
- Resume without duplicates: every step's metrics go in one `log_batch` (one transaction); a resumed run
  first reads the last logged step and skips re-logging steps up to it (runs are deterministic, so the
  recomputed values equal the logged ones).
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import subprocess
import tempfile
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from filelock import FileLock

from gspo_study import provenance
from gspo_study.config import ConfigError
from gspo_study.run import RunSetup, sqlite_path

# every logged step has one of these (step 0 only the evaluation): their last step is the resume point
STEP_SENTINELS = ("rollout/reward/mean", "eval/pass@1")
# the metrics that read the machine (its clock, its memory), not the run: the only ones two runs of the same
# numbers may differ in (the trainer's compute_metrics logs them)
WALL_CLOCK = frozenset({"compute/seconds", "perf/tokens_per_s", "perf/peak_gpu_memory_gb"})
# MLflow metric names may not contain '@': `eval/pass@1` is stored as `eval/pass_at_1` (see docs/METRICS.md).
_MLFLOW_ESCAPES = (("@", "_at_"),)


def mlflow_key(name: str) -> str:
    """The MLflow name of a metric (`eval/pass@1` → `eval/pass_at_1`)."""
    for a, b in _MLFLOW_ESCAPES:
        name = name.replace(a, b)
    return name


def metric_name(key: str) -> str:
    """The suite's name of an MLflow metric (inverse of `mlflow_key`)."""
    for a, b in _MLFLOW_ESCAPES:
        key = key.replace(b, a)
    return key


def _device_and_precision(model) -> tuple[str, str]:
    """Where the run's parameters are and its forwards' precision, read off its model."""
    from gspo_study.runtime import device_text, precision_text

    if model is None:  # a run created without its model (no caller does): say so rather than guess
        return "unrecorded", "unrecorded"
    p = next(model.parameters())
    return device_text(p.device), precision_text(p.device, p.dtype)


def git_commit(short: bool = False) -> str:
    """The suite's checkout's commit (abbreviated with `short`), or "unknown" outside a git checkout."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", *(["--short"] if short else []), "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            cwd=Path(__file__).resolve().parent,
        )
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def quiet_store_logs() -> None:
    """Silence MLflow's store chatter: the schema-creation lines every new store prints ("Creating initial MLflow
    database tables...", alembic's migration steps) and the traceback the store logs before raising a database
    error (the exception still reaches the caller: the CLI says a full disk in one line, and shows a traceback
    for anything unexpected). Without it a one-line error on a fresh store arrives with MLflow's lines beside it."""
    import logging

    logging.getLogger("alembic").setLevel(logging.WARNING)
    logging.getLogger("mlflow.store.db.utils").setLevel(logging.CRITICAL)


def open_client(uri: str):
    """A client of the store at `uri`, quiet (`quiet_store_logs`); every part of the suite opens its clients here.
    Never `mlflow.set_tracking_uri`: it sets `$MLFLOW_TRACKING_URI` for the whole process, and every later run of
    the process without `tracking.uri` would log into this store, whatever its `results_dir` (`run.tracking_uri`
    reads the variable)."""
    from mlflow import MlflowClient

    quiet_store_logs()
    return MlflowClient(tracking_uri=uri)


def find_run(client, experiment_id: str, key: str):
    """The run tagged `run_key = key` in the experiment, or None."""
    found = client.search_runs([experiment_id], filter_string=f"tags.run_key = '{key}'", max_results=1)
    return found[0] if found else None


def artifact_location(uri: str) -> str | None:
    """Artifacts of a sqlite store live beside it (`<dir>/mlartifacts`), never in the working directory."""
    db = sqlite_path(uri)
    return None if db is None else (db.resolve().parent / "mlartifacts").as_uri()


# what MLflow offers to mark an experiment as model training, not GenAI (its UI also needs
# `workflowType=machine_learning` in the URL: gspo_study.mlflow_ui)
TRAINING_EXPERIMENT = {"mlflow.experimentKind": "custom_model_development"}


def _experiment_id(client, name: str, uri: str) -> str:
    exp = client.get_experiment_by_name(name)
    if exp is not None:
        if not TRAINING_EXPERIMENT.keys() <= exp.tags.keys():  # a store made before the kind was set
            _retry(client.set_experiment_tag, exp.experiment_id, *next(iter(TRAINING_EXPERIMENT.items())))
        return exp.experiment_id
    try:
        return client.create_experiment(name, artifact_location=artifact_location(uri), tags=TRAINING_EXPERIMENT)
    except Exception:  # noqa: BLE001 - a concurrent run may have created it first
        exp = client.get_experiment_by_name(name)
        if exp is None:
            raise
        return exp.experiment_id


def _probe_http(uri: str) -> None:
    import urllib.request

    with urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=5):
        pass


STORES_ALLOWED = (
    "sqlite:///<file>, http(s)://<server> or another store MLflow supports (tracking.uri or MLFLOW_TRACKING_URI)"
)


def checked_client(uri: str):
    """A client of the store at `uri`, its URI checked first (the analysis, which reads runs and logs its figures'
    runs there, and `mlflow-urls`): an unreachable server is a one-line ConfigError found in seconds (MLflow's own
    client retries one for minutes), and so is a URI MLflow cannot open. A training run opens its store with
    `_connect`, which also builds a new sqlite store atomically and the run's experiment."""
    if uri.startswith(("http://", "https://")):
        try:
            _probe_http(uri)
        except OSError as exc:
            raise ConfigError(
                f"MLflow tracking URI {uri!r} is unreachable ({type(exc).__name__}); allowed: {STORES_ALLOWED}"
            ) from None
    try:
        return open_client(uri)
    except Exception as exc:  # noqa: BLE001 - MLflow refuses an unknown scheme with several exception types
        raise ConfigError(
            f"MLflow tracking URI {uri!r} is not usable ({type(exc).__name__}); allowed: {STORES_ALLOWED}"
        ) from None


def _connect_once(uri: str, experiment: str):
    if uri.startswith(("http://", "https://")):
        _probe_http(uri)
    # Processes that open one new sqlite store at once each run MLflow's schema migrations, and concurrent
    # migrations leave it broken for good (duplicate columns, stray alembic temp tables); a lock file beside
    # the store lets one process create the schema while the others wait. The migration itself is not atomic
    # either (a kill mid-way leaves `_alembic_tmp_*` tables), so a new store is built under another name and
    # renamed into place complete (`_create_sqlite_store`).
    db = sqlite_path(uri)
    with FileLock(f"{db}.lock", timeout=300) if db is not None else nullcontext():
        if db is not None:
            _create_sqlite_store(db, uri)
        client = open_client(uri)
        return client, _experiment_id(client, experiment, uri)


def _create_sqlite_store(db: Path, uri: str) -> None:
    """Make `db` a complete MLflow store if it is not one yet, atomically: the schema is created in
    `<db>.tmp-<pid>` and renamed to `db`, so a kill at any moment leaves either no store or a whole one (and a
    temporary file, removed here next time). A store left half-migrated by an older version (an
    `_alembic_tmp_*` table) that holds no run is rebuilt; one that holds runs is a one-line error. Called under
    the store's lock."""
    import sqlite3

    for stale in db.parent.glob(f"{db.name}.tmp-*"):  # from a creator killed mid-way (we hold the lock)
        stale.unlink(missing_ok=True)
    if db.is_file() and db.stat().st_size > 0:
        with contextlib.closing(sqlite3.connect(db)) as con:
            tables = {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type='table'")}
            if not any(t.startswith("_alembic_tmp_") for t in tables):
                return
            runs = con.execute("SELECT COUNT(*) FROM runs").fetchone()[0] if "runs" in tables else 0
        if runs:
            raise ConfigError(
                f"MLflow store {db} is half-migrated (stray _alembic_tmp_ tables) and holds {runs} runs; "
                "restore it from a backup or run `mlflow db upgrade` on a copy"
            )
        db.unlink()
    tmp = db.with_name(f"{db.name}.tmp-{os.getpid()}")
    tmp.write_bytes(_empty_store())
    # the copy's Default experiment gets this store's artifact location, as MLflow sets it
    with contextlib.closing(sqlite3.connect(tmp)) as con:
        con.execute(
            "UPDATE experiments SET artifact_location = ? WHERE experiment_id = 0",
            (f"{artifact_location(uri)}/0",),
        )
        con.commit()
    os.replace(tmp, db)


@functools.cache
def _empty_store() -> bytes:
    """A new, empty MLflow sqlite store as bytes: MLflow's schema migrations (~2 s of CPU) run once per MLflow
    version on this machine (the result is kept in `_template_path()`), and every store is a copy of it (a test
    suite creates hundreds, most in processes of their own)."""
    import sqlite3

    cached = _template_path()
    try:  # a template cut short or not a store is rebuilt
        data = cached.read_bytes()
        with contextlib.closing(sqlite3.connect(f"{cached.as_uri()}?mode=ro", uri=True)) as con:
            if con.execute("SELECT version_num FROM alembic_version").fetchone():
                return data
    except (OSError, sqlite3.Error):
        pass
    data = _migrated_store()
    try:  # atomically: processes that build it at once each write their own and the last rename wins
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = cached.with_name(f"{cached.name}.tmp-{os.getpid()}")
        tmp.write_bytes(data)
        os.replace(tmp, cached)
    except OSError:  # a read-only or full cache: the next process migrates again
        pass
    return data


def _template_path() -> Path:
    """`$XDG_CACHE_HOME` (or ~/.cache) `/gspo_study/mlflow-<version>-empty.db`: keyed by MLflow's version, whose
    migrations define the schema (`mlflow.__version__`: the same whether `mlflow` or `mlflow-skinny` installed it)."""
    import mlflow

    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "gspo_study" / f"mlflow-{mlflow.__version__}-empty.db"


def _migrated_store() -> bytes:
    """A new store built by MLflow itself (its schema migrations), as bytes."""
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    quiet_store_logs()
    with tempfile.TemporaryDirectory() as scratch:
        db = Path(scratch) / "mlflow.db"
        SqlAlchemyStore(f"sqlite:///{db}", (Path(scratch) / "mlartifacts").as_uri()).engine.dispose()
        return db.read_bytes()


def _check_store(uri: str) -> None:
    """Fast one-line errors for a store that cannot work, before MLflow retries for minutes: a sqlite path that
    is a directory, in a missing or read-only directory, on a full disk, or a file that cannot be written."""
    if not uri.startswith("sqlite:"):
        return
    db = sqlite_path(uri)
    where = f"MLflow store {uri!r}"
    if db is None or db.is_dir() or str(db) in ("", ":memory:"):
        raise ConfigError(f"{where} is not a sqlite file; allowed: sqlite:///<path to a .db file>")
    above = db.parent
    while not above.exists() and above != above.parent:
        above = above.parent
    if not above.is_dir():
        raise ConfigError(f"{where}: {above} is not a directory; allowed: a path in a directory")
    try:
        db.parent.mkdir(parents=True, exist_ok=True)  # as MLflow itself would
        fd, probe = tempfile.mkstemp(prefix=f".{db.name}.probe-", dir=db.parent)  # sqlite writes a journal here
        os.close(fd)
        os.unlink(probe)
        if db.exists():
            os.close(os.open(db, os.O_WRONLY | os.O_APPEND))  # opened, not written
    except OSError as exc:
        raise ConfigError(f"{where} cannot be written ({exc.strerror}); allowed: a writable file") from None
    if shutil.disk_usage(db.parent).free < 16 << 20:
        raise ConfigError(f"{where}: less than 16 MiB free in {db.parent}; free some space")


def _connect(uri: str, experiment: str):
    """(client, experiment id); an unreachable store is a one-line ConfigError, found fast (no retry storm)."""
    _check_store(uri)
    attempts = 3 if uri.startswith("sqlite:") else 1  # a busy sqlite store may refuse a first connection
    for i in range(attempts):
        try:
            return _connect_once(uri, experiment)
        except ConfigError:
            raise
        except Exception as exc:  # noqa: BLE001 - mlflow and urllib raise many types for a bad store
            if i + 1 == attempts:
                raise ConfigError(
                    f"MLflow tracking URI {uri!r} is unreachable ({type(exc).__name__}); "
                    "set tracking.uri or MLFLOW_TRACKING_URI to a reachable store"
                ) from None
            time.sleep(0.5 * (i + 1))


def _retry(fn, *args, attempts: int = 8, **kwargs):
    """Call `fn`, retrying while a concurrent writer holds the sqlite lock (several runs, one store)."""
    for i in range(attempts):
        try:
            return fn(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001
            if "locked" not in str(exc).lower() or i == attempts - 1:
                raise
            time.sleep(0.05 * 2**i)


def _tracked(run: RunSetup, cache: dict):
    """(client, the run's MLflow run or None); one connection per (store, experiment) in `cache`."""
    where = (run.store, run.experiment)
    if where not in cache:
        cache[where] = _connect(*where)
    client, exp_id = cache[where]
    return client, find_run(client, exp_id, run.key)


def all_finished(runs: list[RunSetup]) -> bool:
    """Whether every run has a FINISHED MLflow run (e.g. imported ones): then a sweep has nothing to train, and
    needs no cold start either."""
    cache: dict = {}
    for run in runs:
        _, tracked = _tracked(run, cache)
        if tracked is None or tracked.info.status != "FINISHED":
            return False
    return True


@dataclass
class Tracker:
    """One MLflow run; metrics are logged one step per transaction."""

    client: Any
    run_id: str
    experiment_id: str
    logged_upto: int  # highest step already in the store (resume skips up to it)

    @classmethod
    def open(cls, run: RunSetup, create: bool = True, origin: str = "", model=None) -> Tracker | None:
        """This config's run (resume), else a new one — or None when `create` is False. `origin` is the
        fingerprint of the checkpoint the run starts from: a tracked run that started from another one (the
        cold start was retrained since) is not silently resumed or reused (ConfigError). `model`: the run's
        model, whose device and precision a new run's provenance tags record."""
        client, exp_id = _connect(run.store, run.experiment)
        tracked = find_run(client, exp_id, run.key)
        if tracked is not None:
            return cls._resume(client, exp_id, tracked, origin, run.store)
        return cls._create(client, exp_id, run, origin, model) if create else None

    @classmethod
    def _resume(cls, client, exp_id: str, run, origin: str, uri: str) -> Tracker:
        """The tracked run, marked RUNNING again, with the highest step it has logged."""
        was = run.data.tags.get("init_fingerprint")
        if origin and was and was != origin:
            raise ConfigError(
                f"MLflow run {run.info.run_name} ({run.info.run_id}) started from a different checkpoint "
                f"(fingerprint {was}, now {origin}): the cold start changed since; delete that run "
                f"(`MLFLOW_TRACKING_URI={uri} mlflow runs delete --run-id {run.info.run_id}`) or restore the "
                "checkpoint"
            )
        histories = [client.get_metric_history(run.info.run_id, mlflow_key(k)) for k in STEP_SENTINELS]
        upto = max((m.step for history in histories for m in history), default=-1)
        if run.info.status not in ("RUNNING", "FINISHED"):
            client.update_run(run.info.run_id, status="RUNNING")
        return cls(client, run.info.run_id, exp_id, upto)

    @classmethod
    def _create(cls, client, exp_id: str, me: RunSetup, origin: str, model) -> Tracker:
        """A new run: its tags (identity, provenance, the checkpoint it starts from) and its params."""
        tags = {**cls._tags(me, model), **({"init_fingerprint": origin} if origin else {})}
        shown = me.name if me.cfg.tracking.run_name else " ".join(filter(None, [me.name, me.variant]))
        run = _retry(client.create_run, exp_id, run_name=shown, tags=tags)
        cls._log_params(client, run.info.run_id, me.params)
        return cls(client, run.info.run_id, exp_id, -1)

    @staticmethod
    def _tags(me: RunSetup, model=None) -> dict[str, str]:
        cfg = me.cfg
        return {
            "run_key": me.key,
            "variant": me.variant,
            "git_commit": git_commit(),
            "algorithm": cfg.algo.objective,
            "routing_replay": cfg.algo.routing_replay,
            "seed": str(cfg.seed),
            "scale": cfg.scale,
            "old_logprobs": cfg.algo.old_logprobs,
            **provenance.tags(*_device_and_precision(model)),  # machine, libraries, device: another draw
            "mlflow.note.content": (
                f"{me.name}: {cfg.algo.objective}, replay {cfg.algo.routing_replay}, seed {cfg.seed}"
            ),
        }

    @staticmethod
    def _log_params(client, run_id: str, flat: dict[str, Any], skip=frozenset()) -> None:
        from mlflow.entities import Param

        params = [Param(k, str(v)[:6000]) for k, v in sorted(flat.items()) if k not in skip]
        for i in range(0, len(params), 100):
            _retry(client.log_batch, run_id, params=params[i : i + 100])

    def log_missing_params(self, run: RunSetup) -> None:
        """A run killed between its creation and its params gets them on resume — only the missing ones:
        MLflow refuses to change a logged value, and non-identity knobs such as threads may differ."""
        have = self.client.get_run(self.run_id).data.params.keys()
        self._log_params(self.client, self.run_id, run.params, skip=have)

    def finished(self) -> bool:
        return self.client.get_run(self.run_id).info.status == "FINISHED"

    def log_step(self, step: int, metrics: dict[str, float]) -> None:
        if step <= self.logged_upto:
            return
        from mlflow.entities import Metric

        ts = int(time.time() * 1000)
        batch = [Metric(mlflow_key(k), float(v), ts, step) for k, v in sorted(metrics.items())]
        for i in range(0, len(batch), 900):  # MLflow caps a batch at 1000 metrics
            _retry(self.client.log_batch, self.run_id, metrics=batch[i : i + 900])
        self.logged_upto = step

    def log_text(self, text: str, artifact_file: str) -> None:
        _retry(self.client.log_text, self.run_id, text, artifact_file)

    def set_status(self, status: str) -> None:
        _retry(self.client.set_terminated, self.run_id, status=status)


class NullTracker:
    """What ranks other than 0 log to: nothing (rank 0 holds the MLflow run)."""

    run_id = ""

    def log_step(self, step: int, metrics: dict[str, float]) -> None:
        pass

    def log_text(self, text: str, artifact_file: str) -> None:
        pass

    def set_status(self, status: str) -> None:
        pass
