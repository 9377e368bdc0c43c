"""The routing-share instrument (`moe/route/*`): the part of the importance log-ratio that is routing, i.e. what
R2 removes. Checked against a float64 reference written out token by token, and for its invariances: zero when
routing did not change, the same numbers whatever the run's own replay mode for the same weights."""

from __future__ import annotations

import math

import pytest
import torch

from gspo_study import step as step_mod
from gspo_study import telemetry as tele
from gspo_study.moe import routing_share
from gspo_study.run import resolve_run
from gspo_study.runtime import derive_seed


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

    def cov(xs, ys):
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / len(xs)

    def quantile(xs, q):  # linear interpolation between order statistics (numpy's default)
        xs = sorted(xs)
        pos = q * (len(xs) - 1)
        lo = math.floor(pos)
        hi = min(lo + 1, len(xs) - 1)
        return xs[lo] + (pos - lo) * (xs[hi] - xs[lo])

    def split(prefix, tot, pol, rou):
        return {
            f"{prefix}var": var(rou),
            f"{prefix}total_var": var(tot),
            f"{prefix}pol_var": var(pol),
            f"{prefix}cov": cov(pol, rou),
            f"{prefix}var_share": var(rou) / var(tot),
            f"{prefix}r2_removed_share": 1 - var(pol) / var(tot),
        }

    seqs = sorted({b for b, _ in tok})
    mean = lambda d, b: sum(v for (bb, _), v in d.items() if bb == b) / sum(1 for bb, _ in d if bb == b)  # noqa: E731
    a = {b: float(adv[b]) for b in seqs}
    flip_tok = {bt: clipped(total[bt], a[bt[0]], 0.2, 0.27) != clipped(policy[bt], a[bt[0]], 0.2, 0.27) for bt in tok}
    flip_seq = {
        b: clipped(mean(total, b), a[b], 3e-4, 4e-4) != clipped(mean(policy, b), a[b], 3e-4, 4e-4) for b in seqs
    }
    active_tok = [bt for bt in tok if a[bt[0]] != 0]
    active_seq = [b for b in seqs if a[b] != 0]
    abs_route = [abs(v) for v in route.values()]
    seq_abs_mean = sum(abs(mean(route, b)) for b in seqs) / len(seqs)
    return {
        "abs_mean": sum(abs_route) / len(tok),
        "abs_max": max(abs_route),
        "abs_p50": quantile(abs_route, 0.5),
        "abs_p90": quantile(abs_route, 0.9),
        "abs_p99": quantile(abs_route, 0.99),
        **split("", list(total.values()), list(policy.values()), list(route.values())),
        "seq_abs_mean": seq_abs_mean,
        **split("seq_", *([mean(d, b) for b in seqs] for d in (total, policy, route))),
        "clip_flip_token": sum(flip_tok.values()) / len(tok),
        "clip_flip_seq": sum(flip_seq.values()) / len(seqs),
        "clip_flip_token_active": sum(flip_tok[bt] for bt in active_tok) / len(active_tok),
        "clip_flip_seq_active": sum(flip_seq[b] for b in active_seq) / len(active_seq),
        "seq_abs_over_clip": seq_abs_mean / 4e-4,
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
    got = routing_share(
        old_logprobs=old, new_logprobs=new, new_logprobs_old_routing=new_old_route, advantages=adv, mask=mask
    )
    want = reference(old, new, new_old_route, adv, mask)
    assert got.keys() == want.keys()
    for key in want:
        assert got[key] == pytest.approx(want[key], rel=1e-12, abs=1e-15), key
    assert 0 < got["clip_flip_token"] < 1 and got["var_share"] > 0
    # a decomposition: Var ℓ = Var ℓ^pol + Var ℓ^route + 2 Cov, at the token and the sequence level
    for p in ("", "seq_"):
        parts = got[f"{p}pol_var"] + got[f"{p}var"] + 2 * got[f"{p}cov"]
        assert got[f"{p}total_var"] == pytest.approx(parts, rel=1e-12)
    # only responses with a nonzero advantage can flip (response 4 has Â = 0 and must not count)
    assert got["clip_flip_token_active"] >= got["clip_flip_token"]


def test_r2_removed_share_can_be_negative_and_differs_from_routings_own_share():
    """Routing anti-correlated with the policy part: R2 would *raise* Var ℓ (a negative removed share), while
    routing's own share Var ℓ^route / Var ℓ stays positive — the reading the old instrument could not tell."""
    g = torch.Generator().manual_seed(5)
    old = -torch.rand(8, 12, generator=g, dtype=torch.float64)
    pol = 0.3 * torch.randn(8, 12, generator=g, dtype=torch.float64)
    route = -0.5 * pol + 0.01 * torch.randn(8, 12, generator=g, dtype=torch.float64)
    new_old_route = old + pol
    new = new_old_route + route
    got = routing_share(
        old_logprobs=old,
        new_logprobs=new,
        new_logprobs_old_routing=new_old_route,
        advantages=torch.ones(8, dtype=torch.float64),
        mask=torch.ones(8, 12, dtype=torch.bool),
    )
    assert got["cov"] < 0 and got["var_share"] > 0
    assert got["r2_removed_share"] < 0  # Var ℓ^pol > Var ℓ: replay would widen the spread
    assert got["r2_removed_share"] == pytest.approx(1 - got["pol_var"] / got["total_var"], rel=1e-12)


def test_routing_share_is_zero_when_routing_did_not_change():
    g = torch.Generator().manual_seed(1)
    old = -torch.rand(4, 5, generator=g)
    new = old + 0.1 * torch.randn(4, 5, generator=g)
    mask = torch.ones(4, 5, dtype=torch.bool)
    got = routing_share(
        old_logprobs=old,
        new_logprobs=new,
        new_logprobs_old_routing=new,
        advantages=torch.tensor([1.0, -1.0, 1.0, -1.0]),
        mask=mask,
    )
    assert {k: v for k, v in got.items() if k not in ("total_var", "pol_var", "seq_total_var", "seq_pol_var")} == (
        dict.fromkeys([k for k in got if k not in ("total_var", "pol_var", "seq_total_var", "seq_pol_var")], 0.0)
    )
    # Var ℓ^pol = Var ℓ when routing did not change: R2 removes nothing
    assert got["total_var"] > 0 and got["pol_var"] == got["total_var"]
    assert got["seq_pol_var"] == got["seq_total_var"] > 0


def perturb(model, seed: int = 3, scale: float = 0.05) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g) * p.abs().mean().clamp(min=1e-3))


def instrument(ctx, batch, adv) -> dict[str, float]:
    """What a step logs, with the trainer's own functions: π_old pass and baseline, then weights moved."""
    from gspo_study import trainer

    old = trainer.old_policy(ctx, batch)
    baseline = tele.route_baseline(ctx, batch, old)
    perturb(ctx.model)
    out = tele.telemetry(ctx, step_mod.StepInputs(batch, adv, old, baseline=baseline))
    return {k: v for k, v in out.items() if k.startswith("moe/route/")}


def test_instrument_is_the_same_whatever_the_replay_mode_and_zero_without_a_change(smoke_cfg):
    from gspo_study import trainer
    from gspo_study.objectives import group_advantages

    readings = {}
    for mode in ("none", "r2", "r3"):
        ctx = trainer.setup(resolve_run(smoke_cfg("algo.objective=grpo", f"algo.routing_replay={mode}")))
        rows, batch = trainer.rollout(ctx, 1)
        adv = group_advantages(torch.arange(len(batch)).float() % 2, ctx.cfg.rollout.group_size)
        if mode == "none":  # before any change: routing's part is exactly zero
            old = trainer.old_policy(ctx, batch)
            base = tele.route_baseline(ctx, batch, old)
            still = tele.telemetry(ctx, step_mod.StepInputs(batch, adv, old, baseline=base))
            assert still["moe/route/abs_max"] == 0.0 and still["moe/route/clip_flip_token"] == 0.0
        readings[mode] = instrument(ctx, batch, adv)
    assert readings["none"]["moe/route/abs_mean"] > 0  # the perturbation moved some routing
    assert readings["none"] == readings["r2"] == readings["r3"]


def test_per_update_volatility_is_the_routing_after_exactly_one_update(smoke_cfg):
    """`moe/routing_volatility/per_update/*` (logged from the second update's own forward) equals a direct
    measurement: a twin run makes only the first update, then a free forward over the second minibatch's rows."""
    from gspo_study import trainer
    from gspo_study.moe import routing_volatility
    from gspo_study.objectives import group_advantages

    cfg = smoke_cfg("algo.objective=grpo", "train.lr=0.05")  # a large step, so routing moves
    logged, twin = trainer.setup(resolve_run(cfg)), trainer.setup(resolve_run(cfg))
    _, batch = trainer.rollout(logged, 1)
    adv = group_advantages(torch.arange(len(batch)).float() % 2, cfg.rollout.group_size)
    old = trainer.old_policy(logged, batch)
    inputs = step_mod.StepInputs(batch, adv, old)
    out = trainer.update(logged, inputs, 1)

    perm = torch.randperm(len(batch), generator=torch.Generator().manual_seed(derive_seed(cfg.seed, 1, "minibatch")))
    first, second = perm.chunk(cfg.train.num_minibatches)[:2]
    trainer.update_minibatch(twin, inputs, first, trainer.learning_rate(cfg, 1))
    _, after_one = step_mod.policy_pass(twin, batch.select(second), None)
    want = routing_volatility(old.natural.select(second), after_one, batch.response_mask[second])
    assert out["moe/routing_volatility/per_update/overall"] == want["overall"] > 0
    assert out["moe/routing_volatility/per_update/tokens_any_changed"] == want["tokens_any_changed"]


def test_train_inference_routing_gap_and_the_telemetry_subsample(smoke_cfg):
    """The engine's recorded routing against π_old's free routing: exactly routing_volatility of the two traces,
    nonzero for a bf16 engine, the same under R3 (whose π_old pass replays it); `telemetry.route_rows` < 1 reads
    the instrument on a seeded subset of the rows, which is the instrument computed on those rows directly."""
    from gspo_study import trainer
    from gspo_study.moe import routing_share, routing_volatility
    from gspo_study.objectives import group_advantages

    gaps = {}
    for mode, dtype in (("none", "bfloat16"), ("r3", "bfloat16"), ("none", "float32")):
        ctx = trainer.setup(
            resolve_run(
                smoke_cfg(
                    "algo.objective=grpo",
                    f"algo.routing_replay={mode}",
                    f"rollout.dtype={dtype}",
                    "rollout.prompts_per_step=16",
                )
            )
        )
        _, batch = trainer.rollout(ctx, 1)
        adv = group_advantages(torch.arange(len(batch)).float() % 2, ctx.cfg.rollout.group_size)
        old = trainer.old_policy(ctx, batch)
        base = tele.route_baseline(ctx, batch, old)
        out = tele.telemetry(ctx, step_mod.StepInputs(batch, adv, old, baseline=base), 1)
        want = routing_volatility(base[1], batch.routing, batch.response_mask)
        gaps[mode, dtype] = {k: v for k, v in out.items() if k.startswith("moe/train_infer_routing/")}
        assert gaps[mode, dtype] == {f"moe/train_infer_routing/{k}": v for k, v in want.items()}
    bf16 = gaps["none", "bfloat16"]
    assert bf16 == gaps["r3", "bfloat16"] and bf16["moe/train_infer_routing/tokens_any_changed"] > 0
    # the fp32 engine is the trainer's own model: its KV-cached routing is the full forward's
    assert set(gaps["none", "float32"].values()) == {0.0}

    ctx = trainer.setup(resolve_run(smoke_cfg("algo.objective=grpo", "telemetry.route_rows=0.5")))
    _, batch = trainer.rollout(ctx, 1)
    adv = group_advantages(torch.arange(len(batch)).float() % 2, ctx.cfg.rollout.group_size)
    old = trainer.old_policy(ctx, batch)
    train_lp, natural_old = old.train_logprobs, old.natural
    base = tele.route_baseline(ctx, batch, old)
    perturb(ctx.model)
    out = tele.telemetry(ctx, step_mod.StepInputs(batch, adv, old, baseline=base), 1)
    rows = tele.telemetry_rows(ctx, len(batch), 1)
    assert len(rows) == len(batch) // 2 and rows.tolist() != list(range(len(rows)))
    sub = batch.select(rows)
    new_lp, natural_new = step_mod.policy_pass(ctx, sub, None)
    new_old_route, _ = step_mod.policy_pass(ctx, sub, natural_old.select(rows))
    want = routing_share(
        old_logprobs=train_lp[rows],
        new_logprobs=new_lp,
        new_logprobs_old_routing=new_old_route,
        advantages=adv[rows],
        mask=sub.response_mask,
    )
    assert {k: out[f"moe/route/{k}"] for k in want} == want
    vol = routing_volatility(natural_old.select(rows), natural_new, sub.response_mask)
    assert out["moe/routing_volatility/overall"] == vol["overall"]
