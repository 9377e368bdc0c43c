"""The prepared GPU check (benchmarks/gpu_check.py) at its tiny size on CPU: every part it can run here runs
and writes its numbers (routing volatility per update and per step included), the suite's own commands run
through it (sft, train, make reproduce-figure-1), the GPU-only parts skip with one line, and the bundle's package
list covers what the check imports."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pandas as pd
import pytest
import torch

from benchmarks import gpu_bundle, gpu_check
from gspo_study.tracking import WALL_CLOCK

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny_start():
    """The check's state after a short cold start of its tiny shape on CPU (its own `coldstart` part, fewer SFT
    steps): enough for groups with mixed rewards, so that the RL steps move the weights."""
    sizes = dict(gpu_check.SIZES["tiny"], sft_steps=60, rl_steps=2)
    state = dict(device=torch.device("cpu"), shape="tiny", sizes=sizes, seed=1, experts="grouped_mm_index")
    state["sft_budget_s"] = math.inf
    gpu_check.part_coldstart(state)
    return state


def test_the_checks_rl_step_is_the_trainers_and_its_r3_run_replays(tiny_start, tmp_path):
    """The RL part drives the trainer (`build_context`, `rl_step` with its `on_update` hook): its GRPO + R3 run
    replays the rollout's routing in every update's forward (one replayed router call per MoE layer), and every
    metric it keeps is what `trainer.setup` + `trainer.rl_step` give for the same config from the same weights on
    disk, so the hook's extra forwards change nothing."""
    from gspo_study import trainer
    from gspo_study.models import save_pretrained
    from gspo_study.moe import count_moe_layers
    from gspo_study.run import resolve_run

    got = gpu_check.rl_run("grpo_r3", tiny_start, budget_s=math.inf)
    model, tok = gpu_check.build("tiny", torch.device("cpu"), 1, tiny_start["experts"])
    model.load_state_dict(tiny_start["weights"])
    layers = count_moe_layers(model)
    assert got["routing_replay"] == "r3" and len(got["steps"]) == 2
    for s in got["steps"]:
        assert [u["replayed_router_calls"] for u in s["volatility_per_update"]] == [layers] * 4  # 4 minibatches
    assert max(u["overall"] for s in got["steps"] for u in s["volatility_per_update"]) > 0  # the updates moved

    save_pretrained(model, tok, tmp_path / "start")
    over = ["seed=1", "model.experts_implementation=grouped_mm_index", f"init_checkpoint={tmp_path / 'start'}"]
    cfg = gpu_check.config("grpo_r3", tiny_start["sizes"], [*over, f"results_dir={tmp_path}"])
    ctx = trainer.setup(resolve_run(cfg))
    for step, s in enumerate(got["steps"], 1):
        want = trainer.rl_step(ctx, step)
        assert {k: v for k, v in s["metrics"].items() if k not in WALL_CLOCK} == {
            k: v for k, v in want.items() if k not in WALL_CLOCK
        }
        assert s["metrics"]["moe/routing_volatility/per_update/overall"] > 0


def test_a_replay_run_that_replays_nothing_fails(tiny_start, monkeypatch):
    """The rule that caught the old check's drift (its own step replayed only for R2): a GRPO + R3 run whose
    updates route freely is refused, not reported as R3."""
    from dataclasses import replace

    from gspo_study import trainer

    old_policy = trainer.old_policy  # the drifted step: π_old without the trace its updates should replay
    monkeypatch.setattr(
        trainer, "old_policy", lambda ctx, batch, step=0: replace(old_policy(ctx, batch, step), replay=None)
    )
    with pytest.raises(RuntimeError, match="routing_replay=r3 but no router call replayed"):
        gpu_check.rl_run("grpo_r3", dict(tiny_start, sizes=dict(tiny_start["sizes"], rl_steps=1)), math.inf)


def test_time_is_kept_only_for_the_parts_that_will_run(monkeypatch):
    """The RL part's share of the budget: the suite part's reserve only where MLflow and the analysis packages
    import (on the GPU it was once skipped after taking 240 s from RL), vLLM's only where vLLM can run."""
    cuda = torch.device("cuda")
    monkeypatch.setattr(gpu_check, "vllm_importable", lambda: False)
    monkeypatch.setattr(gpu_check, "suite_missing", lambda: ["mlflow"])
    assert gpu_check.reserve_s(cuda, None) == gpu_check.reserve_s(torch.device("cpu"), None) == 10.0
    monkeypatch.setattr(gpu_check, "suite_missing", lambda: [])
    assert gpu_check.reserve_s(cuda, None) == 10.0 + gpu_check.SUITE_RESERVE_S["cuda"]
    both = gpu_check.VLLM_RESERVE_S + gpu_check.SUITE_RESERVE_S["cuda"]
    assert gpu_check.reserve_s(cuda, "/opt/vllm/bin/python") == both
    monkeypatch.setattr(gpu_check, "vllm_importable", lambda: True)
    assert gpu_check.reserve_s(cuda, None) == both


@pytest.mark.slow
def test_tiny_check_on_cpu_writes_every_part(tmp_path):
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
    assert suite["runs"] == list(gpu_check.TINY_SUITE_RUNS)
    for run in suite["runs"]:
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
    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is present")
    assert gpu_check.main(["--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--device cpu --tiny" in err
    assert not (tmp_path / "o").exists()


def test_bundle_covers_what_the_suite_imports_and_leaves_the_image_alone():
    image = frozenset(gpu_bundle.closure(gpu_bundle.PREINSTALLED, "3.12", prefixes=()))
    pins = gpu_bundle.closure(gpu_bundle.ROOTS, "3.12", image | frozenset(gpu_bundle.UNUSED))
    for name in ("transformers", "tokenizers", "safetensors", "omegaconf", "pyyaml", "huggingface-hub",
                 "mlflow-skinny", "sqlalchemy", "alembic", "math-verify"):  # fmt: skip
        assert name in pins, name
    assert not any(n.startswith(("torch", "nvidia-")) for n in pins)
    assert not {"numpy", "pandas", "matplotlib", "sympy", "jinja2"} & set(pins)  # the image's (torch's stack too)
    assert not set(gpu_bundle.UNUSED) & set(pins) and "mlflow" not in pins  # skinny: no web UI (8 MiB)
