"""The training engine's forward: per-token log-probs (and entropy) of the targets in the shared layout.

See `gspo_study.rollout.base` for the layout: a forward over `sequences[:, :-1]` gives log-probs of
`sequences[:, 1:]`, aligned with `response_mask`, `rollout_logprobs` and any routing trace.
"""

from __future__ import annotations

import torch

from gspo_study.rollout.base import position_ids_from_mask
from gspo_study.runtime import autocast


def token_logprobs(
    model,
    sequences: torch.Tensor,
    attention_mask: torch.Tensor,
    temperature: float = 1.0,
    with_entropy: bool = False,
    aux_out: list | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log π(sequences[:, t+1] | ≤ t) for every t: `[B, L-1]` float32, and the entropy `[B, L-1]` if asked. The
    forward runs on the model's device, under `runtime.autocast` (bf16 for an fp32 model on CUDA); the log-softmax
    in fp32; the results come back to the batch's device. `aux_out`: a list that gets the forward's auxiliary
    load-balance loss, computed by transformers' Qwen3-MoE itself (`output_router_logits`, its
    `load_balancing_loss_func` over the forward's tokens), with its gradient."""
    home, device = sequences.device, next(model.parameters()).device  # batch on CPU, model maybe on a GPU
    inputs, mask = sequences[:, :-1].to(device), attention_mask[:, :-1].to(device)
    pos = position_ids_from_mask(mask)
    extra = {"output_router_logits": True} if aux_out is not None else {}
    # no KV cache: nothing decodes after this forward
    with autocast(model):
        out = model(input_ids=inputs, attention_mask=mask, position_ids=pos, use_cache=False, **extra)
    if aux_out is not None:
        aux_out.append(out.aux_loss.to(home))
    logp_all = torch.log_softmax(out.logits.float() / temperature, dim=-1)
    logprobs = logp_all.gather(-1, sequences[:, 1:, None].to(device)).squeeze(-1)
    entropy = None
    if with_entropy:
        with torch.no_grad():
            entropy = -(logp_all.exp() * logp_all).sum(-1).to(home)
    return logprobs.to(home), entropy  # the objective works on the batch's device; gradients flow back
