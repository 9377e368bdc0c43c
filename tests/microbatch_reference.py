"""Gradient accumulation over micro-batches with exactly the minibatch's loss, gradient and metrics: the
reference loop the objectives' tests run (the trainer's `update_minibatch` does the same, tested in
tests/test_trainer.py).

Averaging per micro-batch (each micro-batch divided by its own response or token count) changes the
result with the micro-batch size. Instead every micro-batch call receives the minibatch's denominator:

    normalizer = objective.batch_normalizer(minibatch["mask"])        # count over the whole minibatch
    parts = []
    for micro in split_microbatches(minibatch, micro_batch_size):
        loss, metrics = objective(logprobs=model_logprobs(micro), old_logprobs=micro["old_logprobs"],
                                  advantages=micro["advantages"], mask=micro["mask"], normalizer=normalizer)
        loss.backward()                                                 # gradients add up
        parts.append(metrics)
    metrics = combine_metrics(parts)                                    # the minibatch's metrics

Every objective is a sum of per-response contributions divided by that denominator, so the micro-batch
losses sum to the minibatch loss and their gradients to its gradient. `microbatch_loss_and_backward` is
this loop.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from torch import Tensor

from gspo_study.objectives.core import Objective, combine_metrics


def split_microbatches(batch: Mapping[str, Any], micro_batch_size: int) -> list[dict[str, Any]]:
    """Split every tensor of `batch` along dim 0 into chunks of `micro_batch_size` rows (the last may be
    shorter); other values are passed to every chunk unchanged. Slices are views, so gradients of a leaf
    tensor in `batch` accumulate into that leaf."""
    if micro_batch_size < 1:
        raise ValueError(f"bad micro_batch_size {micro_batch_size}; allowed: an integer >= 1")
    sizes = {v.shape[0] for v in batch.values() if isinstance(v, Tensor)}
    if len(sizes) != 1:
        raise ValueError(f"batch tensors must share their first dimension; got sizes {sorted(sizes)}")
    rows = sizes.pop()
    return [
        {k: v[start : start + micro_batch_size] if isinstance(v, Tensor) else v for k, v in batch.items()}
        for start in range(0, rows, micro_batch_size)
    ]


def microbatch_loss_and_backward(
    objective: Objective,
    batch: Mapping[str, Any],
    micro_batch_size: int,
    logprobs_fn: Callable[[dict[str, Any]], Tensor],
    backward: Callable[[Tensor], None] = Tensor.backward,
) -> tuple[float, dict[str, float]]:
    """Accumulate the minibatch gradient micro-batch by micro-batch; return its loss and metrics.

    batch: "mask" [B, T], "old_logprobs" [B, T], "advantages" [B] or [B, T], plus whatever `logprobs_fn`
    needs (input ids, ...). logprobs_fn(micro) -> [b, T] log π_θ with grad for one micro-batch.
    backward: how to back-propagate a loss (e.g. a DeepSpeed engine's `backward`).
    """
    normalizer = objective.batch_normalizer(batch["mask"])
    parts = []
    for micro in split_microbatches(batch, micro_batch_size):
        loss, metrics = objective(
            logprobs=logprobs_fn(micro),
            old_logprobs=micro["old_logprobs"],
            advantages=micro["advantages"],
            mask=micro["mask"],
            normalizer=normalizer,
        )
        backward(loss)
        parts.append(metrics)
    metrics = combine_metrics(parts)
    return metrics["policy/loss"], metrics
