"""The routing frontier's rollout-only doses (gspo_study.rollout.perturb): the rollout copy moves, the trainer never.

A random-init smoke model is enough: every property here is about which forward sees a perturbation, not about a
trained policy. One rollout batch per engine, built once per module (the whole file runs in a few seconds).
"""

from __future__ import annotations

import pytest
import torch

from gspo_study.config import ConfigError, load_config
from gspo_study.models import build_char_tokenizer, build_model
from gspo_study.moe import mismatch_metrics, record_routing, replay_routing, routers, routing_volatility
from gspo_study.rollout import HFEngine, Perturbation, make_engine
from gspo_study.rollout.perturb import perturbed_routing, rounded
from gspo_study.run import run_key
from gspo_study.train.forward import token_logprobs

SMOKE = "experiments/smoke/base.yaml"
PROMPTS = [f"{a}+{b}=" for a in range(4) for b in range(4)]  # 16 rows


@pytest.fixture(scope="module")
def policy():
    torch.manual_seed(0)
    tok = build_char_tokenizer()
    return build_model("qwen3-moe-smoke", tok, seed=3), tok


@pytest.fixture(scope="module")
def pristine(policy):
    """The trainer's model built again from its seed: the same weights, and no engine was ever built on it."""
    model = build_model("qwen3-moe-smoke", policy[1], seed=3)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), policy[0].parameters()))
    return model


def _rollout(model, tok, perturbation=None, seed=7):
    engine = HFEngine(model, tok, dtype="float32", perturbation=perturbation)
    batch = engine.generate(PROMPTS, 12, 1.0, torch.Generator().manual_seed(seed), capture_routing=True)
    return engine, batch


def _trainer_forward(model, batch, replay=None):
    """The trainer's forward over a rollout batch: its log-probs and the routing it used."""
    with torch.no_grad():
        if replay is None:
            with record_routing(model) as trace:
                lp, _ = token_logprobs(model, batch.sequences, batch.attention_mask)
            return lp, trace
        with replay_routing(model, replay) as handle, record_routing(model) as trace:
            lp, _ = token_logprobs(model, batch.sequences, batch.attention_mask)
        assert handle.replayed_calls > 0
        return lp, trace


@pytest.fixture(scope="module")
def rollouts(policy):
    model, tok = policy
    doses = {
        "none": None,
        "noise": Perturbation(router_noise=1.0),
        "bf16": Perturbation(router_precision="bfloat16"),
        "fp8": Perturbation(router_precision="float8_e4m3"),
        "head": Perturbation(head_noise=1.0),
    }
    return {name: _rollout(model, tok, p) for name, p in doses.items()}


def test_no_dose_is_todays_engine(policy, rollouts):
    """At dose 0 the engine shares the trainer's weights and samples exactly what it sampled before the knob."""
    model, tok = policy
    engine, batch = rollouts["none"]
    assert engine.model is model and engine.perturbed is None
    plain = HFEngine(model, tok, dtype="float32").generate(
        PROMPTS, 12, 1.0, torch.Generator().manual_seed(7), capture_routing=True
    )
    assert torch.equal(batch.sequences, plain.sequences)
    assert torch.equal(batch.rollout_logprobs, plain.rollout_logprobs)
    assert Perturbation.from_config(load_config(SMOKE).rollout) == Perturbation()


def test_preallocated_cache_samples_what_the_growing_cache_did(policy, rollouts, monkeypatch):
    """The engine's KV cache is sized once per rollout (`PreallocatedLayer`); with transformers' growing
    `DynamicLayer` put back in its place, every token, log-prob and routing choice is the same, bit for bit."""
    from transformers.cache_utils import DynamicLayer

    from gspo_study.rollout import hf

    model, tok = policy
    for name, perturbation in (("none", None), ("noise", Perturbation(router_noise=1.0))):
        _, batch = rollouts[name]
        with monkeypatch.context() as m:
            m.setattr(hf, "PreallocatedLayer", lambda capacity: DynamicLayer())
            _, grown = _rollout(model, tok, perturbation)
        assert torch.equal(batch.sequences, grown.sequences) and torch.equal(batch.attention_mask, grown.attention_mask)
        assert torch.equal(batch.rollout_logprobs, grown.rollout_logprobs)
        for layer, ids in batch.routing.indices.items():
            assert torch.equal(ids, grown.routing.indices[layer])
    layer = hf.PreallocatedLayer(capacity=3)
    layer.update(torch.zeros(1, 1, 2, 4), torch.zeros(1, 1, 2, 4))
    with pytest.raises(RuntimeError, match="3 positions asked to hold 4"):
        layer.update(torch.zeros(1, 1, 2, 4), torch.zeros(1, 1, 2, 4))


@pytest.mark.parametrize("dose", ["noise", "bf16", "fp8", "head"])
def test_a_dose_moves_only_the_rollout_copy(policy, pristine, rollouts, dose):
    """With a dose on, the engine has its own copy (the trainer's weights, synced), the trainer's forward is bit for
    bit that of a model no engine was built on, and the engine's log-probs move away from the trainer's."""
    model, _ = policy
    engine, batch = rollouts[dose]
    assert engine.model is not model and not engine.shares_weights
    assert all(torch.equal(a, b) for a, b in zip(engine.model.parameters(), model.parameters()))
    lp, trace = _trainer_forward(model, batch)
    ref_lp, ref_trace = _trainer_forward(pristine, batch)
    assert torch.equal(lp, ref_lp) and routing_volatility(trace, ref_trace)["overall"] == 0.0
    assert mismatch_metrics(lp, batch.rollout_logprobs, batch.response_mask)["k3"] > 0


@pytest.mark.parametrize("dose", ["noise", "bf16", "fp8"])
def test_axis_m_changes_routing_and_r3_removes_it(policy, rollouts, dose):
    """Axis M: the engine routes differently from the trainer's free forward; replaying the engine's routing (R3)
    makes the trainer's routing equal the engine's exactly."""
    model, _ = policy
    _, batch = rollouts[dose]
    mask = batch.response_mask
    _, free = _trainer_forward(model, batch)
    assert routing_volatility(batch.routing, free, mask)["overall"] > 0
    _, replayed = _trainer_forward(model, batch, replay=batch.routing)
    assert routing_volatility(batch.routing, replayed, mask)["overall"] == 0.0


def test_control_moves_mu_and_no_routing_decision(policy, rollouts):
    """The control (head noise): k3 > 0 while the engine's routing equals the trainer's free routing everywhere."""
    model, _ = policy
    _, batch = rollouts["head"]
    lp, free = _trainer_forward(model, batch)
    valid = batch.attention_mask[:, :-1].bool()  # every fed position, prompt included
    assert routing_volatility(batch.routing, free, valid)["overall"] == 0.0
    assert mismatch_metrics(lp, batch.rollout_logprobs, batch.response_mask)["k3"] > 1e-3


def test_doses_are_reproducible_and_grow(policy, rollouts):
    """The same seed gives the same perturbed rollout; a larger σ flips more routing choices."""
    model, tok = policy
    _, again = _rollout(model, tok, Perturbation(router_noise=1.0))
    assert torch.equal(again.sequences, rollouts["noise"][1].sequences)
    flips = []
    for sigma in (0.01, 0.3, 3.0):
        _, batch = _rollout(model, tok, Perturbation(router_noise=sigma))
        _, free = _trainer_forward(model, batch)
        flips.append(routing_volatility(batch.routing, free, batch.response_mask)["overall"])
    assert flips[0] < flips[1] < flips[2]


def test_perturbed_router_at_no_dose_is_the_router(policy):
    """`perturbed_routing` mirrors Qwen3MoeTopKRouter.forward exactly when it perturbs nothing, and rounds as cast."""
    model, _ = policy
    _, router = routers(model)[0]
    h = torch.randn(5, router.hidden_dim)
    for got, want in zip(perturbed_routing(router, h, None, 0.0, None), router(h)):
        assert torch.equal(got, want)
    x = torch.tensor([1.0 + 2**-10, 1000.0])
    assert rounded(x, torch.bfloat16).tolist() == [1.0, 1000.0]
    assert rounded(x, torch.float8_e4m3fn).tolist() == [1.0, 448.0]


def test_config_switches(tmp_path):
    """Off by default and outside every pinned key; a vLLM engine or sharded rollouts given a dose refuse in one line;
    an engine other than hf refuses a perturbation."""
    base = load_config(SMOKE)
    assert run_key(base) == run_key(load_config(SMOKE, ["rollout.router_noise=0", "rollout.router_precision=none"]))
    assert run_key(base) != run_key(load_config(SMOKE, ["rollout.router_noise=0.5"]))
    for bad, needle in [
        (["rollout.engine=vllm", "rollout.router_noise=0.3"], "only with rollout.engine=hf"),
        (["rollout.engine=vllm_server", "rollout.head_noise=0.3"], "only with rollout.engine=hf"),
        (["rollout.sharded=true", "rollout.router_precision=bfloat16"], "rollout.sharded=false"),
        (["rollout.router_precision=fp4"], "allowed: none, bfloat16, float16, float8_e4m3"),
        (["rollout.router_noise=-1"], r"'rollout.router_noise'; allowed: a number in \[0, 100\]"),
    ]:
        with pytest.raises(ConfigError, match=needle) as err:
            load_config(SMOKE, bad)
        assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="needs rollout.engine=hf"):
        make_engine("vllm", None, None, perturbation=Perturbation(router_noise=0.1))


def test_calibration_reads_each_axis(smoke_results, tmp_path, monkeypatch):
    """`python -m gspo_study calibrate` on the smoke cold start, one dose per dial: dose 0 moves nothing, the
    control moves k3 and no routing, a router dose flips routing, and axis V reads the drift per update."""
    import pandas as pd

    from gspo_study import calibrate as cal
    from gspo_study.cli import main

    monkeypatch.setattr(
        cal,
        "GRID",
        {
            "M": {"rollout.router_noise": [0.0, 1.0]},
            "control": {"rollout.head_noise": [1.0]},
            "V": {"train.router_lr_scale": [30.0]},
            "F": {"train.num_minibatches": [4]},
            "R": {"train.route_noise": [0.0, 1.0], "train.route_random": [True]},
        },
    )
    out = tmp_path / "calibration.csv"
    args = ["--scale", "smoke", "--batches", "1", "--steps", "2", "--out", str(out), f"results_dir={smoke_results}"]
    assert main(["calibrate", *args]) == 0
    t = pd.read_csv(out, dtype={"dose": str}).set_index(["dial", "dose", "measure"])["mean"]
    assert t["rollout.router_noise", "0.0", "flips_per_layer"] == 0 and t["rollout.router_noise", "0.0", "k3"] < 1e-9
    assert t["rollout.router_noise", "1.0", "flips_per_layer"] > 0.05 and t["rollout.router_noise", "1.0", "k3"] > 0
    assert t["rollout.head_noise", "1.0", "flips_per_layer"] == 0 and t["rollout.head_noise", "1.0", "k3"] > 1e-3
    assert t["train.router_lr_scale", "30.0", "per_update"] > 0
    assert main(["calibrate", "--axes", "Q", *args]) == 2  # a bad axis: one line, nothing written
    # axes F and R, written beside the rows already there: a frozen router still drifts through the hidden states;
    # axis R's dose puts routing inside the ratio from the first update on, dose 0 does not
    assert main(["calibrate", "--axes", "F,R", *args]) == 0
    t = pd.read_csv(out, dtype={"dose": str}).set_index(["axis", "dial", "dose", "measure"])["mean"]
    assert t["M", "rollout.router_noise", "1.0", "flips_per_layer"] > 0.05  # kept
    assert t["F", "train.num_minibatches", "4", "per_update"] >= 0
    assert t["R", "train.route_noise", "0.0", "route_flips_first"] == 0
    assert t["R", "train.route_noise", "1.0", "route_flips_first"] > 0.05
    assert t["R", "train.route_random", "True", "route_share"] > t["R", "train.route_noise", "0.0", "route_share"]
