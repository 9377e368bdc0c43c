"""Policy-gradient objectives (GRPO, GSPO, GSPO-token, CISPO, SAPO, GMPO) as pure tensor functions, with metrics.

    objective = get_objective("gspo")                 # paper defaults; aggregation and hyperparameters optional
    objective = get_objective("sapo", tau_neg=1.1)    # each objective owns its hyperparameters
    loss, metrics = objective(logprobs=lp, old_logprobs=old_lp, advantages=adv, mask=mask)

`loss` is a scalar to minimise (the negative objective), `metrics` a dict of floats (docs/METRICS.md).
`core` holds the shared machinery and documents masking, precision, aggregation and the normaliser;
`algorithms` holds one small function per algorithm, each with its own hyperparameters. Departures from the paper:
log-ratios are clamped to ±MAX_LOG_RATIO before exp (an overflow guard), and responses with no valid token are left
out of the response count.
"""

from gspo_study.objectives import algorithms as _algorithms  # noqa: F401  (registers the objectives)
from gspo_study.objectives.advantages import group_advantages, zero_std_group_frac
from gspo_study.objectives.core import (
    AGGREGATIONS,
    MAX_LOG_RATIO,
    METRIC_NAMES,
    OBJECTIVES,
    ClipRange,
    Objective,
    ObjectiveSpec,
    PolicyInputs,
    Surrogate,
    batch_normalizer,
    combine_metrics,
    get_objective,
    ppo_clip,
    register,
)

__all__ = [
    "group_advantages",
    "zero_std_group_frac",
    "AGGREGATIONS",
    "MAX_LOG_RATIO",
    "ClipRange",
    "METRIC_NAMES",
    "OBJECTIVES",
    "Objective",
    "ObjectiveSpec",
    "PolicyInputs",
    "Surrogate",
    "batch_normalizer",
    "combine_metrics",
    "get_objective",
    "ppo_clip",
    "register",
]
