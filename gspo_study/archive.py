"""The study's runs in one file: `results/<scale>/study-runs.parquet`, written from and loaded into any MLflow store.

    python -m gspo_study export-study --scale cpu [--seeds 1,2,3] [--figures 1,2] [--out FILE] [key=value ...]
    python -m gspo_study import-study --scale cpu [--file FILE] [key=value ...]

Export takes every training run that the scale's figures (experiments/figures.yaml, sweeps included) and
therefore the report draw from — each must have finished — and writes one row per run: experiment, source run
id, run name, status, start and end time, params, tags and every metric's full history (key, step, timestamp,
value; float64, so values come back bit for bit). Rows, params, tags and metrics are sorted, so exporting the
same runs twice writes the same bytes. Analysis runs (`figure-N`, `report`) and artifacts (sample completions)
are left out: the figures and the report are redrawn from the runs.

Import loads the rows into the store the config points at (`tracking.uri`, else `$MLFLOW_TRACKING_URI`, else
`sqlite:///<results_dir>/mlflow.db`), in the config's experiment, keeping tags — `run_key` and
`init_fingerprint` included, so the figures find the runs and the sweep sees them finished — and adding
`archive.source_run_id` (the shipped run's id; MLflow gives the copy a new one). It is idempotent: a run whose
`run_key` is already in the experiment is kept as it is (an import killed half-way leaves its run RUNNING,
and that one is replaced).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from gspo_study.config import Config, ConfigError, load_config
from gspo_study.run import resolve_run, run_key, tracking_uri
from gspo_study.tracking import _connect, _retry, _tracked, find_run

ARCHIVE = "study-runs.parquet"
SOURCE = "archive.source_run_id"  # the id of the run as shipped (an imported run's copy gets a new id)
PARAM_BATCH, METRIC_BATCH = 100, 900  # MLflow caps a log_batch at 100 params / 1000 metrics


def _schema():
    import pyarrow as pa

    metric = pa.struct([("key", pa.string()), ("step", pa.int64()), ("timestamp", pa.int64()), ("value", pa.float64())])
    return pa.schema(
        [
            ("experiment", pa.string()),
            ("run_id", pa.string()),
            ("run_name", pa.string()),
            ("status", pa.string()),
            ("start_time", pa.int64()),
            ("end_time", pa.int64()),
            ("params", pa.map_(pa.string(), pa.string())),
            ("tags", pa.map_(pa.string(), pa.string())),
            ("metrics", pa.list_(metric)),
        ]
    )


def archive_path(scale: str, overrides: tuple[str, ...] = ()) -> Path:
    """`<results_dir>/<scale>/study-runs.parquet`: where the scale's study is shipped."""
    return _base(scale, overrides).out_dir / ARCHIVE


def _base(scale: str, overrides: tuple[str, ...]) -> Config:
    from gspo_study.study import scale_base

    return load_config(scale_base(scale), list(overrides))


def study_configs(
    scale: str, seeds: list[int] | None, overrides: tuple[str, ...] = (), figures: list[int] | None = None
) -> list[tuple[str, Config]]:
    """(run file, config) of every distinct run the scale's figures use (a run shared by figures once), at `seeds`
    (None: each figure's own seeds, `study.parse_seeds`)."""
    from gspo_study.study import figure_configs, parse_seeds
    from gspo_study.study import figures as all_figures

    names = [int(k.removeprefix("figure-")) for k in all_figures()] if figures is None else figures
    out: dict[str, tuple[str, Config]] = {}
    for figure in names:
        at = seeds if seeds is not None else parse_seeds(None, scale, figure)
        for run, cfg in figure_configs(figure, scale, at, overrides):
            out.setdefault(run_key(cfg), (run, cfg))
    return list(out.values())


# ------------------------------------------------------------------------------------------------ lookups
# ------------------------------------------------------------------------------------------------ export
def _row(client, run) -> dict:
    metrics = []
    for key in run.data.metrics:
        metrics += [(m.key, m.step, m.timestamp, m.value) for m in client.get_metric_history(run.info.run_id, key)]
    tags = dict(run.data.tags)
    return {
        "experiment": client.get_experiment(run.info.experiment_id).name,
        "run_id": tags.pop(SOURCE, run.info.run_id),  # a run imported before keeps its shipped id
        "run_name": run.info.run_name,
        "status": run.info.status,
        "start_time": run.info.start_time,
        "end_time": run.info.end_time,
        "params": sorted(run.data.params.items()),
        "tags": sorted(tags.items()),
        "metrics": [dict(zip(("key", "step", "timestamp", "value"), m)) for m in sorted(metrics)],
    }


def export_study(
    scale: str,
    seeds: list[int] | None,
    overrides: tuple[str, ...] = (),
    figures: list[int] | None = None,
    out: Path | None = None,
    partial: bool = False,
    add: bool = False,
) -> tuple[Path, int, list[str]]:
    """Write the scale's runs to `out` (default `archive_path`); every one must have finished, or with `partial`
    the finished ones are written (a partly trained sweep, shipped as such). With `add`, the archive already at `out`
    keeps every run these do not replace (a stage trained in another store, added to the shipped study). Returns
    (path, number of runs written, the runs left out)."""
    from gspo_study.train.sizes import check_export

    cache: dict = {}
    rows, missing = [], []
    configs = study_configs(scale, seeds, overrides, figures)
    check_export([cfg for _, cfg in configs])  # before any history is read
    for name, cfg in configs:
        me = resolve_run(cfg)
        client, run = _tracked(me, cache)
        if run is None or run.info.status != "FINISHED":
            missing.append(f"{name} seed {cfg.seed} {me.variant}".strip())
            continue
        rows.append(_row(client, run))
    if missing and not partial:
        shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        raise ConfigError(
            f"export-study: {len(missing)} run(s) of scale {scale!r} not finished in {me.store}: {shown}; "
            f"train them first (make reproduce-figure-N SCALE={scale}), or ship the finished ones (--partial)"
        )
    path = Path(out) if out else archive_path(scale, overrides)
    if add and path.is_file():
        mine = {dict(r["tags"])["run_key"] for r in rows}
        rows += [r for r in read_archive(path) if r["tags"].get("run_key") not in mine]
    write_archive(rows, path)
    return path, len(rows), missing


def write_archive(rows: list[dict], path: Path) -> None:
    """Rows (as `read_archive` gives them) to `path`, sorted, atomically (a killed export leaves the old file)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{**r, "params": sorted(dict(r["params"]).items()), "tags": sorted(dict(r["tags"]).items())} for r in rows]
    rows.sort(key=lambda r: (r["experiment"], r["run_name"], dict(r["tags"]).get("run_key", "")))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        pq.write_table(pa.Table.from_pylist(rows, schema=_schema()), tmp, compression="zstd", compression_level=19)
        tmp.replace(path)
    finally:  # a write that failed part-way (disk full) leaves neither a partial file nor the old one damaged
        tmp.unlink(missing_ok=True)


# ------------------------------------------------------------------------------------------------ import
def read_archive(path: Path) -> list[dict]:
    """The archive's rows (params and tags as dicts), or a one-line error naming the file."""
    import pyarrow.parquet as pq

    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"no study archive at {path}; allowed: a file written by `make export-study`")
    try:
        meta = pq.ParquetFile(path).metadata
    except Exception as exc:  # noqa: BLE001 - pyarrow raises several types for a damaged file
        raise ConfigError(f"study archive {path} is not readable Parquet ({type(exc).__name__}: {exc})") from None
    from gspo_study.train.sizes import check_archive

    size = sum(meta.row_group(i).total_byte_size for i in range(meta.num_row_groups))
    check_archive(path, meta.num_rows, size)  # from its footer, before a row is read
    try:
        table = pq.read_table(path)
    except Exception as exc:  # noqa: BLE001 - pyarrow raises several types for a damaged file
        raise ConfigError(f"study archive {path} is not readable Parquet ({type(exc).__name__}: {exc})") from None
    if table.schema.names != _schema().names:
        raise ConfigError(f"study archive {path} has columns {table.schema.names}; allowed: {_schema().names}")
    rows = table.to_pylist()
    for r in rows:
        r["params"], r["tags"] = dict(r["params"]), dict(r["tags"])
    return rows


def shipped_tags(path: Path) -> dict[str, dict[str, str]]:
    """run_key → tags (with `archive.source_run_id`) of the runs in an archive; {} when there is none."""
    if not Path(path).is_file():
        return {}
    return {
        r["tags"]["run_key"]: {**r["tags"], SOURCE: r["run_id"]} for r in read_archive(path) if "run_key" in r["tags"]
    }


def draw_notice(out_dir: Path, used: dict[str, dict[str, str]], what: str) -> str | None:
    """One line when the runs `what` draws on (run_key → tags) are another draw than the study shipped in
    `<out_dir>/study-runs.parquet` (gspo_study.provenance.draw_notice); None when the same, or none shipped."""
    from gspo_study.provenance import draw_notice as notice

    return notice(used, shipped_tags(Path(out_dir) / ARCHIVE), what)


@dataclass
class Imported:
    added: int = 0  # runs written
    present: int = 0  # the shipped run was already there
    kept: int = 0  # another run with the same run_key was there (trained here): left as it is


def import_study(
    scale: str, overrides: tuple[str, ...] = (), path: Path | None = None, figures: list[int] | None = None
) -> tuple[Imported, str]:
    """Load an archive (default `archive_path`) into the config's store, or with `figures` only the runs those
    figures draw (at their own seeds: what `make reproduce-figure-N` needs to redraw N); returns (counts, store URI)."""
    rows = read_archive(Path(path) if path else archive_path(scale, overrides))
    if figures is not None:
        wanted = {run_key(cfg) for _, cfg in study_configs(scale, None, overrides, figures)}
        rows = [r for r in rows if r["tags"].get("run_key") in wanted]
    cfg = _base(scale, overrides)
    uri = tracking_uri(cfg)
    client, exp_id = _connect(uri, cfg.tracking.experiment)
    done = Imported()
    for row in rows:
        key = row["tags"].get("run_key")
        if key is None:
            raise ConfigError(f"study archive run {row['run_id']} has no run_key tag; allowed: training runs")
        found = find_run(client, exp_id, key)
        if found is not None and found.data.tags.get(SOURCE) == row["run_id"] and found.info.status == "RUNNING":
            client.delete_run(found.info.run_id)  # an import killed half-way: write it again
            found = None
        if found is not None:
            same = found.data.tags.get(SOURCE, found.info.run_id) == row["run_id"]
            done.present += same
            done.kept += not same
            continue
        _write(client, exp_id, row)
        done.added += 1
    return done, uri


def _write(client, exp_id: str, row: dict) -> None:
    from mlflow.entities import Metric, Param

    tags = {**row["tags"], SOURCE: row["run_id"]}
    run = _retry(client.create_run, exp_id, start_time=row["start_time"], tags=tags, run_name=row["run_name"])
    rid = run.info.run_id
    params = [Param(k, v) for k, v in row["params"].items()]
    for i in range(0, len(params), PARAM_BATCH):
        _retry(client.log_batch, rid, params=params[i : i + PARAM_BATCH])
    store = getattr(getattr(client, "_tracking_client", None), "store", None)
    if type(store).__name__ == "SqlAlchemyStore":  # a local database: the history in one transaction
        _retry(_bulk_metrics, store, rid, row["metrics"])
    else:  # a tracking server: its REST API, in MLflow's batches
        metrics = [Metric(m["key"], m["value"], m["timestamp"], m["step"]) for m in row["metrics"]]
        for i in range(0, len(metrics), METRIC_BATCH):
            _retry(client.log_batch, rid, metrics=metrics[i : i + METRIC_BATCH])
    _retry(client.set_terminated, rid, status=row["status"], end_time=row["end_time"])


def _bulk_metrics(store, run_id: str, metrics: list[dict]) -> None:
    """A run's whole metric history into a SQL store in one transaction, row for row what `log_batch` writes (the
    same values after MLflow's own NaN / ±inf sanitising, duplicates dropped, and per key the latest value by
    (step, timestamp, value), MLflow's rule) — without `log_batch`'s per-batch latest-value queries, which made an
    import of the shipped study take 15 minutes."""
    import sqlalchemy
    from mlflow.store.tracking.dbmodels.models import SqlLatestMetric, SqlMetric

    rows, latest, seen = [], {}, set()
    for m in metrics:
        is_nan, value = store.sanitize_metric_value(float(m["value"]))
        r = dict(
            run_uuid=run_id,
            key=m["key"],
            value=value,
            timestamp=int(m["timestamp"]),
            step=int(m["step"]),
            is_nan=is_nan,
        )
        ident = (r["key"], r["timestamp"], r["step"], r["value"], is_nan)
        if ident in seen:
            continue
        seen.add(ident)
        rows.append(r)
        best = latest.get(r["key"])
        if best is None or (r["step"], r["timestamp"], r["value"]) > (best["step"], best["timestamp"], best["value"]):
            latest[r["key"]] = r
    with store.ManagedSessionMaker(read_only=False) as session:
        if rows:
            session.execute(sqlalchemy.insert(SqlMetric.__table__), rows)
            session.execute(sqlalchemy.insert(SqlLatestMetric.__table__), list(latest.values()))
