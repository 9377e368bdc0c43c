"""Routing record/replay (R2/R3 primitives) and routing telemetry, on the smoke Qwen3-MoE preset."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from gspo_study.models.presets import build_model
from gspo_study.models.tokenizer import build_char_tokenizer
from gspo_study.moe import (
    RoutingTrace,
    count_moe_layers,
    has_moe,
    mismatch_metrics,
    moe_layers,
    record_routing,
    replay_routing,
    routing_volatility,
)

TOK = build_char_tokenizer()
N_SPECIAL = 4  # <pad> <bos> <eos> <unk>: never sampled as content in these tests


def smoke(**overrides) -> torch.nn.Module:
    return build_model("qwen3-moe-smoke", TOK, seed=0, **overrides).eval()


def interleaved() -> torch.nn.Module:
    """4 decoder layers, dense MLPs at 1 and 2: MoE at decoder layers 0 and 3."""
    return smoke(num_hidden_layers=4, mlp_only_layers=[1, 2])


def padded_batch(side: str, lengths=(9, 6, 4, 9), seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.full((len(lengths), width), TOK.pad_token_id)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for row, n in enumerate(lengths):
        cols = slice(width - n, width) if side == "left" else slice(0, n)
        ids[row, cols] = torch.randint(N_SPECIAL, len(TOK), (n,), generator=gen)
        mask[row, cols] = 1
    return ids, mask


def positions(mask: torch.Tensor) -> torch.Tensor:
    """Position ids that skip left padding, as HF generation computes them."""
    return (mask.cumsum(-1) - 1).clamp(min=0)


def perturb_routers(model: torch.nn.Module, scale: float = 0.5, seed: int = 1) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                param.add_(torch.randn(param.shape, generator=gen) * scale * param.std())


def forward(model, ids, mask, **kw) -> torch.Tensor:
    return model(ids, attention_mask=mask, **kw).logits


def record(model, ids, mask, **kw) -> tuple[torch.Tensor, RoutingTrace]:
    with torch.no_grad(), record_routing(model) as trace:
        logits = forward(model, ids, mask, **kw)
    return logits, trace


def routing_hooks(model) -> int:
    """Hooks on MoE blocks and routers (transformers may add its own, so tests compare counts)."""
    blocks = [m for m in model.modules() if hasattr(m, "gate")]
    return sum(len(b._forward_pre_hooks) + len(b.gate._forward_hooks) for b in blocks)


def traces_equal(a: RoutingTrace, b: RoutingTrace) -> bool:
    return a.layers == b.layers and all(torch.equal(a.layer(i), b.layer(i)) for i in a.layers)


# ---- record / replay ---------------------------------------------------------------------------------


@pytest.mark.parametrize("impl", ["eager", "grouped_mm", "grouped_mm_index"])
def test_replay_at_unchanged_weights_is_exact(impl):
    model = smoke(experts_implementation=impl)
    ids, mask = padded_batch("left")
    logits, trace = record(model, ids, mask)
    assert trace.layers == [0, 1] and trace.shape == (4, 9, 2)
    with torch.no_grad(), replay_routing(model, trace) as handle:
        replayed = forward(model, ids, mask)
    assert torch.equal(replayed, logits)
    assert handle.replayed_calls == 2 and handle.calls_per_layer == {0: 1, 1: 1}


def check_replay_after_perturbation(model, expected_layers):
    ids, mask = padded_batch("right")
    _, trace_old = record(model, ids, mask)
    assert trace_old.layers == expected_layers
    perturb_routers(model)
    _, trace_free = record(model, ids, mask)
    stats = routing_volatility(trace_old, trace_free, mask)
    assert stats["overall"] > 0, "perturbation too small to change routing: the test would prove nothing"

    model.zero_grad()
    with replay_routing(model, trace_old) as handle, record_routing(model) as trace_used:
        logits = forward(model, ids, mask)
        logits.logsumexp(-1).sum().backward()
    assert traces_equal(trace_used, trace_old)
    assert handle.replayed_calls == len(expected_layers)
    for layer in expected_layers:
        grad = model.model.layers[layer].mlp.gate.weight.grad
        assert grad is not None and grad.abs().sum() > 0
    assert routing_volatility(trace_old, trace_used, mask)["overall"] == 0.0


def test_replay_forces_recorded_experts_and_routers_get_gradients():
    check_replay_after_perturbation(smoke(), [0, 1])


def test_replay_with_dense_layers_interleaved_uses_decoder_layer_indices():
    model = interleaved()
    assert moe_layers(model) == [0, 3] and count_moe_layers(model) == 2 and has_moe(model)
    check_replay_after_perturbation(model, [0, 3])


def test_replay_inside_record_records_replayed_experts_and_natural_routing():
    model = smoke()
    ids, mask = padded_batch("left")
    _, trace_old = record(model, ids, mask)
    perturb_routers(model)
    # Contexts on the model and on its decoder stack share one set of hooks, so nesting order is moot.
    with (
        torch.no_grad(),
        record_routing(model) as outer,
        replay_routing(model.model, trace_old, record_natural=True) as handle,
    ):
        forward(model, ids, mask)
    assert traces_equal(outer, trace_old)
    _, trace_free = record(model, ids, mask)
    # Natural choices match a free forward in layer 0 (same inputs); deeper layers see replayed activations.
    assert torch.equal(handle.natural.layer(0), trace_free.layer(0))
    assert routing_volatility(trace_old, handle.natural, mask)["overall"] > 0


@pytest.mark.parametrize("side", ["left", "right"])
def test_padding_and_micro_batch_replay(side):
    model = smoke()
    ids, mask = padded_batch(side)
    pos = positions(mask)
    logits, trace = record(model, ids, mask, position_ids=pos)
    perturb_routers(model)
    with torch.no_grad(), replay_routing(model, trace):
        full = forward(model, ids, mask, position_ids=pos)
    for rows in ([2, 0], torch.tensor([3]), slice(1, 3)):
        with torch.no_grad(), replay_routing(model, trace.select(rows)), record_routing(model) as used:
            micro = forward(model, ids[rows], mask[rows], position_ids=pos[rows])
        assert traces_equal(used, trace[rows])
        # Batch size changes the matmul blocking, so equality is to float32 rounding, not bitwise.
        valid = mask[rows].bool()
        torch.testing.assert_close(micro[valid], full[rows][valid], rtol=1e-5, atol=1e-5)


def test_trace_helpers():
    model = interleaved()
    ids, mask = padded_batch("left")
    _, trace = record(model, ids, mask)
    assert trace.batch_size == 4 and trace.seq_len == 9 and trace.top_k == 2
    joined = RoutingTrace.cat([trace.select([0, 1]), trace.select(slice(2, None))])
    assert traces_equal(joined, trace)
    assert trace.select(-1).shape == (1, 9, 2) and trace.to("cpu").layers == [0, 3]
    assert traces_equal(trace.select(torch.tensor([True, False, False, True])), trace.select([0, 3]))
    with pytest.raises(ValueError, match="cannot concatenate"):
        RoutingTrace.cat([trace, RoutingTrace({k: v[:, :3] for k, v in trace.indices.items()})])


def test_replay_under_gradient_checkpointing():
    ids, mask = padded_batch("left")
    _, trace = record(smoke(), ids, mask)

    def router_grads(checkpointing: bool) -> list[torch.Tensor]:
        model = smoke()
        perturb_routers(model)
        if checkpointing:
            model.activation_checkpointing_enable()
        model.train()
        with replay_routing(model, trace) as handle, record_routing(model) as used:
            forward(model, ids, mask).logsumexp(-1).sum().backward()  # recompute happens inside: replayed
        assert handle.replayed_calls == (4 if checkpointing else 2) and used.shape == trace.shape
        return [model.model.layers[i].mlp.gate.weight.grad for i in trace.layers]

    assert all(torch.equal(a, b) for a, b in zip(router_grads(False), router_grads(True)))
    model = smoke()
    model.activation_checkpointing_enable()
    model.train()
    with pytest.warns(UserWarning, match="before backward"), replay_routing(model, trace):
        forward(model, ids, mask)


# ---- generation (R3 contract) ------------------------------------------------------------------------


def generate_cached(model, ids, mask, new_tokens: int, seed: int = 0):
    """KV-cached sampling, one decode step per forward; returns the sequences and their attention mask."""
    gen = torch.Generator().manual_seed(seed)
    cache = DynamicCache(config=model.config)
    pos = positions(mask)
    step_ids = ids
    for _ in range(new_tokens):
        logits = forward(model, step_ids, mask, position_ids=pos, cache=cache, use_cache=True)[:, -1]
        step_ids = torch.multinomial(logits.softmax(-1), 1, generator=gen)
        ids = torch.cat([ids, step_ids], dim=1)
        mask = torch.cat([mask, torch.ones_like(step_ids)], dim=1)
        pos = pos[:, -1:] + 1
    return ids, mask


@pytest.mark.parametrize("impl", ["eager", "grouped_mm", "grouped_mm_index"])
def test_generation_trace_matches_full_forward_routing(impl):
    model = smoke(experts_implementation=impl)
    prompt, prompt_mask = padded_batch("left", lengths=(5, 3, 7))
    with torch.no_grad(), record_routing(model) as rollout_trace:
        seqs, seq_mask = generate_cached(model, prompt, prompt_mask, new_tokens=8)
    ids, mask = seqs[:, :-1], seq_mask[:, :-1]
    assert rollout_trace.shape == (3, ids.shape[1], 2)  # the last sampled token is never fed
    _, full_trace = record(model, ids, mask, position_ids=positions(mask))
    # KV-cached decode and one full forward round differently; on valid tokens the routing agrees exactly
    # here (a near-tie flip would show up as a small non-zero share).
    stats = routing_volatility(full_trace, rollout_trace, mask)
    assert stats["overall"] == 0.0, stats
    with torch.no_grad(), replay_routing(model, rollout_trace) as handle:
        forward(model, ids, mask, position_ids=positions(mask))
    assert handle.replayed_calls == 2


def test_recording_works_with_hf_generate():
    model = smoke()
    prompt, prompt_mask = padded_batch("left", lengths=(5, 3))
    with torch.no_grad(), record_routing(model) as trace:
        seqs = model.generate(prompt, attention_mask=prompt_mask, max_new_tokens=6, min_new_tokens=6, do_sample=False)
    mask = torch.cat([prompt_mask, torch.ones(2, seqs.shape[1] - prompt.shape[1], dtype=torch.long)], dim=1)
    ids, mask = seqs[:, :-1], mask[:, :-1]
    assert trace.shape == (2, ids.shape[1], 2)
    _, full_trace = record(model, ids, mask, position_ids=positions(mask))
    assert routing_volatility(full_trace, trace, mask)["overall"] == 0.0


# ---- replay must be verifiably active ---------------------------------------------------------------


def test_replay_without_forward_raises_and_hooks_are_removed():
    model = smoke()
    ids, mask = padded_batch("left")
    logits, trace = record(model, ids, mask)
    hooks = routing_hooks(model)
    with pytest.raises(RuntimeError, match="no MoE router was replayed"):
        with replay_routing(model, trace):
            pass
    assert routing_hooks(model) == hooks
    perturb_routers(model)
    assert not torch.equal(forward(model, ids, mask), logits)  # hooks gone: free routing again


def test_exception_inside_replay_propagates_and_restores():
    model = smoke()
    ids, mask = padded_batch("left")
    _, trace = record(model, ids, mask)
    hooks = routing_hooks(model)
    with pytest.raises(KeyError):  # not masked by the "nothing replayed" error
        with replay_routing(model, trace):
            raise KeyError("boom")
    assert routing_hooks(model) == hooks


def test_shape_mismatch_and_missing_layer_raise_clearly():
    model = smoke()
    ids, mask = padded_batch("left")
    _, trace = record(model, ids, mask)
    with pytest.raises(RuntimeError, match=r"\[B, T\] = \[2, 9\].*holds \[4, 9\]"):
        with torch.no_grad(), replay_routing(model, trace):
            forward(model, ids[:2], mask[:2])
    with pytest.raises(RuntimeError, match=r"\[B, T\] = \[4, 8\].*holds \[4, 9\]"):
        with torch.no_grad(), replay_routing(model, trace):
            forward(model, ids[:, 1:], mask[:, 1:])
    with pytest.raises(ValueError, match=r"missing \[1\]"):
        with replay_routing(model, RoutingTrace({0: trace.layer(0)})):
            pass
    with pytest.raises(ValueError, match="empty"):
        with replay_routing(model, RoutingTrace()):
            pass


def test_no_moe_model_raises():
    dense = smoke(mlp_only_layers=[0, 1])
    assert not has_moe(dense)
    with pytest.raises(ValueError, match="no MoE router"):
        with replay_routing(dense, RoutingTrace({0: torch.zeros(1, 1, 2, dtype=torch.long)})):
            pass


def test_nested_replay_raises():
    model = smoke()
    ids, mask = padded_batch("left")
    _, trace = record(model, ids, mask)
    with pytest.raises(RuntimeError, match="already active"):
        with torch.no_grad(), replay_routing(model, trace):
            forward(model, ids, mask)
            with replay_routing(model, trace):
                pass


# ---- telemetry --------------------------------------------------------------------------------------


def hand_trace(layer_ids: dict[int, list]) -> RoutingTrace:
    return RoutingTrace({layer: torch.tensor(v) for layer, v in layer_ids.items()})


def test_routing_volatility_exact_values():
    # B=1, T=3, k=2; token 2 is padding.
    old = hand_trace({0: [[[0, 1], [2, 3], [4, 5]]], 5: [[[0, 1], [2, 3], [4, 5]]]})
    new = hand_trace({0: [[[1, 0], [2, 7], [6, 7]]], 5: [[[0, 1], [6, 7], [0, 1]]]})
    mask = torch.tensor([[True, True, False]])
    stats = routing_volatility(old, new, mask)
    # layer 0: token 0 reordered only (0 changed), token 1 one changed -> 1 / (2*2); layer 5: token 1 both.
    assert stats == {"overall": 3 / 8, "tokens_any_changed": 1 / 2, "layer_00": 1 / 4, "layer_05": 2 / 4}
    assert routing_volatility(old, old, mask) == {
        "overall": 0.0,
        "tokens_any_changed": 0.0,
        "layer_00": 0.0,
        "layer_05": 0.0,
    }
    assert routing_volatility(old, new)["tokens_any_changed"] == 2 / 3  # no mask: padding counts


def test_mismatch_metrics_exact_values():
    train = torch.tensor([[0.0, -1.0, 2.0, float("-inf")]])
    rollout = torch.tensor([[0.0, -1.0 - 1.0, 2.0 + 3.0, float("-inf")]])
    mask = torch.tensor([[1, 1, 1, 0]])
    stats = mismatch_metrics(train, rollout, mask)
    lr = torch.tensor([0.0, 1.0, -3.0], dtype=torch.float64)
    k3 = float((lr.exp() - 1 - lr).mean())
    assert stats["k3"] == pytest.approx(k3, rel=1e-12)
    assert stats["f_tau_2"] == 2 / 3  # |log r| = 1 > log 2, 3 > log 2
    assert stats["f_tau_10"] == 1 / 3  # only 3 > log 10
    assert all(v == v for v in stats.values())  # no NaN from the -inf padding
    empty = mismatch_metrics(train, rollout, torch.zeros_like(mask))
    assert empty == {"k3": 0.0, "f_tau_2": 0.0, "f_tau_10": 0.0}


# ---- experts kernel ----------------------------------------------------------------------------------


@pytest.mark.parametrize("preset", ["qwen3-moe-smoke", "qwen3-moe-tiny"])
def test_grouped_mm_index_is_bit_identical_to_grouped_mm(preset):
    """gspo_study's kernel changes only how rows are gathered: logits and every gradient equal transformers'
    grouped_mm bit for bit (so runs keep their identity, `tracking.SAME_NUMBERS`), with replay too."""
    ids, mask = padded_batch("right", lengths=(17, 9, 30, 4, 22, 30))
    results = []
    for impl in ("grouped_mm", "grouped_mm_index"):
        model = build_model(preset, TOK, seed=3, experts_implementation=impl).train()
        _, trace = record(model, ids, mask)
        perturb_routers(model)
        with replay_routing(model, trace):
            logits = forward(model, ids, mask)
        free = forward(model, ids, mask)
        (logits.pow(2).mean() + free.logsumexp(-1).mean()).backward()
        results.append((logits.detach(), free.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (a, b, ga), (c, d, gc) = results
    assert torch.equal(a, c) and torch.equal(b, d)
    assert ga.keys() == gc.keys() and all(torch.equal(ga[k], gc[k]) for k in ga)
    assert any("experts" in k and ga[k].abs().sum() > 0 for k in ga)


def test_grouped_mm_index_backward_is_deterministic_with_threads():
    """With 2 threads transformers' grouped_mm gives different gradients from call to call on CPU (its gather's
    backward is an accumulating index_put_): a cold-start SFT trained with it did not reproduce itself. Ours
    accumulates with index_add_ in a fixed order: the same gradients every time."""
    ids = torch.randint(3, len(TOK), (64, 40), generator=torch.Generator().manual_seed(0))
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        grads = []
        for _ in range(3):
            model = build_model("qwen3-moe-tiny", TOK, seed=3, experts_implementation="grouped_mm_index").train()
            model(input_ids=ids).logits.logsumexp(-1).mean().backward()
            grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(grads[0][k], g[k]) for g in grads[1:] for k in grads[0])
