"""The HF engine's shared prefill (gspo_study.rollout.prefill): prefilling 4 copies of each prompt instead of all G
gives every rollout the bits of the whole batch's prefill — tokens, log-probs and recorded routing — and its rule
refuses the batches and machines where that could fail.

Random-init models are enough (the property is about arithmetic, not a trained policy): the smoke preset, and the
study's shape (`qwen3-moe-tiny` at 4 layers, 32 experts). A few seconds in all.
"""

from __future__ import annotations

import pytest
import torch

from gspo_study.models import build_char_tokenizer, build_model
from gspo_study.rollout import HFEngine, Perturbation, prefill
from gspo_study.rollout.base import encode_prompts

PROMPTS = ["1+2=", "7+8+9=", "3+4=", "5+6+7+8=", "9+9=", "2+2+2="]  # ragged lengths: left padding differs by row


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def _generate(model, tok, prompts, perturbation=None, whole=False, monkeypatch=None):
    if whole:  # the reference: the engine as it was, every row prefilled
        monkeypatch.setattr(prefill, "exact", lambda model: False)
    engine = HFEngine(model, tok, dtype="float32", perturbation=perturbation)
    batch = engine.generate(prompts, 16, 1.0, torch.Generator().manual_seed(5), capture_routing=True)
    if whole:
        monkeypatch.undo()
    return batch


def _same(a, b) -> bool:
    return (
        torch.equal(a.sequences, b.sequences)
        and torch.equal(a.rollout_logprobs, b.rollout_logprobs)
        and a.routing.layers == b.routing.layers
        and all(torch.equal(a.routing.indices[k], b.routing.indices[k]) for k in a.routing.layers)
    )


@pytest.mark.parametrize(
    "preset,overrides", [("qwen3-moe-smoke", {}), ("qwen3-moe-tiny", {"num_hidden_layers": 4})], ids=["smoke", "tiny4"]
)
def test_shared_prefill_gives_every_row_the_whole_batchs_bits(tok, preset, overrides, monkeypatch):
    model = build_model(preset, tok, seed=3, experts_implementation="grouped_mm_index", **overrides)
    prompts = [p for p in PROMPTS for _ in range(8)]
    seq, mask = encode_prompts(tok, prompts)
    assert prefill.exact(model) and prefill.plan(seq, mask) is not None  # the shortcut is taken here
    shared = _generate(model, tok, prompts)
    whole = _generate(model, tok, prompts, whole=True, monkeypatch=monkeypatch)
    assert _same(shared, whole)
    assert shared.routing.shape[:2] == (len(prompts), shared.sequences.shape[1] - 1)


def test_one_copy_per_prompt_would_move_the_bits(tok, monkeypatch):
    """Why four copies: at one, some experts get 1-3 rows, which MKL multiplies along other paths (the study's
    shape)."""
    model = build_model("qwen3-moe-tiny", tok, seed=3, experts_implementation="grouped_mm_index", num_hidden_layers=4)
    prompts = [p for p in PROMPTS for _ in range(8)]
    whole = _generate(model, tok, prompts, whole=True, monkeypatch=monkeypatch)
    plan = prefill.plan
    monkeypatch.setattr(prefill, "plan", lambda seq, mask: plan(seq, mask, copies=1))
    assert not _same(_generate(model, tok, prompts), whole)


@pytest.mark.parametrize("dose", [Perturbation(router_precision="bfloat16"), Perturbation(head_noise=1.0)])
def test_a_perturbed_copy_keeps_its_bits_under_the_shared_prefill(tok, dose, monkeypatch):
    model = build_model("qwen3-moe-smoke", tok, seed=3, experts_implementation="grouped_mm_index")
    prompts = [p for p in PROMPTS for _ in range(8)]
    assert _same(_generate(model, tok, prompts, dose), _generate(model, tok, prompts, dose, True, monkeypatch))


def test_router_noise_prefills_every_row(tok, monkeypatch):
    """The noise is drawn per token of the forward, so fewer rows would draw another stream: no shortcut."""
    model = build_model("qwen3-moe-smoke", tok, seed=3, experts_implementation="grouped_mm_index")
    planned = []
    monkeypatch.setattr(prefill, "plan", lambda *a: planned.append(a))
    _generate(model, tok, [p for p in PROMPTS for _ in range(8)], Perturbation(router_noise=0.5))
    assert planned == []


def test_plan_keeps_four_copies_of_each_prompt_and_maps_every_row_to_one(tok):
    seq, mask = encode_prompts(tok, [p for _ in range(8) for p in PROMPTS[:3]])  # interleaved, 8 rows each
    shared = prefill.plan(seq, mask)
    assert len(shared.keep) == 3 * prefill.COPIES and shared.keep.tolist() == sorted(shared.keep.tolist())
    stand_in = shared.keep[shared.stand_in]  # the batch row standing in for each row
    assert torch.equal(seq[stand_in], seq) and torch.equal(mask[stand_in], mask)


@pytest.mark.parametrize("copies", [[8, 8, 6], [4, 4, 4], [8, 3, 8], [1, 1, 1]])
def test_plan_refuses_counts_off_the_many_row_path_or_with_nothing_to_save(tok, copies):
    seq, mask = encode_prompts(tok, [p for p, n in zip(PROMPTS, copies) for _ in range(n)])
    assert prefill.plan(seq, mask) is None


def test_the_probe_fails_a_product_whose_rows_depend_on_the_batch():
    assert prefill.rows_exact(lambda x: 2 * x, 8)
    assert not prefill.rows_exact(lambda x: x - x.mean(0), 8)  # every row moves with the others
    assert not prefill.rows_exact(lambda x: x * (1 + (x.shape[0] % 8 == 4)), 8)  # a path taken at some sizes only


def test_no_shortcut_off_the_probed_machine_or_kernel(tok):
    model = build_model("qwen3-moe-smoke", tok, seed=3, experts_implementation="eager")
    assert not prefill.exact(model)  # a kernel whose products the probe does not know
    assert not prefill.exact(build_model("qwen3-moe-smoke", tok, seed=3).to(torch.bfloat16))
    zero = build_model("qwen3-moe-smoke", tok, seed=3)
    next(zero.parameters()).ds_id = 0  # a DeepSpeed ZeRO parameter: not held whole, its shape not the product's
    assert not prefill.exact(zero)
    zero = build_model("qwen3-moe-smoke", tok, seed=3)
    zero.lm_head.weight = torch.nn.Parameter(torch.empty(0))  # ZeRO-3's partitioned stand-in (a 1-D placeholder)
    assert not prefill.exact(zero)
