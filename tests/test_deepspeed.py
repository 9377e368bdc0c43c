"""The deepspeed backend with 2 real ranks on CPU (gloo, DS_ACCELERATOR=cpu) gives the single-process
backend's losses and parameter updates, for ZeRO-2 and ZeRO-3, GSPO and GRPO with routing replay."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from gspo_study.config import load_config
from gspo_study.train.checkpointing import run_dir
from gspo_study.trainer import train
from tests.test_trainer import history

pytest.importorskip("deepspeed")
TORCHRUN = Path(sys.executable).parent / "torchrun"
CASES = [("gspo", "none", 2), ("gspo", "none", 3), ("grpo", "r2", 2), ("grpo", "r2", 3)]


def _weights(cfg) -> dict[str, torch.Tensor]:
    return load_file(str(next((run_dir(cfg) / "checkpoint").glob("*.safetensors"))))


@pytest.mark.parametrize("objective, replay, stage", CASES)
def test_two_ranks_match_single_process(smoke_cfg, objective, replay, stage):
    common = [f"algo.objective={objective}", f"algo.routing_replay={replay}", "train.steps=2", "eval.every=0"]
    single = smoke_cfg(*common)
    train(single)
    ranks = [*common, "train.backend=deepspeed", f"train.zero_stage={stage}"]
    ds = smoke_cfg(*ranks)
    overrides = [
        f"results_dir={ds.results_dir}",
        f"tracking.uri={ds.tracking.uri}",
        f"init_checkpoint={ds.init_checkpoint}",
    ]
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "TQDM_DISABLE": "1", "OMP_NUM_THREADS": "1"}
    cmd = [str(TORCHRUN), "--standalone", "--nproc_per_node", "2", "-m", "gspo_study", "train",
           "experiments/smoke/base.yaml", *overrides, *ranks]  # fmt: skip
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert load_config("experiments/smoke/base.yaml", overrides + ranks) == ds
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
