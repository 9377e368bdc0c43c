"""Run under torchrun (tests/test_deepspeed.py): in one launch, `trainer.train` on every rank for each run given,
one after the other (a fresh model, DeepSpeed engine and MLflow run each), then the non-finite-update check of
ds_backend_check.py for each ZeRO stage given: the cases of several tests without a torchrun start (two
interpreters importing torch, transformers and DeepSpeed) for each. The CLI's own path under torchrun is the
resume and bad-store tests'."""

from __future__ import annotations

import json
import sys

from ds_backend_check import check  # this script's folder is first on sys.path

from gspo_study.config import load_config
from gspo_study.train.dist import exit_cleanly, init_distributed
from gspo_study.trainer import train


def main(plan_file: str) -> None:
    plan = json.loads(open(plan_file).read())
    rank, world = init_distributed()
    for overrides in plan["runs"].values():
        train(load_config("experiments/smoke/base.yaml", overrides))
    for stage in plan["nonfinite_stages"]:
        check(plan["checkpoint"], stage, rank, world)


if __name__ == "__main__":
    with exit_cleanly():
        main(sys.argv[1])
