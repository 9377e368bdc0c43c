"""Routing telemetry: expert volatility between two traces, and train–inference probability mismatch.

Formulas are listed in docs/METRICS.md. Every reduction runs over valid tokens only, selected with
`torch.where` (padding may hold garbage, even NaN), and denominators are the whole batch's counts.
An empty selection gives 0.0 rather than NaN so logging never breaks.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from gspo_study.moe.trace import RoutingTrace

# exp(±50) is finite in float64, and a token that far off is extreme under any threshold anyway.
_MAX_LOG_RATIO = 50.0


def _valid_mask(mask: torch.Tensor | None, shape: tuple[int, int], device: torch.device) -> torch.Tensor:
    if mask is None:
        return torch.ones(shape, dtype=torch.bool, device=device)
    if tuple(mask.shape) != tuple(shape):
        raise ValueError(f"mask has shape {tuple(mask.shape)}, expected {tuple(shape)}")
    return mask.to(device=device, dtype=torch.bool)


def changed_choices(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """[B, T] count of experts in each token's new top-k set that are not in its old set (order-free)."""
    kept = (new.unsqueeze(-1) == old.unsqueeze(-2)).any(dim=-1).sum(dim=-1)
    return new.shape[-1] - kept


@torch.no_grad()
def routing_volatility(
    trace_old: RoutingTrace, trace_new: RoutingTrace, mask: torch.Tensor | None = None
) -> dict[str, float]:
    """Share of activated (token, layer, expert) choices that differ between two traces of one batch.

    Returns "overall", "tokens_any_changed" (share of valid tokens whose set changed in ≥1 MoE layer) and
    "layer_XX" per MoE layer (XX = decoder layer index). `mask` [B, T] marks valid trace positions.
    """
    if trace_old.layers != trace_new.layers or trace_old.shape != trace_new.shape:
        raise ValueError(f"routing traces differ in layers or shape: {trace_old!r} vs {trace_new!r}")
    batch, seq, k = trace_old.shape
    device = trace_old.device
    valid = _valid_mask(mask, (batch, seq), device)
    n_valid = int(valid.sum())
    any_changed = torch.zeros(batch, seq, dtype=torch.bool, device=device)
    per_layer: dict[str, float] = {}
    total = 0
    for layer in trace_old.layers:
        changed = changed_choices(trace_old.layer(layer), trace_new.layer(layer).to(device))
        changed = torch.where(valid, changed, 0)
        any_changed |= changed > 0
        n_changed = int(changed.sum())
        total += n_changed
        per_layer[f"layer_{layer:02d}"] = _share(n_changed, k * n_valid)
    return {
        "overall": _share(total, k * n_valid * len(per_layer)),
        "tokens_any_changed": _share(int(any_changed.sum()), n_valid),
        **per_layer,
    }


@torch.no_grad()
def mismatch_metrics(
    train_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    mask: torch.Tensor | None = None,
    taus: Sequence[float] = (2.0, 10.0),
) -> dict[str, float]:
    """Train–inference mismatch on the sampled tokens (R3 paper's metrics).

    With r = p_train / p_rollout per valid token (tokens were sampled by the rollout policy):
    "k3" = mean(r − 1 − log r), an unbiased, non-negative estimate of KL(rollout ‖ train);
    "f_tau_<τ>" = share of tokens with max(r, 1/r) > τ, i.e. |log r| > log τ.
    """
    if train_logprobs.shape != rollout_logprobs.shape:
        raise ValueError(f"log-prob shapes differ: {tuple(train_logprobs.shape)} vs {tuple(rollout_logprobs.shape)}")
    device = train_logprobs.device
    valid = _valid_mask(mask, tuple(train_logprobs.shape), device)
    n_valid = int(valid.sum())
    log_r = torch.where(valid, train_logprobs.double() - rollout_logprobs.to(device).double(), 0.0)
    log_r = log_r.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    k3 = torch.where(valid, torch.expm1(log_r) - log_r, 0.0)  # expm1: exact near r = 1
    stats = {"k3": _share(float(k3.sum()), n_valid)}
    for tau in taus:
        extreme = valid & (log_r.abs() > math.log(tau))
        stats[f"f_tau_{tau:g}"] = _share(int(extreme.sum()), n_valid)
    return stats


def _share(num: float, den: int) -> float:
    return float(num) / den if den else 0.0


# The paper's clip ranges (§5.1), at which the instrument asks whether routing alone flips a clip decision.
GRPO_CLIP = (0.2, 0.27)
GSPO_CLIP = (3e-4, 4e-4)


def _clipped(log_ratio: torch.Tensor, advantages: torch.Tensor, clip: tuple[float, float]) -> torch.Tensor:
    """PPO's clip decision in log space: Â > 0 and r > 1 + ε_high, or Â < 0 and r < 1 − ε_low."""
    low, high = clip
    return ((advantages > 0) & (log_ratio > math.log1p(high))) | ((advantages < 0) & (log_ratio < math.log1p(-low)))


# |ℓ^route| quantiles the instrument logs (besides its mean and max)
ROUTE_QUANTILES = (0.5, 0.9, 0.99)


@torch.no_grad()
def routing_share(
    *,
    old_logprobs: torch.Tensor,
    new_logprobs: torch.Tensor,
    new_logprobs_old_routing: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
) -> dict[str, float]:
    """How much of the importance log-ratio is routing: the part R2 removes (docs/METRICS.md, `moe/route/*`).

    ℓ_t = log π_θ(y_t; own routing) − log π_old(y_t; own routing) splits into a policy part
    ℓ^pol_t = log π_θ(y_t; π_old's routing) − log π_old(y_t) and a routing part
    ℓ^route_t = log π_θ(y_t; own routing) − log π_θ(y_t; π_old's routing), so that
    Var ℓ = Var ℓ^pol + Var ℓ^route + 2 Cov(ℓ^pol, ℓ^route) exactly; R2 would leave ℓ^pol, removing the share
    1 − Var ℓ^pol / Var ℓ of Var ℓ (negative when routing anti-correlates with the policy part). The same split
    for GSPO's log s_i = m_i(ℓ) (the mean over response i's tokens). All tensors [B, T] over the same positions
    (advantages [B]); reductions over valid tokens (`mask`), or responses with at least one. Clip flips: tokens
    (GRPO's range) and responses (GSPO's s_i and range) whose clip decision differs between ℓ and ℓ^pol, over
    all of them and over those with a nonzero advantage (the only ones a clip can act on).
    """
    valid = mask.bool()
    zero = torch.zeros((), dtype=torch.float64, device=valid.device)
    old = torch.where(valid, old_logprobs.double(), zero)
    new = torch.where(valid, new_logprobs.double(), zero)
    new_old_route = torch.where(valid, new_logprobs_old_routing.double(), zero)
    total, route = new - old, new - new_old_route
    policy = new_old_route - old
    n_tok = int(valid.sum())
    seqs = valid.any(-1)
    lengths = valid.sum(-1).clamp(min=1)
    adv = advantages.double()
    tok_adv = torch.where(valid, adv[:, None].expand_as(valid), zero)
    flips_tok = valid & (_clipped(total, tok_adv, GRPO_CLIP) != _clipped(policy, tok_adv, GRPO_CLIP))
    seq_total, seq_policy, seq_route = (x.sum(-1) / lengths for x in (total, policy, route))
    flips_seq = seqs & (_clipped(seq_total, adv, GSPO_CLIP) != _clipped(seq_policy, adv, GSPO_CLIP))
    active_tok, active_seq = valid & (tok_adv != 0), seqs & (adv != 0)
    out = {
        "abs_mean": _share(float(route.abs().sum()), n_tok),
        "abs_max": float(route.abs().max()) if n_tok else 0.0,
        **_abs_quantiles(route[valid]),
        **_split("", total, policy, route, valid),
        "seq_abs_mean": _share(float(torch.where(seqs, seq_route.abs(), zero).sum()), int(seqs.sum())),
        **_split("seq_", seq_total, seq_policy, seq_route, seqs),
        "clip_flip_token": _share(int(flips_tok.sum()), n_tok),
        "clip_flip_seq": _share(int(flips_seq.sum()), int(seqs.sum())),
        "clip_flip_token_active": _share(int((flips_tok & active_tok).sum()), int(active_tok.sum())),
        "clip_flip_seq_active": _share(int((flips_seq & active_seq).sum()), int(active_seq.sum())),
    }
    out["seq_abs_over_clip"] = out["seq_abs_mean"] / GSPO_CLIP[1]  # routing's part of log s_i / ε_high
    return out


def _abs_quantiles(values: torch.Tensor) -> dict[str, float]:
    """|x| quantiles (linear interpolation, as numpy's default); 0 for no values."""
    if values.numel() == 0:
        return {f"abs_p{round(q * 100)}": 0.0 for q in ROUTE_QUANTILES}
    qs = torch.quantile(values.abs(), torch.tensor(ROUTE_QUANTILES, dtype=values.dtype, device=values.device))
    return {f"abs_p{round(q * 100)}": float(v) for q, v in zip(ROUTE_QUANTILES, qs)}


def _split(prefix: str, total, policy, route, valid) -> dict[str, float]:
    """Var ℓ = Var ℓ^pol + Var ℓ^route + 2 Cov: every term, routing's own share Var ℓ^route / Var ℓ, and the share
    R2 removes, 1 − Var ℓ^pol / Var ℓ (both 0 when Var ℓ = 0)."""
    var_total, var_pol, var_route = (_masked_var(x, valid) for x in (total, policy, route))
    cov = _masked_cov(policy, route, valid)
    ok = var_total > 0
    return {
        f"{prefix}var": var_route,
        f"{prefix}total_var": var_total,
        f"{prefix}pol_var": var_pol,
        f"{prefix}cov": cov,
        f"{prefix}var_share": var_route / var_total if ok else 0.0,
        f"{prefix}r2_removed_share": 1.0 - var_pol / var_total if ok else 0.0,
    }


def _masked_cov(x: torch.Tensor, y: torch.Tensor, valid: torch.Tensor) -> float:
    """Population covariance over the valid entries, two-pass (0 for none)."""
    n = int(valid.sum())
    if n == 0:
        return 0.0
    mx = torch.where(valid, x, 0.0).sum() / n
    my = torch.where(valid, y, 0.0).sum() / n
    return float(torch.where(valid, (x - mx) * (y - my), 0.0).sum() / n)


def _masked_var(values: torch.Tensor, valid: torch.Tensor) -> float:
    """Population variance over the valid entries, two-pass (0 for fewer than one)."""
    n = int(valid.sum())
    if n == 0:
        return 0.0
    mean = torch.where(valid, values, 0.0).sum() / n
    return float(torch.where(valid, (values - mean) ** 2, 0.0).sum() / n)


# ------------------------------------------------------------------------------------------------ expert load, routers
@torch.no_grad()
def load_metrics(trace: RoutingTrace, mask: torch.Tensor, num_experts: int) -> dict[str, float]:
    """Expert load per MoE layer over the valid tokens (`mask` [B, T]), from the experts they used (`trace`), and the
    mean over layers ("…/mean"; "max_share/max": the worst layer). With load_e = share of the layer's (token, slot)
    choices that went to expert e (Σ_e load_e = 1): `max_share` = max_e load_e (1/E when balanced, 1 when one expert
    takes every choice); `entropy` = −Σ_e load_e log load_e / log E (1 balanced, 0 one expert); `dead_frac` = share of
    experts no valid token chose; `max_vio` = (max_e load_e − mean_e load_e) / mean_e load_e, verl's and prime-rl's
    load-imbalance measure (0 balanced, E − 1 one expert). A layer with no valid token reads 0."""
    out: dict[str, float] = {}
    valid = mask.bool()
    names = ("max_share", "entropy", "dead_frac", "max_vio")
    per: dict[str, list[float]] = {n: [] for n in names}
    for layer in trace.layers:
        ids = trace.layer(layer)[valid.to(trace.device)]  # [N, k]
        counts = torch.bincount(ids.reshape(-1), minlength=num_experts)[:num_experts].double()
        total = float(counts.sum())
        if total == 0:
            vals = dict.fromkeys(names, 0.0)
        else:
            load = counts / total
            nz = load[load > 0]
            mean = 1.0 / num_experts
            vals = {
                "max_share": float(load.max()),
                "entropy": float(-(nz * nz.log()).sum() / math.log(num_experts)) if num_experts > 1 else 1.0,
                "dead_frac": float((counts == 0).double().mean()),
                "max_vio": float((load.max() - mean) / mean),
            }
        for n in names:
            out[f"{n}/layer_{layer:02d}"] = vals[n]
            per[n].append(vals[n])
    for n in names:
        out[f"{n}/mean"] = sum(per[n]) / len(per[n]) if per[n] else 0.0
    out["max_share/max"] = max(per["max_share"], default=0.0)
    return out


@torch.no_grad()
def router_metrics(logits: dict[int, torch.Tensor], mask: torch.Tensor, top_k: int) -> dict[str, float]:
    """Per MoE layer over the valid tokens, and the mean over layers: `logit_norm` = mean over tokens of the L2 norm of
    the router's logit vector [E]; `topk_margin` = mean over tokens of (k-th − (k+1)-th largest logit), the gap a
    perturbation of the logits must cross to change a token's expert set (0 when k = E)."""
    valid = mask.bool()
    out: dict[str, float] = {}
    norms, margins = [], []
    for layer, z in sorted(logits.items()):
        v = z[valid.to(z.device)].double()  # [N, E]
        if v.shape[0] == 0:
            norm = margin = 0.0
        else:
            norm = float(v.norm(dim=-1).mean())
            if top_k < v.shape[-1]:
                top = torch.topk(v, top_k + 1, dim=-1).values
                margin = float((top[:, top_k - 1] - top[:, top_k]).mean())
            else:
                margin = 0.0
        out[f"logit_norm/layer_{layer:02d}"], out[f"topk_margin/layer_{layer:02d}"] = norm, margin
        norms.append(norm)
        margins.append(margin)
    out["logit_norm/mean"] = sum(norms) / len(norms) if norms else 0.0
    out["topk_margin/mean"] = sum(margins) / len(margins) if margins else 0.0
    return out


@torch.no_grad()
def gate_drift(gates_old: RoutingTrace, gates_new: RoutingTrace, mask: torch.Tensor) -> dict[str, float]:
    """Mean |g_new − g_old| over the valid tokens' k gate weights, per MoE layer and the mean over layers, where both
    are the gate weights at the *same* experts (π_old's): how far the updated routers reweight the experts π_old chose
    — what replaying expert ids leaves free (Miles #2722)."""
    valid = mask.bool()
    out: dict[str, float] = {}
    vals = []
    for layer in gates_old.layers:
        a = gates_old.layer(layer)[valid.to(gates_old.device)].double()
        b = gates_new.layer(layer).to(gates_old.device)[valid.to(gates_old.device)].double()
        v = float((a - b).abs().mean()) if a.numel() else 0.0
        out[f"layer_{layer:02d}"] = v
        vals.append(v)
    out["mean"] = sum(vals) / len(vals) if vals else 0.0
    return out
