"""Studies: the runs each figure needs, at a scale and seeds, and running them resumably.

A figure lists run files in experiments/figures.yaml; a run's config is experiments/<scale>/base.yaml
layered with experiments/runs/<run>.yaml and `seed=<s>`. A figure with a `sweep:` (per scale, key → list of
values) takes every run at every combination of those values (applied as `key=value` overrides). Runs are
identified by their config (see `run.run_key`), so a run shared by two figures runs once, a finished run is
skipped, and a killed one resumes from its last checkpoint. Each model architecture gets its own cold start
(`coldstart_name`), trained with experiments/<scale>/coldstart.yaml or, if it exists,
experiments/<scale>/<coldstart name>.yaml
(e.g. coldstart-L16.yaml: a deeper model needs more SFT steps to reach the same pass@1).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import itertools
import multiprocessing
import os
import pickle
import signal
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

from gspo_study import stopping
from gspo_study.config import (  # noqa: F401 (coldstart_overrides: part of this module's interface)
    Config,
    ConfigError,
    coldstart_name,
    coldstart_overrides,
    load_config,
    read_yaml_file,
)
from gspo_study.errors import SweepInterrupted, Terminated
from gspo_study.paths import EXPERIMENTS, scale_base  # noqa: F401 (part of this module's interface)

DEFAULT_SEEDS = {"smoke": [1], "cpu": [1, 2, 3], "gpu": [1, 2, 3], "paper": [1]}


MAX_FIGURES_VALUES = 10_000  # figures.yaml holds ~400 (its `&bf16_sweep` alias expanded): aliases stay bounded


def figures(experiments: Path = EXPERIMENTS) -> dict[str, dict]:
    return read_yaml_file(experiments / "figures.yaml", MAX_FIGURES_VALUES)


def figure_spec(figure: str | int, experiments: Path = EXPERIMENTS) -> dict:
    name = f"figure-{figure}" if not str(figure).startswith("figure-") else str(figure)
    specs = figures(experiments)
    if name not in specs:
        raise ConfigError(f"unknown figure {figure!r}; allowed: {', '.join(k.removeprefix('figure-') for k in specs)}")
    return specs[name]


def parse_seeds(text: str | None, scale: str, figure: str | int | None = None) -> list[int]:
    """The seeds `text` names; without it, `figure`'s own (`seeds: {<scale>: [...]}` in figures.yaml, e.g. a
    figure sized for more seeds than the others), else the scale's default."""
    if not text:
        if scale not in DEFAULT_SEEDS:
            raise ConfigError(f"unknown scale {scale!r}; allowed: {', '.join(DEFAULT_SEEDS)}")
        own = figure_spec(figure).get("seeds", {}) if figure is not None else {}
        return list(own.get(scale, DEFAULT_SEEDS[scale]))
    try:
        return [int(s) for s in str(text).replace(",", " ").split()]
    except ValueError:
        raise ConfigError(f"bad SEEDS {text!r}; allowed: integers separated by commas or spaces") from None


def run_config(
    scale: str, run: str, seed: int, overrides: tuple[str, ...] = (), experiments: Path = EXPERIMENTS
) -> Config:
    run_file = experiments / "runs" / f"{run}.yaml"
    if not run_file.is_file():
        raise ConfigError(f"run file not found: {run_file}")
    return load_config([scale_base(scale, experiments), run_file], [f"seed={seed}", *overrides])


def drawn_at(figure: str | int, scale: str) -> bool:
    """Whether figure N has runs at `scale`: a figure without a sweep runs at every scale, one with a sweep at the
    scales it lists (the frontier's stages at smoke and cpu only)."""
    sweep = figure_spec(figure).get("sweep")
    return not sweep or scale in sweep


def sweep_cells(spec: dict, scale: str) -> list[tuple[str, ...]]:
    """Every combination of a figure's `sweep: {<scale>: {key: [values]}}` as `key=value` overrides
    ([()] for a figure without a sweep). A `cells: [{key: value, ...}, ...]` entry lists cells that are not a
    product (a dose axis and its controls): each is crossed with the other keys' combinations, after them."""
    if not spec.get("sweep"):
        return [()]
    if scale not in spec["sweep"]:
        raise ConfigError(f"figure sweep has no values for scale {scale!r}; allowed: {', '.join(spec['sweep'])}")
    sweep = dict(spec["sweep"][scale])
    listed = sweep.pop("cells", [{}])
    if not isinstance(listed, list) or not listed or not all(isinstance(c, dict) for c in listed):
        raise ConfigError(f"figures.yaml: sweep 'cells' must be a non-empty list of mappings, got {listed!r}")
    for key, values in sweep.items():
        if not isinstance(values, list) or not values:
            raise ConfigError(f"figures.yaml: sweep '{key}' must be a non-empty list of values, got {values!r}")
    axes = [[f"{key}={value}" for value in values] for key, values in sweep.items()]
    extra = [tuple(f"{key}={value}" for key, value in cell.items()) for cell in listed]
    return [(*cell, *more) for cell in itertools.product(*axes) for more in extra]


def figure_configs(figure, scale: str, seeds: list[int], overrides: tuple[str, ...] = ()) -> list[tuple[str, Config]]:
    """(run name, config) for every sweep cell × run × seed of a figure (cell-major, then run, then seed); a figure
    of more runs than a sweep may plan is refused first (`sizes.check_runs`)."""
    from gspo_study.train.sizes import check_runs

    spec = figure_spec(figure)
    per_seed = len(sweep_cells(spec, scale)) * len(spec["runs"])
    check_runs(f"figure {figure}", per_seed * len(seeds), per_seed)
    return [
        (run, run_config(scale, run, seed, (*cell, *overrides))) for cell, run, seed in _items(figure, scale, seeds)
    ]


def _items(figure, scale: str, seeds: list[int]) -> list[tuple[tuple[str, ...], str, int]]:
    spec = figure_spec(figure)
    cells = sweep_cells(spec, scale)
    gone = dropped(spec, scale, cells)
    return [
        (cell, run, seed)
        for cell in cells
        for run in spec["runs"]
        for seed in seeds
        if not any(run == d_run and seed in d_seeds and set(d_cell) <= set(cell) for d_run, d_seeds, d_cell in gone)
    ]


def dropped(spec: dict, scale: str, cells: list[tuple[str, ...]]) -> list[tuple[str, set[int], tuple[str, ...]]]:
    """A figure's `dropped: {<scale>: [{run, seeds, cell}, ...]}`: runs its study planned and can no longer train
    (each entry says why, and the plan's history records it): no sweep trains them and no figure waits for them.
    Each entry must name one of the figure's runs and a cell of its sweep at that scale."""
    out = []
    for entry in (spec.get("dropped") or {}).get(scale, []):
        fields = entry if isinstance(entry, dict) else {}
        cell, seeds = fields.get("cell"), fields.get("seeds")
        cell_items = tuple(f"{k}={v}" for k, v in cell.items()) if isinstance(cell, dict) else ()
        if not (
            set(fields) == {"run", "seeds", "cell", "why"}
            and fields["run"] in spec["runs"]
            and isinstance(seeds, list)
            and all(isinstance(s, int) for s in seeds)
            and any(cell_items and set(cell_items) <= set(c) for c in cells)
        ):
            raise ConfigError(
                f"figures.yaml: bad dropped entry {entry!r}; allowed: {{run: one of {spec['runs']}, seeds: [ints], "
                "cell: {key: value} of one of the sweep's cells, why: text}"
            )
        out.append((fields["run"], set(seeds), cell_items))
    return out


def ensure_coldstart(scale: str, overrides: tuple[str, ...] = ()) -> Path:
    """The scale's cold-start checkpoint (for the model the overrides describe), trained first if missing
    (under the cold start's lock: two sweeps needing it at once train it once, `sft.ensure_trained`)."""
    from gspo_study.sft import ensure_trained

    cfg = load_config(EXPERIMENTS / scale / "coldstart.yaml", list(overrides))
    shared = dataclasses.replace(cfg, sft=dataclasses.replace(cfg.sft, per_seed=False))  # a seed's: the same recipe
    own = EXPERIMENTS / scale / f"{coldstart_name(shared)}.yaml"  # an architecture's own recipe, if it has one
    if own.is_file():
        cfg = load_config(own, list(overrides))
    if cfg.init_checkpoint:
        return Path(cfg.init_checkpoint)
    return ensure_trained(cfg)


def base_coldstart(scale: str, overrides: tuple[str, ...] = ()) -> Path:
    """The cold start of the scale's base model (`make coldstart`), trained first if missing; `overrides`
    apply to both (e.g. `results_dir=...`, or another depth)."""
    model = coldstart_overrides(load_config(scale_base(scale), list(overrides)))
    return ensure_coldstart(scale, (*overrides, *model))


def run_figure(figure, scale: str, seeds: list[int], overrides: tuple[str, ...] = (), jobs: int = 1) -> list[Config]:
    """Train every run the figure needs that has not finished (each model's cold start when first needed).

    `jobs` > 1 trains that many runs at once, each in its own process with `threads // jobs` torch threads
    (on 2 CPU cores two 1-thread runs do ~1.7x the work of one 2-thread run). Cold starts are then all made
    first. A run's numbers depend on its thread count: same config, seed and threads, same numbers."""
    if jobs < 1:
        raise ConfigError(f"bad JOBS {jobs!r}; allowed: a positive integer (runs trained at once)")
    code = code_digest()  # each worker imports the package afresh: it must be the code the sweep started with
    configs = figure_configs(figure, scale, seeds, overrides)
    from gspo_study.run import resolve_run
    from gspo_study.tracking import all_finished

    runs = [resolve_run(cfg) for _, cfg in configs]
    if all_finished(runs):  # e.g. imported (`make import-study`): no cold start needed
        print(f"== figure {figure}: all {len(configs)} runs already finished; nothing to train")
        return [cfg for _, cfg in configs]
    labels = [f"{run} seed {seed} {' '.join(cell)}".strip() for cell, run, seed in _items(figure, scale, seeds)]
    cold = [None if run.cfg.init_checkpoint else coldstart_overrides(run.cfg) for run in runs]  # cold-start runs
    if jobs == 1:
        from gspo_study.trainer import train

        for i, (run, model, label) in enumerate(zip(runs, cold, labels), 1):
            print(f"== figure {figure} [{i}/{len(configs)}]: {label}")
            if model is not None:  # when first needed: a partial sweep makes progress
                ensure_coldstart(scale, (*overrides, *model))
            train(run.cfg)
        return [cfg for _, cfg in configs]
    for model in dict.fromkeys(model for model in cold if model is not None):
        ensure_coldstart(scale, (*overrides, *model))
    threads = max(1, (configs[0][1].threads or os.cpu_count() or 1) // jobs)
    print(f"== figure {figure}: {len(configs)} runs, {jobs} at a time, {threads} thread(s) each")
    ctx = multiprocessing.get_context("spawn")  # a fresh interpreter per run: no torch state shared
    with ProcessPoolExecutor(jobs, mp_context=ctx, max_tasks_per_child=1) as pool:
        futures = {
            pool.submit(_train_quietly, code, pickle.dumps(dataclasses.replace(cfg, threads=threads))): i
            for i, (_, cfg) in enumerate(configs)
        }
        try:
            with _forward_sigterm(pool, futures):
                done = _collect(figure, futures, labels, len(configs))
            if done is not None:
                raise done
        except BrokenProcessPool:
            raise SweepInterrupted(
                f"figure {figure}: a worker process died (killed, or out of memory); the runs finished so far are "
                "kept and the others resume where they stopped: rerun the same command"
            ) from None
        except BaseException:
            for future in futures:
                future.cancel()
            raise
    return [cfg for _, cfg in configs]


@contextlib.contextmanager
def _forward_sigterm(pool: ProcessPoolExecutor, futures: dict):
    """SIGTERM to the sweep: the runs not started are cancelled and each running worker gets SIGTERM, so it stops
    at its next safe point, checkpointed and marked KILLED (gspo_study.trainer.stop_on_sigterm)."""

    def handler(signum, frame):
        for future in futures:
            future.cancel()
        for proc in list(getattr(pool, "_processes", {}).values()):  # the executor's live workers
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGTERM)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _collect(figure, futures: dict, labels: list[str], total: int) -> BaseException | None:
    """Wait for every run; a worker stopped by SIGTERM (or cancelled by it) ends the sweep as Terminated once all
    the others have stopped."""
    stopped = None
    for n, future in enumerate(as_completed(futures), 1):
        if future.cancelled():
            stopped = stopped or Terminated(f"SIGTERM: figure {figure}'s sweep stopped; rerun the same command")
            continue
        try:
            seconds, trained = future.result()
        except Terminated as exc:
            stopped = Terminated(
                f"SIGTERM: figure {figure}'s sweep stopped, its running runs checkpointed and "
                f"marked KILLED ({exc}); rerun the same command to resume"
            )
            continue
        what = f"done in {seconds / 60:.1f} min" if trained else "already finished"
        print(f"== figure {figure} [{n}/{total}] {labels[futures[future]]}: {what}", flush=True)
    return stopped


def code_digest() -> str:
    """sha256 of the package's Python sources (relative paths and contents), as the running interpreter finds them."""
    package = Path(__file__).resolve().parent
    h = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        h.update(path.relative_to(package).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def _terminated_before_the_run(signum, frame):
    raise Terminated("SIGTERM before the run started; nothing to checkpoint")


def _train_quietly(code: str, pickled: bytes) -> tuple[float, bool]:
    """One run in a worker process (no progress bar: several runs share the terminal): (wall seconds, whether
    it trained — a finished run is skipped). The config comes pickled and is unpickled only once the worker's
    code is known to be the sweep's (an edit under a running sweep once crashed its workers in unpickling)."""
    if code_digest() != code:
        raise SweepInterrupted(
            f"the code under {Path(__file__).resolve().parent} changed since this sweep started; the runs finished "
            "so far are kept: rerun the same command (or run long sweeps from a frozen copy, `git worktree add`)"
        )
    signal.signal(signal.SIGTERM, _terminated_before_the_run)  # the run's own handler takes over in `train`
    stopping.sweep_worker()
    cfg: Config = pickle.loads(pickled)
    os.environ["TQDM_DISABLE"] = "1"
    from gspo_study.trainer import train

    start = time.perf_counter()
    trained = bool(train(cfg))
    return time.perf_counter() - start, trained
