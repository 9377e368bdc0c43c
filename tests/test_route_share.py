"""The routing-share instrument (`moe/route/*`): the part of the importance log-ratio that is routing, i.e. what
R2 removes. Checked against a float64 reference written out token by token, and for its invariances: zero when
routing did not change, the same numbers whatever the run's own replay mode for the same weights."""

from __future__ import annotations

import math

import pytest
import torch

from gspo_study.moe import routing_share


def reference(old, new, new_old_route, adv, mask) -> dict[str, float]:
    """The formulas of docs/METRICS.md, one valid token at a time, in float64."""
    tok = [(b, t) for b in range(mask.shape[0]) for t in range(mask.shape[1]) if mask[b, t]]
    route = {bt: float(new[bt]) - float(new_old_route[bt]) for bt in tok}
    total = {bt: float(new[bt]) - float(old[bt]) for bt in tok}
    policy = {bt: float(new_old_route[bt]) - float(old[bt]) for bt in tok}

    def var(xs):
        m = sum(xs) / len(xs)
        return sum((x - m) ** 2 for x in xs) / len(xs)

    def clipped(lr, a, lo, hi):
        r = math.exp(lr)
        return (a > 0 and r > 1 + hi) or (a < 0 and r < 1 - lo)

    seqs = sorted({b for b, _ in tok})
    mean = lambda d, b: sum(v for (bb, _), v in d.items() if bb == b) / sum(1 for bb, _ in d if bb == b)  # noqa: E731
    a = {b: float(adv[b]) for b in seqs}
    return {
        "abs_mean": sum(abs(v) for v in route.values()) / len(tok),
        "abs_max": max(abs(v) for v in route.values()),
        "var": var(list(route.values())),
        "total_var": var(list(total.values())),
        "var_share": var(list(route.values())) / var(list(total.values())),
        "seq_abs_mean": sum(abs(mean(route, b)) for b in seqs) / len(seqs),
        "clip_flip_token": sum(
            clipped(total[bt], a[bt[0]], 0.2, 0.27) != clipped(policy[bt], a[bt[0]], 0.2, 0.27) for bt in tok
        )
        / len(tok),
        "clip_flip_seq": sum(
            clipped(mean(total, b), a[b], 3e-4, 4e-4) != clipped(mean(policy, b), a[b], 3e-4, 4e-4)
            for b in seqs
        )
        / len(seqs),
    }


def test_routing_share_matches_a_float64_reference():
    g = torch.Generator().manual_seed(0)
    B, T = 6, 9
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    new_old_route = old + 0.2 * torch.randn(B, T, generator=g, dtype=torch.float64)
    new = new_old_route + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)
    mask = torch.rand(B, T, generator=g) > 0.3
    mask[-1] = False  # an empty response: left out of every response-level quantity
    adv = torch.tensor([1.0, -1.0, 0.5, -0.7, 0.0, 2.0], dtype=torch.float64)
    # padding holds garbage that must never leak
    for t in (old, new, new_old_route):
        t[~mask] = float("nan")
    got = routing_share(old_logprobs=old, new_logprobs=new, new_logprobs_old_routing=new_old_route,
                        advantages=adv, mask=mask)  # fmt: skip
    want = reference(old, new, new_old_route, adv, mask)
    assert got.keys() == want.keys()
    for key in want:
        assert got[key] == pytest.approx(want[key], rel=1e-12, abs=1e-15), key
    assert 0 < got["clip_flip_token"] < 1 and got["var_share"] > 0


def test_routing_share_is_zero_when_routing_did_not_change():
    g = torch.Generator().manual_seed(1)
    old = -torch.rand(4, 5, generator=g)
    new = old + 0.1 * torch.randn(4, 5, generator=g)
    mask = torch.ones(4, 5, dtype=torch.bool)
    got = routing_share(old_logprobs=old, new_logprobs=new, new_logprobs_old_routing=new,
                        advantages=torch.tensor([1.0, -1.0, 1.0, -1.0]), mask=mask)  # fmt: skip
    assert {k: v for k, v in got.items() if k != "total_var"} == dict.fromkeys(
        ["abs_mean", "abs_max", "var", "var_share", "seq_abs_mean", "clip_flip_token", "clip_flip_seq"], 0.0
    )
    assert got["total_var"] > 0


def perturb(model, seed: int = 3, scale: float = 0.05) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g) * p.abs().mean().clamp(min=1e-3))


def instrument(ctx, batch, adv) -> dict[str, float]:
    """What a step logs, with the trainer's own functions: π_old pass and baseline, then weights moved."""
    from gspo_study import trainer

    _, train_lp, natural_old, _ = trainer.old_policy(ctx, batch)
    baseline = trainer.route_baseline(ctx, batch, train_lp, natural_old)
    perturb(ctx.model)
    out = trainer.telemetry(ctx, batch, natural_old, train_lp, baseline, adv)
    return {k: v for k, v in out.items() if k.startswith("moe/route/")}


def test_instrument_is_the_same_whatever_the_replay_mode_and_zero_without_a_change(smoke_cfg):
    from gspo_study import trainer
    from gspo_study.objectives import group_advantages

    readings = {}
    for mode in ("none", "r2", "r3"):
        ctx = trainer.setup(smoke_cfg("algo.objective=grpo", f"algo.routing_replay={mode}"))
        rows, batch = trainer.rollout(ctx, 1)
        adv = group_advantages(torch.arange(len(batch)).float() % 2, ctx.cfg.rollout.group_size)
        if mode == "none":  # before any change: routing's part is exactly zero
            _, train_lp, natural_old, _ = trainer.old_policy(ctx, batch)
            base = trainer.route_baseline(ctx, batch, train_lp, natural_old)
            still = trainer.telemetry(ctx, batch, natural_old, train_lp, base, adv)
            assert still["moe/route/abs_max"] == 0.0 and still["moe/route/clip_flip_token"] == 0.0
        readings[mode] = instrument(ctx, batch, adv)
    assert readings["none"]["moe/route/abs_mean"] > 0  # the perturbation moved some routing
    assert readings["none"] == readings["r2"] == readings["r3"]
