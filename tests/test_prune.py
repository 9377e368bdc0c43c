"""Pruning a Qwen3-MoE checkpoint (gspo_study.models.prune): the pruned model against the same computation done in
the full model — all kept → identical; fewer experts → the full model with the dropped experts' router logits at
−inf; fewer layers → the full model's stack without them; usage counts → the full model's own routing."""

from __future__ import annotations

import json
from contextlib import contextmanager

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open

from gspo_study.cli import main
from gspo_study.models import build_char_tokenizer, build_model, load_pretrained, save_pretrained
from gspo_study.models.prune import PruneError, prune
from gspo_study.moe import record_routing

LAYERS, EXPERTS, TOP_K = 4, 8, 2


def _source(path, norm_topk_prob=True, **save_kwargs):
    tok = build_char_tokenizer()
    model = build_model("qwen3-moe-smoke", tok, seed=3, num_hidden_layers=LAYERS, norm_topk_prob=norm_topk_prob)
    if save_kwargs:  # e.g. a sharded source
        path.mkdir(parents=True)
        model.save_pretrained(path, **save_kwargs)
        tok.save_pretrained(path)
        return path
    return save_pretrained(model, tok, path)


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    return _source(tmp_path_factory.mktemp("prune") / "full")


@pytest.fixture(scope="module")
def full(src):
    return load_pretrained(src)[0].eval()


def _ids(seed=0):
    return torch.randint(4, 25, (3, 14), generator=torch.Generator().manual_seed(seed))


def _logits(model, ids, **kw):
    with torch.no_grad():
        return model(ids, attention_mask=torch.ones_like(ids), use_cache=False, **kw)


@contextmanager
def masked_routers(model, kept: dict[int, list[int]], top_k: int):
    """The full model's routers with every expert outside `kept[layer]` given logit −inf (reference formula:
    softmax over all logits, top-k, renormalised when norm_topk_prob)."""
    saved = []
    for i, layer in enumerate(model.model.layers):
        if i not in kept:  # a dense layer
            continue
        router = layer.mlp.gate

        def forward(h, router=router, ids=kept[i]):
            h = h.reshape(-1, router.hidden_dim)
            logits = F.linear(h, router.weight)
            mask = torch.full_like(logits, float("-inf"))
            mask[:, ids] = 0.0
            probs = torch.softmax((logits + mask).float(), dim=-1)
            top, idx = torch.topk(probs, top_k, dim=-1)
            if router.norm_topk_prob:
                top = top / top.sum(dim=-1, keepdim=True)
            return logits, top.to(logits.dtype), idx

        saved.append((router, router.forward))
        router.forward = forward
    try:
        yield
    finally:
        for router, fwd in saved:
            router.forward = fwd


def test_keeping_everything_gives_identical_tensors_and_logits(src, full, tmp_path):
    dst = tmp_path / "same"
    plan = prune(src, dst, layers=LAYERS, experts=EXPERTS)
    assert plan.layers == list(range(LAYERS)) and plan.top_k == TOP_K
    pruned = load_pretrained(dst)[0].eval()
    assert torch.equal(_logits(pruned, _ids()).logits, _logits(full, _ids()).logits)
    for name, p in full.state_dict().items():
        assert torch.equal(p, pruned.state_dict()[name]), name


@pytest.mark.parametrize("norm_topk_prob", [True, False])
@pytest.mark.parametrize("top_k", [None, 1])
def test_expert_subset_is_the_full_model_with_dropped_experts_masked(tmp_path, norm_topk_prob, top_k):
    src = _source(tmp_path / "full", norm_topk_prob=norm_topk_prob)
    plan = prune(src, tmp_path / "pruned", layers=LAYERS, experts=5, top_k=top_k)
    k = top_k or TOP_K
    kept = plan.experts
    assert plan.selection["expert_select"] == "norm" and all(len(kept[i]) == 5 for i in range(LAYERS))
    full, pruned = load_pretrained(src)[0].eval(), load_pretrained(tmp_path / "pruned")[0].eval()
    assert pruned.config.num_experts == 5 and pruned.config.num_experts_per_tok == k
    assert pruned.config.norm_topk_prob is norm_topk_prob
    with masked_routers(full, kept, k):
        want = _logits(full, _ids())
    got = _logits(pruned, _ids())
    torch.testing.assert_close(got.logits, want.logits, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(got.logits, _logits(full, _ids()).logits, atol=1e-4)  # the masking mattered
    # the router itself, on one layer's real input: top-k among kept == the full router restricted to them
    h = _logits(full, _ids(), output_hidden_states=True).hidden_states[1].reshape(-1, 32)
    h = full.model.layers[1].post_attention_layernorm(h)
    with torch.no_grad():
        logits_full, gates_full, idx_full = full.model.layers[1].mlp.gate(h)
        _, gates, idx = pruned.model.layers[1].mlp.gate(h)
    ids = torch.tensor(kept[1])
    restricted = logits_full[:, ids].topk(k, dim=-1).indices
    assert torch.equal(ids[idx].sort(dim=-1).values, ids[restricted].sort(dim=-1).values)
    # the documented gate relation to the full model's own gates (same K): equal where the full top-k is kept
    if top_k is None:
        inside = torch.isin(idx_full, ids).all(dim=-1)
        assert inside.any()
        if norm_topk_prob:
            torch.testing.assert_close(gates[inside].sort(-1).values, gates_full[inside].sort(-1).values)
        else:  # the full gate divided by the kept experts' probability mass
            mass = torch.softmax(logits_full[inside], -1)[:, ids].sum(-1, keepdim=True)
            torch.testing.assert_close(gates[inside].sort(-1).values, (gates_full[inside] / mass).sort(-1).values)
            assert (mass < 1).all()


def test_first_layers_keep_the_full_models_hidden_states(src, full, tmp_path):
    prune(src, tmp_path / "first2", layers=2, experts=EXPERTS)
    pruned = load_pretrained(tmp_path / "first2")[0].eval()
    assert pruned.config.num_hidden_layers == 2
    hs_full = _logits(full, _ids(), output_hidden_states=True).hidden_states
    hs = _logits(pruned, _ids(), output_hidden_states=True).hidden_states
    for j in range(2):  # the embeddings and layer 0's output; the last entry is after the final norm
        assert torch.equal(hs[j], hs_full[j]), j
    with torch.no_grad():
        layer1 = full.model.norm(hs_full[2])  # the full model's layer-1 output through the final norm
    torch.testing.assert_close(hs[2], layer1)


@pytest.mark.parametrize("select, layers", [("spaced", [0, 2, 3]), ("3,1", [1, 3])])
def test_chosen_layers_are_the_full_stack_without_the_others(src, full, tmp_path, select, layers):
    plan = prune(src, tmp_path / "sub", layers=len(layers), experts=EXPERTS, layer_select=select)
    assert plan.layers == layers
    pruned = load_pretrained(tmp_path / "sub")[0].eval()
    stack = full.model.layers
    full.model.layers = torch.nn.ModuleList([stack[i] for i in layers])
    full.config.num_hidden_layers = len(layers)
    try:
        want = _logits(full, _ids()).logits
    finally:
        full.model.layers, full.config.num_hidden_layers = stack, LAYERS
    torch.testing.assert_close(_logits(pruned, _ids()).logits, want, rtol=0, atol=0)


def test_usage_counts_are_the_full_models_routing(src, full, tmp_path):
    texts = ["12+34=46", "7+8=15,#:", "(1+2)*3=9", "99+1=100 ok"]
    (tmp_path / "calib.txt").write_text("\n".join(texts) + "\n")
    plan = prune(src, tmp_path / "used", layers=3, experts=3, calibration=tmp_path / "calib.txt")
    assert plan.selection["expert_select"] == "usage"
    tok = load_pretrained(src)[1]
    want = {i: torch.zeros(EXPERTS, dtype=torch.long) for i in range(LAYERS)}
    for t in texts:  # one sample at a time, as the pruner runs them
        ids = torch.tensor([tok(t)["input_ids"]])
        with record_routing(full) as trace, torch.no_grad():
            full(ids)
        for i in range(LAYERS):
            want[i] += torch.bincount(trace.indices[i].flatten(), minlength=EXPERTS)
    for i in range(3):
        assert plan.selection["usage"][str(i)] == want[i].tolist()
        top = sorted(sorted(range(EXPERTS), key=lambda e: (-int(want[i][e]), e))[:3])
        assert plan.experts[i] == top
    assert json.loads((tmp_path / "used" / "prune.json").read_text())["experts"]["0"] == plan.experts[0]


def test_sharded_source_and_explicit_experts(src, tmp_path):
    sharded = _source(tmp_path / "sharded", max_shard_size="20KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    (tmp_path / "ids.json").write_text(json.dumps({"0": [1, 3, 4, 6], "1": [0, 1, 2, 7]}))
    a = prune(sharded, tmp_path / "a", layers=2, experts=4, expert_select="1,3,4,6")
    b = prune(src, tmp_path / "b", layers=2, experts=4, expert_select=str(tmp_path / "ids.json"))
    assert a.experts == {0: [1, 3, 4, 6], 1: [1, 3, 4, 6]} and b.experts[1] == [0, 1, 2, 7]
    ma, mb = load_pretrained(tmp_path / "a")[0], load_pretrained(tmp_path / "b")[0]
    full = load_pretrained(src)[0]
    assert torch.equal(ma.model.layers[0].mlp.experts.down_proj, mb.model.layers[0].mlp.experts.down_proj)
    torch.testing.assert_close(
        mb.model.layers[1].mlp.gate.weight, full.model.layers[1].mlp.gate.weight[[0, 1, 2, 7]], rtol=0, atol=0
    )
    index = json.loads((tmp_path / "a" / "model.safetensors.index.json").read_text())
    with safe_open(str(tmp_path / "a" / index["weight_map"]["model.layers.1.mlp.gate.weight"]), "pt") as f:
        assert f.get_tensor("model.layers.1.mlp.gate.weight").shape == (4, 32)


def test_cli_writes_a_loadable_checkpoint_with_the_tokenizer(src, tmp_path, capsys):
    dst = tmp_path / "cli"
    assert main(["prune", str(src), str(dst), "--layers", "2", "--experts", "4", "--top-k", "2"]) == 0
    assert "source layers [0, 1]" in capsys.readouterr().out
    model, tok = load_pretrained(dst)
    cfg = json.loads((dst / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 2 and cfg["num_local_experts"] == 4 and cfg["num_experts"] == 4
    assert tok.get_vocab() == load_pretrained(src)[1].get_vocab()
    assert (dst / "CHECKPOINT_COMPLETE").is_file() and (dst / "prune.json").is_file()
    assert model.model.layers[1].mlp.experts.gate_up_proj.shape[0] == 4


@pytest.mark.parametrize(
    "args, words",
    [
        (["--layers", "0", "--experts", "4"], ["--layers 0", "1..4"]),
        (["--layers", "5", "--experts", "4"], ["--layers 5", "1..4"]),
        (["--layers", "2", "--experts", "0"], ["--experts 0", "1..8"]),
        (["--layers", "2", "--experts", "9"], ["--experts 9", "1..8"]),
        (["--layers", "2", "--experts", "4", "--top-k", "5"], ["--top-k 5", "1..4"]),
        (["--layers", "2", "--experts", "4", "--layer-select", "0,9"], ["0,9", "0..3"]),
        (["--layers", "2", "--experts", "4", "--layer-select", "middle"], ["middle", "first, spaced"]),
        (["--layers", "2", "--experts", "2", "--expert-select", "1,1"], ["[1, 1]", "0..7"]),
        (["--layers", "2", "--experts", "2", "--expert-select", "usage"], ["usage", "--calibration"]),
    ],
)
def test_bad_requests_are_one_line_errors_and_write_nothing(src, tmp_path, capsys, args, words):
    out = tmp_path / "out"
    assert main(["prune", str(src), str(out / "dst"), *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and all(w in err for w in words), err
    assert not out.exists()


def test_existing_destination_and_non_moe_source_are_refused(src, tmp_path):
    (tmp_path / "taken").mkdir()
    with pytest.raises(PruneError, match="already exists"):
        prune(src, tmp_path / "taken", layers=1, experts=2)
    assert list((tmp_path / "taken").iterdir()) == []
    (tmp_path / "llama").mkdir()
    (tmp_path / "llama" / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(PruneError, match="'llama'; a Qwen3-MoE"):
        prune(tmp_path / "llama", tmp_path / "x", layers=1, experts=2)
    assert not (tmp_path / "x").exists()


def test_dense_layers_stay_dense_under_their_new_index(tmp_path):
    tok = build_char_tokenizer()
    model = build_model("qwen3-moe-smoke", tok, seed=5, num_hidden_layers=LAYERS, mlp_only_layers=[1])
    src = save_pretrained(model, tok, tmp_path / "mixed")
    plan = prune(src, tmp_path / "p", layers=3, experts=5, layer_select="1,2,3")
    assert sorted(plan.experts) == [2, 3]  # experts chosen for the MoE layers only
    pruned = load_pretrained(tmp_path / "p")[0].eval()
    assert pruned.config.mlp_only_layers == [0] and pruned.config.num_experts == 5
    full = load_pretrained(src)[0].eval()
    full.model.layers = torch.nn.ModuleList([full.model.layers[i] for i in (1, 2, 3)])
    full.config.num_hidden_layers = 3
    with masked_routers(full, {1: plan.experts[2], 2: plan.experts[3]}, TOP_K):
        want = _logits(full, _ids()).logits
    torch.testing.assert_close(_logits(pruned, _ids()).logits, want, rtol=1e-5, atol=1e-6)
