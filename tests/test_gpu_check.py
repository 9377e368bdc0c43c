"""The prepared GPU check (benchmarks/gpu_check.py) at its tiny size on CPU: every part it can run here runs
and writes its numbers (routing volatility per update and per step included), the suite's own commands run
through it (sft, train, make reproduce-figure-1), the GPU-only parts skip with one line, and the bundle's package
list covers what the check imports."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pandas as pd
import pytest

ROOT = Path(__file__).resolve().parents[1]


def _module(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow
def test_tiny_check_on_cpu_writes_every_part(tmp_path):
    gpu_check = _module("gpu_check")
    mini = gpu_check.SHAPES["mini"]  # what the GPU runs: Qwen3-30B-A3B's routing shape
    assert (mini["num_hidden_layers"], mini["num_experts"], mini["num_experts_per_tok"]) == (48, 128, 8)
    vllm_py = ROOT / ".venv-vllm" / "bin" / "python"  # the server part against vLLM's CPU build, where built
    server = ["--vllm-python", str(vllm_py)] if vllm_py.exists() else []
    rc = gpu_check.main(["--out", str(tmp_path), "--device", "cpu", "--tiny", "--budget-s", "300", *server])
    res = json.loads((tmp_path / "results.json").read_text())
    assert rc == 0, {k: v.get("error") for k, v in res.items()}
    assert [res[k]["status"] for k in ("env", "coldstart", "hf_engine", "rl")] == ["ok"] * 4
    assert res["coldstart"]["loss_last"] < res["coldstart"]["loss_first"]
    hf = res["hf_engine"]
    assert hf["same_seed_same_tokens"] and hf["response_tokens"] > 0
    assert hf["r3_trace_vs_bf16_forward_changed"] < 0.01  # generation's routing = the same weights' forward
    assert 0 <= hf["mismatch_vs_train_forward"]["k3"] < 0.05
    moved = []
    for run in gpu_check.RUNS:
        steps = res["rl"][run]["steps"]
        assert steps and all(len(s["volatility_per_update"]) == 4 for s in steps)  # 4 minibatches per step
        moved.append(res["rl"][run]["mean_volatility_per_update"])
    assert max(moved) > 0  # the updates moved the routers
    suite = res["suite"]  # the suite's own sft / train / reproduce-figure-1 commands, on the check's device
    assert suite["status"] == "ok", suite.get("error")
    for run in gpu_check.SUITE_RUNS:
        got = suite[run]
        assert got["provenance_device"] == "cpu" and got["provenance_precision"] == "fp32" and got["metrics_finite"]
        assert got["steps_with_signal"] > 0 and got["tensors_changed"] > 0 and got["eval_pass@1_end"] is not None
        assert got["seconds_per_step"] > 0 and got["peak_gpu_memory_gb"] is None  # no CUDA: not logged
    assert suite["sft"]["steps"] == 100 and suite["figure_files"] and suite["reproduce_figure_1_s"] > 0
    # `make reproduce-figure-1 SCALE=smoke SEEDS=1 OVERRIDES=...`, for real (the suite's only test of the target)
    csv = pd.read_csv(tmp_path / "figure-1" / "smoke" / "figure-1.csv")
    assert set(csv[csv.kind == "curve"].n_seeds) == {1} and (tmp_path / "figure-1" / "smoke" / "figure-1.png").is_file()
    assert res["vllm"]["status"] == "skipped" and res["deepspeed"]["status"] == "skipped"
    if server:  # a real server: bf16 rollouts near the fp32 trainer's forward, a push that lands, same seed
        srv = res["vllm_server"]
        assert srv["status"] == "ok" and srv["cpu_build"] and srv["response_tokens"] > 0, srv
        assert 0 <= srv["mismatch_vs_train_forward"]["k3"] < 0.05 and 0 <= srv["mismatch_after_push"]["k3"] < 0.05
        assert srv["push"]["reload_s"] < 10 and srv["same_seed_same_tokens"]
    text = (tmp_path / "summary.txt").read_text()
    assert "% per update" in text and "vllm: skipped" in text and "suite: sft" in text


def test_cuda_without_a_gpu_is_a_one_line_error(tmp_path, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is present")
    assert _module("gpu_check").main(["--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--device cpu --tiny" in err
    assert not (tmp_path / "o").exists()


def test_bundle_covers_what_the_check_imports():
    bundle = _module("gpu_bundle")
    pins = bundle.closure(bundle.ROOTS, "3.12")
    for name in (
        "transformers",
        "tokenizers",
        "safetensors",
        "omegaconf",
        "pyyaml",
        "numpy",
        "huggingface-hub",
    ):
        assert name in pins, name
    assert not any(n.startswith(("torch", "nvidia-")) for n in pins)
    assert "mlflow" not in pins  # the check writes JSON; MLflow would not fit the 64 MiB carry
