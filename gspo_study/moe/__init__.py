"""MoE routing: record/replay of router choices (R2, R3) and routing telemetry.

with record_routing(model) as trace:
    model(input_ids, attention_mask=attention_mask)
with replay_routing(model, trace):
    out = model(input_ids, attention_mask=attention_mask)
stats = routing_volatility(trace_old, trace_new, mask)
"""

from gspo_study.moe.modes import REPLAY_MODES, ReplayMode
from gspo_study.moe.routing import (
    ReplayHandle,
    count_moe_layers,
    has_moe,
    moe_layers,
    record_routing,
    replay_routing,
    routers,
)
from gspo_study.moe.trace import RoutingTrace
from gspo_study.moe.volatility import changed_choices, mismatch_metrics, routing_share, routing_volatility

__all__ = [
    "REPLAY_MODES",
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
