"""The registered policy objectives, one small function each (formulas: /work/shared/PAPER.md).

Each function maps masked inputs (`PolicyInputs`: padding already zeroed, log-ratios clamped) to the term
to maximise; aggregation, the loss sign, normalisation and metrics are shared (`core`). To add an
algorithm, write one more function here and decorate it with `@register(name, clip_low=..., clip_high=...)`.
"""

from __future__ import annotations

import torch

from gspo_study.objectives.core import PolicyInputs, Surrogate, ppo_clip, register


@register("grpo", clip_low=0.2, clip_high=0.27)  # GSPO paper §5.1's GRPO clip range
def grpo(x: PolicyInputs, *, clip_low: float, clip_high: float) -> Surrogate:
    """GRPO: per token min(w_it Â_it, clip(w_it) Â_it), w_it = π_θ(y_it)/π_old(y_it); returns [B, T]."""
    return ppo_clip(torch.exp(x.log_ratio), x.token_advantages, clip_low, clip_high)


@register("gspo", clip_low=3e-4, clip_high=4e-4)  # GSPO paper §5.1
def gspo(x: PolicyInputs, *, clip_low: float, clip_high: float) -> Surrogate:
    """GSPO: per response min(s_i Â_i, clip(s_i) Â_i), s_i = exp(mean_t log w_it); returns [B].

    The term stays per response (averaged over responses), never broadcast over tokens and summed, which
    would weight responses by length. Per-token advantages are reduced to their mean over the response
    (exact for group advantages, which are constant along a response); use gspo_token for genuinely
    per-token advantages.
    """
    return ppo_clip(torch.exp(x.seq_log_ratio), x.seq_advantages, clip_low, clip_high)


@register("gspo_token", clip_low=3e-4, clip_high=4e-4)  # GSPO paper's token-level variant, GSPO's clip range
def gspo_token(x: PolicyInputs, *, clip_low: float, clip_high: float) -> Surrogate:
    """GSPO-token: s_it = sg[s_i] · π_θ(y_it)/sg[π_θ(y_it)] in the GRPO-style per-token term; returns [B, T].

    s_it equals s_i in value (so clipping is decided by s_i) while its gradient is s_i ∇log π_θ(y_it);
    with Â_it = Â_i it reproduces GSPO's value, clipping and gradient.
    """
    s_i = torch.exp(x.seq_log_ratio).detach()
    s_it = s_i[:, None] * torch.exp(x.logprobs - x.logprobs.detach())
    return ppo_clip(s_it, x.token_advantages, clip_low, clip_high)


# MiniMax-M1 (arXiv 2506.13585) sets no lower bound ("ε_low^IS large") and tunes only ε_high^IS without
# publishing it; ε_low = 1 (lower bound 0, never active) and ε_high = 0.28 follow Trinity-RFT's defaults.
@register("cispo", clip_low=1.0, clip_high=0.28)
def cispo(x: PolicyInputs, *, clip_low: float, clip_high: float) -> Surrogate:
    """CISPO: per token sg[clip(w_it, 1-ε_low, 1+ε_high)] Â_it log π_θ(y_it); returns [B, T].

    Clipping caps the (detached) IS weight but never removes a token's gradient; `clipped_*` flag tokens
    whose weight was capped, whatever the sign of Â.
    """
    ratio = torch.exp(x.log_ratio)
    weight = ratio.clamp(1.0 - clip_low, 1.0 + clip_high).detach()
    return Surrogate(
        weight * x.token_advantages * x.logprobs, ratio < 1.0 - clip_low, ratio > 1.0 + clip_high
    )
