"""Training backends and the training engine's forward: `torch` (one process), `deepspeed` (ZeRO, many ranks)."""

from __future__ import annotations

from gspo_study.config import Config, ConfigError
from gspo_study.train.base import TrainingBackend


def make_backend(cfg: Config, model) -> tuple[int, int, TrainingBackend]:
    """(rank, world size, training backend) for `train.backend`."""
    if cfg.train.backend == "torch":
        from gspo_study.train.torch_backend import TorchBackend

        t = cfg.train
        return 0, 1, TorchBackend(model, t.lr, t.weight_decay, t.grad_clip, t.router_lr_scale)
    from gspo_study.train.deepspeed_backend import DeepSpeedBackend
    from gspo_study.train.dist import init_distributed

    rank, world = init_distributed()
    minibatch = cfg.rollout.group_size * cfg.rollout.prompts_per_step // cfg.train.num_minibatches
    if minibatch % world:
        raise ConfigError(
            f"a minibatch of {minibatch} responses does not split over {world} ranks; allowed: a world size "
            "dividing group_size x prompts_per_step / num_minibatches"
        )
    return rank, world, DeepSpeedBackend(model, cfg, rank, world, rows_per_rank=minibatch // world)
