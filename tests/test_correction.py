"""Train–inference corrections (`algo.rollout_correction`): every mode against a float64 reference written token
by token, for GRPO, GSPO and GSPO-token; no effect when μ = π_old; padding and micro-batches never change a
result; each mode runs in the trainer with a bf16 rollout engine and logs its metrics; bad settings are
one-line errors."""

from __future__ import annotations

import math

import pytest
import torch

from gspo_study.config import ConfigError, load_config
from gspo_study.objectives import get_objective
from gspo_study.objectives.correction import CORRECTION_METRICS, CORRECTIONS, correction_weights
from gspo_study.run import resolve_run

MODES = [m for m in CORRECTIONS if m != "none"]
CAP, GEO, ICE = 3.0, 1.01, (0.5, 2.0)
BOUNDS = {"cap": CAP, "geo_cap": GEO, "icepop": ICE}
LENGTHS = (5, 9, 1, 0, 7, 3)


def make(seed: int = 0, spread: float = 0.8):
    g = torch.Generator().manual_seed(seed)
    b, t = len(LENGTHS), max(LENGTHS)
    mask = torch.arange(t)[None] < torch.tensor(LENGTHS)[:, None]
    old = -3 * torch.rand(b, t, generator=g, dtype=torch.float64)
    mu = old + spread * torch.randn(b, t, generator=g, dtype=torch.float64)  # rollout engine
    lp = old + 0.3 * torch.randn(b, t, generator=g, dtype=torch.float64)
    adv = torch.randn(b, generator=g, dtype=torch.float64)
    return lp, old, mu, adv, mask


def reference_c(old, mu, mask, mode) -> list[list[float]]:
    """c per token, straight from the module's table."""
    out = []
    for i in range(mask.shape[0]):
        idx = [t for t in range(mask.shape[1]) if mask[i, t]]
        logs = [float(old[i, t] - mu[i, t]) for t in idx]
        row = [0.0] * mask.shape[1]
        if not idx:
            out.append(row)
            continue
        w_seq, g_seq = math.exp(sum(logs)), math.exp(sum(logs) / len(logs))
        for t, lw in zip(idx, logs):
            w = math.exp(lw)
            row[t] = {
                "token_truncate": min(w, CAP),
                "token_mask": float(1 / CAP <= w <= CAP),
                "icepop": float(ICE[0] <= w <= ICE[1]),
                "sequence_truncate": min(w_seq, CAP),
                "sequence_mask": float(1 / CAP <= w_seq <= CAP),
                "geometric_mask": float(1 / GEO <= g_seq <= GEO),
            }[mode]
        out.append(row)
    return out


def reference_loss(name, lp, old, adv, mask, c, lo, hi):
    """−(1/|R|) Σ_i (1/|y_i|) Σ_t c_t term_t (GRPO, GSPO-token), −(1/|R|) Σ_i mean_t(c_t) J_i (GSPO)."""
    lp = lp.detach().clone().requires_grad_()
    total, n = 0.0, 0
    for i in range(mask.shape[0]):
        idx = [t for t in range(mask.shape[1]) if mask[i, t]]
        if not idx:
            continue
        n += 1
        s = torch.exp(sum(lp[i, t] - old[i, t] for t in idx) / len(idx))
        if name == "gspo":
            term = torch.minimum(s * adv[i], s.clamp(1 - lo, 1 + hi) * adv[i])
            total = total + term * sum(c[i][t] for t in idx) / len(idx)
            continue
        terms = []
        for t in idx:
            r = (
                torch.exp(lp[i, t] - old[i, t])
                if name == "grpo"
                else s.detach() * torch.exp(lp[i, t] - lp[i, t].detach())
            )
            terms.append(c[i][t] * torch.minimum(r * adv[i], r.clamp(1 - lo, 1 + hi) * adv[i]))
        total = total + sum(terms) / len(idx)
    loss = -total / n
    loss.backward()
    return loss.detach(), lp.grad


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", ["grpo", "gspo", "gspo_token"])
def test_each_mode_matches_a_float64_reference(name, mode):
    lp, old, mu, adv, mask = make(spread=0.8 if mode != "geometric_mask" else 0.03)
    c, metrics = correction_weights(
        old_logprobs=old, rollout_logprobs=mu, mask=mask, mode=mode, cap=CAP, geo_cap=GEO, icepop=ICE
    )
    want = reference_c(old, mu, mask, mode)
    torch.testing.assert_close(c, torch.tensor(want, dtype=torch.float64), rtol=1e-12, atol=0)
    obj = get_objective(name, clip_low=0.2, clip_high=0.27)  # a range wide enough to leave gradients
    leaf = lp.detach().clone().requires_grad_()
    loss, _ = obj(logprobs=leaf, old_logprobs=old, advantages=adv, mask=mask, weights=c)
    loss.backward()
    ref_loss, ref_grad = reference_loss(name, lp, old, adv, mask, want, 0.2, 0.27)
    torch.testing.assert_close(loss.detach(), ref_loss, rtol=1e-10, atol=1e-14)
    torch.testing.assert_close(leaf.grad, ref_grad, rtol=1e-10, atol=1e-14)
    assert set(metrics) == set(CORRECTION_METRICS)
    assert 0 <= metrics["correction/masked_frac/token"] <= 1 and 0 < metrics["correction/ess"] <= 1
    if mode.endswith("mask") or mode == "icepop":
        assert 0 < metrics["correction/masked_frac/token"] < 1  # the test exercises both sides
    else:
        assert metrics["correction/truncated_frac/token"] > 0


@pytest.mark.parametrize("mode", MODES)
def test_no_effect_when_the_engines_agree(mode):
    lp, old, _, adv, mask = make()
    c, metrics = correction_weights(old_logprobs=old, rollout_logprobs=old.clone(), mask=mask, mode=mode, **BOUNDS)
    assert torch.equal(c, mask.double())  # exactly 1 on every valid token
    assert metrics["correction/masked_frac/token"] == metrics["correction/truncated_frac/token"] == 0.0
    assert metrics["correction/weight/mean"] == metrics["correction/ess"] == 1.0
    obj = get_objective("gspo")
    plain, _ = obj(logprobs=lp, old_logprobs=old, advantages=adv, mask=mask)
    weighted, _ = obj(logprobs=lp, old_logprobs=old, advantages=adv, mask=mask, weights=c)
    assert torch.equal(plain, weighted)


@pytest.mark.parametrize("mode", ["token_truncate", "sequence_mask"])
def test_padding_and_micro_batches_never_change_the_result(mode):
    lp, old, mu, adv, mask = make(seed=3)
    garbage = mu.clone()
    garbage[~mask] = float("nan")
    c, _ = correction_weights(old_logprobs=old, rollout_logprobs=mu, mask=mask, mode=mode, **BOUNDS)
    c2, _ = correction_weights(old_logprobs=old, rollout_logprobs=garbage, mask=mask, mode=mode, **BOUNDS)
    assert torch.equal(c, c2)
    obj = get_objective("grpo")
    whole, _ = obj(logprobs=lp, old_logprobs=old, advantages=adv, mask=mask, weights=c)
    norm = obj.batch_normalizer(mask)
    parts = sum(
        obj(
            logprobs=lp[r],
            old_logprobs=old[r],
            advantages=adv[r],
            mask=mask[r],
            weights=c[r],
            normalizer=norm,
        )[0]
        for r in torch.arange(len(adv)).split(2)
    )
    torch.testing.assert_close(parts, whole, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("mode", MODES)
def test_each_mode_runs_in_the_trainer_and_logs_its_metrics(smoke_cfg, mode):
    from gspo_study import trainer

    cfg = smoke_cfg("algo.objective=grpo", "rollout.dtype=bfloat16", f"algo.rollout_correction={mode}")
    metrics = trainer.rl_step(trainer.setup(resolve_run(cfg)), 1)
    assert set(CORRECTION_METRICS) <= metrics.keys() and "correction/masked_frac/token/mb_3" in metrics
    assert metrics["correction/weight/min"] <= metrics["correction/weight/mean"] <= metrics["correction/weight/max"]
    assert metrics["correction/weight/mean"] != 1.0  # a bf16 engine: μ differs from π_old


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        (["algo.rollout_correction=tis"], "allowed: none, token_truncate"),
        (["algo.rollout_correction=token_mask", "algo.old_logprobs=rollout"], "nothing to correct"),
        (["algo.rollout_correction_cap=1"], "'algo.rollout_correction_cap'; allowed: a number > 1"),
        (["algo.icepop_low=1.5"], "0 < low < 1 < high"),
    ],
)
def test_bad_settings_are_one_line_errors(overrides, words):
    with pytest.raises(ConfigError) as err:
        load_config("experiments/smoke/base.yaml", overrides)
    assert words in str(err.value) and "\n" not in str(err.value)


def test_the_mode_table_is_the_docstrings_table():
    from gspo_study.objectives import correction

    rows = [line.split("|")[1].strip(" `") for line in correction.__doc__.splitlines() if line.startswith("| `")]
    assert rows == list(correction.MODES)
