"""Run identity: every tracked run keeps its `run_key` as the code changes.

tests/golden/run_keys.json holds the keys of every figure's runs — each figure of experiments/figures.yaml at each
scale it is drawn at, each sweep cell, seeds 1-5 and the figure's own (`tests.golden.regen.figure_labels`) — and of
every run × ablation file at seed 1. The first 670 were computed by the code at f2162fb (the tracked CPU study's
commit; the few combinations now refused at load, a preset override on a checkpoint path, were dropped), figures 9
and 10's CPU runs added at 09f91e7; the gpu scale, figures 11 and 12 and the later cells of figures 9 and 10 were
added with `python -m tests.golden.regen --run-keys`, figures 11 and 12's CPU keys checked equal to the `run_key`
tags of the shipped runs (results/cpu/study-runs.parquet). A new config field must keep these keys at its default
(`run.LATER_KNOBS`): if this test fails, a change moved the identity of runs that exist and would silently
re-train them.
"""

from __future__ import annotations

import json
from pathlib import Path

from gspo_study.config import load_config
from gspo_study.run import run_key
from gspo_study.study import EXPERIMENTS, figures, run_config
from tests.golden.regen import figure_labels

GOLDEN = Path(__file__).parent / "golden" / "run_keys.json"


def current_key(label: str) -> str:
    scale, run, seed, *rest = label.split()
    seed = int(seed.removeprefix("seed="))
    if rest and rest[0] == "+":
        abl = EXPERIMENTS / rest[1]
        return run_key(
            load_config(
                [EXPERIMENTS / scale / "base.yaml", EXPERIMENTS / "runs" / f"{run}.yaml", abl], [f"seed={seed}"]
            )
        )
    return run_key(run_config(scale, run, seed, tuple(rest)))


def test_every_pinned_run_keeps_its_key():
    golden = json.loads(GOLDEN.read_text())
    assert len(golden) > 500
    now = {label: current_key(label) for label in golden}
    moved = {label: (key, now[label]) for label, key in golden.items() if now[label] != key}
    assert not moved, f"{len(moved)} runs changed identity, e.g. {next(iter(moved.items()))}"


def test_golden_file_covers_every_figure_of_figures_yaml():
    golden = json.loads(GOLDEN.read_text())
    wanted = figure_labels()
    assert wanted.keys() == figures().keys()
    for figure, labels in wanted.items():
        missing = [label for label in labels if label not in golden]
        assert labels and not missing, (
            f"{figure}: {missing[:2]} not pinned; run: python -m tests.golden.regen --run-keys"
        )


def test_run_identity_is_computed_once_per_config(tmp_path, monkeypatch):
    """Name, key, variant, directory, start and store come from one place (`resolve_run`): the key is hashed once
    per resolution, the variant (which loads the base config) once per record and only when read, and the run
    directory is looked up on disk once per distinct config in a process (a run renamed since keeps it)."""
    from collections import Counter

    from gspo_study import run as run_module
    from gspo_study.run import resolve_run, run_name, variant

    calls = Counter()

    def counted(name, fn):
        def inner(*a, **k):
            calls[name] += 1
            return fn(*a, **k)

        return inner

    monkeypatch.setattr(run_module, "run_key", counted("run_key", run_module.run_key))
    monkeypatch.setattr(run_module, "variant", counted("variant", run_module.variant))
    monkeypatch.setattr(Path, "glob", counted("glob", Path.glob))
    (tmp_path / "smoke" / "runs").mkdir(parents=True)
    cfg = load_config("experiments/smoke/base.yaml", [f"results_dir={tmp_path}", "train.lr=3e-3"])
    me = resolve_run(cfg)
    assert calls == {"run_key": 1, "glob": 1}  # the variant is not computed until read
    assert (me.key, me.name, me.variant, me.variant) == (run_key(cfg), run_name(cfg), variant(cfg), variant(cfg))
    assert calls["variant"] == 1 and "train.lr" in me.variant  # read three times, computed once
    assert resolve_run(cfg) == me and calls["glob"] == 1 and calls["run_key"] == 2  # the directory: looked up once
    assert me.dir == tmp_path / "smoke" / "runs" / f"{me.name}-{me.key}" and me.checkpoint == me.dir / "checkpoint"
    assert me.start == me.coldstart == tmp_path / "smoke" / "checkpoints" / "coldstart"
    assert me.store == f"sqlite:///{tmp_path.resolve()}/mlflow.db"
    renamed = tmp_path / "smoke" / "runs" / f"old-name-{me.key}"  # a run renamed since keeps its directory
    renamed.mkdir(parents=True)
    fresh = load_config("experiments/smoke/base.yaml", [f"results_dir={tmp_path}", "train.lr=3e-3", "threads=2"])
    assert resolve_run(fresh).dir == renamed and resolve_run(fresh).key == me.key
    elsewhere = load_config("experiments/smoke/base.yaml", [f"results_dir={tmp_path}", f"init_checkpoint={tmp_path}"])
    assert resolve_run(elsewhere).start == tmp_path and resolve_run(elsewhere).coldstart == me.coldstart


def test_opening_a_store_leaves_the_next_runs_store_to_its_config(tmp_path):
    """A process that opened one run's store (a sweep, a test, a notebook) must not log the next run, whose
    `results_dir` differs, into it: MLflow's `set_tracking_uri` would set `$MLFLOW_TRACKING_URI` process-wide."""
    import os

    from gspo_study.run import resolve_run
    from gspo_study.tracking import _connect

    first = load_config("experiments/smoke/base.yaml", [f"results_dir={tmp_path / 'a'}"])
    _connect(resolve_run(first).store, "first")
    assert "MLFLOW_TRACKING_URI" not in os.environ
    second = load_config("experiments/smoke/base.yaml", [f"results_dir={tmp_path / 'b'}"])
    assert resolve_run(second).store == f"sqlite:///{(tmp_path / 'b').resolve()}/mlflow.db"
