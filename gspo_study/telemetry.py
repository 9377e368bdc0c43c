"""A step's telemetry: numbers that never change a training number (docs/METRICS.md). After the step's last update, on
its rollout: routing volatility, the share of the importance log-ratio that is routing (`moe/route/*`), expert load,
routers and gate drift; inside each update, the routing part of the ratio the objective itself saw
(`moe/route_obj/*`, `telemetry.update_route`) and the routing after exactly one update (`per_update/*`)."""

from __future__ import annotations

import math

import torch

from gspo_study.moe import (
    RouterOutputs,
    RoutingTrace,
    gate_drift,
    load_metrics,
    mismatch_metrics,
    replay_routing,
    router_metrics,
    routing_share,
    routing_volatility,
)
from gspo_study.rollout import RolloutBatch
from gspo_study.runtime import derive_seed
from gspo_study.step import (
    Context,
    MinibatchResult,
    OldPolicy,
    StepInputs,
    cat_outputs,
    policy_pass,
    replay_mode,
    route_dose,
    routing_context,
)
from gspo_study.train.forward import token_logprobs


@torch.no_grad()
def objective_route(ctx: Context, inputs: StepInputs, rows: torch.Tensor) -> dict[str, float] | None:
    """The routing part of the log-ratio the objective itself sees in this update (`telemetry.update_route`), on the
    update's rows among the step's telemetry rows, before the optimizer step: the update's own routing context (free,
    axis R's noisy choice, or the replayed trace) against π_old's routing replayed, both forwards at the weights the
    update's gradient was taken at. Exactly 0 under R2 and R3 (both forwards replay the same trace). None when no
    telemetry row is in the update."""
    tele, old = inputs.telemetry_rows, inputs.old
    sub = rows if tele is None else rows[torch.isin(rows, tele)]
    if old.natural is None or len(sub) == 0:
        return None
    batch, temp = inputs.batch, ctx.cfg.rollout.temperature
    fixed = (old.replay if old.replay is not None else old.natural).select(sub)
    seq, att, mask = batch.sequences[sub], batch.attention_mask[sub], batch.response_mask[sub]
    free = old.replay is None
    with routing_context(ctx.model, old.replay, sub, free, route_dose(ctx, inputs.step)) as routed:
        lp_own, _ = token_logprobs(ctx.model, seq, att, temp)
    used = routed if free else fixed  # the experts that forward used
    with replay_routing(ctx.model, fixed):
        lp_fixed, _ = token_logprobs(ctx.model, seq, att, temp)
    share = routing_share(
        old_logprobs=old.logprobs[sub],
        new_logprobs=lp_own,
        new_logprobs_old_routing=lp_fixed,
        advantages=inputs.advantages[sub],
        mask=mask,
    )
    flips = routing_volatility(fixed, used, mask)["overall"]
    keep = ("total_var", "pol_var", "var", "cov", "r2_removed_share", "abs_mean", "clip_flip_token")
    return {"flips": flips, **{k: share[k] for k in keep}}


def per_update_volatility(natural_old: RoutingTrace, result: MinibatchResult, mask: torch.Tensor) -> dict:
    """Routing volatility after exactly one optimizer update (the GSPO paper's unit): π_old's routing of the
    second minibatch's rows against the routing of the second update's own forward, which runs on the policy
    after the first update. Free: both traces come from passes the step makes anyway."""
    vol = routing_volatility(natural_old.select(result.rows), result.routing, mask[result.rows])
    return {f"moe/routing_volatility/per_update/{k}": vol[k] for k in ("overall", "tokens_any_changed")}


def pooled_route(seen: list[dict[str, float]]) -> dict[str, float]:
    """The step's `moe/route_obj/*` over its updates: variances summed (so 1 − Σ pol_var / Σ total_var is the share
    R2 removes from the step's pooled ratio), flips averaged; {} when no update was read."""
    if not seen:
        return {}
    tot = {k: sum(x[k] for x in seen) for k in ("total_var", "pol_var", "var", "cov")}
    out = {f"moe/route_obj/{k}": v / len(seen) for k, v in tot.items()}
    out["moe/route_obj/r2_removed_share"] = 1.0 - tot["pol_var"] / tot["total_var"] if tot["total_var"] > 0 else 0.0
    out["moe/route_obj/var_share"] = tot["var"] / tot["total_var"] if tot["total_var"] > 0 else 0.0
    for k in ("flips", "abs_mean", "clip_flip_token"):
        out[f"moe/route_obj/{k}"] = sum(x[k] for x in seen) / len(seen)
    return out


def route_baseline(
    ctx: Context, batch: RolloutBatch, old: OldPolicy
) -> tuple[torch.Tensor, RoutingTrace, RoutingTrace | None] | None:
    """π_old's log-probs, routing and gate weights with its routers free, for the routing telemetry: the π_old pass's
    own output, except under R3, whose π_old pass replays the rollout's routing, and under axis R's sham, whose π_old
    pass routes noisily (then one more free pass, telemetry), so the instrument reads the same whatever the run's
    replay mode or dose. None without MoE layers."""
    if old.natural is None:
        return None
    if replay_mode(ctx.cfg).replays == "rollout" or ctx.cfg.train.route_sham:
        outputs: list[RouterOutputs] = []
        lp, natural = policy_pass(ctx, batch, None, ctx.behaviour, outputs=outputs)
        return lp, natural, cat_outputs(outputs)[1]
    return old.train_logprobs, old.natural, old.gates


def telemetry(ctx: Context, inputs: StepInputs, step: int = 0) -> dict[str, float]:
    """After the step's last update, on its rollout: routing volatility (updated policy vs π_old), the share of
    the importance log-ratio that is routing (`moe/route/*`), both on `telemetry.route_rows` of the responses;
    train–inference mismatch and, where the rollout engine recorded routing, train–inference routing
    disagreement (π_old's free routing vs the engine's), both on the whole batch at no extra forward."""
    out = {}
    batch, adv, natural_old, train_lp = inputs.batch, inputs.advantages, inputs.old.natural, inputs.old.train_logprobs
    baseline, mask = inputs.baseline, batch.response_mask
    if natural_old is not None:
        rows = telemetry_rows(ctx, len(batch), step)
        sub = batch if rows is None else batch.select(rows)
        pick = (lambda x: x) if rows is None else (lambda x: x.select(rows) if isinstance(x, RoutingTrace) else x[rows])
        seen: list[RouterOutputs] = []
        new_lp, natural_new = policy_pass(ctx, sub, None, outputs=seen)
        vol = routing_volatility(pick(natural_old), natural_new, sub.response_mask)
        out.update({f"moe/routing_volatility/{k}": v for k, v in vol.items()})
        out.update(router_telemetry(ctx, seen, natural_new, sub.response_mask))
        old_lp, old_routing, old_gates = baseline
        fixed: list[RouterOutputs] = []
        new_lp_old_routing, _ = policy_pass(ctx, sub, pick(old_routing), outputs=fixed)
        if old_gates is not None:  # π_θ's gate weights at π_old's experts against π_old's own
            drift = gate_drift(pick(old_gates), cat_outputs(fixed)[1], sub.response_mask)
            out.update({f"moe/gate_drift/{k}": v for k, v in drift.items()})
        share = routing_share(
            old_logprobs=pick(old_lp),
            new_logprobs=new_lp,
            new_logprobs_old_routing=new_lp_old_routing,
            advantages=pick(adv),
            mask=sub.response_mask,
        )
        out.update({f"moe/route/{k}": v for k, v in share.items()})
        if batch.routing is not None:
            gap = routing_volatility(baseline[1], batch.routing, mask)
            out.update({f"moe/train_infer_routing/{k}": v for k, v in gap.items()})
    mm = mismatch_metrics(train_lp, batch.rollout_logprobs, mask)
    out.update({f"mismatch/{k}": v for k, v in mm.items()})
    return out


def router_telemetry(
    ctx: Context, outputs: list[RouterOutputs], natural: RoutingTrace, mask: torch.Tensor
) -> dict[str, float]:
    """The updated policy's expert load (`moe/load/*`) and routers (`moe/router/*`) on the telemetry rows: what a
    load collapse or a router running away would show (docs/METRICS.md)."""
    logits, _ = cat_outputs(outputs)
    c = ctx.model.config
    load = load_metrics(natural, mask, c.num_experts)
    routers = router_metrics(logits, mask, c.num_experts_per_tok)
    return {**{f"moe/load/{k}": v for k, v in load.items()}, **{f"moe/router/{k}": v for k, v in routers.items()}}


def telemetry_rows(ctx: Context, n: int, step: int) -> torch.Tensor | None:
    """The responses the routing telemetry's two forwards read: all (None) at `telemetry.route_rows: 1`, else a
    seeded draw of ⌈route_rows · n⌉ of them, the same for every algorithm of a seed (keyed by seed and step)."""
    share = ctx.cfg.telemetry.route_rows
    if share >= 1.0:
        return None
    k = max(1, math.ceil(share * n))
    gen = torch.Generator().manual_seed(derive_seed(ctx.cfg.seed, step, "telemetry"))
    return torch.randperm(n, generator=gen)[:k].sort().values
