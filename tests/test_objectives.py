"""Objectives against float64 references written from the formulas, padding/extreme-value robustness,
micro-batch exactness, clipping metrics on hand-made inputs."""

from __future__ import annotations

import math

import pytest
import torch

from gspo_study.objectives import (
    METRIC_NAMES,
    OBJECTIVES,
    ClipRange,
    batch_normalizer,
    combine_metrics,
    get_objective,
)

from .microbatch_reference import microbatch_loss_and_backward, split_microbatches

NAMES = sorted(OBJECTIVES)
AGGS = ("seq_mean", "token_mean")
LENGTHS = (1, 9, 4, 0, 6, 2)  # ragged, incl. length 1 and an empty response (B = 6, T = 9)


def make_batch(noise: float, seed: int = 0, lengths=LENGTHS, token_adv: bool = False) -> dict:
    g = torch.Generator().manual_seed(seed)
    b, t = len(lengths), max(lengths)
    mask = torch.arange(t)[None, :] < torch.tensor(lengths)[:, None]
    logprobs = -3 * torch.rand(b, t, generator=g, dtype=torch.float64)
    old = logprobs + noise * torch.randn(b, t, generator=g, dtype=torch.float64)
    adv = torch.randn((b, t) if token_adv else (b,), generator=g, dtype=torch.float64)
    return {"logprobs": logprobs.requires_grad_(), "old_logprobs": old, "advantages": adv, "mask": mask}


def run(objective, batch, **kwargs):
    """(loss, metrics, grad w.r.t. logprobs) of one call on a fresh leaf."""
    lp = batch["logprobs"].detach().clone().requires_grad_()
    loss, metrics = objective(
        logprobs=lp,
        old_logprobs=batch["old_logprobs"],
        advantages=batch["advantages"],
        mask=batch["mask"],
        **kwargs,
    )
    loss.backward()
    return loss, metrics, lp.grad


# ------------------------------------------------------------------------------- float64 reference


def clip(v, lo, hi):
    return min(max(v, 1 - lo), 1 + hi)


def reference(name: str, batch: dict, p, aggregation: str):
    """Loss and gradient straight from the formulas, one response and one token at a time, in float64;
    `p` the objective's hyperparameters."""
    lo, hi = getattr(p, "clip_low", None), getattr(p, "clip_high", None)
    mask = batch["mask"]
    lengths = [int(n) for n in mask.sum(-1)]
    lp = batch["logprobs"].detach().clone().requires_grad_()
    old, adv = batch["old_logprobs"], batch["advantages"]
    total, n_seq, n_tok = 0.0, 0, 0
    for i, n in enumerate(lengths):
        if n == 0:
            continue
        n_seq, n_tok = n_seq + 1, n_tok + n
        a = [adv[i, t] if adv.dim() == 2 else adv[i] for t in range(n)]
        tokens = []
        if name == "grpo":
            for t in range(n):
                w = torch.exp(lp[i, t] - old[i, t])
                tokens.append(torch.minimum(w * a[t], clip(w, lo, hi) * a[t]))
        elif name == "gspo":
            s = torch.exp(sum(lp[i, t] - old[i, t] for t in range(n)) / n)
            a_i = sum(a) / n
            tokens = [torch.minimum(s * a_i, clip(s, lo, hi) * a_i)] * n  # J_i counted per token below
        elif name == "gspo_token":
            s = torch.exp(sum(lp[i, t] - old[i, t] for t in range(n)) / n).detach()
            for t in range(n):
                s_t = s * torch.exp(lp[i, t] - lp[i, t].detach())
                tokens.append(torch.minimum(s_t * a[t], clip(s_t, lo, hi) * a[t]))
        elif name == "cispo":
            for t in range(n):
                w = torch.exp(lp[i, t] - old[i, t]).detach()
                tokens.append(clip(w, lo, hi) * a[t] * lp[i, t])
        elif name == "sapo":  # arXiv 2511.20347: (4/τ) σ(τ (w − 1)) Â, τ by the advantage's sign
            for t in range(n):
                w = torch.exp(lp[i, t] - old[i, t])
                tau = p.tau_pos if a[t] > 0 else p.tau_neg
                tokens.append(4.0 / tau * torch.sigmoid(tau * (w - 1)) * a[t])
        elif name == "gmpo":  # arXiv 2507.20673: geometric mean of log-clipped token ratios
            logs = []
            for t in range(n):
                sg = torch.sign(a[t])
                x = sg * (lp[i, t] - old[i, t])
                logs.append(sg * torch.minimum(x, x.clamp(-p.log_clip, p.log_clip)))
            tokens = [sum(a) / n * torch.exp(sum(logs) / n)] * n  # J_i counted per token below
        elif name in ("dppo_tv", "dppo_kl"):  # arXiv 2602.04879; prime-rl's default loss, verl's dppo_*
            for t in range(n):
                ell = lp[i, t] - old[i, t]
                pi, mu = math.exp(lp[i, t].item()), math.exp(old[i, t].item())
                if name == "dppo_tv":
                    up, down = pi - mu > p.mask_high, pi - mu < -p.mask_low
                else:  # the sampled token's binary KL, verl's 1e-8 guard; NaN (never masked) where a test's
                    # random "log-prob" above 0 puts μ past 1
                    arg = (1 - mu + 1e-8) / (1 - pi + 1e-8)
                    d = mu * math.log(mu / pi) + (1 - mu) * math.log(arg) if arg > 0 else math.nan
                    up, down = d > p.mask_high and pi > mu, d > p.mask_low and pi < mu
                masked = up if a[t] > 0 else down
                tokens.append((0.0 if masked else a[t] * torch.exp(ell)) - p.kl_tau * ell**2)
        seq_sum = sum(tokens)
        total = total + (seq_sum / n if aggregation == "seq_mean" else seq_sum)
    loss = -total / (n_seq if aggregation == "seq_mean" else n_tok)
    loss.backward()
    return loss.detach(), lp.grad


# ------------------------------------------------------------------------------------------- tests


@pytest.mark.parametrize("aggregation", AGGS)
@pytest.mark.parametrize("noise", [1e-4, 0.3])  # mostly unclipped for GSPO / clipping for every objective
@pytest.mark.parametrize("name", NAMES)
def test_matches_float64_reference(name, noise, aggregation):
    obj = get_objective(name, aggregation=aggregation)
    for token_adv in (False, True):
        batch = make_batch(noise, seed=1, token_adv=token_adv)
        loss, metrics, grad = run(obj, batch)
        ref_loss, ref_grad = reference(name, batch, obj.params, aggregation)
        assert loss.dtype == torch.float64
        torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-12)
        torch.testing.assert_close(grad, ref_grad, rtol=1e-6, atol=1e-12)
        assert metrics["policy/loss"] == pytest.approx(float(ref_loss), rel=1e-9, abs=1e-15)
        assert set(metrics) == set(METRIC_NAMES)


@pytest.mark.parametrize("aggregation", AGGS)
@pytest.mark.parametrize("noise", [1e-4, 0.3])
def test_gspo_token_equals_gspo_with_sequence_advantages(noise, aggregation):
    batch = make_batch(noise, seed=2)
    gspo = run(get_objective("gspo", aggregation=aggregation), batch)
    for adv in (batch["advantages"], batch["advantages"][:, None].expand_as(batch["logprobs"])):
        token = run(get_objective("gspo_token", aggregation=aggregation), {**batch, "advantages": adv})
        torch.testing.assert_close(token[0], gspo[0], rtol=1e-12, atol=1e-15)
        torch.testing.assert_close(token[2], gspo[2], rtol=1e-12, atol=1e-15)
        for key in METRIC_NAMES:
            assert token[1][key] == pytest.approx(gspo[1][key], rel=1e-12, abs=1e-15), key


@pytest.mark.parametrize("aggregation", AGGS)
@pytest.mark.parametrize("name", NAMES)
def test_on_policy_is_plain_policy_gradient(name, aggregation):
    batch = make_batch(0.0, seed=3)
    _, metrics, grad = run(get_objective(name, aggregation=aggregation), batch)
    mask, adv = batch["mask"], batch["advantages"]
    lengths = mask.sum(-1, keepdim=True).clamp(min=1).double()
    if aggregation == "seq_mean":  # -Â_i / (|y_i| B) with B the number of non-empty responses
        expected = -adv[:, None] / (lengths * mask.any(-1).sum())
    else:  # -Â_i / (total tokens)
        expected = -adv[:, None].expand_as(grad) / mask.sum()
    torch.testing.assert_close(grad, torch.where(mask, expected, 0.0), rtol=1e-12, atol=1e-15)
    for key in ("token", "seq", "low", "high"):
        assert metrics[f"policy/clip_frac/{key}"] == 0.0
    assert metrics["policy/ratio/token_mean"] == metrics["policy/ratio/seq_mean"] == 1.0
    assert metrics["policy/ratio/token_var"] == metrics["policy/ratio/seq_var"] == 0.0
    assert metrics["policy/kl/k1"] == metrics["policy/kl/k3"] == 0.0


@pytest.mark.parametrize("garbage", [math.nan, math.inf, -math.inf, 1e30])
@pytest.mark.parametrize("name", NAMES)
def test_padding_garbage_changes_nothing(name, garbage):
    for token_adv in (False, True):
        batch = make_batch(0.3, seed=4, token_adv=token_adv)
        b, t = batch["mask"].shape
        padded_mask = torch.zeros(b + 2, t + 3, dtype=torch.bool)  # 3 extra columns, 2 all-padding rows
        padded_mask[:b, :t] = batch["mask"]
        padded = {"mask": padded_mask}
        for key in ("logprobs", "old_logprobs", "advantages"):
            value = batch[key].detach()
            out = torch.full((b + 2, t + 3)[: value.dim()], garbage, dtype=torch.float64)
            out[(slice(0, b), slice(0, t))[: value.dim()]] = value
            if value.dim() == 2:
                out = torch.where(padded_mask, out, garbage)  # garbage inside the ragged rows too
            padded[key] = out
        for aggregation in AGGS:
            obj = get_objective(name, aggregation=aggregation)
            loss, metrics, grad = run(obj, batch)
            p_loss, p_metrics, p_grad = run(obj, padded)
            torch.testing.assert_close(p_loss, loss, rtol=1e-12, atol=1e-15)
            torch.testing.assert_close(p_grad[:b, :t][batch["mask"]], grad[batch["mask"]], rtol=1e-12, atol=1e-15)
            assert torch.isfinite(p_grad).all() and (p_grad[~padded_mask] == 0).all()
            for key in METRIC_NAMES:
                assert p_metrics[key] == pytest.approx(metrics[key], rel=1e-12, abs=1e-15), key


@pytest.mark.parametrize("name", NAMES)
def test_extreme_log_ratios_stay_finite(name):
    batch = make_batch(0.0, seed=5)
    batch["old_logprobs"] = batch["old_logprobs"].clone()
    batch["old_logprobs"][:, 0::2] += 100.0
    batch["old_logprobs"][:, 1::2] -= 100.0
    for aggregation in AGGS:
        for dtype in (torch.float64, torch.float32):
            cast = {
                **batch,
                "logprobs": batch["logprobs"].to(dtype),
                "old_logprobs": batch["old_logprobs"].to(dtype),
            }
            loss, metrics, grad = run(get_objective(name, aggregation=aggregation), cast)
            assert torch.isfinite(loss) and torch.isfinite(grad).all()
            assert all(math.isfinite(v) for v in metrics.values())


@pytest.mark.parametrize("aggregation", AGGS)
@pytest.mark.parametrize("name", NAMES)
def test_microbatches_reproduce_full_batch(name, aggregation):
    obj = get_objective(name, aggregation=aggregation)
    batch = make_batch(0.3, seed=6, token_adv=name in ("grpo", "gspo_token"))
    loss, metrics, grad = run(obj, batch)
    for size in (1, 2, 3, 4, 6):  # 4 is uneven (4 + 2); size 1 yields a part with no valid token
        leaf = batch["logprobs"].detach().clone().requires_grad_()
        micro_loss, micro_metrics = microbatch_loss_and_backward(
            obj, {**batch, "logprobs": leaf}, size, logprobs_fn=lambda micro: micro["logprobs"]
        )
        assert micro_loss == pytest.approx(loss.item(), rel=1e-12, abs=1e-15)
        torch.testing.assert_close(leaf.grad, grad, rtol=1e-12, atol=1e-15)
        for key in METRIC_NAMES:
            assert micro_metrics[key] == pytest.approx(metrics[key], rel=1e-9, abs=1e-12), (size, key)


def test_split_microbatches_and_normalizer():
    batch = make_batch(0.1)
    parts = split_microbatches({**batch, "step": 7}, 4)
    assert [p["mask"].shape[0] for p in parts] == [4, 2] and parts[1]["step"] == 7
    assert batch_normalizer(batch["mask"], "seq_mean") == 5  # the empty response does not count
    assert batch_normalizer(batch["mask"], "token_mean") == sum(LENGTHS)
    assert batch_normalizer(torch.zeros(2, 3, dtype=torch.bool), "token_mean") == 1
    with pytest.raises(ValueError, match="allowed"):
        split_microbatches(batch, 0)
    with pytest.raises(ValueError, match="combine_metrics"):
        combine_metrics([])


def uniform_ratio_batch(log_ratios, advantages, lengths):
    """Responses whose every token has the given log-ratio (so s_i = exp(log_ratio))."""
    t = max(lengths)
    mask = torch.arange(t)[None, :] < torch.tensor(lengths)[:, None]
    old = torch.full((len(lengths), t), -1.0, dtype=torch.float64)
    lp = old + torch.tensor(log_ratios, dtype=torch.float64)[:, None]
    return {
        "logprobs": lp,
        "old_logprobs": old,
        "advantages": torch.tensor(advantages, dtype=torch.float64),
        "mask": mask,
    }


@pytest.mark.parametrize("name", ["gspo", "gspo_token"])
def test_gspo_clipping_counts_whole_responses(name):
    # clipped high (Â > 0, s > 1 + 4e-4), clipped low (Â < 0, s < 1 - 3e-4), and two unclipped: s on the
    # pessimistic side of each bound, where min() keeps the unclipped term.
    batch = uniform_ratio_batch([1e-3, -1e-3, -1e-3, 1e-3], [1.0, -1.0, 1.0, -1.0], [2, 3, 4, 1])
    _, metrics, grad = run(get_objective(name), batch)
    assert metrics["policy/clip_frac/token"] == pytest.approx(5 / 10, abs=1e-15)
    assert metrics["policy/clip_frac/high"] == pytest.approx(2 / 10, abs=1e-15)
    assert metrics["policy/clip_frac/low"] == pytest.approx(3 / 10, abs=1e-15)
    assert metrics["policy/clip_frac/seq"] == pytest.approx(2 / 4, abs=1e-15)
    assert (grad[:2] == 0).all() and (grad[2:][batch["mask"][2:]] != 0).all()


def test_grpo_clip_fractions_by_side():
    lr = [0.3, -0.3, 0.1, -0.1]  # w = 1.35 (> 1.27), 0.74 (< 0.8), 1.105, 0.905
    old = torch.full((3, 4), -1.0, dtype=torch.float64)
    lp = old + torch.tensor([lr, lr, [0.01, -0.01, 0.0, 0.02]], dtype=torch.float64)
    batch = {
        "logprobs": lp,
        "old_logprobs": old,
        "advantages": torch.tensor([1.0, -1.0, 1.0], dtype=torch.float64),
        "mask": torch.ones(3, 4, dtype=torch.bool),
    }
    _, metrics, grad = run(get_objective("grpo"), batch)
    assert metrics["policy/clip_frac/high"] == pytest.approx(1 / 12, abs=1e-15)  # row 0, token 0
    assert metrics["policy/clip_frac/low"] == pytest.approx(1 / 12, abs=1e-15)  # row 1, token 1
    assert metrics["policy/clip_frac/token"] == pytest.approx(2 / 12, abs=1e-15)
    assert metrics["policy/clip_frac/seq"] == pytest.approx(2 / 3, abs=1e-15)
    assert grad[0, 0] == 0 and grad[1, 1] == 0 and (grad[0, 1:] != 0).all() and (grad[2] != 0).all()
    assert metrics["policy/ratio/token_max"] == pytest.approx(math.exp(0.3), rel=1e-12)
    assert metrics["policy/ratio/token_min"] == pytest.approx(math.exp(-0.3), rel=1e-12)


def test_cispo_caps_weight_but_keeps_gradient():
    lr = [0.3, -0.9, 0.1, 0.0]  # w = 1.35 capped at 1.28; w = 0.41 not capped (no lower bound by default)
    old = torch.full((1, 4), -1.0, dtype=torch.float64)
    batch = {
        "logprobs": old + torch.tensor([lr], dtype=torch.float64),
        "old_logprobs": old,
        "advantages": torch.tensor([2.0], dtype=torch.float64),
        "mask": torch.ones(1, 4, dtype=torch.bool),
    }
    _, metrics, grad = run(get_objective("cispo"), batch)
    assert metrics["policy/clip_frac/high"] == 0.25 and metrics["policy/clip_frac/low"] == 0.0
    expected = -2.0 / 4 * torch.tensor([[1.28, math.exp(-0.9), math.exp(0.1), 1.0]], dtype=torch.float64)
    torch.testing.assert_close(grad, expected, rtol=1e-12, atol=1e-15)


def test_registry_and_arguments():
    assert {"grpo", "gspo", "gspo_token", "cispo", "sapo", "gmpo"} <= set(OBJECTIVES)
    assert OBJECTIVES["gspo"].defaults == ClipRange(3e-4, 4e-4)
    assert OBJECTIVES["grpo"].defaults == ClipRange(0.2, 0.27)
    assert (OBJECTIVES["sapo"].defaults.tau_pos, OBJECTIVES["sapo"].defaults.tau_neg) == (1.0, 1.05)
    assert OBJECTIVES["gmpo"].hyperparameters == ("log_clip",)
    obj = get_objective("gspo", clip_low=0.1, clip_high=0.2, aggregation="token_mean")
    assert (obj.params, obj.aggregation) == (ClipRange(0.1, 0.2), "token_mean")
    assert get_objective("sapo", tau_neg=1.2, tau_pos=None).params.tau_neg == 1.2  # None keeps the default
    with pytest.raises(ValueError, match="no hyperparameter 'clip_low'; allowed: tau_pos, tau_neg"):
        get_objective("sapo", clip_low=0.2)
    with pytest.raises(ValueError, match="allowed: numbers > 0"):
        get_objective("sapo", tau_neg=-1)
    with pytest.raises(ValueError, match="allowed: cispo, dppo_kl, dppo_tv, gmpo, grpo, gspo, gspo_token, sapo"):
        get_objective("ppo")
    with pytest.raises(ValueError, match="allowed: seq_mean, token_mean"):
        get_objective("gspo", aggregation="sum")
    with pytest.raises(ValueError, match="advantages"):
        run(get_objective("gspo"), {**make_batch(0.1), "advantages": torch.zeros(3)})


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", NAMES)
def test_low_precision_inputs_compute_in_float32(name, dtype):
    batch = make_batch(0.05, seed=7)
    low = {
        **batch,
        "logprobs": batch["logprobs"].detach().to(dtype),
        "old_logprobs": batch["old_logprobs"].to(dtype),
    }
    loss, _, grad = run(get_objective(name), low)
    assert loss.dtype == torch.float32 and grad.dtype == dtype
    as_f32 = {
        **low,
        "logprobs": low["logprobs"].float(),
        "old_logprobs": low["old_logprobs"].float(),
        "advantages": low["advantages"].float(),
    }
    torch.testing.assert_close(loss, run(get_objective(name), as_f32)[0], rtol=0, atol=0)


@pytest.mark.parametrize("name", ["dppo_tv", "dppo_kl"])
def test_dppo_masks_by_the_advantages_sign_at_its_boundaries(name):
    """A token is masked only on the side its advantage pushes: Â > 0 once π_θ rose past the bound, Â < 0 once it
    fell past it; at the bound itself it is kept (strict inequalities, as prime-rl and verl). The KL term acts on every
    token, masked ones included."""
    obj = get_objective(name, kl_tau=0.0)
    mu = 0.5
    if name == "dppo_tv":
        up, down = mu + obj.params.mask_high, mu - obj.params.mask_low
    else:  # the probability at which the binary KL reaches the bound, found by bisection

        def bkl(pi):
            return mu * math.log(mu / pi) + (1 - mu) * math.log((1 - mu + 1e-8) / (1 - pi + 1e-8))

        def solve(near, far, bound):  # bkl grows from 0 at μ (`near`) towards `far`: where it reaches `bound`
            for _ in range(200):
                mid = (near + far) / 2
                near, far = (mid, far) if bkl(mid) < bound else (near, mid)
            return (near + far) / 2

        up, down = solve(mu, 1 - 1e-9, obj.params.mask_high), solve(mu, 1e-9, obj.params.mask_low)
    eps = 1e-6
    pis = [up - eps, up + eps, down + eps, down - eps, down - eps, up + eps]
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0, 1.0, -1.0], dtype=torch.float64)
    batch = {
        "logprobs": torch.tensor([[math.log(v)] for v in pis], dtype=torch.float64),
        "old_logprobs": torch.full((6, 1), math.log(mu), dtype=torch.float64),
        "advantages": adv,
        "mask": torch.ones(6, 1, dtype=torch.bool),
    }
    _, metrics, grad = run(obj, batch)
    kept = torch.tensor([True, False, True, False, True, True])  # the last two: the far side of their advantage
    assert ((grad[:, 0] != 0) == kept).all()
    assert metrics["policy/clip_frac/high"] == pytest.approx(1 / 6) and metrics[
        "policy/clip_frac/low"
    ] == pytest.approx(1 / 6)
    _, _, with_kl = run(get_objective(name, kl_tau=0.5), batch)
    assert (with_kl[~kept, 0] != 0).all()  # the KL term still pulls the masked tokens back


def test_dppo_is_anchored_to_the_rollout_and_refuses_r2():
    from gspo_study.config import ConfigError, load_config

    base = ["experiments/smoke/base.yaml", "experiments/runs/dppo.yaml"]
    assert OBJECTIVES["dppo_tv"].anchor == OBJECTIVES["dppo_kl"].anchor == "rollout"
    assert OBJECTIVES["grpo"].anchor == "old"
    load_config(base, ["algo.routing_replay=r3"])  # R3 replays the rollout's routing: allowed
    with pytest.raises(ConfigError, match="R2 has nothing to replay"):
        load_config(base, ["algo.routing_replay=r2"])
    with pytest.raises(ConfigError, match="against the rollout's log-probs .μ., by definition"):
        load_config(base, ["algo.old_logprobs=recompute"])
    with pytest.raises(ConfigError, match="nothing to correct"):  # a train–inference correction: there is no π_old
        load_config(base, ["algo.rollout_correction=token_truncate"])
