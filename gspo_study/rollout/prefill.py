"""A shared prefill: a rollout batch repeats every prompt G times (one row per response), so the HF engine's first
forward, the prompts' prefill, would compute each prompt G times over. `plan` picks `COPIES` rows of each distinct
prompt to prefill; their KV cache, last logits and routing then stand in for every row of that prompt.

The shortcut must not move one bit of a rollout (its tokens, log-probs and routing are training numbers), and it
does not, for this reason: in the prefill every row's result depends on that row alone — attention, norms, routers
and sampling are per row, and a GEMM row is a dot product over the same K in the same order — except that the
CPU's fp32 GEMM (MKL) multiplies a matrix of 1 row, or of 2–3 rows, along other kernel paths than one of 4 or
more, with other rounding; and the experts' grouped GEMM multiplies each expert's rows as one matrix. With every
distinct prompt present a multiple of `COPIES` = 4 times in both batches, each expert's group holds a multiple of
4 rows in both, so both take the ≥ 4-row path (with 2 threads, MKL splits 5-7 and 9-11 rows along yet other
paths: multiples of 4 avoid those too). `exact` checks that path on this machine, for the model's own weight
shapes and thread count (`rows_exact`), so a BLAS that switches paths elsewhere falls back to the whole batch.
Its speed gain is not shown yet: no entry of docs/LOG.md measured the prefill's share of a rollout (an earlier
line here cited one that does not exist), and one loaded 1-thread repeat at the CPU study shape measured none
(docs/LOG.md, 2026-12-05). That its numbers are bit-identical is measured (the same entry).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers.integrations.moe import _grouped_linear

from gspo_study.moe.routing import ROUTER_TYPES

COPIES = 4  # the fewest rows MKL's fp32 GEMM multiplies along its many-row path (1 and 2-3 rows take others)
# the row counts `rows_exact` checks against one product of REFERENCE_ROWS rows, at two alignments each: multiples
# of COPIES, the only counts either prefill gives a product (`plan`)
PROBE_ROWS = (*range(COPIES, 129, COPIES), 252, 256, 1000, 1024, 2044)
REFERENCE_ROWS = 2048
GROUPED = ("grouped_mm_index", "grouped_mm")  # the experts kernels whose GEMMs `exact` can probe
_EXACT: weakref.WeakKeyDictionary[nn.Module, dict[int, bool]] = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class Plan:
    """The prefill's rows (`keep`, indices into the batch) and, for each row of the batch, the index among them of
    the row that stands in for it (`stand_in`: its prompt's first copy)."""

    keep: torch.Tensor
    stand_in: torch.Tensor


def plan(seq: torch.Tensor, mask: torch.Tensor, copies: int = COPIES) -> Plan | None:
    """The first `copies` rows of every distinct prompt (ids and mask), in batch order; None unless every prompt has a
    multiple of `copies` rows (so every product of either prefill has a multiple of `copies` rows) and one has more
    (something to save)."""
    _, inverse, counts = torch.unique(torch.cat([seq, mask], dim=1), dim=0, return_inverse=True, return_counts=True)
    if (counts % copies).any() or counts.max() == copies:
        return None
    seen: dict[int, int] = {}
    first: dict[int, int] = {}
    keep = []
    for row, prompt in enumerate(inverse.tolist()):
        copy = seen[prompt] = seen.get(prompt, 0) + 1
        if copy == 1:
            first[prompt] = len(keep)
        if copy <= copies:
            keep.append(row)
    return Plan(torch.tensor(keep), torch.tensor([first[p] for p in inverse.tolist()]))


def rows_exact(op: Callable[[torch.Tensor], torch.Tensor], width: int, rows: tuple[int, ...] = PROBE_ROWS) -> bool:
    """Whether `op` (a row-wise product) gives rows m0 … m0+m-1 of a REFERENCE_ROWS-row input the same bits alone as
    within the whole input, for every m in `rows` and m0 in (0, 1)."""
    x = torch.randn(REFERENCE_ROWS, width, generator=torch.Generator().manual_seed(0))
    whole = op(x)
    return all(torch.equal(op(x[m0 : m0 + m]), whole[m0 : m0 + m]) for m in rows for m0 in (0, 1))


def _grouped_op(weight: torch.Tensor, transposed: bool) -> Callable[[torch.Tensor], torch.Tensor]:
    def op(x: torch.Tensor) -> torch.Tensor:  # every row to the first expert, the others empty
        offs = torch.full((weight.shape[0],), x.shape[0], dtype=torch.int32)
        return _grouped_linear(x, weight, offs, is_transposed=transposed)

    return op


def _products(model: nn.Module) -> dict[tuple, tuple[Callable[[torch.Tensor], torch.Tensor], int]] | None:
    """One probe (op, input width) per distinct product of the model's forward: dense projections, routers and the
    experts' grouped GEMMs, keyed by weight shape, strides and layout; None where a weight is not held whole here
    (DeepSpeed ZeRO's partitioned or flattened parameters: their shapes are not the product's)."""
    if any(hasattr(p, "ds_id") for p in model.parameters()):
        return None
    found = {}
    for module in model.modules():
        if isinstance(module, (nn.Linear, *ROUTER_TYPES)):
            w = module.weight.detach()
            if w.dim() != 2:
                return None
            found[("linear", tuple(w.shape), w.stride())] = (lambda x, w=w: F.linear(x, w), w.shape[1])
        for name in ("gate_up_proj", "down_proj"):
            w = getattr(module, name, None)
            if isinstance(w, torch.Tensor) and w.dim() == 3:
                t = bool(getattr(module, "is_transposed", False))
                found[(name, tuple(w.shape), w.stride(), t)] = (_grouped_op(w.detach(), t), w.shape[-2 if t else -1])
    return found


@torch.no_grad()
def exact(model: nn.Module) -> bool:
    """Whether a prefill over `COPIES` copies of each prompt gives every row the whole batch's bits here: a CPU float32
    model on a grouped experts kernel whose every product passes `rows_exact` (once per model and thread count)."""
    per_model = _EXACT.setdefault(model, {})
    threads = torch.get_num_threads()
    if threads not in per_model:
        p = next(model.parameters())
        ok = p.device.type == "cpu" and p.dtype == torch.float32
        ok = ok and getattr(model.config, "_experts_implementation", None) in GROUPED
        products = _products(model) if ok else None
        per_model[threads] = products is not None and all(rows_exact(op, w) for op, w in products.values())
    return per_model[threads]
