"""`rollout.policy_lag`: the rollout and π_old come from the policy of k steps ago — exactly, deterministically,
and across a kill and resume; lag 0 keeps a run's identity."""

from __future__ import annotations

import torch

from gspo_study.config import ConfigError, load_config
from gspo_study.run import resolve_run, run_key

from .test_trainer import WALL_CLOCK, _cli, history


def state(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_behaviour_policy_is_the_one_of_k_steps_ago(smoke_cfg):
    """After step s the behaviour copy holds θ_{max(0, s-1-k)}; the trainer's model keeps moving."""
    from gspo_study import trainer

    ctx = trainer.setup(resolve_run(smoke_cfg("algo.objective=grpo", "algo.routing_replay=r2", "rollout.policy_lag=2")))
    thetas = [state(ctx.model)]  # θ_0
    for step in range(1, 5):
        trainer.rl_step(ctx, step)
        assert same(state(ctx.lag.model), thetas[max(0, step - 1 - 2)]), step
        thetas.append(state(ctx.model))
    assert not same(thetas[-1], thetas[0])
    assert ctx.engine.model is ctx.lag.model  # fp32 engine: the stale copy generates


def test_lag_grows_off_policyness(smoke_cfg):
    """The same step 3 sees more routing change between π_old and the updated policy at lag 2 than at lag 0."""
    from gspo_study import trainer

    vol = {}
    for k in (0, 2):
        ctx = trainer.setup(resolve_run(smoke_cfg("algo.objective=grpo", f"rollout.policy_lag={k}", "train.lr=3e-3")))
        for step in range(1, 4):
            metrics = trainer.rl_step(ctx, step)
        vol[k] = metrics["policy/kl/k3"]
    assert vol[2] > vol[0]


def test_lag_zero_keeps_identity_and_bad_values_are_one_line_errors():
    base = load_config("experiments/smoke/base.yaml")
    assert run_key(load_config("experiments/smoke/base.yaml", ["rollout.policy_lag=0"])) == run_key(base)
    assert run_key(load_config("experiments/smoke/base.yaml", ["rollout.policy_lag=1"])) != run_key(base)
    for bad, words in (("-1", "an integer >= 0"), ("1.5", "rollout.policy_lag")):
        try:
            load_config("experiments/smoke/base.yaml", [f"rollout.policy_lag={bad}"])
        except ConfigError as exc:
            assert words in str(exc) and "\n" not in str(exc)
        else:
            raise AssertionError(f"policy_lag={bad} accepted")
    try:
        load_config("experiments/smoke/base.yaml", ["rollout.policy_lag=1", "train.backend=deepspeed"])
    except ConfigError as exc:
        assert "train.backend=torch" in str(exc)
    else:
        raise AssertionError("policy_lag with deepspeed accepted")


def test_lagged_run_resumes_after_sigkill_to_the_same_metrics(smoke_cfg, tmp_path):
    """Killed after its step-2 checkpoint, a lag-2 run resumes with the stale weights it kept (θ_0, θ_1 for
    steps 3 and 4), not the resumed model's."""
    from gspo_study.trainer import train

    args = ["train.steps=4", "train.checkpoint_every=2", "eval.every=2", "rollout.policy_lag=2"]
    ref = smoke_cfg(*args, "tracking.experiment=ref")
    train(ref)
    killed = [
        f"results_dir={tmp_path}",
        f"tracking.uri=sqlite:///{tmp_path}/mlflow.db",
        f"init_checkpoint={ref.init_checkpoint}",
        *args,
    ]
    first = _cli(killed, env={"GSPO_STUDY_KILL_AT_STEP": "3"})
    assert first.returncode == -9, first.stderr[-2000:]
    resumed = load_config("experiments/smoke/base.yaml", killed)
    train(resumed)  # the resume, in this process (what the CLI's `train` calls)
    h_ref, h_res = history(ref), history(resumed)
    assert h_ref.keys() == h_res.keys()
    for k in h_ref.keys() - WALL_CLOCK:
        assert h_ref[k] == h_res[k], k
