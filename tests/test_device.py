"""`train.device`: the model trains where the config says, every tensor that reaches its forward is on its
device (the trainer's π_old, update and telemetry passes, the HF engine's bf16 copy, routing replay, evaluation),
a CUDA device torch does not see is a one-line error that writes nothing, and the run records its device and
precision. On a machine without a GPU the CUDA cases skip; `make gpu-check` runs this file on CUDA."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from transformers import Qwen3MoeForCausalLM

from gspo_study import trainer
from gspo_study.cli import main
from gspo_study.config import ConfigError, load_config
from gspo_study.run import resolve_run
from gspo_study.runtime import autocast, device_text, precision_text, resolve_device

SMOKE = "experiments/smoke/base.yaml"
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU"))]


@pytest.fixture
def forward_devices(monkeypatch):
    """Counter of (tensor argument's device, model's device) over every Qwen3-MoE forward while inside: a spy
    around the real forward, which still runs."""
    seen: Counter = Counter()
    real = Qwen3MoeForCausalLM.forward

    def spy(self, *args, **kwargs):
        home = next(self.parameters()).device
        for value in [*args, *kwargs.values()]:
            if isinstance(value, torch.Tensor):
                seen[(value.device.type, home.type)] += 1
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Qwen3MoeForCausalLM, "forward", spy)
    return seen


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("replay", ["r2", "r3"])
def test_every_forward_gets_its_inputs_on_the_models_device(smoke_cfg, forward_devices, device, replay):
    cfg = smoke_cfg(
        "algo.objective=grpo",
        f"algo.routing_replay={replay}",
        "rollout.dtype=bfloat16",
        f"train.device={device}",
        "train.micro_batch_size=8",
    )
    ctx = trainer.setup(resolve_run(cfg))
    assert next(ctx.model.parameters()).device.type == device
    assert next(ctx.engine.model.parameters()).device.type == device  # the engine's bf16 copy
    metrics = trainer.rl_step(ctx, 1)
    metrics.update(trainer.eval_metrics(ctx))
    assert all(v == v for v in metrics.values()), "a metric is NaN"
    assert {"moe/routing_volatility/overall", "mismatch/k3", "eval/pass@1"} <= metrics.keys()
    mismatched = {k: n for k, n in forward_devices.items() if k[0] != k[1]}
    assert sum(forward_devices.values()) > 20 and not mismatched, mismatched


def test_device_values_and_a_missing_gpu_are_one_line_errors(smoke_cfg, tmp_path, capsys):
    for bad in ("gpu", "cuda:x", "CUDA", "cpu:0"):
        with pytest.raises(ConfigError, match=f"bad value '{bad}' for 'train.device'; allowed: auto, cpu, cuda") as e:
            load_config(SMOKE, [f"train.device={bad}"])
        assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="DeepSpeed places each rank"):
        load_config(SMOKE, ["train.device=cpu", "train.backend=deepspeed"])
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is present")
    with pytest.raises(ConfigError, match="torch sees no CUDA GPU"):
        resolve_device("cuda:1")
    cfg = smoke_cfg("train.device=cuda")
    over = [
        f"results_dir={cfg.results_dir}",
        f"tracking.uri={cfg.tracking.uri}",
        f"init_checkpoint={cfg.init_checkpoint}",
    ]
    for command in ("train", "sft"):  # the CLI's entry point, in this process (`python -m gspo_study` exits with it)
        assert main([command, SMOKE, *over, "train.device=cuda"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "train.device='cuda' but torch sees no CUDA GPU" in err, err
    assert not (tmp_path / "results").exists() and not (tmp_path / "mlflow.db").exists()


def test_precision_and_device_as_tagged():
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert precision_text(cpu, torch.float32) == "fp32" and precision_text(cpu, torch.bfloat16) == "bf16"
    assert precision_text(cuda, torch.float32) == "bf16 autocast, fp32 weights"
    assert precision_text(cuda, torch.bfloat16) == "bf16" and device_text(cpu) == "cpu"
    model = torch.nn.Linear(2, 2)
    with autocast(model):  # on the CPU nothing changes: the CPU path stays bit-identical
        assert not torch.is_autocast_enabled("cpu") and model(torch.ones(1, 2)).dtype == torch.float32
