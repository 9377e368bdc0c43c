"""The `vllm_server` rollout engine: rollouts from a pool of vLLM OpenAI-compatible servers with their own devices
and parallelism (as slime, verl's server mode and TRL's `vllm_mode="server"` run large models), behind
`RolloutEngine` (`rollout/base.py`), sampling through `vllm_engine.VLLMRollout`'s `generate`.

The pool is `rollout.server.urls`, or one server the suite starts on loopback (`server_argv`, its own process
group, dying with the trainer); one `/v1/completions` request per row; weights go to the servers by disk
(safetensors shards, then `POST /collective_rpc` to our worker extension `vllm_worker`). Everything that does
not need a server (its command line, a request's body, a response to samples, the weights on disk) is a pure
function, tested on CPU without vLLM; nothing here imports vLLM. How it works and why (requests, the weight
sync, R3, many ranks): docs/SCALE.md, "Rollout engine: a vLLM server pool".
"""

from __future__ import annotations

import base64
import contextlib
import ctypes
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from gspo_study.config import ConfigError
from gspo_study.rollout.pool_key import auth_header, pool_key
from gspo_study.rollout.vllm_engine import (
    CPU_KV_CACHE_BYTES,
    ROUTING_NOT_ON_CPU,
    SEED_BOUND,
    VLLMRollout,
    check_dtype,
    hf_to_vllm_weights,
    is_cpu_build,
    vllm_config_dict,
)

SERVED_NAME = "policy"  # the model name the suite's servers answer to
EXTENSION = "gspo_study.rollout.vllm_worker.DiskWeightReload"
RELOAD_METHOD = "gspo_reload_weights"
SHARD_BYTES = 2**30  # weights are written in shards of at most this size (bounded extra memory on rank 0)
# vLLM's CPU platform: an explicit KV-cache size (vllm_engine.CPU_KV_CACHE_BYTES) and eager mode
CPU_ARGS = ("--enforce-eager", "--kv-cache-memory-bytes", str(CPU_KV_CACHE_BYTES))
# One CPU process per server runs the model in its engine-core process ("uni" executor). vLLM's CPU platform
# swaps "uni" for a worker process of its own (to bind OpenMP threads) unless multiprocessing is off in its
# environment: a third process that imports vLLM again (≈ 9 s of every start on a 2-core machine) and spins on
# shared memory beside the engine core while it generates. The API server still runs its engine core apart.
CPU_ONE_PROCESS_ARGS = ("--distributed-executor-backend", "uni")
CPU_ONE_PROCESS_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
SERVER_ENV = {"VLLM_SERVER_DEV_MODE": "1"}  # /collective_rpc (the weight push) and /reset_prefix_cache
PR_SET_PDEATHSIG = 1


# ------------------------------------------------------------------------------------------ command line
def server_argv(
    python: str,
    model_dir: str,
    port: int,
    dtype: str,
    server,
    cpu: bool,
    routing: bool,
    host: str = "127.0.0.1",
) -> list[str]:
    """`vllm serve` for a server of the pool (`server`: `rollout.server`): on `host` (loopback for the suite's
    own), the policy's weights from `model_dir`, our worker extension, sampling with no checkpoint defaults and
    processed log-probs. `python -m gspo_study rollout-server` runs the same for a pool on other machines."""
    if routing and cpu:
        raise ConfigError(ROUTING_NOT_ON_CPU.replace("rollout.engine=vllm", "rollout.engine=vllm_server"))
    argv = [
        python, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model_dir),
        "--served-model-name", SERVED_NAME,
        "--host", host,
        "--port", str(port),
        "--dtype", dtype,
        "--skip-tokenizer-init",
        "--generation-config", "vllm",
        "--logprobs-mode", "processed_logprobs",
        "--worker-extension-cls", EXTENSION,
        "--tensor-parallel-size", str(server.tensor_parallel_size),
        "--data-parallel-size", str(server.data_parallel_size),
        "--seed", "0",
        "--disable-log-stats",
    ]  # fmt: skip
    if server.enable_expert_parallel:
        argv.append("--enable-expert-parallel")
    if routing:
        argv.append("--enable-return-routed-experts")
    if cpu:
        argv.extend(CPU_ARGS)
    if _one_process(server, cpu):
        argv.extend(CPU_ONE_PROCESS_ARGS)
    return argv + list(server.args)


def server_env(server, cpu: bool, key: str | None = None) -> dict[str, str]:
    """What `server_argv`'s process needs in its environment besides the caller's; with the pool's `key`, vLLM's own
    key on its /v1 routes (in the environment, never on the command line, which `ps` shows)."""
    keyed = {"VLLM_API_KEY": key} if key else {}
    return {**SERVER_ENV, **(CPU_ONE_PROCESS_ENV if _one_process(server, cpu) else {}), **keyed}


def _one_process(server, cpu: bool) -> bool:
    return cpu and server.tensor_parallel_size == 1


def has_vllm(python: str) -> bool:
    code = "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"
    return subprocess.run([python, "-c", code], capture_output=True, timeout=120).returncode == 0


# -------------------------------------------------------------------------------------- requests, answers
def completion_body(
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    temperature: float,
    greedy: bool,
    seed: int,
    eos: int,
    routing: bool = False,
) -> dict:
    """One row's `/v1/completions` request: token-id prompt, its seed, EOS the only stop, pure temperature
    sampling, the sampled token's log-prob and the token ids back (and the routed experts, for R3)."""
    body = {
        "model": SERVED_NAME,
        "prompt": [int(t) for t in prompt_ids],
        "max_tokens": int(max_new_tokens),
        "temperature": 0.0 if greedy else float(temperature),
        "top_p": 1.0,
        "top_k": -1,
        "n": 1,
        "seed": int(seed) % SEED_BOUND,
        "logprobs": 0,
        "stop_token_ids": [int(eos)],
        "return_token_ids": True,
        "return_tokens_as_token_ids": True,
        "skip_special_tokens": False,
    }
    if routing:
        body["routed_experts_prompt_start"] = 0
    return body


def decode_array(b64: str) -> np.ndarray:
    """A NumPy array the server sent as base64 of its `.npy` bytes (vLLM's `numpy2base64`)."""
    return np.load(io.BytesIO(base64.b64decode(b64)), allow_pickle=False)


def parse_completion(response: dict, eos: int) -> tuple[tuple[list[int], list[float], bool], object | None]:
    """(sample for `to_rollout_batch`, routed experts or None) from one `/v1/completions` answer."""
    choices = response.get("choices") or []
    if len(choices) != 1:
        raise ValueError(f"the rollout server answered {len(choices)} choices for one request (n=1)")
    choice = choices[0]
    ids = choice.get("token_ids")
    logprobs = (choice.get("logprobs") or {}).get("token_logprobs")
    if ids is None or logprobs is None:
        raise ValueError("the rollout server returned no token ids or log-probs (return_token_ids, logprobs=0)")
    if any(lp is None for lp in logprobs):
        raise ValueError("the rollout server returned a missing log-prob for a sampled token")
    routed = choice.get("routed_experts")
    routed = decode_array(routed) if isinstance(routed, str) else routed
    return (list(ids), [float(x) for x in logprobs], bool(ids) and ids[-1] == eos), routed


# ------------------------------------------------------------------------------------------ weights on disk
def write_weights(
    named_params: Iterable[tuple[str, torch.Tensor]], directory: str | Path, shard_bytes: int = SHARD_BYTES
) -> list[Path]:
    """The trainer's parameters as safetensors shards under their checkpoint names (`hf_to_vllm_weights`),
    written into a temporary sibling and renamed to `directory` (a reader never sees half a push). At most
    `shard_bytes` (or one tensor) is copied out at a time. Returns the shards."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.tmp-", dir=directory.parent))
    try:
        shard: dict[str, torch.Tensor] = {}
        size, names = 0, []

        def flush() -> None:
            nonlocal shard, size
            if shard:
                name = f"weights-{len(names) + 1:05d}.safetensors"
                save_file(shard, str(tmp / name))
                names.append(name)
                shard, size = {}, 0

        for name, tensor in hf_to_vllm_weights(named_params):
            nbytes = tensor.numel() * tensor.element_size()
            if shard and size + nbytes > shard_bytes:
                flush()
            shard[name] = tensor.detach().to("cpu").contiguous().clone()  # a view of a fused tensor: its own copy
            size += nbytes
        flush()
        if directory.exists():
            shutil.rmtree(directory)
        tmp.rename(directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return [directory / n for n in names]


def write_model_dir(named_params, config, directory: str | Path) -> Path:
    """What a server the suite starts loads: the weights and config.json (`vllm_config_dict`)."""
    directory = Path(directory)
    write_weights(named_params, directory)
    (directory / "config.json").write_text(json.dumps(vllm_config_dict(config), indent=1))
    return directory


# --------------------------------------------------------------------------------------------------- HTTP
def post_json(url: str, body: dict | None = None, timeout: float = 600.0, key: str | None = None) -> dict:
    """POST `body` as JSON, carrying the pool's `key` (gspo_study.rollout.pool_key) when there is one."""
    data = json.dumps(body or {}).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json", **auth_header(key)})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as answer:
            text = answer.read().decode() or "{}"
    except urllib.error.HTTPError as err:
        detail = err.read().decode(errors="replace")[:500]
        if err.code == 401:
            raise ConfigError(
                f"rollout server {url} refused the request (HTTP 401): it needs the pool's key; allowed: "
                "the servers' key in $GSPO_STUDY_POOL_KEY or rollout.server.key_file"
            ) from None
        raise RuntimeError(f"rollout server {url} answered HTTP {err.code}: {detail}") from None
    except urllib.error.URLError as err:
        raise RuntimeError(f"rollout server {url} is not answering ({err.reason}); is it running?") from None
    return json.loads(text)


def is_ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as answer:
            return answer.status == 200
    except OSError:
        return False


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:  # in the child, before exec: SIGTERM when the trainer dies, even by SIGKILL
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


class ServerProcess:
    """A `vllm serve` the suite started: its own process group (the API server and its engine-core and
    worker processes), its log in a file, stopped as a whole."""

    def __init__(self, argv: list[str], log_path: Path, env: dict[str, str] | None = None):
        self.argv, self.log_path = argv, Path(log_path)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            argv,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )
        self.pgid = self.proc.pid

    def wait_ready(self, url: str, timeout: float) -> float:
        """Seconds until `url` answers /health; a one-line error with the log's last line if the server exits or
        does not come up in `timeout` seconds."""
        start = time.monotonic()
        while time.monotonic() - start < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"the rollout server exited with code {self.proc.returncode} before it was ready: "
                    f"{self.tail()} (log: {self.log_path})"
                )
            if is_ready(url):
                return time.monotonic() - start
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(
            f"the rollout server was not ready after {timeout:.0f} s (rollout.server.start_timeout_s): "
            f"{self.tail()} (log: {self.log_path})"
        )

    def tail(self) -> str:
        lines = [x for x in self.log_path.read_text(errors="replace").splitlines() if x.strip()]
        return lines[-1].strip() if lines else "(empty log)"

    def stop(self) -> None:
        """SIGTERM the whole group, SIGKILL what lingers after 30 s."""
        for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
            try:
                os.killpg(self.pgid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(timeout=wait)
            except subprocess.TimeoutExpired:
                continue
            if not group_alive(self.pgid):
                break
            time.sleep(1)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pgid, signal.SIGKILL)
        deadline = time.monotonic() + 10  # SIGKILL is asynchronous: return once the group is really gone
        while group_alive(self.pgid) and time.monotonic() < deadline:
            time.sleep(0.1)
        self._log.close()


def group_alive(pgid: int) -> bool:
    """Whether a process of group `pgid` still runs (zombies, dead but not yet reaped, do not count; where /proc
    is missing, any member counts)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    proc = Path("/proc")
    if not proc.is_dir():
        return True
    for stat in proc.glob("[0-9]*/stat"):
        try:
            state, _, group = stat.read_text().rsplit(")", 1)[1].split()[:3]
        except (OSError, IndexError, ValueError):
            continue  # the process ended while being read
        if int(group) == pgid and state != "Z":
            return True
    return False


# ------------------------------------------------------------------------------------------------ engine
def _dist():
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


class VLLMServerEngine(VLLMRollout):
    """Rollouts from a vLLM server pool with `HFEngine`'s interface (see the module docstring).

    `server`: `rollout.server` (urls, python, parallelism, weight_dir, start_timeout_s, max_concurrency,
    args); `weight_dir`: where pushes are written when `server.weight_dir` is empty (the run directory's).
    """

    writes_weights = True  # the trainer hands it `full_state` (trainer.sync_hooks)
    NO_ROUTING = (
        "the rollout servers were started without routed-experts capture; start them with "
        "--enable-return-routed-experts (a GPU)"
    )

    def __init__(self, model, tokenizer, dtype: str, server, weight_dir: str | Path):
        check_dtype(dtype)
        self.model, self.tokenizer, self.dtype, self.server = model, tokenizer, dtype, server
        self.weight_dir = Path(server.weight_dir or weight_dir).resolve()
        self.urls: list[str] = [u.rstrip("/") for u in server.urls]
        self.key = pool_key(server)  # the pool's shared key, or None (never logged, never in a config)
        self.process: ServerProcess | None = None
        self.routing = False
        self._gather = contextlib.nullcontext
        self._full_state = None
        self._weights_stale = True
        self._version = 0
        self._started = False
        self.last_push: dict[str, object] = {}
        self.timings: dict[str, float] = {}

    # ---- public interface ------------------------------------------------------------------------
    def sync(self, model, gather=None, full_state=None) -> None:
        """The trainer's current weights go to the pool before the next `generate` (pushed then, so that a step
        without a rollout costs nothing). `full_state`: a collective that returns the whole weights on rank 0's
        CPU, gathered layer by layer (DeepSpeed ZeRO-3's `full_state_dict`; None where the ranks hold whole
        weights), used instead of `gather` (which makes the whole model resident on every rank's device)."""
        self.model, self._gather, self._weights_stale = model, gather or contextlib.nullcontext, True
        self._full_state = full_state

    def close(self) -> None:
        """Stop the server the suite started (its whole process group) and remove the pushed weights."""
        if self.process is not None:
            self.process.stop()
            self.process = None
        if self._started and not self.server.weight_dir:
            shutil.rmtree(self.weight_dir, ignore_errors=True)

    # ---- the pool --------------------------------------------------------------------------------
    def _ensure_started(self, routing: bool) -> None:
        if self._started:
            return
        if self.urls:
            # an external pool (the same on every rank): R3 works if it was started to capture routing
            self.routing = routing
        else:
            # every rank joins (ZeRO-3: a collective); rank 0 starts the server
            with self._whole_weights() as weights:
                if weights is not None:
                    self._start(routing, weights)
        dist = _dist()
        if dist is not None:
            shared = [self.urls, self._weights_stale, self.routing]
            dist.broadcast_object_list(shared, src=0)
            self.urls, self._weights_stale, self.routing = shared
        self._started = True

    def _start(self, routing: bool, weights) -> None:
        python = self.server.python or sys.executable
        if not has_vllm(python):
            raise ConfigError(
                f"rollout.engine=vllm_server: rollout.server.python={python!r} has no vLLM; allowed: an interpreter "
                "with vLLM (e.g. .venv-vllm/bin/python, `make vllm-env`), or rollout.server.urls of running servers"
            )
        cpu = is_cpu_build(python)
        port = _free_port()
        model_dir = self.weight_dir / "model"
        # built first: it refuses what cannot run (R3 on the CPU build) before anything is written
        argv = server_argv(python, str(model_dir), port, self.dtype, self.server, cpu, routing)
        t0 = time.perf_counter()
        write_model_dir(weights, self.model.config, model_dir)
        env = {**os.environ, **server_env(self.server, cpu, self.key)}
        self.process = ServerProcess(argv, self.weight_dir / "server.log", env)
        (self.weight_dir / "server.json").write_text(
            json.dumps({"pid": self.process.proc.pid, "pgid": self.process.pgid, "port": port, "argv": argv})
        )
        url = f"http://127.0.0.1:{port}"
        ready = self.process.wait_ready(url, self.server.start_timeout_s)
        self.urls, self.routing, self._weights_stale = [url], routing, False
        self.timings = {"write_s": time.perf_counter() - t0 - ready, "start_s": ready}

    @contextlib.contextmanager
    def _whole_weights(self):
        """Collective: yields the whole weights as (name, tensor) pairs on rank 0 (None on the others), from
        `full_state` (layer by layer onto rank 0's CPU) where it gives them, else inside `gather`."""
        dist = _dist()
        rank = dist.get_rank() if dist is not None else 0
        with torch.no_grad():
            state = self._full_state() if self._full_state is not None else None
            layerwise = [state is not None]  # ZeRO-3: a dict on rank 0 only; ZeRO-2 and one process: None
            if dist is not None:
                dist.broadcast_object_list(layerwise, src=0)
            if layerwise[0]:
                yield state.items() if rank == 0 else None
            else:
                with self._gather():
                    yield self.model.named_parameters() if rank == 0 else None

    def _push_weights(self) -> None:
        """Every rank joins the gather; rank 0 writes and pushes; all wait."""
        with self._whole_weights() as weights:
            if weights is not None:
                self._push(weights)
        dist = _dist()
        if dist is not None:
            dist.barrier()
        self._weights_stale = False

    def _push(self, named_params) -> None:
        self._version += 1
        target = self.weight_dir / f"push-{self._version:06d}"
        t0 = time.perf_counter()
        write_weights(named_params, target)
        t1 = time.perf_counter()
        results = []
        for url in self.urls:
            try:
                answer = post_json(
                    f"{url}/collective_rpc", {"method": RELOAD_METHOD, "args": [str(target)]}, key=self.key
                )
            except RuntimeError as err:  # (a refusal for want of the key is a ConfigError of its own)
                raise ConfigError(
                    f"rollout server {url} cannot reload weights ({err}); serve it with VLLM_SERVER_DEV_MODE=1 "
                    f"and --worker-extension-cls {EXTENSION}"
                ) from None
            results.extend(answer.get("results") or [])
            post_json(f"{url}/reset_prefix_cache", key=self.key)  # cached KV blocks belong to the old weights
        self.last_push = {"workers": results, "write_s": t1 - t0, "reload_s": time.perf_counter() - t1}
        for old in self.weight_dir.glob("push-*"):
            if old != target:
                shutil.rmtree(old, ignore_errors=True)

    def _ready(self, want_routing: bool) -> None:
        self._ensure_started(want_routing)

    def _sample(self, prompt_ids, max_new_tokens, temperature, greedy, seeds, routing, sharded):
        """(samples, routed pairs); under DeepSpeed with unsharded rows, rank 0 asks the pool for every rank."""
        dist = _dist()
        if sharded or dist is None or dist.get_world_size() == 1:
            return self._request(prompt_ids, max_new_tokens, temperature, greedy, seeds, routing)
        shared = [None]
        if dist.get_rank() == 0:
            shared = [self._request(prompt_ids, max_new_tokens, temperature, greedy, seeds, routing)]
        dist.broadcast_object_list(shared, src=0)
        return shared[0]

    def _request(self, prompt_ids, max_new_tokens, temperature, greedy, seeds, routing):
        eos = self.tokenizer.eos_token_id
        bodies = [
            completion_body(ids, max_new_tokens, temperature, greedy, seed, eos, routing)
            for ids, seed in zip(prompt_ids, seeds)
        ]
        urls = [self.urls[i % len(self.urls)] for i in range(len(bodies))]
        workers = max(1, min(len(bodies), self.server.max_concurrency))
        with ThreadPoolExecutor(workers) as pool:
            ask = lambda ub: post_json(f"{ub[0]}/v1/completions", ub[1], key=self.key)  # noqa: E731
            answers = list(pool.map(ask, zip(urls, bodies)))
        parsed = [parse_completion(a, eos) for a in answers]
        return [p[0] for p in parsed], [(None, p[1]) for p in parsed]
