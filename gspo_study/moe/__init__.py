"""MoE routing: record/replay of router choices (R2, R3) and routing telemetry.

with record_routing(model) as trace:
    model(input_ids, attention_mask=attention_mask)
with replay_routing(model, trace):
    out = model(input_ids, attention_mask=attention_mask)
stats = routing_volatility(trace_old, trace_new, mask)
"""

from gspo_study.moe.modes import REPLAY_MODES, ReplayMode
from gspo_study.moe.routing import (
    NoisyChoice,
    ReplayHandle,
    RouterOutputs,
    count_moe_layers,
    has_moe,
    moe_layers,
    noisy_routing,
    record_router_outputs,
    record_routing,
    replay_routing,
    routers,
)
from gspo_study.moe.trace import RoutingTrace
from gspo_study.moe.volatility import (
    changed_choices,
    gate_drift,
    load_metrics,
    mismatch_metrics,
    router_metrics,
    routing_share,
    routing_volatility,
)

__all__ = [
    "NoisyChoice",
    "REPLAY_MODES",
    "RouterOutputs",
    "gate_drift",
    "load_metrics",
    "noisy_routing",
    "record_router_outputs",
    "router_metrics",
    "ReplayMode",
    "ReplayHandle",
    "RoutingTrace",
    "changed_choices",
    "count_moe_layers",
    "has_moe",
    "mismatch_metrics",
    "moe_layers",
    "record_routing",
    "replay_routing",
    "routing_share",
    "routers",
    "routing_volatility",
]
