"""The `vllm_server` rollout engine: its pure parts without vLLM, then against a real vLLM server (the CPU build in
`.venv-vllm`, `make vllm-env`) that the engine starts on loopback — the trainer side never imports vLLM, so the
real checks run in this process, the server in its own."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from gspo_study.config import ConfigError, ServerConfig, load_config
from gspo_study.rollout import make_engine
from gspo_study.rollout.vllm_engine import hf_to_vllm_weights, routing_trace_from_vllm
from gspo_study.rollout.vllm_server import (
    CPU_ARGS,
    CPU_ONE_PROCESS_ARGS,
    CPU_ONE_PROCESS_ENV,
    EXTENSION,
    SERVED_NAME,
    VLLMServerEngine,
    completion_body,
    decode_array,
    group_alive,
    parse_completion,
    server_argv,
    server_env,
    write_weights,
)
from gspo_study.rollout.vllm_worker import read_weights
from gspo_study.train.forward import token_logprobs
from tests.test_vllm_engine import (  # noqa: F401
    EOS,
    ROOT,
    SMOKE_BASE,
    TOK,
    VLLM_PY,
    _real_engine_env,
    smoke,
    vllm_coldstart,
)

PROMPTS = ["1+2=", "33+44=", "5=", "7+8="] * 3
TEMPERATURE = 0.9


# ------------------------------------------------------------------------------------ pure parts, no vLLM
def test_server_argv_for_the_cpu_build_and_for_a_gpu_pool():
    cpu = server_argv("py", "/w/model", 8123, "float32", ServerConfig(), cpu=True, routing=False)
    assert cpu[:3] == ["py", "-m", "vllm.entrypoints.openai.api_server"]
    flags = dict(zip(cpu[3::1], cpu[4::1]))
    assert flags["--model"] == "/w/model" and flags["--port"] == "8123" and flags["--host"] == "127.0.0.1"
    assert flags["--worker-extension-cls"] == EXTENSION and flags["--served-model-name"] == SERVED_NAME
    assert flags["--logprobs-mode"] == "processed_logprobs" and flags["--generation-config"] == "vllm"
    assert "--skip-tokenizer-init" in cpu and cpu[-len(CPU_ARGS + CPU_ONE_PROCESS_ARGS) :] == [
        *CPU_ARGS,
        *CPU_ONE_PROCESS_ARGS,
    ]
    # the CPU build's one process: the "uni" executor and the environment that keeps it; the dev endpoints always
    assert server_env(ServerConfig(), cpu=True) == {"VLLM_SERVER_DEV_MODE": "1", **CPU_ONE_PROCESS_ENV}
    assert server_env(ServerConfig(), cpu=False) == {"VLLM_SERVER_DEV_MODE": "1"}
    two = server_argv("py", "/w/model", 1, "float32", ServerConfig(tensor_parallel_size=2), cpu=True, routing=False)
    assert "uni" not in two and server_env(ServerConfig(tensor_parallel_size=2), cpu=True) == {
        "VLLM_SERVER_DEV_MODE": "1"
    }
    pool = ServerConfig(
        tensor_parallel_size=4, enable_expert_parallel=True, data_parallel_size=2, args=["--max-model-len", "8192"]
    )
    gpu = server_argv("py", "/w/model", 1, "bfloat16", pool, cpu=False, routing=True)
    flags = dict(zip(gpu, gpu[1:]))
    assert flags["--tensor-parallel-size"] == "4" and flags["--data-parallel-size"] == "2"
    assert "--enable-expert-parallel" in gpu and "--enable-return-routed-experts" in gpu
    assert "--enforce-eager" not in gpu and "uni" not in gpu and gpu[-2:] == ["--max-model-len", "8192"]
    with pytest.raises(ConfigError, match="needs a CUDA GPU"):
        server_argv("py", "/w", 1, "float32", ServerConfig(), cpu=True, routing=True)


def test_completion_body_is_one_seeded_token_id_request():
    body = completion_body([1, 5, 6], 12, 0.9, False, 2**31 + 4, EOS)
    assert body["prompt"] == [1, 5, 6] and body["max_tokens"] == 12 and body["n"] == 1
    assert body["temperature"] == 0.9 and body["top_p"] == 1.0 and body["logprobs"] == 0
    assert body["seed"] == (2**31 + 4) % (2**31 - 1) and body["stop_token_ids"] == [EOS]
    assert body["return_token_ids"] and "routed_experts_prompt_start" not in body
    assert completion_body([1], 4, 0.9, True, 0, EOS, routing=True)["temperature"] == 0.0
    assert completion_body([1], 4, 0.9, True, 0, EOS, routing=True)["routed_experts_prompt_start"] == 0


def _answer(ids, lps, routed=None):
    choice = {"token_ids": ids, "logprobs": {"token_logprobs": lps}, "finish_reason": "stop"}
    if routed is not None:
        import base64
        import io

        buf = io.BytesIO()
        np.save(buf, routed, allow_pickle=False)  # vLLM's numpy2base64
        choice["routed_experts"] = base64.b64encode(buf.getvalue()).decode()
    return {"choices": [choice]}


def test_parse_completion_reads_samples_and_routed_experts():
    (ids, lps, ended), routed = parse_completion(_answer([7, 8, EOS], [-0.1, -0.2, -0.3]), EOS)
    assert ids == [7, 8, EOS] and lps == [-0.1, -0.2, -0.3] and ended and routed is None
    (_, _, ended), _ = parse_completion(_answer([7, 8], [-0.1, -0.2]), EOS)
    assert not ended
    for bad in ({"choices": []}, {"choices": [{"token_ids": [1]}]}, _answer([1], [None])):
        with pytest.raises(ValueError, match="rollout server"):
            parse_completion(bad, EOS)
    # R3: the server's routed experts over prompt + response become the trace the HF recorder would give
    experts = np.arange(5 * 2 * 2).reshape(5, 2, 2) % 4  # [fed positions, MoE layers, k]
    (ids, _, _), routed = parse_completion(_answer([7, 8, EOS], [-1.0] * 3, experts), EOS)
    assert np.array_equal(decode_array(_answer([1], [0.0], experts)["choices"][0]["routed_experts"]), experts)
    trace = routing_trace_from_vllm([(None, routed)], [3], [3], [0, 1], 2, 4)
    assert trace.indices[1][0].tolist() == experts[:, 1].tolist()


def test_write_weights_are_the_checkpoints_names_in_bounded_shards(tmp_path):
    model = smoke()
    want = dict(hf_to_vllm_weights(model.named_parameters()))
    shards = write_weights(model.named_parameters(), tmp_path / "push", shard_bytes=8 * 1024)
    from safetensors.torch import load_file

    assert len(shards) > 3
    for shard in shards:  # each shard stays under the bound, unless it is a single larger tensor
        tensors = load_file(str(shard)).values()
        assert len(tensors) == 1 or sum(t.numel() * t.element_size() for t in tensors) <= 8 * 1024
    got = dict(read_weights(tmp_path / "push"))
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    write_weights([("a.weight", torch.ones(2))], tmp_path / "push")  # replaces the directory as a whole
    assert dict(read_weights(tmp_path / "push")).keys() == {"a.weight"}
    assert [p.name for p in tmp_path.iterdir()] == ["push"]  # no temporary sibling left
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        list(read_weights(tmp_path))


def test_server_config_is_checked_and_never_part_of_a_runs_identity():
    from gspo_study.run import run_key

    base = load_config(SMOKE_BASE, ["rollout.engine=vllm_server"])
    wide = load_config(
        SMOKE_BASE,
        [
            "rollout.engine=vllm_server",
            "rollout.server.tensor_parallel_size=8",
            "rollout.server.urls=[http://10.0.0.2:8000]",
            "rollout.server.weight_dir=/nfs/w",
        ],
    )
    assert run_key(base) == run_key(wide) != run_key(load_config(SMOKE_BASE))
    for bad, match in (
        ("rollout.server.urls=[10.0.0.2]", "rollout.server.urls"),
        ("rollout.server.tensor_parallel_size=0", "tensor_parallel_size"),
        ("rollout.server.start_timeout_s=0", "start_timeout_s"),
        ("rollout.server.urls=[http://node-b:8000]", "weight_dir must name storage"),
    ):
        with pytest.raises(ConfigError, match=match) as err:
            load_config(SMOKE_BASE, [bad])
        assert "\n" not in str(err.value)


def test_an_interpreter_without_vllm_is_named_in_one_line(tmp_path):
    engine = make_engine(
        "vllm_server", smoke(), TOK, "float32", server=ServerConfig(python=sys.executable), weight_dir=tmp_path
    )
    assert isinstance(engine, VLLMServerEngine)
    if "vllm" in sys.modules or _has_vllm_here():
        pytest.skip("this interpreter has vLLM")
    with pytest.raises(ConfigError, match="has no vLLM") as err:
        engine.generate(["1+2="], 4, 1.0, torch.Generator().manual_seed(0))
    assert "\n" not in str(err.value)


def _has_vllm_here() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


# ---------------------------------------------------------------------------- a real vLLM server (CPU build)
def _hf_diff(model, batch) -> dict:
    with torch.no_grad():
        hf = token_logprobs(model, batch.sequences, batch.attention_mask, TEMPERATURE)[0]
    diff = (batch.rollout_logprobs - hf).abs()[batch.response_mask]
    return {"mean": diff.mean().item(), "max": diff.max().item(), "tokens": int(diff.numel())}


POOL_KEY = "test-pool-key-" + "7" * 32  # the pool's shared key for this file's real server (and every engine here)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """One real server started by the engine (vLLM's CPU build) with the pool's key, the model it serves, and a run
    of checks; every engine of the file's tests sends the key (from the environment, as a pool's clients do)."""
    from gspo_study.rollout.pool_key import KEY_ENV

    python = _real_engine_env()
    torch.manual_seed(0)
    model = smoke(head_dim=32, moe_intermediate_size=32)
    root = tmp_path_factory.mktemp("vllm-server")
    keyed = pytest.MonkeyPatch()
    keyed.setenv(KEY_ENV, POOL_KEY)
    engine = VLLMServerEngine(model, TOK, "float32", ServerConfig(python=str(python)), root / "weights")
    try:
        yield SimpleNamespace(engine=engine, model=model, root=root)
    finally:
        engine.close()
        keyed.undo()


def _rollout(engine, seed=1):
    return engine.generate(PROMPTS, 10, TEMPERATURE, torch.Generator().manual_seed(seed))


@pytest.mark.slow
def test_real_server_logprobs_equal_the_trainers_and_reproduce(served):
    batch = _rollout(served.engine)
    assert served.engine.timings["start_s"] < served.engine.server.start_timeout_s
    diff = _hf_diff(served.model, batch)
    assert diff["tokens"] > 40 and diff["mean"] < 1e-6 and diff["max"] < 1e-5
    again, other = _rollout(served.engine), _rollout(served.engine, seed=2)
    assert torch.equal(again.sequences, batch.sequences) and torch.equal(again.rollout_logprobs, batch.rollout_logprobs)
    assert not torch.equal(other.sequences, batch.sequences)
    names = _group_names(served.engine.process.pgid)  # its engine core runs the model: no worker process
    assert "VLLM::EngineCor" in names and not any(n.startswith("VLLM::Worker") for n in names), names


def _group_names(pgid: int) -> list[str]:
    """The live processes of group `pgid`, by name (/proc/PID/comm: at most 15 characters)."""
    names = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid and fields[0] != "Z":
                names.append((stat.parent / "comm").read_text().strip())
        except (OSError, IndexError, ValueError):
            continue
    return sorted(names)


@pytest.mark.slow
def test_real_server_follows_every_weight_push(served):
    """Perturb all the weights, `sync`: the server's log-probs are the new weights' (the reload went through
    /collective_rpc and repacked the CPU kernels), and they moved far more than the agreement."""
    engine, model = served.engine, served.model
    before = _rollout(engine)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    engine.sync(model)
    after = _rollout(engine)
    push = engine.last_push
    assert push["workers"][0]["path"] == "reload_weights" and push["workers"][0]["cpu_layers_refreshed"] == 3
    assert push["workers"][0]["tensors"] == len(dict(hf_to_vllm_weights(model.named_parameters())))
    assert push["reload_s"] < 5 and [p.name for p in served.engine.weight_dir.glob("push-*")] == ["push-000001"]
    assert _hf_diff(model, after)["mean"] < 1e-6
    moved = _hf_diff(model, before)  # the old rollout scored by the new weights
    assert moved["mean"] > 1e-3


def _server_overrides(root: Path, init: Path, urls: list[str] = ()) -> list[str]:
    return [
        f"results_dir={root}",
        f"tracking.uri=sqlite:///{root}/mlflow.db",
        f"init_checkpoint={init}",
        "rollout.engine=vllm_server",
        f"rollout.server.python={VLLM_PY}",
        "train.steps=4",
        *([f"rollout.server.urls=[{','.join(urls)}]"] if urls else []),
    ]


def _train_server(root: Path, init: Path, kill_at: int | None = None):
    over = _server_overrides(root, init)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TQDM_DISABLE": "1"}
    if kill_at is not None:
        env["GSPO_STUDY_KILL_AT_STEP"] = str(kill_at)
    cmd = [sys.executable, "-m", "gspo_study", "train", SMOKE_BASE, "experiments/runs/gspo.yaml", *over]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    return done, load_config([SMOKE_BASE, "experiments/runs/gspo.yaml"], over)


@pytest.mark.slow
def test_real_server_run_trains_logs_and_resumes_after_a_kill(vllm_coldstart, served, tmp_path):  # noqa: F811
    """`train ... rollout.engine=vllm_server` end to end: the suite starts the server (vLLM's CPU build, another
    interpreter), the trainer is SIGKILLed after step 3 and its server's process group dies with it; the run
    resumes against a running server given by address (`rollout.server.urls`: the module's, so this test starts
    one server, not two) and pushes its step-2 checkpoint's weights there, every step is logged once, the
    parameters changed, and the server's log-probs equal the fp32 trainer's at every step (every push landed)."""
    from gspo_study.run import resolve_run
    from tests.test_trainer import history, weights

    _real_engine_env()
    killed, cfg = _train_server(tmp_path, vllm_coldstart, kill_at=3)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    record = json.loads((resolve_run(cfg).dir / "server-weights" / "server.json").read_text())
    deadline = time.monotonic() + 60
    while group_alive(record["pgid"]) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not group_alive(record["pgid"]), "the killed trainer's server outlived it"
    from gspo_study.trainer import train

    cfg = load_config(
        [SMOKE_BASE, "experiments/runs/gspo.yaml"], _server_overrides(tmp_path, vllm_coldstart, served.engine.urls)
    )
    train(cfg)  # the resume, in this process (what the CLI's `train` calls)
    hist = history(cfg)
    assert sorted(hist["rollout/reward/mean"]) == [1, 2, 3, 4] and sorted(hist["eval/pass_at_1"]) == [0, 2, 4]
    assert all(abs(v) < 1e-5 for v in hist["mismatch/k3"].values())  # fp32 server = fp32 trainer, every step
    before, after = weights(vllm_coldstart), weights(resolve_run(cfg).dir / "checkpoint")
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert {k for k in before if "self_attn" in k or k.endswith("mlp.gate.weight")} <= changed
    assert not (
        resolve_run(cfg).dir / "server-weights"
    ).exists()  # the finished run stopped its server, removed its pushes
    from mlflow.tracking import MlflowClient

    stored = MlflowClient(cfg.tracking.uri).get_run(_run_id(cfg))
    assert POOL_KEY not in json.dumps({**stored.data.params, **stored.data.tags})  # the key was in every request


def test_a_zero3_push_writes_the_layerwise_full_state_not_the_gathered_model(tmp_path, monkeypatch):
    """Under ZeRO-3 the trainer hands the engine `full_state` (the whole weights gathered layer by layer onto
    rank 0's CPU): the push writes exactly those tensors, without entering `gather`, and asks every server of
    the pool to reload them (the HTTP calls recorded; the real server path is tested below)."""
    import contextlib

    from gspo_study.rollout import vllm_server

    model = smoke()
    state = {k: v + 1.0 for k, v in model.state_dict().items()}  # not the model's own values
    calls = []
    monkeypatch.setattr(
        vllm_server, "post_json", lambda url, body=None, timeout=0, key=None: calls.append((url, body)) or {}
    )

    @contextlib.contextmanager
    def gather():
        raise AssertionError("the layer-by-layer state must be used instead of gathering the whole model")
        yield

    engine = VLLMServerEngine(model, TOK, "float32", ServerConfig(urls=["http://a:1", "http://b:2"]), tmp_path)
    engine.sync(model, gather=gather, full_state=lambda: state)
    engine._push_weights()
    written = dict(read_weights(tmp_path / "push-000001"))
    want = dict(hf_to_vllm_weights(state.items()))
    assert written.keys() == want.keys() and all(torch.equal(written[k], want[k]) for k in want)
    rpc = [(u, b) for u, b in calls if u.endswith("/collective_rpc")]
    assert [u for u, _ in rpc] == ["http://a:1/collective_rpc", "http://b:2/collective_rpc"]
    assert rpc[0][1] == {"method": "gspo_reload_weights", "args": [str(tmp_path / "push-000001")]}
    assert [u for u, _ in calls if u.endswith("/reset_prefix_cache")] == [
        "http://a:1/reset_prefix_cache",
        "http://b:2/reset_prefix_cache",
    ]
    engine.sync(model, full_state=lambda: None)  # ZeRO-2 / one process: the model's own weights
    engine._push_weights()
    assert [p.name for p in tmp_path.glob("push-*")] == ["push-000002"]
    assert torch.equal(dict(read_weights(tmp_path / "push-000002"))["model.norm.weight"], model.model.norm.weight)


def test_rollout_server_command_for_a_pool_on_other_machines(capsys, monkeypatch):
    """`python -m gspo_study rollout-server ... --print`: the vLLM command line a pool's server needs (what the
    trainer's requests and weight pushes expect), from the run's own config; no weights: a one-line error."""
    from gspo_study.cli import main

    over = [
        "rollout.engine=vllm_server",
        "rollout.server.tensor_parallel_size=2",
        "init_checkpoint=/models/x",
    ]
    assert main(["rollout-server", SMOKE_BASE, *over, "--model-dir", "/data/policy", "--port", "8011", "--print"]) == 0
    argv = capsys.readouterr().out.split()
    assert argv[0] == "VLLM_SERVER_DEV_MODE=1"  # the weight push's endpoint: the printed line runs as it is
    flags = dict(zip(argv, argv[1:]))
    assert flags["--host"] == "127.0.0.1" and flags["--port"] == "8011" and flags["--tensor-parallel-size"] == "2"
    assert flags["--worker-extension-cls"] == EXTENSION and flags["--model"] == "/data/policy"
    assert main(["rollout-server", SMOKE_BASE, "--model-dir", "/d", "--print"]) == 2
    err = capsys.readouterr().err
    assert "needs the weights to serve" in err and err.count("\n") == 1
    # on a network: refused without the pool's key; with it, vLLM stays on loopback behind this command's front,
    # and the printed line names the key's variable, never the key
    public = [*over, "--model-dir", "/data/policy", "--host", "0.0.0.0", "--port", "8011", "--print"]
    monkeypatch.delenv("GSPO_STUDY_POOL_KEY", raising=False)  # (the real server's fixture may have set it)
    assert main(["rollout-server", SMOKE_BASE, *public]) == 2
    err = capsys.readouterr().err
    assert "--host 0.0.0.0 puts the server on a network" in err and err.count("\n") == 1
    key = "k" * 40
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("GSPO_STUDY_POOL_KEY", key)
        assert main(["rollout-server", SMOKE_BASE, *public]) == 0
    out = capsys.readouterr().out
    line, front = out.splitlines()
    flags = dict(zip(line.split(), line.split()[1:]))
    assert flags["--host"] == "127.0.0.1" and flags["--port"] != "8011" and key not in out
    assert "VLLM_API_KEY=$GSPO_STUDY_POOL_KEY" in line and "front on 0.0.0.0:8011" in front


@pytest.mark.slow
def test_real_server_with_two_zero3_ranks_matches_one_process(vllm_coldstart, served, tmp_path):  # noqa: F811
    """2 DeepSpeed ranks (gloo, ZeRO-3) against the suite's server: rank 0 starts it, the weights are pushed from
    the layer-by-layer gather every step, rank 0's rollout is broadcast — the losses, rewards and the server's
    agreement with the trainer match a one-process run against another server (the module's, reached by
    address: same seeds, same tokens)."""
    from tests.test_deepspeed import ENV, TORCHRUN
    from tests.test_trainer import history

    _real_engine_env()
    common = [
        "train.steps=2",
        "eval.every=0",
        "rollout.engine=vllm_server",
        f"rollout.server.python={VLLM_PY}",
        f"init_checkpoint={vllm_coldstart}",
    ]
    from gspo_study.trainer import train

    def overrides(name: str, *extra: str) -> list[str]:
        return [
            f"results_dir={tmp_path / name}",
            f"tracking.uri=sqlite:///{tmp_path / name}/mlflow.db",
            *common,
            *extra,
        ]

    ranks_over = overrides("ranks", "train.backend=deepspeed", "train.zero_stage=3")
    cmd = [str(TORCHRUN), "--standalone", "--nproc_per_node", "2", "-m", "gspo_study", "train", SMOKE_BASE]
    done = subprocess.run(
        [*cmd, "experiments/runs/gspo.yaml", *ranks_over],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = history(load_config([SMOKE_BASE, "experiments/runs/gspo.yaml"], ranks_over))
    one_cfg = load_config(
        [SMOKE_BASE, "experiments/runs/gspo.yaml"],
        overrides("one", f"rollout.server.urls=[{','.join(served.engine.urls)}]"),
    )
    train(one_cfg)  # the one-process reference, in this process
    one = history(one_cfg)
    assert one["rollout/reward/mean"] == ranks["rollout/reward/mean"]  # the same tokens: the same server rollouts
    for key in ("policy/loss", "train/grad_norm"):
        for step in (1, 2):
            assert ranks[key][step] == pytest.approx(one[key][step], rel=1e-3, abs=1e-5), (key, step)
    assert all(abs(v) < 1e-5 for h in (one, ranks) for v in h["mismatch/k3"].values())  # step 2: the push landed


@pytest.mark.slow
def test_r3_against_the_cpu_build_is_refused_in_one_line_before_anything_is_written(tmp_path):
    python = _real_engine_env()

    model = smoke(head_dim=32, moe_intermediate_size=32)
    engine = VLLMServerEngine(model, TOK, "float32", ServerConfig(python=str(python)), tmp_path / "w")
    with pytest.raises(ConfigError, match="needs a CUDA GPU") as err:
        engine.generate(PROMPTS, 4, TEMPERATURE, torch.Generator().manual_seed(0), capture_routing=True)
    assert "\n" not in str(err.value) and "rollout.engine=vllm_server" in str(err.value)
    assert not (tmp_path / "w").exists() and engine.process is None


@pytest.mark.slow
def test_real_server_answers_only_to_the_key_and_the_front_guards_what_vllm_does_not(served, tmp_path, capsys):
    """vLLM's own key (VLLM_API_KEY, from the pool's key) refuses an unkeyed completion, but not its dev-mode
    /collective_rpc, where anyone could reach the workers. Behind `AuthFront` both need the key: a push and a
    completion without it are refused, with it they work. The key is in no log or file the run writes."""
    from gspo_study.rollout.pool_key import AuthFront
    from gspo_study.rollout.vllm_server import RELOAD_METHOD, post_json

    _rollout(served.engine)  # the module's server, started (with the key) if no test before this one did
    url = served.engine.urls[0]
    body = {"model": "policy", "prompt": [1, 2, 3], "max_tokens": 2}
    with pytest.raises(ConfigError, match="HTTP 401"):
        post_json(f"{url}/v1/completions", body)
    assert post_json(f"{url}/v1/completions", body, key=POOL_KEY)["choices"]
    with pytest.raises(RuntimeError, match="HTTP 500") as reached:  # no 401: the unkeyed call reached a worker
        post_json(f"{url}/collective_rpc", {"method": RELOAD_METHOD, "args": ["/nowhere"]})
    assert not isinstance(reached.value, ConfigError)
    host, port = url.removeprefix("http://").rsplit(":", 1)
    front = AuthFront("127.0.0.1", 0, (host, int(port)), POOL_KEY).start()
    fronted = "http://{}:{}".format(*front.address)
    try:
        with pytest.raises(ConfigError, match="HTTP 401"):
            post_json(f"{fronted}/collective_rpc", {"method": RELOAD_METHOD, "args": ["/nowhere"]})
        with pytest.raises(ConfigError, match="HTTP 401"):
            post_json(f"{fronted}/v1/completions", body)
        other_model = smoke(head_dim=32, moe_intermediate_size=32)
        other = VLLMServerEngine(other_model, TOK, "float32", ServerConfig(urls=[fronted]), tmp_path / "w")
        batch = other.generate(PROMPTS, 10, TEMPERATURE, torch.Generator().manual_seed(5))  # a push, then samples
        assert other.last_push["workers"] and _hf_diff(other_model, batch)["mean"] < 1e-6
        other.close()
        assert front.refused == 2 and POOL_KEY not in capsys.readouterr().err
    finally:
        front.close()
    for name in ("server.log", "server.json"):
        assert POOL_KEY not in (served.engine.weight_dir / name).read_text(errors="replace"), name


@pytest.mark.slow
def test_real_server_reached_by_address_and_stopped_as_a_group(served, tmp_path):
    """A second engine given the first one's server as `rollout.server.urls` (an external pool): it pushes its
    own weights there and leaves the server running at close; the engine that started it stops its group.
    Last in the file: the end-to-end runs above reach the same server by address (one start per test)."""
    url = served.engine.urls[0]
    other_model = smoke(head_dim=32, moe_intermediate_size=32)
    other = VLLMServerEngine(other_model, TOK, "float32", ServerConfig(urls=[url]), tmp_path / "w")
    batch = other.generate(PROMPTS, 10, TEMPERATURE, torch.Generator().manual_seed(3))
    assert other.process is None and _hf_diff(other_model, batch)["mean"] < 1e-6
    other.close()
    pgid = served.engine.process.pgid
    assert group_alive(pgid)
    served.engine.close()
    assert not group_alive(pgid) and not served.engine.weight_dir.exists()


# ---------------------------------------------------------------------------- the pool's key (no vLLM needed)
def test_the_pools_key_comes_from_the_environment_or_a_file_never_a_config_value(tmp_path, monkeypatch):
    from gspo_study.rollout.pool_key import KEY_ENV, pool_key

    monkeypatch.delenv(KEY_ENV, raising=False)
    assert pool_key(ServerConfig()) is None
    kf = tmp_path / "key"
    kf.write_text("f" * 32 + "\n")
    assert pool_key(ServerConfig(key_file=str(kf))) == "f" * 32
    monkeypatch.setenv(KEY_ENV, "e" * 32)
    assert pool_key(ServerConfig(key_file=str(kf))) == "e" * 32  # the environment first
    monkeypatch.setenv(KEY_ENV, "short")
    with pytest.raises(ConfigError, match="is 5 characters; allowed: at least 16"):
        pool_key(ServerConfig())
    monkeypatch.delenv(KEY_ENV)
    with pytest.raises(ConfigError, match="cannot be read"):
        pool_key(ServerConfig(key_file=str(tmp_path / "missing")))


def test_the_authenticating_front_forwards_only_requests_that_carry_the_key(capsys):
    """A stand-in server behind the front: without the key (or with a wrong one) every route but /health is refused
    with 401 and one stderr line that names the route, never the key; with it the request and its answer pass."""
    import http.server
    import threading
    import urllib.error
    import urllib.request

    from gspo_study.rollout.pool_key import AuthFront
    from gspo_study.rollout.vllm_server import post_json

    class Echo(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            out = json.dumps({"path": self.path, "got": json.loads(body or b"{}")}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

        do_GET = do_POST

        def log_message(self, *a):
            pass

    upstream = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Echo)
    threading.Thread(target=upstream.serve_forever, daemon=True).start()
    key = "s" * 48
    front = AuthFront("127.0.0.1", 0, upstream.server_address[:2], key).start()
    url = "http://{}:{}".format(*front.address)
    try:
        for route in ("/v1/completions", "/collective_rpc", "/reset_prefix_cache"):
            with pytest.raises(ConfigError, match="HTTP 401"):
                post_json(url + route, {"method": "reload_weights"})
            with pytest.raises(ConfigError, match="HTTP 401"):
                post_json(url + route, {}, key="w" * 48)
            assert post_json(url + route, {"a": 1}, key=key) == {"path": route, "got": {"a": 1}}
        with urllib.request.urlopen(url + "/health", timeout=5) as answer:  # liveness stays open
            assert answer.status == 200
        assert front.refused == 6
        err = capsys.readouterr().err
        assert err.count("rollout pool: refused POST /collective_rpc from 127.0.0.1") == 2 and key not in err
    finally:
        front.close()
        upstream.shutdown()


def _run_id(cfg) -> str:
    from mlflow.tracking import MlflowClient

    from gspo_study.run import run_key

    client = MlflowClient(cfg.tracking.uri)
    exp = client.get_experiment_by_name(cfg.tracking.experiment)
    (run,) = client.search_runs([exp.experiment_id], f"tags.run_key = '{run_key(cfg)}'")
    return run.info.run_id
