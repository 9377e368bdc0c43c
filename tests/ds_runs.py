"""Run under torchrun (tests/test_deepspeed.py): `trainer.train` on every rank for each run given, one after the
other in one launch (a fresh model, DeepSpeed engine and MLflow run each): the two-ranks-vs-one cases without a
torchrun start (two interpreters importing torch, transformers and DeepSpeed) per case. The CLI's own path
under torchrun is the resume and bad-store tests'."""

from __future__ import annotations

import json
import sys

from gspo_study.config import load_config
from gspo_study.train.dist import exit_cleanly, init_distributed
from gspo_study.trainer import train


def main(runs_file: str) -> None:
    init_distributed()
    for overrides in json.loads(open(runs_file).read()):
        train(load_config("experiments/smoke/base.yaml", overrides))


if __name__ == "__main__":
    with exit_cleanly():
        main(sys.argv[1])
