"""Ranks: who am I, and gathering per-rank results. A single process is rank 0 of a world of 1."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
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


@contextmanager
def exit_cleanly() -> Iterator[None]:
    """Wrap a command run under torchrun: when it succeeds, the ranks leave together (a barrier), destroy the
    process group and exit at once (`os._exit(0)` after flushing output). Letting the interpreter tear down a
    gloo group with DeepSpeed ZeRO-3 state can abort a rank ("terminate called without an active exception") on
    a loaded CPU machine after all its work is done. A failing command raises as usual; one process: no-op."""
    yield
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
