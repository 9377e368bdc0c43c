"""The registered policy objectives, one small function each, with the hyperparameters each one owns.

Each function maps masked inputs (`PolicyInputs`: padding already zeroed, log-ratios clamped) and its own
hyperparameter dataclass to the term to maximise; aggregation, the loss sign, normalisation and metrics are
shared (`core`). Formulas: docs/METRICS.md and the papers cited. To add an algorithm, write one more function
here (and, if it needs hyperparameters other than a clip range, a frozen dataclass with one documented field
each), and decorate it with `@register(name, defaults)`; `algo.objective: <name>` then selects it and
`algo.hparams.<field>=...` (or `algo.clip_low` / `algo.clip_high` for a `ClipRange`) sets its fields.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gspo_study.objectives.core import ClipRange, PolicyInputs, Surrogate, ppo_clip, register


@register("grpo", ClipRange(0.2, 0.27))  # GSPO paper §5.1's GRPO clip range
def grpo(x: PolicyInputs, p: ClipRange) -> Surrogate:
    """GRPO: per token min(w_it Â_it, clip(w_it) Â_it), w_it = π_θ(y_it)/π_old(y_it); returns [B, T]."""
    return ppo_clip(torch.exp(x.log_ratio), x.token_advantages, p.clip_low, p.clip_high)


@register("gspo", ClipRange(3e-4, 4e-4))  # GSPO paper §5.1
def gspo(x: PolicyInputs, p: ClipRange) -> Surrogate:
    """GSPO: per response min(s_i Â_i, clip(s_i) Â_i), s_i = exp(mean_t log w_it); returns [B].

    The term stays per response (averaged over responses), never broadcast over tokens and summed, which
    would weight responses by length. Per-token advantages are reduced to their mean over the response
    (exact for group advantages, which are constant along a response); use gspo_token for genuinely
    per-token advantages.
    """
    return ppo_clip(torch.exp(x.seq_log_ratio), x.seq_advantages, p.clip_low, p.clip_high)


@register("gspo_token", ClipRange(3e-4, 4e-4))  # GSPO paper's token-level variant, GSPO's clip range
def gspo_token(x: PolicyInputs, p: ClipRange) -> Surrogate:
    """GSPO-token: s_it = sg[s_i] · π_θ(y_it)/sg[π_θ(y_it)] in the GRPO-style per-token term; returns [B, T].

    s_it equals s_i in value (so clipping is decided by s_i) while its gradient is s_i ∇log π_θ(y_it);
    with Â_it = Â_i it reproduces GSPO's value, clipping and gradient.
    """
    s_i = torch.exp(x.seq_log_ratio).detach()
    s_it = s_i[:, None] * torch.exp(x.logprobs - x.logprobs.detach())
    return ppo_clip(s_it, x.token_advantages, p.clip_low, p.clip_high)


# MiniMax-M1 (arXiv 2506.13585) sets no lower bound ("ε_low^IS large") and tunes only ε_high^IS without
# publishing it; ε_low = 1 (lower bound 0, never active) and ε_high = 0.28 follow Trinity-RFT's defaults.
@register("cispo", ClipRange(1.0, 0.28))
def cispo(x: PolicyInputs, p: ClipRange) -> Surrogate:
    """CISPO: per token sg[clip(w_it, 1-ε_low, 1+ε_high)] Â_it log π_θ(y_it); returns [B, T].

    Clipping caps the (detached) IS weight but never removes a token's gradient; `clipped_*` flag tokens
    whose weight was capped, whatever the sign of Â.
    """
    ratio = torch.exp(x.log_ratio)
    weight = ratio.clamp(1.0 - p.clip_low, 1.0 + p.clip_high).detach()
    return Surrogate(weight * x.token_advantages * x.logprobs, ratio < 1.0 - p.clip_low, ratio > 1.0 + p.clip_high)


@dataclass(frozen=True)
class SapoParams:
    """SAPO's soft gate (arXiv 2511.20347; defaults as the paper, TRL, verl and torchforge)."""

    tau_pos: float = 1.0  # gate temperature for tokens with Â > 0 (larger: the gate closes faster)
    tau_neg: float = 1.05  # gate temperature for Â <= 0 (the paper keeps it above tau_pos: negative updates
    # are the less stable ones)

    def __post_init__(self):
        if not (self.tau_pos > 0 and self.tau_neg > 0):
            raise ValueError(f"bad SAPO temperatures ({self.tau_pos}, {self.tau_neg}); allowed: numbers > 0")


@register("sapo", SapoParams())
def sapo(x: PolicyInputs, p: SapoParams) -> Surrogate:
    """SAPO: per token (4/τ) σ(τ (w_it − 1)) Â_it, τ = τ_pos if Â_it > 0 else τ_neg; returns [B, T].

    A smooth gate instead of a hard clip: its gradient is 4 σ(1 − σ) ∇w_it Â_it, equal to the plain
    policy gradient on-policy (w = 1) and fading as w leaves 1. Nothing is clipped, so the clip flags are all
    false and `policy/clip_frac/*` are 0 for SAPO (docs/METRICS.md).
    """
    ratio = torch.exp(x.log_ratio)
    tau = torch.where(x.token_advantages > 0, ratio.new_tensor(p.tau_pos), ratio.new_tensor(p.tau_neg))
    gate = torch.sigmoid(tau * (ratio - 1.0)) * 4.0 / tau
    never = torch.zeros_like(x.mask)
    return Surrogate(gate * x.token_advantages, never, never)


@dataclass(frozen=True)
class GmpoParams:
    """GMPO's clip on token log-ratios (arXiv 2507.20673; default as its paper and code: ±0.4 in log space)."""

    log_clip: float = 0.4  # |log w_it| bound on the side that would increase the objective (see `gmpo`)

    def __post_init__(self):
        if not self.log_clip > 0:
            raise ValueError(f"bad GMPO log_clip {self.log_clip}; allowed: a number > 0")


@register("gmpo", GmpoParams())
def gmpo(x: PolicyInputs, p: GmpoParams) -> Surrogate:
    """GMPO: per response Â_i · exp(mean_t sgn(Â_i) min(sgn(Â_i) ℓ_it, clamp(sgn(Â_i) ℓ_it, ±log_clip))); [B].

    The geometric mean of the token ratios, each clipped in log space where it would push the objective up
    (sgn(Â) ℓ > log_clip: that token's ratio gets no gradient); on the other side the pessimistic min keeps it.
    """
    sign = torch.sign(x.token_advantages)
    signed = sign * x.log_ratio
    clipped = torch.minimum(signed, signed.clamp(-p.log_clip, p.log_clip))
    seq_log_ratio = torch.where(x.mask, sign * clipped, 0.0).sum(-1) / x.lengths
    beyond = x.mask & (signed > p.log_clip)
    return Surrogate(
        x.seq_advantages * torch.exp(seq_log_ratio),
        beyond & (x.token_advantages < 0),
        beyond & (x.token_advantages > 0),
    )


@dataclass(frozen=True)
class DppoParams:
    """DPPO's trust region on the sampled token's probability (arXiv 2602.04879) and its optional KL term. Defaults of
    dppo_tv: prime-rl's default loss (`DefaultLossConfig`: dppo_mask_low = dppo_mask_high = 0.2, kl_tau = 1e-3,
    PrimeIntellect-ai/prime-rl 559b447, packages/prime-rl-configs/src/prime_rl/configs/trainer.py); of dppo_kl:
    verl's DPPO example (examples/dppo_trainer/run_qwen30b_dppo.sh at 8f11888: binary-KL thresholds 0.05, no KL
    term)."""

    mask_low: float = 0.2  # Â < 0: a token is masked once its probability fell by more than this (TV) / binary KL
    mask_high: float = 0.2  # Â > 0: masked once its probability rose by more than this (TV) / binary KL beyond this
    kl_tau: float = 1e-3  # weight of the squared log-ratio term kl_tau · (log π_θ − log μ)² on every token

    def __post_init__(self):
        if not (self.mask_low > 0 and self.mask_high > 0 and self.kl_tau >= 0):
            raise ValueError(
                f"bad DPPO parameters (mask_low {self.mask_low}, mask_high {self.mask_high}, kl_tau {self.kl_tau}); "
                "allowed: mask_low > 0, mask_high > 0, kl_tau >= 0"
            )


def _dppo(x: PolicyInputs, p: DppoParams, masked_up: torch.Tensor, masked_down: torch.Tensor) -> Surrogate:
    """The DPPO term per token: keep · Â_it · w_it − kl_tau · ℓ_it², keep = not masked on the side Â's sign asks
    (Â > 0: `masked_up`; Â ≤ 0: `masked_down`); the gradient flows through w (∇w = w ∇log π_θ), as prime-rl's
    default loss and verl's dppo_* (whose sg[min(w, C)] log π_θ has the same gradient below C)."""
    adv = x.token_advantages
    masked = torch.where(adv > 0, masked_up, masked_down)
    ratio = torch.exp(x.log_ratio)
    term = torch.where(masked, torch.zeros_like(ratio), adv * ratio) - p.kl_tau * x.log_ratio**2
    return Surrogate(term, (adv < 0) & masked, (adv > 0) & masked)


def _probs(x: PolicyInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """(π_θ, μ) of the sampled tokens, detached: the masks are decided on them, never differentiated."""
    lp = x.logprobs.detach()
    return lp.exp(), (lp - x.log_ratio.detach()).exp()


@register("dppo_tv", DppoParams(), anchor="rollout")
def dppo_tv(x: PolicyInputs, p: DppoParams) -> Surrogate:
    """DPPO-Binary-TV: per token keep · Â w − kl_tau ℓ², w = π_θ/μ against the rollout's log-probs, a token masked
    when π_θ − μ > mask_high (Â > 0) or π_θ − μ < −mask_low (Â ≤ 0); returns [B, T] (prime-rl's default loss,
    src/prime_rl/trainer/rl/loss.py `default_loss_fn` at 559b447; verl `compute_policy_loss_dppo_tv`)."""
    prob, mu = _probs(x)
    return _dppo(x, p, prob - mu > p.mask_high, prob - mu < -p.mask_low)


BINARY_KL_EPS = 1e-8  # verl's guard in log((1 − μ) / (1 − π)) for probabilities at 1


@register("dppo_kl", DppoParams(mask_low=0.05, mask_high=0.05, kl_tau=0.0), anchor="rollout")
def dppo_kl(x: PolicyInputs, p: DppoParams) -> Surrogate:
    """DPPO-Binary-KL: dppo_tv's term with the mask on the binary KL of the sampled token, D = μ log(μ/π) + (1 − μ)
    log((1 − μ)/(1 − π)): masked when D > mask_high and π > μ (Â > 0), or D > mask_low and π < μ (Â ≤ 0); returns
    [B, T] (verl `compute_policy_loss_dppo_kl`, verl/trainer/ppo/core_algos.py)."""
    prob, mu = _probs(x)
    eps = BINARY_KL_EPS
    kl = mu * (mu.log() - prob.log()) + (1 - mu) * torch.log((1 - mu + eps) / (1 - prob + eps))
    return _dppo(x, p, (kl > p.mask_high) & (prob > mu), (kl > p.mask_low) & (prob < mu))
