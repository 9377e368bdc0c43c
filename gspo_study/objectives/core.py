"""Shared machinery of the policy objectives: registry, input masking, aggregation, metrics.

An algorithm is one small function `surrogate(x: PolicyInputs, p) -> Surrogate` registered with
`@register(name, defaults)`, where `defaults` is an instance of the algorithm's own frozen dataclass of
hyperparameters (`ClipRange(clip_low, clip_high)` for PPO-style clipping; SAPO's temperatures, GMPO's log-space
clip, …), each field documented where it is defined. It returns the term to maximise, either per response ([B],
e.g. GSPO's min(s_i Â_i, clip(s_i) Â_i)) or per token ([B, T], the GRPO-style double sum), plus which tokens or
responses were clipped. `get_objective(name, aggregation, **hyperparameters)` binds it, a value of None keeping
the default. Everything else lives here, once, for every algorithm:

- Inputs (`prepare`): computed in float32, or in the input's precision when it is higher (float64 inputs
  stay float64, so tests can compare against float64 references). Padding may hold anything, NaN and inf
  included: it is removed with `torch.where` (NaN * 0 is NaN, so never by multiplication), which also
  gives padding an exact zero gradient. The per-token log-ratio is clamped to ±MAX_LOG_RATIO before any
  `exp`; a token beyond the clamp gets no gradient through its ratio (an overflow guard, not a method).
- Aggregation: "seq_mean" (the paper) averages a per-token term over each response, then over
  responses; a per-response term is averaged over responses. "token_mean" (DAPO) sums a per-token term
  over all tokens and divides by the number of tokens; a per-response term J_i then counts |y_i| times,
  i.e. weight |y_i| / Σ_j |y_j|. Responses with no valid token are excluded from the response count
  (weight 0, length read as 1), so they never yield NaN.
- Normaliser: the loss is -(sum of the aggregated terms) / normalizer, where normalizer is the number of
  valid responses (seq_mean) or of valid tokens (token_mean). By default it is counted from the mask
  passed in (full-batch semantics). A trainer that splits a minibatch into micro-batches passes the
  minibatch's count, `batch_normalizer(minibatch_mask, aggregation)`, to every micro-batch call: the
  micro-batch losses then sum to the minibatch loss and their gradients to its gradient (the trainer's
  `update_minibatch`; the reference loop is tests/microbatch_reference.py). Under data parallelism the count
  must also be summed over ranks (and the loss multiplied by the world size if the backend averages
  gradients over ranks).
- Metrics (`METRIC_NAMES`, docs/METRICS.md): computed without gradient, variances are
  population variances, plus the counts `policy/count/tokens` and `policy/count/seqs` that
  `combine_metrics` needs to merge micro-batch metrics into minibatch metrics.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields, is_dataclass, replace

import torch
from torch import Tensor

MAX_LOG_RATIO = 20.0  # exp() overflow guard: log-ratios are clamped to [-MAX_LOG_RATIO, MAX_LOG_RATIO]
AGGREGATIONS = ("seq_mean", "token_mean")

METRIC_NAMES = (
    "policy/clip_frac/token",
    "policy/clip_frac/seq",
    "policy/clip_frac/low",
    "policy/clip_frac/high",
    "policy/ratio/token_mean",
    "policy/ratio/token_var",
    "policy/ratio/token_max",
    "policy/ratio/token_min",
    "policy/ratio/seq_mean",
    "policy/ratio/seq_var",
    "policy/kl/k1",
    "policy/kl/k3",
    "policy/loss",
    "policy/count/tokens",
    "policy/count/seqs",
)


@dataclass(frozen=True)
class PolicyInputs:
    """Masked, upcast inputs shared by every algorithm. Padding holds 0 everywhere; B responses, T tokens."""

    mask: Tensor  # [B, T] bool, valid response tokens
    valid_seq: Tensor  # [B] bool, responses with at least one valid token
    lengths: Tensor  # [B] float, |y_i| with 0 read as 1 (empty responses carry weight 0 elsewhere)
    logprobs: Tensor  # [B, T] log π_θ, carries the gradient
    log_ratio: Tensor  # [B, T] log π_θ - log π_old, clamped to ±MAX_LOG_RATIO
    seq_log_ratio: Tensor  # [B] (1/|y_i|) Σ_t log_ratio: log of GSPO's s_i
    token_advantages: Tensor  # [B, T] Â_it (Â_i broadcast when advantages are per response)
    seq_advantages: Tensor  # [B] Â_i (mean of Â_it over the response when advantages are per token)


@dataclass(frozen=True)
class Surrogate:
    """What an algorithm returns: the term to maximise and where clipping acted.

    objective: [B] per-response term or [B, T] per-token term (values at padding are ignored).
    clipped_low / clipped_high: bool, [B] (every token of the response) or [B, T]; for PPO-style clipping,
    where the gradient is zeroed by the lower bound (Â < 0, ratio < 1 - ε_low) or the upper bound
    (Â > 0, ratio > 1 + ε_high).
    """

    objective: Tensor
    clipped_low: Tensor
    clipped_high: Tensor


SurrogateFn = Callable[..., Surrogate]


@dataclass(frozen=True)
class ClipRange:
    """PPO-style trust region of the importance ratio: [1 − clip_low, 1 + clip_high]."""

    clip_low: float  # ε_low, in [0, 1] (1: no lower bound)
    clip_high: float  # ε_high, >= 0

    def __post_init__(self):
        if not (0 <= self.clip_low <= 1 and 0 <= self.clip_high < 10):
            raise ValueError(
                f"bad clip range ({self.clip_low}, {self.clip_high}); allowed: clip_low in [0, 1], clip_high in [0, 10)"
            )


ANCHORS = ("old", "rollout")  # what an objective's ratio is taken against (`register`)


@dataclass(frozen=True)
class ObjectiveSpec:
    """A registered algorithm: its surrogate function, its default hyperparameters (a frozen dataclass) and the
    policy its ratio is anchored to: "old" (π_old, recomputed or the rollout's as `algo.old_logprobs` says) or
    "rollout" (μ, the rollout engine's own log-probs, by definition: there is no π_old, so nothing for R2 to replay
    and nothing for a train–inference correction to correct; the config refuses both, `validate`)."""

    name: str
    surrogate: SurrogateFn
    defaults: object
    anchor: str = "old"

    @property
    def hyperparameters(self) -> tuple[str, ...]:
        return tuple(f.name for f in fields(self.defaults))


OBJECTIVES: dict[str, ObjectiveSpec] = {}


def register(name: str, defaults, anchor: str = "old") -> Callable[[SurrogateFn], SurrogateFn]:
    """Decorator adding `surrogate` to OBJECTIVES under `name`, with `defaults`: an instance of its own frozen
    dataclass of hyperparameters (e.g. `ClipRange(0.2, 0.27)`), and the policy its ratio is `anchor`ed to
    (`ObjectiveSpec`)."""
    if not is_dataclass(defaults) or isinstance(defaults, type):
        raise TypeError(f"objective {name!r}: defaults must be a dataclass instance, got {defaults!r}")
    if anchor not in ANCHORS:
        raise ValueError(f"objective {name!r}: bad anchor {anchor!r}; allowed: {', '.join(ANCHORS)}")

    def add(surrogate: SurrogateFn) -> SurrogateFn:
        if name in OBJECTIVES:
            raise ValueError(f"objective {name!r} is already registered")
        OBJECTIVES[name] = ObjectiveSpec(name, surrogate, defaults, anchor)
        return surrogate

    return add


def ppo_clip(ratio: Tensor, advantages: Tensor, clip_low: float, clip_high: float) -> Surrogate:
    """PPO's pessimistic term min(r Â, clip(r, 1-ε_low, 1+ε_high) Â), elementwise on [B] or [B, T]."""
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    objective = torch.minimum(ratio * advantages, clipped * advantages)
    # Exactly where min() picks the constant clipped branch, i.e. where the gradient is zeroed.
    low = (advantages < 0) & (ratio < 1.0 - clip_low)
    high = (advantages > 0) & (ratio > 1.0 + clip_high)
    return Surrogate(objective, low, high)


def compute_dtype(*tensors: Tensor) -> torch.dtype:
    """float32, or the inputs' precision when higher (float64)."""
    dtype = torch.float32
    for t in tensors:
        dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def prepare(*, logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor) -> PolicyInputs:
    """Check shapes, upcast, and neutralise padding (see the module docstring)."""
    if logprobs.dim() != 2 or old_logprobs.shape != logprobs.shape or mask.shape != logprobs.shape:
        raise ValueError(
            f"logprobs, old_logprobs and mask must share one [B, T] shape; got {tuple(logprobs.shape)}, "
            f"{tuple(old_logprobs.shape)}, {tuple(mask.shape)}"
        )
    if advantages.shape not in (logprobs.shape[:1], logprobs.shape):
        raise ValueError(
            f"advantages must be [B] or [B, T]; got {tuple(advantages.shape)} for logprobs {tuple(logprobs.shape)}"
        )
    dtype = compute_dtype(logprobs, old_logprobs)
    mask = mask.bool()
    count = mask.sum(-1)
    valid_seq = count > 0
    lengths = count.clamp(min=1).to(dtype)
    zero = torch.zeros((), dtype=dtype, device=logprobs.device)
    lp = torch.where(mask, logprobs.to(dtype), zero)
    old = torch.where(mask, old_logprobs.detach().to(dtype), zero)
    log_ratio = (lp - old).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    adv = advantages.detach().to(dtype)
    if adv.dim() == 1:
        seq_adv = torch.where(valid_seq, adv, zero)
        tok_adv = torch.where(mask, seq_adv[:, None], zero)
    else:
        tok_adv = torch.where(mask, adv, zero)
        seq_adv = tok_adv.sum(-1) / lengths
    return PolicyInputs(
        mask=mask,
        valid_seq=valid_seq,
        lengths=lengths,
        logprobs=lp,
        log_ratio=log_ratio,
        seq_log_ratio=log_ratio.sum(-1) / lengths,
        token_advantages=tok_adv,
        seq_advantages=seq_adv,
    )


def batch_normalizer(mask: Tensor, aggregation: str = "seq_mean") -> int:
    """Loss denominator of a whole (mini)batch: valid responses (seq_mean) or valid tokens (token_mean).

    Never below 1, so an all-padding batch gives loss 0, not NaN.
    """
    _check_aggregation(aggregation)
    mask = mask.bool()
    count = mask.any(-1).sum() if aggregation == "seq_mean" else mask.sum()
    return max(int(count), 1)


def aggregate(objective: Tensor, x: PolicyInputs, aggregation: str, weights: Tensor | None = None) -> Tensor:
    """Sum of the objective with the aggregation's weights, before division by the normaliser. `weights`
    [B, T] (detached, e.g. a train–inference correction, `objectives.correction`) multiply each token's term,
    and a per-response term by their mean over the response's tokens."""
    zero = torch.zeros((), dtype=objective.dtype, device=objective.device)
    if weights is not None:
        w = torch.where(x.mask, weights.detach().to(objective.dtype), zero)
        objective = objective * (w.sum(-1) / x.lengths if objective.dim() == 1 else w)
    if objective.dim() == 1:  # per response: J_i, or |y_i| J_i for token_mean
        weighted = objective * x.lengths if aggregation == "token_mean" else objective
        return torch.where(x.valid_seq, weighted, zero).sum()
    per_seq = torch.where(x.mask, objective, zero).sum(-1)
    if aggregation == "seq_mean":
        per_seq = per_seq / x.lengths
    return per_seq.sum()


@dataclass(frozen=True)
class Objective:
    """A registered algorithm bound to its hyperparameters and an aggregation; call it to get (loss, metrics)."""

    name: str
    surrogate: SurrogateFn
    params: object  # the algorithm's hyperparameter dataclass (e.g. ClipRange)
    aggregation: str = "seq_mean"

    def __call__(
        self,
        *,
        logprobs: Tensor,
        old_logprobs: Tensor,
        advantages: Tensor,
        mask: Tensor,
        normalizer: float | Tensor | None = None,
        weights: Tensor | None = None,
    ) -> tuple[Tensor, dict[str, float]]:
        """Loss to minimise (a scalar, -objective) and metrics (python floats).

        logprobs [B, T] (with grad), old_logprobs [B, T], advantages [B] or [B, T], mask [B, T] bool or 0/1.
        normalizer: the loss denominator; None counts it from `mask` (full batch). For a micro-batch,
        pass `self.batch_normalizer(minibatch_mask)`. weights [B, T]: per-token multipliers of the terms
        (a rollout correction; None: all 1).
        """
        x = prepare(logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages, mask=mask)
        surrogate = self.surrogate(x, self.params)
        if normalizer is None:
            normalizer = batch_normalizer(x.mask, self.aggregation)
        loss = -aggregate(surrogate.objective, x, self.aggregation, weights) / normalizer
        return loss, compute_metrics(x, surrogate, loss)

    def batch_normalizer(self, mask: Tensor) -> int:
        """The loss denominator of the batch `mask` belongs to, for this objective's aggregation."""
        return batch_normalizer(mask, self.aggregation)


def get_objective(name: str, aggregation: str = "seq_mean", **hyperparameters) -> Objective:
    """The registered objective `name` with its hyperparameters; a missing or None one keeps the algorithm's
    default, one the algorithm does not have is a ValueError naming those it has."""
    if name not in OBJECTIVES:
        raise ValueError(f"unknown objective {name!r}; allowed: {', '.join(sorted(OBJECTIVES))}")
    _check_aggregation(aggregation)
    spec = OBJECTIVES[name]
    given = {k: v for k, v in hyperparameters.items() if v is not None}
    unknown = sorted(set(given) - set(spec.hyperparameters))
    if unknown:
        raise ValueError(
            f"objective {name!r} has no hyperparameter {', '.join(map(repr, unknown))}; allowed: "
            f"{', '.join(spec.hyperparameters)}"
        )
    bad = {k: v for k, v in given.items() if isinstance(v, bool) or not isinstance(v, (int, float))}
    if bad:
        raise ValueError(f"hyperparameters of {name!r} are numbers; got {bad}")
    return Objective(
        name, spec.surrogate, replace(spec.defaults, **{k: float(v) for k, v in given.items()}), aggregation
    )


def _check_aggregation(aggregation: str) -> None:
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"unknown aggregation {aggregation!r}; allowed: {', '.join(AGGREGATIONS)}")


# ----------------------------------------------------------------------------------------------- metrics


def _per_token(flags: Tensor, mask: Tensor) -> Tensor:
    """Per-response flags [B] spread over the response's valid tokens; per-token flags [B, T] masked."""
    return (flags[:, None] if flags.dim() == 1 else flags) & mask


def _mean(values: Tensor, where: Tensor) -> Tensor:
    zero = torch.zeros((), dtype=values.dtype, device=values.device)
    return torch.where(where, values, zero).sum() / where.sum().clamp(min=1)


def _var(values: Tensor, where: Tensor) -> Tensor:
    """Population variance (divides by n), two-pass for precision near ratio 1."""
    return _mean((values - _mean(values, where)) ** 2, where)


@torch.no_grad()
def compute_metrics(x: PolicyInputs, surrogate: Surrogate, loss: Tensor) -> dict[str, float]:
    """The metrics of docs/METRICS.md, one host sync for all of them."""
    mask, valid = x.mask, x.valid_seq
    dtype = x.log_ratio.dtype
    low = _per_token(surrogate.clipped_low, mask)
    high = _per_token(surrogate.clipped_high, mask)
    clipped = low | high
    log_ratio = x.log_ratio.detach()
    ratio = log_ratio.exp()
    seq_ratio = x.seq_log_ratio.detach().exp()
    n_tok = mask.sum()
    nan = torch.full((), math.nan, dtype=dtype, device=mask.device)
    stats = {
        "policy/clip_frac/token": _mean(clipped.to(dtype), mask),
        "policy/clip_frac/seq": _mean(clipped.any(-1).to(dtype), valid),
        "policy/clip_frac/low": _mean(low.to(dtype), mask),
        "policy/clip_frac/high": _mean(high.to(dtype), mask),
        "policy/ratio/token_mean": _mean(ratio, mask),
        "policy/ratio/token_var": _var(ratio, mask),
        # NaN when there is no valid token (combine_metrics skips such parts).
        "policy/ratio/token_max": torch.where(n_tok > 0, torch.where(mask, ratio, -math.inf).max(), nan),
        "policy/ratio/token_min": torch.where(n_tok > 0, torch.where(mask, ratio, math.inf).min(), nan),
        "policy/ratio/seq_mean": _mean(seq_ratio, valid),
        "policy/ratio/seq_var": _var(seq_ratio, valid),
        "policy/kl/k1": _mean(-log_ratio, mask),
        # k3 = (r - 1) - log r with r = π_θ/π_old; expm1 avoids cancellation for r near 1.
        "policy/kl/k3": _mean(torch.expm1(log_ratio) - log_ratio, mask),
        "policy/loss": loss.detach().to(dtype),
        "policy/count/tokens": n_tok.to(dtype),
        "policy/count/seqs": valid.sum().to(dtype),
    }
    values = torch.stack(list(stats.values())).tolist()
    return dict(zip(stats, values))


_TOKEN_MEANS = ("clip_frac/token", "clip_frac/low", "clip_frac/high", "ratio/token_mean", "kl/k1", "kl/k3")
_SEQ_MEANS = ("clip_frac/seq", "ratio/seq_mean")


def combine_metrics(parts: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """Merge the metrics of micro-batch calls into the metrics of their union.

    Means are re-weighted by the counts, variances merged exactly (pooled within + between parts), max/min
    taken over parts, and `policy/loss` summed: this assumes every part was called with the union's
    normaliser, so that the micro-batch losses sum to the union's loss.
    """
    if not parts:
        raise ValueError("combine_metrics needs at least one part")
    tokens = [p["policy/count/tokens"] for p in parts]
    seqs = [p["policy/count/seqs"] for p in parts]
    out: dict[str, float] = {}
    for key in _TOKEN_MEANS:
        out[f"policy/{key}"] = _weighted_mean([p[f"policy/{key}"] for p in parts], tokens)
    for key in _SEQ_MEANS:
        out[f"policy/{key}"] = _weighted_mean([p[f"policy/{key}"] for p in parts], seqs)
    out["policy/ratio/token_var"] = _pooled_var(parts, "token", tokens)
    out["policy/ratio/seq_var"] = _pooled_var(parts, "seq", seqs)
    with_tokens = [p for p, n in zip(parts, tokens) if n > 0]
    out["policy/ratio/token_max"] = max((p["policy/ratio/token_max"] for p in with_tokens), default=math.nan)
    out["policy/ratio/token_min"] = min((p["policy/ratio/token_min"] for p in with_tokens), default=math.nan)
    out["policy/loss"] = math.fsum(p["policy/loss"] for p in parts)
    out["policy/count/tokens"] = math.fsum(tokens)
    out["policy/count/seqs"] = math.fsum(seqs)
    return {k: out[k] for k in METRIC_NAMES}


def _weighted_mean(values: Sequence[float], counts: Sequence[float]) -> float:
    total = math.fsum(counts)
    return math.fsum(v * n for v, n in zip(values, counts)) / max(total, 1.0)


def _pooled_var(parts: Sequence[Mapping[str, float]], level: str, counts: Sequence[float]) -> float:
    means = [p[f"policy/ratio/{level}_mean"] for p in parts]
    variances = [p[f"policy/ratio/{level}_var"] for p in parts]
    mean = _weighted_mean(means, counts)
    return _weighted_mean([v + (m - mean) ** 2 for v, m in zip(variances, means)], counts)
