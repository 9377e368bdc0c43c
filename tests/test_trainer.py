"""End-to-end RL runs on the smoke preset: every algorithm trains, logs every metric at every step,
is deterministic, and resumes after SIGKILL to the same numbers."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from mlflow import MlflowClient
from safetensors.torch import load_file

from gspo_study.run import resolve_run, run_key, tracking_uri
from gspo_study.tracking import WALL_CLOCK, mlflow_key
from gspo_study.trainer import train

REQUIRED = [
    "rollout/reward/mean",
    "rollout/reward/std",
    "rollout/zero_std_group_frac",
    "rollout/response_len/mean",
    "rollout/response_len/max",
    "rollout/truncated_frac",
    "policy/clip_frac/token",
    "policy/clip_frac/seq",
    "policy/clip_frac/low",
    "policy/clip_frac/high",
    "policy/ratio/token_mean",
    "policy/ratio/token_var",
    "policy/ratio/seq_mean",
    "policy/ratio/seq_var",
    "policy/ratio/token_max",
    "policy/ratio/token_min",
    "policy/kl/k1",
    "policy/kl/k3",
    "policy/loss",
    "policy/clip_frac/token/mb_0",
    "policy/clip_frac/token/mb_3",
    "moe/routing_volatility/overall",
    "moe/routing_volatility/tokens_any_changed",
    "moe/routing_volatility/layer_00",
    "moe/routing_volatility/layer_01",
    "moe/route/var_share",
    "moe/route/clip_flip_token",
    "moe/route/clip_flip_seq",
    "mismatch/k3",
    "mismatch/f_tau_2",
    "mismatch/f_tau_10",
    "train/grad_norm",
    "train/lr",
    "train/entropy",
    "compute/flops",
    "compute/seconds",
    "perf/tokens_per_s",
]
ALGOS = {
    "gspo": ["algo.objective=gspo"],
    "grpo": ["algo.objective=grpo"],
    "grpo-r2": ["algo.objective=grpo", "algo.routing_replay=r2"],
    "grpo-r3": ["algo.objective=grpo", "algo.routing_replay=r3"],
    "sapo": ["algo.objective=sapo", "algo.hparams.tau_neg=1.1"],  # an objective's own hyperparameter
    "gmpo": ["algo.objective=gmpo"],
}


def history(cfg) -> dict[str, dict[int, float]]:
    client = MlflowClient(tracking_uri(cfg))
    exp = client.get_experiment_by_name(cfg.tracking.experiment)
    run = client.search_runs([exp.experiment_id], f"tags.run_key = '{run_key(cfg)}'")[0]
    return {k: {m.step: m.value for m in client.get_metric_history(run.info.run_id, k)} for k in run.data.metrics}


def weights(path) -> dict[str, torch.Tensor]:
    return load_file(str(next(path.glob("*.safetensors"))))


@pytest.mark.parametrize("algo", list(ALGOS))
def test_each_algorithm_trains_and_logs_everything(smoke_cfg, algo):
    cfg = smoke_cfg(*ALGOS[algo], "train.steps=3", "rollout.max_new_tokens=16")
    train(cfg)
    before = weights(Path(cfg.init_checkpoint))
    after = weights(resolve_run(cfg).dir / "checkpoint")
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    must = {k for k in before if "self_attn" in k or k.endswith("mlp.gate.weight")}  # experts change only if routed to
    assert must <= changed and len(changed) > len(before) / 2, sorted(set(before) - changed)
    hist = history(cfg)
    for name in REQUIRED:
        assert sorted(hist[mlflow_key(name)]) == [1, 2, 3], name
    assert sorted(hist[mlflow_key("eval/pass@1")]) == [0, 2, 3]
    assert all(v == 0.0 for v in hist["policy/clip_frac/token/mb_0"].values())  # update 1 is on-policy
    if algo == "grpo":  # no replay: the updated policy routes some tokens differently
        assert max(hist["moe/routing_volatility/overall"].values()) > 0


def test_gspo_clips_off_policy_minibatches(smoke_cfg):
    cfg = smoke_cfg("algo.objective=gspo", "train.steps=2", "train.lr=3e-3")
    train(cfg)
    hist = history(cfg)
    later = [hist[f"policy/clip_frac/token/mb_{i}"][s] for i in (1, 2, 3) for s in (1, 2)]
    assert all(v == 0.0 for v in hist["policy/clip_frac/token/mb_0"].values())
    assert max(later) > 0


def test_same_seed_same_numbers(smoke_cfg, tmp_path):
    a = smoke_cfg("algo.objective=grpo", "algo.routing_replay=r2", "train.steps=2", "tracking.experiment=a")
    b = smoke_cfg(
        "algo.objective=grpo",
        "algo.routing_replay=r2",
        "train.steps=2",
        "tracking.experiment=b",
        f"results_dir={tmp_path}",
        f"init_checkpoint={a.init_checkpoint}",
    )
    train(a)
    train(b)
    ha, hb = history(a), history(b)
    assert ha.keys() == hb.keys()
    for k in ha.keys() - WALL_CLOCK:
        assert ha[k] == hb[k], k


def test_finished_run_is_skipped(smoke_cfg):
    cfg = smoke_cfg("train.steps=1")
    train(cfg)
    assert train(cfg) == {}


def _cli(cfg_overrides, env=None):
    cmd = [sys.executable, "-m", "gspo_study", "train", "experiments/smoke/base.yaml", *cfg_overrides]
    return subprocess.run(cmd, env={**os.environ, "TQDM_DISABLE": "1", **(env or {})}, capture_output=True, text=True)


def test_resume_after_sigkill_gives_same_metrics(smoke_cfg, tmp_path):
    args = ["train.steps=5", "train.checkpoint_every=2", "eval.every=2"]
    ref = smoke_cfg(*args, "tracking.experiment=ref")
    train(ref)
    killed_overrides = [
        f"results_dir={tmp_path}",
        f"tracking.uri=sqlite:///{tmp_path}/mlflow.db",
        f"init_checkpoint={ref.init_checkpoint}",
        *args,
    ]
    first = _cli(killed_overrides, env={"GSPO_STUDY_KILL_AT_STEP": "3"})  # after checkpoint 2, before 4
    assert first.returncode == -9, first.stderr[-2000:]
    from gspo_study.config import load_config

    resumed = load_config("experiments/smoke/base.yaml", killed_overrides)
    train(resumed)  # the resume, in this process (what the CLI's `train` calls)
    h_ref, h_res = history(ref), history(resumed)
    assert h_ref.keys() == h_res.keys()
    for k in h_ref.keys() - WALL_CLOCK:
        assert h_res[k] == h_ref[k], k  # same steps (no duplicates) and same values


def test_old_pass_counts_as_compute_only_when_training_uses_it(smoke_cfg):
    """compute/flops counts the π_old forward (2·N per token) when the objective uses its log-probs or R2
    replays its routing; with rollout log-probs and no replay it only feeds telemetry and is not counted."""
    from gspo_study import trainer

    flops = {}
    for name, over in {
        "recompute": ["algo.old_logprobs=recompute"],
        "rollout_r2": ["algo.old_logprobs=rollout", "algo.routing_replay=r2"],
        "rollout": ["algo.old_logprobs=rollout"],
    }.items():
        ctx = trainer.setup(resolve_run(smoke_cfg("algo.objective=grpo", *over)))
        flops[name] = trainer.rl_step(ctx, 1)["compute/flops"]  # the same rollout: it depends on the seed only
    assert flops["recompute"] == flops["rollout_r2"]
    assert flops["rollout"] == pytest.approx(flops["recompute"] * 8 / 10, rel=1e-12)


def test_model_without_moe_layers_trains(smoke_cfg, tmp_path):
    """A dense model (every layer in mlp_only_layers) runs the whole step; routing metrics are simply absent."""
    from gspo_study import trainer
    from gspo_study.models import build_char_tokenizer, build_model, save_pretrained

    tok = build_char_tokenizer()
    dense = build_model("qwen3-moe-smoke", tok, seed=0, mlp_only_layers=[0, 1])
    save_pretrained(dense, tok, tmp_path / "dense")
    cfg = smoke_cfg(f"init_checkpoint={tmp_path / 'dense'}", "train.steps=1", "eval.every=0")
    metrics = trainer.rl_step(trainer.setup(resolve_run(cfg)), 1)
    assert "mismatch/k3" in metrics and not any(k.startswith("moe/") for k in metrics)


@pytest.mark.parametrize("algo", ["gspo", "grpo-r2"])
def test_micro_batch_size_never_changes_an_update(smoke_cfg, algo):
    """The trainer's own micro-batch loop (whole-minibatch denominators, gradients accumulated): each of a
    step's minibatch gradients, and the step's objective metrics, are the same with micro-batches of 1 and 3
    sequences as with the whole minibatch (float32: up to summation order). The optimizer step is replaced by
    a recorder, so every minibatch sees the same weights."""
    from gspo_study import trainer

    results = {}
    for size in (None, 1, 3):
        ctx = trainer.setup(resolve_run(smoke_cfg(*ALGOS[algo], f"train.micro_batch_size={size or 'null'}")))
        grads = []

        def record(lr, ctx=ctx, grads=grads):
            grads.append({n: p.grad.clone() for n, p in ctx.model.named_parameters() if p.grad is not None})
            ctx.backend.optimizer.zero_grad(set_to_none=True)
            return 1.0

        ctx.backend.step = record
        results[size] = (trainer.rl_step(ctx, 1), grads)
    ref_metrics, ref_grads = results[None]
    assert len(ref_grads) == ctx.cfg.train.num_minibatches
    for size in (1, 3):
        metrics, grads = results[size]
        for ref, got in zip(ref_grads, grads):
            assert ref.keys() == got.keys()
            for k in ref:
                scale = ref[k].abs().max().item()
                torch.testing.assert_close(got[k], ref[k], rtol=1e-4, atol=1e-5 * scale + 1e-12)
        for k in ("policy/loss", "policy/clip_frac/token", "policy/ratio/token_var", "policy/kl/k3"):
            assert metrics[k] == pytest.approx(ref_metrics[k], rel=1e-4, abs=1e-7), (size, k)
