"""Run identity: every tracked run keeps its `run_key` as the code changes.

tests/golden/run_keys.json holds the keys of every figure's runs (each scale, sweep cell and seeds 1-5) and of
every run × ablation file at seed 1, computed by the code at f2162fb (the tracked CPU study's commit; the few
combinations that are now refused at load, a preset override on a checkpoint path, were dropped); figures 9 and
10's CPU runs were added at 09f91e7, their keys checked equal to the `run_key` tags of the tracked runs. A new config
field must keep these keys at its default (`run.LATER_KNOBS`): if this test fails, a change moved the
identity of runs that exist and would silently re-train them.
"""

from __future__ import annotations

import json
from pathlib import Path

from gspo_study.config import load_config
from gspo_study.run import run_key
from gspo_study.study import EXPERIMENTS, _items, run_config

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


def test_golden_file_covers_every_figure_at_the_cpu_scale():
    golden = json.loads(GOLDEN.read_text())
    for figure in range(1, 11):
        labels = {" ".join(["cpu", run, f"seed={seed}", *cell]) for cell, run, seed in _items(figure, "cpu", [1, 2, 3])}
        assert labels <= golden.keys(), figure


def test_run_identity_is_computed_once_per_config(tmp_path):
    """Name, key, variant, directory, start and store come from one place (`resolve_run`); the identity and the
    directory lookup are computed once per config."""
    from gspo_study.run import resolve_run, run_name, variant

    cfg = load_config("experiments/smoke/base.yaml", [f"results_dir={tmp_path}", "train.lr=3e-3"])
    me = resolve_run(cfg)
    assert (me.key, me.name, me.variant) == (
        run_key(cfg),
        run_name(cfg),
        variant(cfg),
    ) and "train.lr" in me.variant
    assert me.dir == tmp_path / "smoke" / "runs" / f"{me.name}-{me.key}" and me.checkpoint == me.dir / "checkpoint"
    assert me.start == me.coldstart == tmp_path / "smoke" / "checkpoints" / "coldstart"
    assert me.store == f"sqlite:///{tmp_path.resolve()}/mlflow.db" and not (tmp_path / "smoke").exists()
    assert resolve_run(cfg) == me  # the same record again
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
