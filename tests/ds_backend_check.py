"""Run under torchrun (tests/test_deepspeed.py): the deepspeed backend on 2 gloo ranks skips an update whose
gradient is not finite (weights unchanged, norm reported non-finite) and applies the next finite one, for each
ZeRO stage given (one launch, a fresh model and engine per stage)."""

from __future__ import annotations

import math
import sys

import torch
from omegaconf import OmegaConf

from gspo_study.config import Config
from gspo_study.models import load_pretrained
from gspo_study.train.deepspeed_backend import DeepSpeedBackend
from gspo_study.train.dist import exit_cleanly, init_distributed


def check(checkpoint: str, stage: int, rank: int, world: int) -> None:
    model, tok = load_pretrained(checkpoint)
    cfg: Config = OmegaConf.to_object(OmegaConf.structured(Config))
    cfg.train.zero_stage, cfg.train.backend = stage, "deepspeed"
    backend = DeepSpeedBackend(model, cfg, rank, world, rows_per_rank=2)
    ids = torch.randint(4, len(tok), (2, 6), generator=torch.Generator().manual_seed(rank))

    def snapshot():
        with backend.gathered_parameters():
            return torch.cat([p.detach().flatten().clone() for p in backend.model.parameters()])

    before = snapshot()
    backend.backward(backend.engine(ids).logits.float().mean() * float("nan"))
    norm = backend.step(1e-3)
    assert not math.isfinite(norm), norm
    assert torch.equal(snapshot(), before), "a non-finite update changed the weights"
    backend.backward(backend.engine(ids).logits.float().mean())
    norm = backend.step(1e-3)
    after = snapshot()
    assert math.isfinite(norm) and torch.isfinite(after).all() and not torch.equal(after, before)
    print(f"rank {rank}, ZeRO-{stage}: ok", flush=True)


def main(checkpoint: str, stages: list[int]) -> None:
    rank, world = init_distributed()
    for stage in stages:
        check(checkpoint, stage, rank, world)


if __name__ == "__main__":
    with exit_cleanly():
        main(sys.argv[1], [int(s) for s in sys.argv[2:]])
