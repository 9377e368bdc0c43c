"""The deepspeed backend with 2 real ranks on CPU (gloo, DS_ACCELERATOR=cpu) gives the single-process
backend's losses and parameter updates, for ZeRO-2 and ZeRO-3, GSPO and GRPO with routing replay, with
rollouts generated whole on every rank or sharded across ranks; it skips non-finite updates; and a run stopped by
SIGTERM inside a step stops on every rank at once and resumes from its ZeRO checkpoint (weights and Adam state) to
the numbers of an uninterrupted run."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from mlflow import MlflowClient
from safetensors.torch import load_file

from gspo_study.config import load_config
from gspo_study.run import resolve_run
from gspo_study.trainer import train
from tests.test_trainer import history

pytest.importorskip("deepspeed")
TORCHRUN = Path(sys.executable).parent / "torchrun"
# A pairwise cover (every pair of values of any two factors appears in some case) of the objective and replay
# (GSPO, GRPO + R2, GRPO + R3), the ZeRO stage, rollouts whole on every rank or sharded across ranks, and one or
# several micro-batches per rank (DeepSpeed must accumulate them, not keep the last one's gradient): 6 cases
# instead of the 24 of every combination, trained by the two ranks of one torchrun launch.
CASES = [
    ("gspo", "none", 2, ()),
    ("gspo", "none", 3, ("rollout.sharded=true", "train.micro_batch_size=1")),
    ("grpo", "r2", 2, ("rollout.sharded=true", "train.micro_batch_size=1")),
    ("grpo", "r2", 3, ()),
    ("grpo", "r3", 2, ("train.micro_batch_size=1",)),
    ("grpo", "r3", 3, ("rollout.sharded=true",)),
]
ENV = {**os.environ, "DS_ACCELERATOR": "cpu", "TQDM_DISABLE": "1", "OMP_NUM_THREADS": "1"}


def _weights(cfg) -> dict[str, torch.Tensor]:
    return load_file(str(next((resolve_run(cfg).dir / "checkpoint").glob("*.safetensors"))))


def _torchrun(overrides: list[str], env=ENV, check: bool = True) -> subprocess.CompletedProcess:
    cmd = [
        str(TORCHRUN),
        "--standalone",
        "--nproc_per_node",
        "2",
        "-m",
        "gspo_study",
        "train",
        "experiments/smoke/base.yaml",
        *overrides,
    ]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert not check or done.returncode == 0, done.stderr[-3000:]
    return done


def _store(cfg) -> list[str]:
    return [
        f"results_dir={cfg.results_dir}",
        f"tracking.uri={cfg.tracking.uri}",
        f"init_checkpoint={cfg.init_checkpoint}",
    ]


def _case_overrides(case) -> list[str]:
    objective, replay, _, extra = case
    return [f"algo.objective={objective}", f"algo.routing_replay={replay}", "train.steps=2", "eval.every=0", *extra]


def _rank_overrides(case) -> list[str]:
    return [*_case_overrides(case), "train.backend=deepspeed", f"train.zero_stage={case[2]}"]


RESUME = [  # the ZeRO-2 run the resume test kills and resumes
    "train.backend=deepspeed",
    "train.zero_stage=2",
    "train.steps=3",
    "eval.every=0",
    "train.checkpoint_every=1",
    "rollout.sharded=true",
    "seed=5",
]


@pytest.fixture(scope="module")
def launch(smoke_results, tmp_path_factory):
    """One torchrun launch of 2 DeepSpeed ranks (tests/ds_runs.py) for this file's runs — every case of CASES and
    the resume test's uninterrupted reference, each into a store of its own — then the non-finite check under
    ZeRO-2 and ZeRO-3: (each run's overrides by name, the launch's CompletedProcess)."""
    import json

    root = tmp_path_factory.mktemp("ds-ranks")
    coldstart = smoke_results / "smoke/checkpoints/coldstart"

    def store(name: str) -> list[str]:
        return [
            f"results_dir={root / name}",
            f"tracking.uri=sqlite:///{root / name}/mlflow.db",
            f"init_checkpoint={coldstart}",
        ]

    runs = {f"case-{i}": [*store(f"case-{i}"), *_rank_overrides(case)] for i, case in enumerate(CASES)}
    runs["resume-whole"] = [*store("resume-whole"), *RESUME]
    plan = {"runs": runs, "checkpoint": str(coldstart), "nonfinite_stages": [2, 3]}
    (root / "plan.json").write_text(json.dumps(plan))
    script = Path(__file__).with_name("ds_runs.py")
    cmd = [str(TORCHRUN), "--standalone", "--nproc_per_node", "2", str(script), str(root / "plan.json")]
    return runs, subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=900)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}-zero{c[2]}-{len(c[3])}")
def test_two_ranks_match_single_process(smoke_cfg, launch, case):
    runs, done = launch
    assert done.returncode == 0, done.stderr[-3000:]
    single = smoke_cfg(*_case_overrides(case))
    train(single)
    ds = load_config("experiments/smoke/base.yaml", runs[f"case-{CASES.index(case)}"])
    h1, h2 = history(single), history(ds)
    for key in (
        "policy/loss",
        "policy/clip_frac/token",
        "policy/ratio/token_var",
        "train/grad_norm",
        "rollout/reward/mean",
    ):
        a, b = h1[key], h2[key]
        assert a.keys() == b.keys() == {1, 2}, key
        for s in a:
            assert b[s] == pytest.approx(a[s], rel=1e-3, abs=1e-5), (key, s)  # see the weights below
    w1, w2 = _weights(single), _weights(ds)
    assert w1.keys() == w2.keys()
    start = load_file(str(next(Path(single.init_checkpoint).glob("*.safetensors"))))
    upd1 = torch.cat([(w1[k] - start[k]).flatten() for k in w1])
    upd2 = torch.cat([(w2[k] - start[k]).flatten() for k in w1])
    lr = single.train.lr
    # Adam turns float-rounding noise in near-zero gradients into steps of up to ±lr per update, so single
    # elements may differ by a fraction of lr; the updates as a whole must agree to well under 1%.
    assert (upd2 - upd1).abs().max() < 0.5 * lr
    assert (upd2 - upd1).norm() < 0.01 * upd1.norm()
    assert upd1.norm() > 0  # the comparison is of real updates


def test_sigterm_stops_every_rank_at_one_point_and_resumes_from_zero_checkpoint(smoke_cfg, launch, tmp_path):
    """SIGTERM (to rank 0 and to torchrun, which forwards it: a scheduler's notice) inside step 2's π_old pass of a
    2-rank ZeRO-2 run: every rank stops at the same stop point (the stop is all-gathered) within the grace, the
    weights of step 1 are checkpointed by both ranks together (ZeRO state and whole weights), the run is KILLED;
    the rerun resumes from that ZeRO state (weights and Adam state) and logs at steps 2-3 what a run that was never
    interrupted logs (the module launch's); only the newest ZeRO tag is kept."""
    runs, done = launch
    assert done.returncode == 0, done.stderr[-3000:]
    whole = load_config("experiments/smoke/base.yaml", runs["resume-whole"])
    killed = smoke_cfg(*RESUME, f"results_dir={tmp_path / 'killed'}", "tracking.experiment=killed")  # own dir
    over = [*_store(killed), *RESUME, "tracking.experiment=killed", "train.checkpoint_every=2"]
    done = _torchrun(over, env={**ENV, "GSPO_STUDY_SIGTERM_IN": "old_policy@2"}, check=False)
    stops = [line for line in done.stderr.splitlines() if line.startswith("stopped:")]
    assert len(stops) == 2 and all(
        "inside step 2's old_policy (at a stop point), checkpointed at step 1, marked KILLED" in s for s in stops
    ), done.stderr[-3000:]
    assert "Unable to shutdown process" not in done.stderr  # no rank needed torchrun's SIGKILL
    client = MlflowClient(killed.tracking.uri)
    (run,) = client.search_runs([client.get_experiment_by_name("killed").experiment_id])
    assert run.info.status == "KILLED" and history(killed)["rollout/reward/mean"].keys() == {1}
    _torchrun(over)
    h1, h2 = history(whole), history(killed)
    for key in ("policy/loss", "policy/ratio/token_var", "train/grad_norm", "rollout/reward/mean"):
        assert h2[key].keys() == {1, 2, 3}, key
        for step in (2, 3):
            assert h2[key][step] == pytest.approx(h1[key][step], rel=1e-6, abs=1e-9), (key, step)
    assert [p.name for p in (resolve_run(killed).dir / "zero").iterdir() if p.is_dir()] == ["step00000003"]
    w1, w2 = _weights(whole), _weights(killed)
    assert all(torch.equal(w1[k], w2[k]) for k in w1)


def test_nonfinite_update_is_skipped_under_zero2_and_zero3(launch):
    """tests/ds_backend_check.py, run by the module launch after its training runs."""
    _, done = launch
    assert done.returncode == 0 and done.stdout.count(": ok") == 4, done.stderr[-3000:]
    found = re.findall(r"rank (\d), ZeRO-(\d): ok", done.stdout)  # a rank's line may follow another's log text
    assert sorted(found) == [(r, s) for r in "01" for s in "23"], done.stdout[-3000:]


def test_bad_store_stops_every_rank_with_one_line(smoke_cfg, tmp_path):
    """A bad tracking store stops every rank with the one-line error (no rank left waiting), writing nothing."""
    cfg = smoke_cfg()
    bad = [
        f"results_dir={tmp_path / 'bad'}",
        "tracking.uri=http://127.0.0.1:9",
        f"init_checkpoint={cfg.init_checkpoint}",
    ]
    done = _torchrun(bad + ["train.backend=deepspeed", "train.steps=1"], check=False)
    assert done.returncode != 0
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 2 and all("http://127.0.0.1:9" in e and "unreachable" in e for e in errors), done.stderr[
        -3000:
    ]
    assert not (tmp_path / "bad").exists()
