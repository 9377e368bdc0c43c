"""Axis R and the frozen router: a routing change between π_old and π_θ that only R2 removes (`train.route_noise`, its
sham `train.route_sham`, its positive control `train.route_random`, gspo_study.moe.routing.NoisyChoice), routers that
never move (`train.router_lr_scale: 0`), and the telemetry that says why a run died (expert load, routers, gate drift,
the objective's own routing component). Smoke model; each RL test makes one or two steps."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from gspo_study.config import ConfigError
from gspo_study.models import build_char_tokenizer, build_model
from gspo_study.moe import (
    NoisyChoice,
    RoutingTrace,
    gate_drift,
    load_metrics,
    noisy_routing,
    record_router_outputs,
    record_routing,
    router_metrics,
)
from gspo_study.run import resolve_run, run_key
from gspo_study.train.forward import token_logprobs

TIMING = ("compute/seconds", "perf/tokens_per_s")


def _draw(row: int, layer: int, seq: int, experts: int) -> torch.Tensor:
    return torch.randn(seq, experts, generator=torch.Generator().manual_seed(1000 * row + layer))


@pytest.fixture(scope="module")
def policy():
    tok = build_char_tokenizer()
    model = build_model("qwen3-moe-smoke", tok, seed=3)
    texts = [f"{a}+{b}={a + b}#" for a in range(4) for b in range(2)]
    ids = torch.tensor([[tok.convert_tokens_to_ids(c) for c in t] for t in texts])
    return model, ids


def _forward(model, ids, choice=None):
    with torch.no_grad(), record_routing(model) as trace, record_router_outputs(model) as outs:
        if choice is None:
            token_logprobs(model, ids, torch.ones_like(ids))
        else:
            with noisy_routing(model, choice):
                token_logprobs(model, ids, torch.ones_like(ids))
    return trace, outs


def test_the_noisy_choice_picks_experts_from_the_draw_and_weights_them_by_the_clean_softmax(policy):
    model, ids = policy
    rows = torch.arange(len(ids))
    natural, _ = _forward(model, ids)
    trace, outs = _forward(model, ids, NoisyChoice(2.0, rows, _draw))
    moved = 0
    for layer, logits in outs.logits.items():
        z = torch.stack([_draw(int(r), layer, logits.shape[1], logits.shape[2]) for r in rows]).double()
        want = torch.topk(logits.double() + 2.0 * z, trace.top_k, dim=-1).indices
        assert torch.equal(trace.layer(layer), want)
        probs = F.softmax(logits.double(), dim=-1).gather(-1, want)
        torch.testing.assert_close(outs.gates.layer(layer).double(), probs / probs.sum(-1, keepdim=True))
        moved += int((torch.sort(trace.layer(layer)).values != torch.sort(natural.layer(layer)).values).any(-1).sum())
    assert moved > 0  # σ = 2 moves some tokens' expert sets
    random, _ = _forward(model, ids, NoisyChoice(math.inf, rows, _draw))  # σ = inf: the draw alone
    for layer in random.layers:
        z = torch.stack([_draw(int(r), layer, ids.shape[1] - 1, outs.logits[layer].shape[2]) for r in rows])
        assert torch.equal(random.layer(layer), torch.topk(z, random.top_k, dim=-1).indices)


def test_a_rows_draw_does_not_depend_on_what_shares_its_forward(policy):
    model, ids = policy
    together, _ = _forward(model, ids, NoisyChoice(1e3, torch.arange(len(ids)), _draw))
    alone, _ = _forward(model, ids[3:4], NoisyChoice(1e3, torch.tensor([3]), _draw))
    for layer in together.layers:
        assert torch.equal(together.layer(layer)[3:4], alone.layer(layer))


def test_load_router_and_gate_metrics_against_float64_references():
    e, k = 4, 2
    ids = torch.tensor([[[0, 1], [0, 1], [0, 2], [9, 9]]])  # the last token is padding (ids never read)
    mask = torch.tensor([[True, True, True, False]])
    got = load_metrics(RoutingTrace({5: ids}), mask, e)
    load = torch.tensor([3, 2, 1, 0], dtype=torch.float64) / 6
    nz = load[load > 0]
    assert got["max_share/layer_05"] == pytest.approx(0.5)
    assert got["entropy/layer_05"] == pytest.approx(float(-(nz * nz.log()).sum() / math.log(e)))
    assert got["dead_frac/layer_05"] == pytest.approx(0.25)
    assert got["max_vio/layer_05"] == pytest.approx((0.5 - 0.25) / 0.25)
    balanced = load_metrics(RoutingTrace({0: torch.tensor([[[0, 1], [2, 3]]])}), torch.ones(1, 2, dtype=torch.bool), e)
    assert balanced["entropy/mean"] == pytest.approx(1.0) and balanced["max_vio/mean"] == pytest.approx(0.0)
    logits = torch.tensor([[[3.0, 1.0, 0.5, -1.0], [0.0, 0.0, 2.0, 1.0], [9.0, 9.0, 9.0, 9.0]]])
    r = router_metrics({5: logits}, torch.tensor([[True, True, False]]), k)
    assert r["logit_norm/layer_05"] == pytest.approx(float(logits[0, :2].double().norm(dim=-1).mean()))
    assert r["topk_margin/layer_05"] == pytest.approx(((1.0 - 0.5) + (1.0 - 0.0)) / 2)
    g0, g1 = torch.tensor([[[0.6, 0.4], [0.5, 0.5]]]), torch.tensor([[[0.7, 0.3], [0.5, 0.5]]])
    d = gate_drift(RoutingTrace({5: g0}), RoutingTrace({5: g1}), torch.tensor([[True, False]]))
    assert d["layer_05"] == pytest.approx(0.1) and d["mean"] == pytest.approx(0.1)


def _steps(cfg, n: int = 1):
    from gspo_study import trainer

    ctx = trainer.setup(resolve_run(cfg))
    out = [trainer.rl_step(ctx, s) for s in range(1, n + 1)]
    return ctx, [{k: v for k, v in m.items() if k not in TIMING} for m in out]


def test_r2_at_every_dose_is_r2_at_dose_0_bit_for_bit(smoke_cfg):
    """The built-in remedy control: under R2 the update forwards replay π_old's routing, so the dose (noise, or
    random experts) changes no number, and the objective's own routing component is exactly 0."""
    base = ("algo.objective=grpo", "algo.routing_replay=r2", "telemetry.update_route=true")
    ref_ctx, ref = _steps(smoke_cfg(*base), 2)
    assert ref[0]["moe/route_obj/abs_mean"] == 0.0 and ref[0]["moe/route_obj/flips"] == 0.0
    for dose in ("train.route_noise=3.0", "train.route_random=true"):
        ctx, got = _steps(smoke_cfg(*base, dose), 2)
        assert got == ref
        assert all(torch.equal(a, b) for a, b in zip(ctx.model.parameters(), ref_ctx.model.parameters()))


def test_the_dose_reaches_the_update_forwards_only_and_the_sham_removes_the_mismatch(smoke_cfg):
    from gspo_study import trainer

    grpo = ("algo.objective=grpo", "telemetry.update_route=true", "train.lr=1e-6")  # little drift: the dose shows
    clean, dosed, sham = (
        trainer.setup(resolve_run(smoke_cfg(*grpo, *extra)))
        for extra in ((), ("train.route_noise=3.0",), ("train.route_noise=3.0", "train.route_sham=true"))
    )
    _, batch = trainer.rollout(clean, 1)
    old_clean, old_dosed = trainer.old_policy(clean, batch, 1), trainer.old_policy(dosed, batch, 1)
    assert torch.equal(old_clean.train_logprobs, old_dosed.train_logprobs)  # π_old's pass is clean
    assert not torch.equal(trainer.old_policy(sham, batch, 1).train_logprobs, old_clean.train_logprobs)
    c, d, s = (trainer.rl_step(ctx, 1) for ctx in (clean, dosed, sham))
    # the first update is on-policy: without a dose π_θ routes as π_old; with it, a share of experts moves
    assert c["moe/route_obj/mb_0/flips"] == 0.0 and c["policy/kl/k3/mb_0"] < 1e-9
    assert d["moe/route_obj/mb_0/flips"] > 0.05 and d["policy/kl/k3/mb_0"] > 1e-4
    assert d["moe/route_obj/mb_0/r2_removed_share"] > 0.99  # on-policy, the whole ratio is routing
    # the sham: the same draw in π_old's pass, so π_θ's first update routes exactly as π_old did
    assert s["moe/route_obj/mb_0/flips"] == 0.0 and s["policy/kl/k3/mb_0"] < 1e-9
    # the telemetry's baseline stays clean in every arm: the counterfactual reads the same kind of thing
    assert {"moe/route/r2_removed_share", "moe/load/entropy/mean", "moe/gate_drift/mean"} <= s.keys()


def test_a_frozen_router_never_moves_and_holds_no_optimizer_state(smoke_cfg):
    from gspo_study.train.torch_backend import ROUTER_SUFFIX

    cfg = smoke_cfg("algo.objective=grpo", "train.router_lr_scale=0", "train.lr=0.01")
    from gspo_study import trainer

    ctx = trainer.setup(resolve_run(cfg))
    before = {n: p.detach().clone() for n, p in ctx.model.named_parameters()}
    trainer.rl_step(ctx, 1)
    named = dict(ctx.model.named_parameters())
    routers = [n for n in named if n.endswith(ROUTER_SUFFIX)]
    assert routers and all(torch.equal(named[n], before[n]) for n in routers)
    assert any(not torch.equal(named[n], before[n]) for n in named if n not in routers)
    state = ctx.backend.optimizer.state
    assert not any(named[n] in state for n in routers) and any(p in state for p in named.values())


def test_the_knobs_refuse_what_cannot_work_and_leave_every_key_at_their_defaults(smoke_cfg):
    base = smoke_cfg("algo.objective=grpo")
    assert run_key(base) == run_key(smoke_cfg("algo.objective=grpo", "train.route_noise=0", "numerics=1"))
    assert run_key(smoke_cfg("algo.objective=grpo", "train.route_noise=0.5")) != run_key(base)
    with pytest.raises(ConfigError, match="train.route_random=true chooses experts at random"):
        smoke_cfg("train.route_random=true", "train.route_noise=1")
    with pytest.raises(ConfigError, match="train.route_sham=True takes no part"):
        smoke_cfg("train.route_sham=true")
    with pytest.raises(ConfigError, match="'numerics'; allowed: 1"):
        smoke_cfg("numerics=2")
    with pytest.raises(ConfigError, match="'train.router_lr_scale'; allowed: a number >= 0"):
        smoke_cfg("train.router_lr_scale=-1")


def test_the_load_balance_loss_is_transformers_own_and_off_by_default(policy, smoke_cfg):
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    model, ids = policy
    att = torch.ones_like(ids)
    aux = []
    with torch.no_grad(), record_router_outputs(model) as outs:
        token_logprobs(model, ids, att, aux_out=aux)
    e, k = model.config.num_experts, model.config.num_experts_per_tok
    logits = tuple(outs.logits[layer].reshape(-1, e) for layer in sorted(outs.logits))
    assert torch.equal(aux[0], load_balancing_loss_func(logits, e, k, att[:, :-1]))
    _, (off,) = _steps(smoke_cfg("algo.objective=grpo"))
    _, (on,) = _steps(smoke_cfg("algo.objective=grpo", "train.aux_loss_coef=0.1"))
    assert "moe/aux_loss" not in off and on["moe/aux_loss"] > 0
    assert on["train/grad_norm"] != off["train/grad_norm"]
