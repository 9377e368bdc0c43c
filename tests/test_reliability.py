"""Reliability: resume after SIGKILL at any moment, corrupt checkpoints skipped, non-finite guards,
one-line errors that write nothing, failing reward functions, concurrent writers to one MLflow store."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from mlflow import MlflowClient

from gspo_study.cli import main
from gspo_study.config import _get
from gspo_study.errors import NonFiniteError
from gspo_study.models import build_char_tokenizer, build_model, save_pretrained
from gspo_study.run import resolve_run, tracking_uri
from gspo_study.tasks import TASKS
from gspo_study.tasks.arith import ArithTask
from gspo_study.train.checkpointing import RunState
from gspo_study.train.torch_backend import TorchBackend
from gspo_study.trainer import train
from tests.test_trainer import WALL_CLOCK, history

SMOKE = "experiments/smoke/base.yaml"


def _overrides(root: Path, init: Path, *extra: str) -> list[str]:
    return [
        f"results_dir={root}",
        f"tracking.uri=sqlite:///{root}/mlflow.db",
        f"init_checkpoint={init}",
        *extra,
    ]


def _spawn(overrides, env=None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "gspo_study", "train", SMOKE, *overrides]
    return subprocess.Popen(
        cmd,
        env={**os.environ, "TQDM_DISABLE": "1", **(env or {})},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def _same_metrics(ref_cfg, other_cfg):
    a, b = history(ref_cfg), history(other_cfg)
    assert a.keys() == b.keys()
    for k in a.keys() - WALL_CLOCK:
        assert a[k] == b[k], k


def test_external_sigkill_during_checkpoint_then_resume(smoke_cfg, smoke_results, tmp_path):
    args = ["train.steps=6", "train.checkpoint_every=1", "eval.every=3"]
    ref = smoke_cfg(*args, "tracking.experiment=ref")
    train(ref)
    init = smoke_results / "smoke/checkpoints/coldstart"
    over = _overrides(tmp_path, init, *args)
    proc = _spawn(over)
    from gspo_study.config import load_config

    cfg = load_config(SMOKE, over)
    runs = resolve_run(cfg).dir
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:  # kill mid-write if we catch one, else after ckpt 1
        if runs.exists() and (
            any(p.name.startswith(".checkpoint.tmp") for p in runs.iterdir()) or (runs / "checkpoint").exists()
        ):
            break
        time.sleep(0.001)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    train(cfg)  # the resume, in this process (what the CLI's `train` calls)
    _same_metrics(ref, cfg)


def test_corrupt_checkpoint_is_skipped_with_warning(smoke_cfg, smoke_results, tmp_path):
    args = ["train.steps=4", "train.checkpoint_every=2"]
    ref = smoke_cfg(*args, "tracking.experiment=ref")
    train(ref)
    init = smoke_results / "smoke/checkpoints/coldstart"
    over = _overrides(tmp_path, init, *args)
    killed = _spawn(over, env={"GSPO_STUDY_KILL_AT_STEP": "3"})
    assert killed.wait(timeout=300) == -signal.SIGKILL
    from gspo_study.config import load_config

    cfg = load_config(SMOKE, over)
    weights = next((resolve_run(cfg).dir / "checkpoint").glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:100])  # truncated: unreadable
    with pytest.warns(UserWarning, match="skipping unreadable checkpoint"):
        train(cfg)
    _same_metrics(ref, cfg)


def test_nonfinite_update_is_skipped_and_counted():
    tok = build_char_tokenizer()
    model = build_model("qwen3-moe-smoke", tok, seed=0)
    backend = TorchBackend(model, lr=1e-3, weight_decay=0.0, grad_clip=1.0)
    before = [p.detach().clone() for p in model.parameters()]
    loss = model(torch.randint(4, len(tok), (2, 5))).logits.sum() * float("nan")
    loss.backward()
    norm = backend.step(lr=1e-3)
    assert norm != norm  # NaN reported
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # nothing applied
    assert all(p.grad is None for p in model.parameters())  # and the bad gradient dropped
    state = RunState()
    for n in (1.0, float("nan"), float("inf"), 2.0, float("nan")):
        state.note_update(n)
    assert (state.nonfinite_streak, state.nonfinite_total) == (1, 3)


def _diverging(cfg):
    """An lr no config accepts (train.lr is at most 1): set after validation, to make a run diverge."""
    cfg.train.lr = 1e30
    return cfg


def test_diverging_run_stops_cleanly_without_nonfinite_checkpoint(smoke_cfg, capsys, monkeypatch):
    cfg = _diverging(smoke_cfg("train.steps=3", "train.checkpoint_every=1", "train.max_nonfinite_updates=2"))
    with pytest.raises(NonFiniteError):
        train(cfg)
    ckpt = resolve_run(cfg).dir / "checkpoint"
    if ckpt.exists():  # whatever was written before divergence is finite
        from safetensors.torch import load_file

        for t in load_file(str(next(ckpt.glob("*.safetensors")))).values():
            assert torch.isfinite(t).all()
    client = MlflowClient(tracking_uri(cfg))
    run = client.search_runs([client.get_experiment_by_name(cfg.tracking.experiment).experiment_id])[0]
    assert run.info.status == "FAILED"
    import gspo_study.cli

    real = gspo_study.cli.load_config
    monkeypatch.setattr(gspo_study.cli, "load_config", lambda *a, **k: _diverging(real(*a, **k)))
    assert main(["train", SMOKE, *[f"{k}={v}" for k, v in _cli_pairs(cfg)]]) == 3
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error:") and "non-finite" in err


def _cli_pairs(cfg):
    return [
        ("results_dir", cfg.results_dir),
        ("tracking.uri", cfg.tracking.uri),
        ("init_checkpoint", cfg.init_checkpoint),
        ("train.steps", 3),
        ("train.max_nonfinite_updates", 2),
        ("seed", cfg.seed),  # the diverged run: resumed, it diverges again
    ]


def _no_moe_checkpoint(path: Path) -> Path:
    tok = build_char_tokenizer()
    model = build_model("qwen3-moe-smoke", tok, seed=0)
    model.config.mlp_only_layers = [0, 1]
    dense = type(model)(model.config)
    save_pretrained(dense, tok, path)
    return path


@pytest.mark.parametrize(
    "extra, fragment",
    [
        (["rollout.group_size=1"], "'rollout.group_size'"),
        (["train.num_minibatches=3"], "divisor of the rollout batch"),
        (["algo.clip_high=-1"], "'algo.clip_high'"),
        (["init_checkpoint=/nonexistent/ckpt"], "not found"),
        (["task.name=math_file", "task.path=/nonexistent/data.jsonl"], "dataset file not found"),
        (["tracking.uri=http://127.0.0.1:9"], "unreachable"),
        (["algo.routing_replay=r2", "init_checkpoint=NO_MOE"], "needs a model with MoE layers"),
        (["init_checkpoint=NOT_QWEN"], "Qwen3-MoE checkpoint"),
        (["train.router_lr_scale=-1"], "'train.router_lr_scale'; allowed: a number >= 0"),
        (["sft.target_pass1=1.5"], "'sft.target_pass1'; allowed: null or a number in [0, 1]"),
        (["eval.num_prompts=100"], "held-out problems; lower eval.num_prompts"),
        (["results_dir=A_FILE"], "for 'results_dir'; allowed: a directory"),
        (["init_checkpoint=TRUNCATED"], "model.safetensors does not match its hash in MANIFEST.json"),
    ],
)
def test_bad_input_one_line_nothing_written(smoke_results, tmp_path, capsys, extra, fragment):
    init = smoke_results / "smoke/checkpoints/coldstart"
    no_moe = _no_moe_checkpoint(tmp_path / "dense") if "init_checkpoint=NO_MOE" in extra else None
    not_qwen = tmp_path / "llama"
    not_qwen.mkdir()
    (not_qwen / "config.json").write_text('{"model_type": "llama"}')
    a_file = tmp_path / "a_file"
    a_file.write_text("not a directory\n")
    truncated = shutil.copytree(init, tmp_path / "truncated")
    weights = next(truncated.glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:100])
    subs = {"NO_MOE": no_moe, "NOT_QWEN": not_qwen, "A_FILE": a_file, "TRUNCATED": truncated}
    extra = [e.split("=")[0] + "=" + str(subs.get(e.split("=")[1], e.split("=")[1])) for e in extra]
    rc = main(["train", SMOKE, *_overrides(tmp_path / "res", init, *extra)])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.startswith("error:") and fragment in err and "\n" not in err, err
    assert not (tmp_path / "res" / "smoke" / "runs").exists()  # no run directory, no checkpoint
    db = tmp_path / "res" / "mlflow.db"
    # a missing cold start is found before the store is opened
    assert not (fragment == "not found" and db.exists())
    if db.exists():  # the store may exist, but holds no run
        client = MlflowClient(f"sqlite:///{db}")
        exps = [e.experiment_id for e in client.search_experiments()]
        assert not client.search_runs(exps)


class FlakyRewardTask(ArithTask):
    def reward(self, completion, problem):
        if int(problem.answer) % 2:
            raise RuntimeError("reward server hiccup")
        return super().reward(completion, problem)


def test_reward_that_raises_scores_zero_and_is_counted(smoke_cfg, monkeypatch):
    monkeypatch.setitem(TASKS, "flaky", lambda cfg: FlakyRewardTask(num_terms=cfg.num_terms, digits=cfg.digits))
    monkeypatch.setattr("gspo_study.config.validate", lambda cfg: None)
    cfg = smoke_cfg("task.name=flaky", "train.steps=2")
    train(cfg)
    hist = history(cfg)
    assert sum(hist["rollout/reward_errors"].values()) > 0
    assert sorted(hist["rollout/reward/mean"]) == [1, 2]


def test_two_runs_one_store_lose_no_metrics(smoke_results, tmp_path):
    init = smoke_results / "smoke/checkpoints/coldstart"
    common = _overrides(tmp_path, init, "train.steps=4", "eval.every=1")
    procs = [_spawn([*common, f"seed={s}"]) for s in (11, 12)]
    for p in procs:
        assert p.wait(timeout=300) == 0, p.stderr.read()[-2000:]
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    exp = client.get_experiment_by_name("study-smoke")
    runs = client.search_runs([exp.experiment_id])
    assert len(runs) == 2
    for run in runs:
        for key in ("rollout/reward/mean", "policy/loss", "eval/pass_at_1"):
            steps = sorted(m.step for m in client.get_metric_history(run.info.run_id, key))
            assert steps == ([0, 1, 2, 3, 4] if key.startswith("eval") else [1, 2, 3, 4]), (key, steps)


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["eval", "--checkpoint", "INIT", "--samples", "0"], "for 'eval.samples'; allowed: an integer >= 1"),
        (["eval", "--checkpoint", "INIT", "--num-prompts", "-1"], "for 'eval.num_prompts'"),
        (["sweep", "--figure", "1", "--scale", "tiny"], "unknown scale 'tiny'; allowed: smoke, cpu, gpu, paper"),
    ],
)
def test_bad_cli_arguments_one_line(smoke_results, capsys, argv, fragment):
    init = str(smoke_results / "smoke/checkpoints/coldstart")
    rc = main([init if a == "INIT" else a for a in argv])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.startswith("error:") and fragment in err and "\n" not in err, err


def test_second_process_on_a_run_is_refused(smoke_cfg, smoke_results, tmp_path, capsys):
    """While one process trains a run (holds its lock), another on the same run stops with a one-line error
    and logs nothing; a different run (another seed) is not held up."""
    from gspo_study.run import resolve_run, run_lock

    cfg = smoke_cfg("train.steps=1")
    over = [f"{k}={_get(cfg, k)}" for k in ("results_dir", "tracking.uri", "init_checkpoint", "train.steps")]
    with run_lock(resolve_run(cfg)):
        rc = main(["train", SMOKE, *over])
        err = capsys.readouterr().err.strip()
        assert rc == 2 and "is being trained by another process" in err and "\n" not in err, err
        client = MlflowClient(cfg.tracking.uri)
        assert not client.search_runs([e.experiment_id for e in client.search_experiments()])
        assert main(["train", SMOKE, *over, "seed=2"]) == 0
    train(cfg)  # released: the run trains
    assert sorted(history(cfg)["rollout/reward/mean"]) == [1]


def test_killed_right_after_step_0_logs_no_step_twice(smoke_cfg, smoke_results, tmp_path):
    args = ["train.steps=2", "eval.every=1"]
    ref = smoke_cfg(*args, "tracking.experiment=ref")
    train(ref)
    over = _overrides(tmp_path, smoke_results / "smoke/checkpoints/coldstart", *args)
    assert _spawn(over, env={"GSPO_STUDY_KILL_AT_STEP": "0"}).wait(timeout=300) == -signal.SIGKILL
    from gspo_study.config import load_config

    cfg = load_config(SMOKE, over)
    train(cfg)  # the resume, in this process (what the CLI's `train` calls)
    client = MlflowClient(cfg.tracking.uri)
    run = client.search_runs([client.get_experiment_by_name("study-smoke").experiment_id])[0]
    steps = [m.step for m in client.get_metric_history(run.info.run_id, "eval/pass_at_1")]
    assert sorted(steps) == [0, 1, 2]
    _same_metrics(ref, cfg)


def test_run_killed_before_its_params_gets_them_on_resume(smoke_cfg):
    """A process killed between creating its MLflow run and logging the run's parameters: the resumed run
    logs them (only the missing ones)."""
    from gspo_study.run import resolve_run, run_name
    from gspo_study.tracking import Tracker, _connect

    cfg = smoke_cfg("train.steps=1")
    client, exp_id = _connect(cfg.tracking.uri, cfg.tracking.experiment)
    run = client.create_run(exp_id, run_name=run_name(cfg), tags=Tracker._tags(resolve_run(cfg)))
    client.log_param(run.info.run_id, "seed", str(cfg.seed))
    train(cfg)
    params = client.get_run(run.info.run_id).data.params
    assert params["train.steps"] == "1" and params["algo.objective"] == cfg.algo.objective
    assert len(params) > 50


def test_save_killed_between_its_renames_is_finished_on_resume(smoke_cfg):
    """`save_pretrained` renames the old checkpoint away, then the new one into place: killed in between,
    the resumed run takes the new one (not a restart from step 0) and clears the leftovers."""
    from gspo_study.train.checkpointing import load_run_checkpoint, settle_interrupted_save

    cfg = smoke_cfg("train.steps=2", "train.checkpoint_every=1")
    train(cfg)
    ckpt = resolve_run(cfg).dir / "checkpoint"
    run_id = json.loads((ckpt / "trainer_state.json").read_text())["mlflow_run_id"]
    shutil.copytree(ckpt, resolve_run(cfg).dir / ".checkpoint.old")  # the previous checkpoint, moved aside
    ckpt.rename(resolve_run(cfg).dir / ".checkpoint.tmp-abc123")  # the new, complete one, not yet in place
    (resolve_run(cfg).dir / ".checkpoint.tmp-dead00").mkdir()  # a save killed mid-write
    settle_interrupted_save(resolve_run(cfg))  # what `train` does first, holding the run's lock
    _, _, state, optim = load_run_checkpoint(resolve_run(cfg), run_id)
    assert state.step == 2 and optim is not None
    assert sorted(p.name for p in resolve_run(cfg).dir.iterdir()) == ["checkpoint"]
    shutil.rmtree(resolve_run(cfg).dir / "checkpoint")  # a first save killed mid-write: nothing to finish, all cleared
    (resolve_run(cfg).dir / ".checkpoint.tmp-dead01").mkdir()
    settle_interrupted_save(resolve_run(cfg))
    assert not any(resolve_run(cfg).dir.iterdir())


def test_processes_creating_one_new_store_at_once_all_get_it(tmp_path):
    """Concurrent MLflow schema migrations break a new sqlite store for good; the lock beside it serialises
    them, so four processes opening one new store at once all get the same experiment."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    from tests.store_open import open_store

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    with ProcessPoolExecutor(4, mp_context=multiprocessing.get_context("spawn")) as pool:
        ids = list(pool.map(open_store, [uri] * 4))
    assert len(set(ids)) == 1
    assert MlflowClient(uri).get_experiment_by_name("race").experiment_id == ids[0]


def test_killed_sweep_resumes_to_the_same_figure(smoke_results, tmp_path):
    """`make reproduce-figure-1` killed mid-sweep (SIGKILL inside its second run) and rerun: every run
    finishes once, no step is logged twice, and the figure is drawn."""
    init = smoke_results / "smoke/checkpoints/coldstart"
    over = _overrides(tmp_path, init, "train.steps=3")
    cmd = [
        sys.executable,
        "-m",
        "gspo_study",
        "sweep",
        "--figure",
        "1",
        "--scale",
        "smoke",
        "--seeds",
        "1",
        *over,
    ]
    env = {**os.environ, "TQDM_DISABLE": "1"}
    # The first run (gspo) finishes; the kill lands at step 2 of the second (grpo_r2).
    first = subprocess.run(
        cmd, env={**env, "GSPO_STUDY_KILL_AT_STEP": "2"}, capture_output=True, text=True, timeout=300
    )
    assert first.returncode == -signal.SIGKILL
    from analysis.figures import make_figure
    from gspo_study.study import run_figure

    run_figure(1, "smoke", [1], over)  # the rerun and the drawing, in this process (what the commands call)
    make_figure(1, "smoke", [1], over)
    assert (tmp_path / "smoke" / "figure-1.png").is_file()
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    runs = client.search_runs(
        [client.get_experiment_by_name("study-smoke").experiment_id], "attributes.run_name != 'figure-1'"
    )
    assert sorted(r.info.run_name for r in runs) == ["grpo-r2-s1", "gspo-nr-s1"]
    for run in runs:
        assert run.info.status == "FINISHED"
        steps = [m.step for m in client.get_metric_history(run.info.run_id, "rollout/reward/mean")]
        assert sorted(steps) == [1, 2, 3]


def test_run_from_a_retrained_cold_start_is_not_reused(smoke_cfg, smoke_results, tmp_path, capsys):
    """A tracked run remembers the fingerprint of the checkpoint it started from; once that cold start is
    retrained at the same path, the run is neither skipped as finished nor resumed: a one-line error (exit 2)
    says which run and how to proceed."""
    init = tmp_path / "cold"
    shutil.copytree(smoke_results / "smoke/checkpoints/coldstart", init)
    cfg = smoke_cfg("train.steps=1", "eval.every=0", f"init_checkpoint={init}")
    train(cfg)
    from gspo_study.models import load_pretrained

    model, tok = load_pretrained(init)
    with torch.no_grad():
        next(model.parameters()).add_(1e-3)  # as a retrained cold start would differ: other weights
    save_pretrained(model, tok, init)
    args = [
        "train",
        "experiments/smoke/base.yaml",
        f"results_dir={cfg.results_dir}",
        f"tracking.uri={cfg.tracking.uri}",
        f"init_checkpoint={init}",
        "train.steps=1",
        "eval.every=0",
    ]
    capsys.readouterr()
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "started from a different checkpoint" in err[0] and "mlflow runs delete" in err[0]


def test_sweep_worker_refuses_code_changed_under_the_sweep(tmp_path):
    """A sweep's worker imports the package afresh: if the sources changed since the sweep started, it stops with
    one line before it unpickles the config (an edit under a running sweep once crashed its workers there); the
    digest follows an edit of any module, as a fresh interpreter finds it."""
    from gspo_study.errors import SweepInterrupted
    from gspo_study.study import _train_quietly, code_digest

    with pytest.raises(SweepInterrupted, match="changed since this sweep started") as err:
        _train_quietly("0" * 64, b"not a pickle: never read")
    assert "\n" not in str(err.value)
    package = Path(__file__).resolve().parents[1] / "gspo_study"
    shutil.copytree(package, tmp_path / "gspo_study", ignore=shutil.ignore_patterns("__pycache__"))
    probe = [sys.executable, "-c", "from gspo_study.study import code_digest; print(code_digest())"]
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}

    def digest() -> str:
        return subprocess.run(probe, env=env, cwd=tmp_path, capture_output=True, text=True, check=True).stdout.strip()

    before = digest()
    assert before == code_digest()  # the copy is the code under test
    with open(tmp_path / "gspo_study" / "config.py", "a") as f:
        f.write("\n# edited under a running sweep\n")
    assert digest() != before
