"""Train–inference mismatch corrections: importance weights from the rollout engine's policy μ to the training
engine's π_old, applied beside any objective, replay mode and π_old recompute (`algo.rollout_correction`).

Per token w_t = π_old(y_t) / μ(y_t); per response W_i = exp(Σ_t log w_t), the product over the response (the
**sum** of log-ratios: a different object from GSPO's length-normalised s_i, TRL #5814); geometric
G_i = exp(mean_t log w_t) (verl's geometric mask). Modes, as the peers name them (`MODES` is this table):

| mode | weight c on token t of response i | source |
|---|---|---|
| `token_truncate` | sg[min(w_t, C)] | TIS (TRL `token_truncate`, verl token TIS, slime `--use-tis`) |
| `token_mask` | 1 if 1/C ≤ w_t ≤ C else 0 | TRL `token_mask` |
| `icepop` | 1 if α ≤ w_t ≤ β else 0 | IcePop (slime, OpenRLHF, NeMo-RL; α = 0.5, β = 2) |
| `sequence_truncate` | sg[min(W_i, C)] | TRL `sequence_truncate`, verl sequence TIS |
| `sequence_mask` | 1 if 1/C ≤ W_i ≤ C else 0 | TRL `sequence_mask` (its default with vLLM), verl sequence MIS |
| `geometric_mask` | 1 if 1/C_g ≤ G_i ≤ C_g else 0 | verl's geometric rejection |

C = `algo.rollout_correction_cap` (3.0, TRL's `vllm_importance_sampling_cap`), [α, β] = `algo.icepop_low/high`
(0.5, 2.0, IcePop's), C_g = `algo.rollout_correction_geo_cap` (1.01: ours — a geometric mean of token ratios sits
within a percent of 1 at bf16 mismatch; no peer default was found to copy). The weights are detached (they
carry no gradient), log-ratios are clamped to ±MAX_LOG_RATIO before `exp`, padding never leaks (`torch.where`),
and the objective multiplies each token's term by c (a per-response term by the mean of c over its tokens, which
is c_i itself for the sequence modes), with the whole minibatch's denominators unchanged — so micro-batch and
rank invariance hold as for the objectives. μ = π_old gives c = 1 exactly.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

from gspo_study.objectives.core import MAX_LOG_RATIO


class Mode(NamedTuple):
    """One row of the module docstring's table: what the weight is of, and what is done with it."""

    unit: str  # "token" (w_t), "sequence" (W_i) or "geometric" (G_i)
    rule: str  # "truncate" (c = sg[min(·, C)]) or "mask" (c = 1 inside the bounds, else 0)
    bounds: str  # the mask's bounds: "cap" [1/C, C], "icepop" [α, β], "geo_cap" [1/C_g, C_g]


MODES = {
    "token_truncate":    Mode("token", "truncate", "cap"),
    "token_mask":        Mode("token", "mask", "cap"),
    "icepop":            Mode("token", "mask", "icepop"),
    "sequence_truncate": Mode("sequence", "truncate", "cap"),
    "sequence_mask":     Mode("sequence", "mask", "cap"),
    "geometric_mask":    Mode("geometric", "mask", "geo_cap"),
}  # fmt: skip
CORRECTIONS = ("none", *MODES)
CORRECTION_METRICS = (
    "correction/weight/mean",
    "correction/weight/min",
    "correction/weight/max",
    "correction/ess",
    "correction/masked_frac/token",
    "correction/masked_frac/seq",
    "correction/truncated_frac/token",
    "correction/truncated_frac/seq",
)


@torch.no_grad()
def correction_weights(
    *,
    old_logprobs: Tensor,
    rollout_logprobs: Tensor,
    mask: Tensor,
    mode: str,
    cap: float,
    geo_cap: float,
    icepop: tuple[float, float],
) -> tuple[Tensor, dict[str, float]]:
    """(c [B, T] float64, 0 on padding; metrics) for `mode` (module docstring); logprobs [B, T] over the same
    positions as `mask`. Metrics are over the mode's units — tokens for token modes, responses with a valid
    token for sequence modes: the raw weight's (w, W or G) mean / min / max, the effective sample size
    (Σ c)² / (n Σ c²) of the applied weights, and the share of tokens / responses masked (c = 0) or truncated
    (w or W above C)."""
    if mode not in MODES:
        raise ValueError(f"unknown correction {mode!r}; allowed: {', '.join(MODES)}")
    m = MODES[mode]
    valid = mask.bool()
    zero = torch.zeros((), dtype=torch.float64, device=valid.device)
    log_w = torch.where(valid, old_logprobs.double() - rollout_logprobs.double(), zero)
    log_w = log_w.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    seqs = valid.any(-1)
    if m.unit == "token":
        raw, units = log_w.exp(), valid
    elif m.unit == "geometric":
        raw, units = (log_w.sum(-1) / valid.sum(-1).clamp(min=1)).exp(), seqs
    else:
        raw, units = log_w.sum(-1).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO).exp(), seqs
    lo, hi = {"cap": (1 / cap, cap), "icepop": icepop, "geo_cap": (1 / geo_cap, geo_cap)}[m.bounds]
    truncating = m.rule == "truncate"
    c = raw.clamp(max=cap) if truncating else ((raw >= lo) & (raw <= hi)).double()
    c = torch.where(units, c, zero)
    token_c = c if c.dim() == 2 else torch.where(valid, c[:, None].expand_as(log_w), zero)
    return token_c, _metrics(raw, c, units, valid, truncating, cap)


def _metrics(raw, c, units, valid, truncating: bool, cap: float) -> dict[str, float]:
    n = int(units.sum())
    if n == 0:
        return dict.fromkeys(CORRECTION_METRICS, 0.0)
    r = raw[units]
    applied = c[units]
    dropped = (applied == 0) if not truncating else torch.zeros_like(applied, dtype=torch.bool)
    cut = (r > cap) if truncating else torch.zeros_like(applied, dtype=torch.bool)
    per_token = units.dim() == 2
    tok_dropped = _spread(units, dropped, valid)
    tok_cut = _spread(units, cut, valid)
    square = float((applied**2).sum())
    return {
        "correction/weight/mean": float(r.mean()),
        "correction/weight/min": float(r.min()),
        "correction/weight/max": float(r.max()),
        "correction/ess": float(applied.sum()) ** 2 / (n * square) if square > 0 else 0.0,
        "correction/masked_frac/token": float(tok_dropped.sum()) / int(valid.sum()),
        "correction/masked_frac/seq": _seq_share(tok_dropped, valid) if per_token else float(dropped.double().mean()),
        "correction/truncated_frac/token": float(tok_cut.sum()) / int(valid.sum()),
        "correction/truncated_frac/seq": _seq_share(tok_cut, valid) if per_token else float(cut.double().mean()),
    }


def _spread(units: Tensor, flags: Tensor, valid: Tensor) -> Tensor:
    """Flags of the units (tokens [n] or responses [n]) as a [B, T] token map over valid tokens."""
    out = torch.zeros_like(valid)
    if units.dim() == 2:
        out[units] = flags
    else:
        per_seq = torch.zeros(units.shape, dtype=torch.bool, device=units.device)
        per_seq[units] = flags
        out = valid & per_seq[:, None]
    return out


def _seq_share(token_flags: Tensor, valid: Tensor) -> float:
    """Share of responses with at least one flagged token."""
    seqs = valid.any(-1)
    return float((token_flags.any(-1) & seqs).sum()) / max(int(seqs.sum()), 1)


def check_correction(mode: str, cap: float, geo_cap: float, icepop: tuple[float, float]) -> None:
    """ValueError naming the bad value (the config turns it into a one-line error)."""
    if mode not in CORRECTIONS:
        raise ValueError(f"bad value {mode!r} for 'algo.rollout_correction'; allowed: {', '.join(CORRECTIONS)}")
    if not (cap > 1 and math.isfinite(cap)):
        raise ValueError(f"bad value {cap} for 'algo.rollout_correction_cap'; allowed: a number > 1")
    if not (geo_cap > 1 and math.isfinite(geo_cap)):
        raise ValueError(f"bad value {geo_cap} for 'algo.rollout_correction_geo_cap'; allowed: a number > 1")
    if not (0 < icepop[0] < 1 < icepop[1] < math.inf):
        raise ValueError(f"bad IcePop range {list(icepop)} for 'algo.icepop_low/high'; allowed: 0 < low < 1 < high")
