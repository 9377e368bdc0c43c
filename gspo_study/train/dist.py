"""Ranks: who am I, and gathering per-rank results. A single process is rank 0 of a world of 1."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist


def init_distributed() -> tuple[int, int]:
    """(rank, world size), initialising the process group from torchrun's environment when present."""
    if "RANK" not in os.environ:
        return 0, 1
    if not dist.is_initialized():
        import deepspeed

        deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    return dist.get_rank(), dist.get_world_size()


def gather(obj: Any, world: int) -> list[Any]:
    """Every rank's `obj`, in rank order (just [obj] in one process)."""
    if world == 1:
        return [obj]
    out: list[Any] = [None] * world
    dist.all_gather_object(out, obj)
    return out


def broadcast(obj: Any, world: int) -> Any:
    """Rank 0's `obj` on every rank (just `obj` in one process)."""
    if world == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]
