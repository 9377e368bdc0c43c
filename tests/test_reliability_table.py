"""Adversarial probes, kept: every bad input as one table (input → its one-line error, exit 2,
nothing written), kills at random moments of a run, an SFT and a sweep compared value for value with
uninterrupted ones, processes racing on one run, one cold start and one new store, and tampered checkpoints.

Kill moments are drawn from a seeded generator (GSPO_STUDY_KILL_SEED, default 21) over the length of the
uninterrupted job, so they land anywhere — in imports, a rollout, an update, a save — not only at step
boundaries; each test prints the moments it used."""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from mlflow import MlflowClient

from gspo_study.cli import main
from gspo_study.config import load_config
from gspo_study.models import build_char_tokenizer, build_model, save_pretrained
from gspo_study.models.checkpoint import MANIFEST, CheckpointError, fingerprint, verify, write_manifest
from gspo_study.run import resolve_run
from gspo_study.train.checkpointing import load_run_checkpoint
from gspo_study.trainer import train
from tests.test_trainer import WALL_CLOCK, history, weights

SMOKE = "experiments/smoke/base.yaml"
ENV = {**os.environ, "TQDM_DISABLE": "1", "OMP_NUM_THREADS": "1"}
KILLS = random.Random(int(os.environ.get("GSPO_STUDY_KILL_SEED", "21")))


# ------------------------------------------------------------------------------------------ bad inputs
def _files(root: Path, init: Path) -> dict[str, str]:
    """The bad files the table points at, by placeholder."""
    root.mkdir(parents=True, exist_ok=True)

    def write(name: str, data: str | bytes) -> str:
        path = root / name
        path.write_bytes(data if isinstance(data, bytes) else data.encode())
        return str(path)

    records = "".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(8))
    listed = root / "listed"
    listed.mkdir(exist_ok=True)
    (listed / "config.json").write_text("[1, 2]")
    readonly = root / "readonly"
    readonly.mkdir(exist_ok=True)
    store_dir = root / "store_dir.db"
    store_dir.mkdir(exist_ok=True)
    return {
        "NONUTF8_YAML": write(
            "latin1.yaml",
            b"base: BASE\ntrain:\n  steps: 2 # \xe9t\xe9\n".replace(b"BASE", str(Path(SMOKE).resolve()).encode()),
        ),
        "DUP_YAML": write("dup.yaml", f"base: {Path(SMOKE).resolve()}\ntrain:\n  steps: 2\ntrain:\n  lr: 1.0\n"),
        "DUP_NESTED": write("dupn.yaml", f"base: {Path(SMOKE).resolve()}\ntrain:\n  steps: 2\n  steps: 3\n"),
        "BASE_INT": write("base_int.yaml", "base: 123\n"),
        "BASE_LIST": write("base_list.yaml", "base: [a.yaml]\n"),
        "DOTTED": write("dotted.yaml", f"base: {Path(SMOKE).resolve()}\ntrain.lr: 1.0e-3\n"),
        "EMPTY_OUTPUT": write("empty_output.yaml", f"base: {Path(SMOKE).resolve()}\nsft:\n  output: ''\n"),
        "DATA": write("data.jsonl", records),
        "NONUTF8_DATA": write("latin1.jsonl", b'{"prompt": "\xe9", "answer": "1"}\n'),
        "LISTED": str(listed),
        "READONLY": str(readonly),
        "STORE_DIR": str(store_dir),
        "LONG": "x" * 300,
        "INIT": str(init),
        "ALIAS_YAML": write("aliases.yaml", _alias_bomb(8)),
        "DEEP_YAML": write("deep.yaml", "train: {lr: " + "[" * 200_000 + "]" * 200_000 + "}\n"),
        "MANY_SEEDS": ",".join(map(str, range(5_001))),  # figure 1 has 2 runs per seed: 10,002 runs
    }


def _alias_bomb(levels: int) -> str:
    """Ten lines of YAML whose aliases expand to 9^(levels+1) values (levels=8: 387 million)."""
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, levels + 1)]
    return "\n".join(lines) + "\n"


def _big_archive(root: Path) -> str:
    """A study archive of 10,001 (empty) runs: more than an import may load."""
    from gspo_study.archive import write_archive

    row = {"experiment": "e", "run_name": "r", "status": "FINISHED", "start_time": 0, "end_time": 0}
    rows = [
        {**row, "run_id": f"{i:032x}", "params": [], "tags": [("run_key", str(i))], "metrics": []}
        for i in range(10_001)
    ]
    path = root / "big.parquet"
    write_archive(rows, path)
    return str(path)


MATH = ["task.name=math_file", "task.path=DATA", "task.num_eval=3"]
# (argv after the command's name, fragment of the one-line error); RES is the case's results dir, URI a
# store shared by every case (it must stay without runs), the capitals the files above.
# fmt: off
TABLE = [
    ("train", ["NONUTF8_YAML"], "not UTF-8 text"),
    ("train", ["DUP_YAML"], "duplicate key 'train' (line 4)"),
    ("train", ["DUP_NESTED"], "duplicate key 'steps' (line 4)"),
    ("train", ["BASE_INT"], "bad value 123 for 'base'; allowed: one file name"),
    ("train", ["BASE_LIST"], "bad value ['a.yaml'] for 'base'"),
    ("train", ["DOTTED"], "dotted key 'train.lr' in a config file; allowed: nested keys, e.g. 'train: {lr: ...}'"),
    ("train", [SMOKE, "seed=99999999999999999999999"], "for 'seed'; allowed: an integer in [0, 2^63 - 1]"),
    ("train", [SMOKE, "seed=-1"], "for 'seed'; allowed"),
    ("train", [SMOKE, *MATH[:2], "task.num_eval=0"], "'task.num_eval'; allowed: an integer >= 1"),
    ("train", [SMOKE, *MATH[:2], "task.num_eval=-1"], "'task.num_eval'; allowed: an integer >= 1"),
    ("train", [SMOKE, *MATH, "task.prompt_template={prompt"], "for 'task.prompt_template' (ValueError"),
    ("train", [SMOKE, *MATH, "task.prompt_template='{question}'"], "for 'task.prompt_template' (KeyError"),
    ("train", [SMOKE, *MATH, "task.prompt_template=Solve it"], "a format string containing {prompt}"),
    ("train", [SMOKE, *MATH, "eval.num_prompts=4"], "eval.num_prompts=4 but the task has 3 held-out problems"),
    ("train", [SMOKE, "task.name=math_file", "task.path=NONUTF8_DATA"], "not UTF-8 text"),
    ("train", [SMOKE, "tracking.run_name=../../x"], "for 'tracking.run_name'"),
    ("train", [SMOKE, "tracking.run_name=LONG"], "for 'tracking.run_name'"),
    ("train", [SMOKE, "tracking.experiment= "], "for 'tracking.experiment'"),
    (
        "train",
        [SMOKE, "model.num_experts=0"],
        "for 'model.num_experts'; allowed: null (the preset's) or an integer >= 1",
    ),
    ("train", [SMOKE, "model.num_hidden_layers=0"], "for 'model.num_hidden_layers'"),
    ("train", [SMOKE, "model.num_hidden_layers=-1"], "for 'model.num_hidden_layers'"),
    ("train", [SMOKE, "model.num_experts_per_tok=9"], "'model.num_experts_per_tok'; allowed: an integer in [1, 8]"),
    ("train", [SMOKE, "rollout.temperature=.inf"], "bad value inf for 'rollout.temperature'; allowed: a finite number"),
    ("train", [SMOKE, "rollout.temperature=1e-30"], "'rollout.temperature'; allowed: a number in [0.01, 100]"),
    ("train", [SMOKE, "algo.advantage_eps=.inf"], "bad value inf for 'algo.advantage_eps'"),
    ("train", [SMOKE, "algo.advantage_eps=2"], "'algo.advantage_eps'; allowed: a number in [0, 1]"),
    ("train", [SMOKE, "train.lr=1e3"], "for 'train.lr'; allowed: a number in (0, 1]"),
    ("train", [SMOKE, "train.lr=.nan"], "bad value nan for 'train.lr'; allowed: a finite number"),
    ("train", [SMOKE, "train.weight_decay=-1"], "'train.weight_decay'"),
    ("train", [SMOKE, "model.num_hidden_layers=3"], "model.num_hidden_layers=3 but checkpoint"),
    ("train", [SMOKE, "rollout.max_new_tokens=300"], "'rollout.max_new_tokens'; allowed: fewer than the model's 256"),
    ("train", [SMOKE, "init_checkpoint=LISTED"], "config.json must hold a JSON object, got a list"),
    ("train", [SMOKE, "tracking.uri=sqlite:///STORE_DIR"], "is not a sqlite file"),
    ("train", [SMOKE, "tracking.uri=sqlite:///DATA/m.db"], "data.jsonl is not a directory"),
    ("train", [SMOKE, "tracking.uri=sqlite:///READONLY/m.db"], "cannot be written"),
    ("train", [SMOKE, "tracking.uri=foo://bar"], "'foo://bar' is unreachable"),
    ("train", [SMOKE, "results_dir=READONLY"], "for 'results_dir': cannot write in"),
    ("sft", [SMOKE, "sft.output=."], "for 'sft.output'; allowed: a checkpoint name"),
    ("sft", [SMOKE, "sft.output=../x"], "for 'sft.output'"),
    ("sft", ["EMPTY_OUTPUT"], "bad value '' for 'sft.output'"),
    ("sft", [SMOKE, "model.num_experts=0"], "for 'model.num_experts'"),
    ("sft", [SMOKE, *MATH], "has no SFT targets (its records need a 'solution' field)"),
    ("sft", [SMOKE, "results_dir=READONLY"], "cannot write in"),
    # the model a run names, settings it ignores, sizes against the machine, prompt + response positions
    ("train", [SMOKE, "model.path=/nonexistent/model"], "for 'model.path': no such directory"),
    ("sft", [SMOKE, "model.path=/nonexistent/model"], "for 'model.path': no such directory"),
    ("train", [SMOKE, "task.path=DATA"], "takes no part in this run (only with task.name=math_file)"),
    ("train", [SMOKE, "algo.icepop_low=0.4"], "algo.icepop_low=0.4 takes no part in this run"),
    ("train", [SMOKE, "rollout.server.tensor_parallel_size=2"], "only with rollout.engine=vllm_server"),
    ("train", [SMOKE, "train.zero_stage=3"], "only with train.backend=deepspeed"),
    ("train", [SMOKE, "telemetry.route_rows=0"], "for 'telemetry.route_rows'; allowed: a number in (0, 1]"),
    ("train", [SMOKE, "rollout.group_size=100000000"], "GiB available; allowed: a smaller batch"),
    ("train", [SMOKE, "eval.batch_size=100000000"], "its eval phase"),
    ("sft", [SMOKE, "sft.batch_size=100000000"], "an SFT step needs"),
    ("train", [SMOKE, "rollout.max_new_tokens=252"], "with the task's longest prompt (5 tokens) a sequence needs 257"),
]
# issue 49: every size a run or command takes, against what the machine can hold and do (gspo_study.train.sizes),
# and a config file of nested aliases; each answers within seconds (before: minutes to hours).
HUGE = "1000000000000000"
SIZES = [
    ("train", [SMOKE, f"eval.num_prompts={HUGE}"], f"{HUGE} for 'eval.num_prompts'; allowed: an integer in [1, "),
    ("train", [SMOKE, f"eval.samples={HUGE}"], f"bad value {HUGE} for 'eval.samples'; allowed: an integer in [1, "),
    ("train", [SMOKE, f"train.steps={HUGE}"], f"bad value {HUGE} for 'train.steps'; allowed: an integer in [0, "),
    ("train", [SMOKE, "eval.num_prompts=200"], "has only 81 distinct problems, so fewer than 200 held-out problems"),
    ("sft", [SMOKE, f"sft.steps={HUGE}"], f"bad value {HUGE} for 'sft.steps'; allowed: an integer in [0, "),
    ("eval", ["--checkpoint", "INIT", "--num-prompts", HUGE], f"bad value {HUGE} for 'eval.num_prompts'; allowed"),
    ("eval", ["--checkpoint", "INIT", "--samples", HUGE], f"bad value {HUGE} for 'eval.samples'; allowed"),
    ("sweep", [*"--figure 1 --scale smoke --seeds".split(), "MANY_SEEDS"],
     "10,002 runs (2 per seed); allowed: at most 5,000 "),
    ("export-study", [*"--scale smoke --figures 1 --seeds".split(), "MANY_SEEDS"], "allowed: at most 5,000 seeds"),
    ("import-study", ["--scale", "smoke", "--file", "BIG_ARCHIVE"], "holds 10,001 runs and 0.0 GiB of data"),
    ("train", ["ALIAS_YAML"], "aliases.yaml: its YAML holds more than 1,000 values, aliases expanded; allowed"),
    ("train", ["DEEP_YAML"], "deep.yaml: its YAML nests deeper than 32 levels (line 1); allowed: at most 32"),
]
TABLE += SIZES
# fmt: on


@pytest.fixture(scope="module")
def shared_store(tmp_path_factory):
    return f"sqlite:///{tmp_path_factory.mktemp('store')}/mlflow.db"


def _immutable(path: Path, on: bool) -> None:
    """Read-only for anyone: `chattr +i` for root (whom permissions do not stop), else chmod."""
    if os.geteuid() == 0:
        subprocess.run(["chattr", "+i" if on else "-i", str(path)], check=True)
    else:
        path.chmod(0o555 if on else 0o755)


@pytest.mark.parametrize(
    "command, argv, fragment",
    TABLE,
    ids=[f"{c}:{' '.join(a[1:] if len(a) > 1 else a)[-50:]}" for c, a, _ in TABLE],
)
def test_bad_input_is_one_line_exit_2_nothing_written(
    smoke_results, tmp_path, shared_store, capsys, command, argv, fragment
):
    init = smoke_results / "smoke/checkpoints/coldstart"
    before = fingerprint(init)
    subs = _files(tmp_path / "in", init)
    res = tmp_path / "res"
    subs["RES"] = str(res)

    def fill(arg: str) -> str:
        for name in sorted(subs, key=len, reverse=True):
            arg = arg.replace(name, subs[name])
        return arg

    if "BIG_ARCHIVE" in argv:
        subs["BIG_ARCHIVE"] = _big_archive(tmp_path)
    args = [fill(a) for a in argv]
    defaults = [f"results_dir={res}", f"init_checkpoint={init}"]
    if command in ("train", "sweep") and not any(a.startswith("tracking.uri=") for a in args):
        defaults.append(f"tracking.uri={shared_store}")
    configs = command in ("train", "sft")  # their files and overrides come first; the others' options first
    readonly = Path(subs["READONLY"])
    _immutable(readonly, True)
    try:
        start = time.perf_counter()
        rc = main([command, *args[:1], *defaults, *args[1:]] if configs else [command, *args, *defaults])
        seconds = time.perf_counter() - start
    finally:
        _immutable(readonly, False)
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.startswith("error:") and fragment in err and "\n" not in err, err
    assert seconds < 60, f"{seconds:.0f} s to say so"  # no retry storm (a directory as store took 322 s)
    if (command, argv, fragment) in SIZES:  # measured: 0.01-0.15 s each (the alias file: 0.004 s, the deep one 0.11)
        assert seconds < 5, f"{seconds:.1f} s to say so"
    assert not list(res.rglob("*.safetensors")) and not (res / "smoke" / "runs").exists()
    assert not any(readonly.iterdir())
    assert fingerprint(init) == before and not list(init.parent.glob(".*tmp-*"))  # the cold start intact
    db = Path(shared_store.removeprefix("sqlite:///"))
    if db.exists():
        client = MlflowClient(shared_store)
        assert not client.search_runs([e.experiment_id for e in client.search_experiments()])


def test_analysis_with_an_unusable_store_is_one_line(monkeypatch, capsys):
    from analysis import figures, report

    monkeypatch.setenv("MLFLOW_TRACKING_URI", "foo://bar")
    for script, extra in ((figures, ["--figure", "1"]), (report, [])):
        assert script.main(["--scale", "smoke", *extra]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "'foo://bar' is not usable" in err[0], err


# ------------------------------------------------------------------------------------------ kills
def _cmd(command: str, *over: str) -> list[str]:
    return [sys.executable, "-m", "gspo_study", command, SMOKE, *over]


def _quiet(fn, *args) -> None:
    import threading

    from tqdm import tqdm

    # tqdm's default lock holds a semaphore shared with the parent: a child killed while holding it would hang
    # the parent's next progress bar for ever. The child gets a lock of its own.
    tqdm.set_lock(threading.RLock())
    sys.stdout = sys.stderr = open(os.devnull, "w")  # noqa: SIM115 - the child dies with it
    fn(*args)


def _kill_after(seconds: float, fn, *args) -> int | None:
    """Run `fn(*args)` in a forked process (everything already imported: the kill lands in the work, not in
    imports) and SIGKILL it after `seconds`; None if killed, else its exit code (it finished first)."""
    import multiprocessing

    proc = multiprocessing.get_context("fork").Process(target=_quiet, args=(fn, *args))
    proc.start()
    proc.join(seconds)
    if proc.exitcode is not None:
        return proc.exitcode
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(60)
    return None


def _timed(fn, *args) -> float:
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def _store_runs(uri: str, experiment: str):
    client = MlflowClient(uri)
    return client, client.search_runs([client.get_experiment_by_name(experiment).experiment_id])


def _each_step_once(uri: str, experiment: str) -> None:
    client, runs = _store_runs(uri, experiment)
    for run in runs:
        for key in run.data.metrics:
            steps = [m.step for m in client.get_metric_history(run.info.run_id, key)]
            assert len(steps) == len(set(steps)), (run.info.run_name, key, sorted(steps))


def _same_history(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a.keys() - WALL_CLOCK:
        assert a[key] == b[key], key


def test_train_killed_at_random_moments_resumes_to_identical_metrics(smoke_results, tmp_path):
    init = smoke_results / "smoke/checkpoints/coldstart"
    args = ["train.steps=4", "train.checkpoint_every=1", "eval.every=2", f"init_checkpoint={init}"]
    ref = load_config(SMOKE, [f"results_dir={tmp_path / 'ref'}", f"tracking.uri=sqlite:///{tmp_path}/ref.db", *args])
    length = _timed(train, ref)
    cfg = load_config(SMOKE, [f"results_dir={tmp_path / 'k'}", f"tracking.uri=sqlite:///{tmp_path}/k.db", *args])
    moments = [KILLS.uniform(0.0, 1.0) * length for _ in range(3)]
    print("train killed after", [f"{m:.2f}s" for m in moments], f"of {length:.2f}s")
    for m in moments:
        assert _kill_after(m, train, cfg) in (None, 0)
    train(cfg)
    _same_history(history(ref), history(cfg))
    _each_step_once(cfg.tracking.uri, "study-smoke")
    assert sorted(p.name for p in resolve_run(cfg).dir.iterdir()) == ["checkpoint"]


def test_sft_killed_at_random_moments_gives_the_same_cold_start(tmp_path):
    from gspo_study.sft import run_sft

    ref = load_config(SMOKE, [f"results_dir={tmp_path / 'ref'}", "sft.steps=30"])
    length = _timed(run_sft, ref)
    cfg = load_config(SMOKE, [f"results_dir={tmp_path / 'k'}", "sft.steps=30"])
    moments = [KILLS.uniform(0.3, 1.0) * length for _ in range(3)]
    print("sft killed after", [f"{m:.2f}s" for m in moments], f"of {length:.2f}s")
    for m in moments:
        _kill_after(m, run_sft, cfg)
    run_sft(cfg)
    a, b = tmp_path / "ref/smoke/checkpoints/coldstart", tmp_path / "k/smoke/checkpoints/coldstart"
    verify(b)
    assert fingerprint(a) == fingerprint(b)
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert sorted(p.name for p in b.parent.iterdir()) == ["coldstart"]


def test_sweep_killed_at_random_moments_resumes_to_identical_runs(smoke_results, tmp_path):
    from gspo_study.study import run_figure

    init = smoke_results / "smoke/checkpoints/coldstart"

    def over(name: str) -> tuple[str, ...]:
        return (
            f"results_dir={tmp_path / name}",
            f"tracking.uri=sqlite:///{tmp_path}/{name}.db",
            "train.steps=3",
            f"init_checkpoint={init}",
        )

    length = _timed(run_figure, 1, "smoke", [1], over("ref"))
    moments = [KILLS.uniform(0.0, 1.0) * length for _ in range(2)]
    print("sweep killed after", [f"{m:.2f}s" for m in moments], f"of {length:.2f}s")
    for m in moments:
        _kill_after(m, run_figure, 1, "smoke", [1], over("k"))
    run_figure(1, "smoke", [1], over("k"))
    for run in ("gspo", "grpo_r2"):
        a, b = (load_config([SMOKE, f"experiments/runs/{run}.yaml"], list(over(n))) for n in ("ref", "k"))
        _same_history(history(a), history(b))
    _each_step_once(f"sqlite:///{tmp_path}/k.db", "study-smoke")


def _workers() -> list[int]:
    """This process's pool workers (spawned interpreters, not multiprocessing's resource tracker)."""
    out = []
    for task in Path(f"/proc/{os.getpid()}/task").iterdir():
        for pid in (task / "children").read_text().split():
            with contextlib.suppress(OSError):
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
                if b"spawn_main" in cmdline and b"resource_tracker" not in cmdline:
                    out.append(int(pid))
    return out


def test_parallel_sweep_with_a_killed_worker_is_one_line_and_resumes(smoke_results, tmp_path, capsys):
    import threading

    init = smoke_results / "smoke/checkpoints/coldstart"
    over = [
        f"results_dir={tmp_path}",
        f"tracking.uri=sqlite:///{tmp_path}/m.db",
        "train.steps=3",
        f"init_checkpoint={init}",
    ]
    argv = ["sweep", "--figure", "1", "--scale", "smoke", "--seeds", "1", *over]
    killed: list[int] = []

    def kill_one() -> None:
        deadline = time.time() + 300
        while not killed and time.time() < deadline:
            if pids := _workers():
                time.sleep(KILLS.uniform(0.5, 5.0))
                os.kill(pids[0], signal.SIGKILL)
                killed.append(pids[0])
            time.sleep(0.02)

    killer = threading.Thread(target=kill_one, daemon=True)
    killer.start()
    rc = main([*argv, "--jobs", "2"])
    killer.join(60)
    err = capsys.readouterr().err.strip().splitlines()
    assert killed and rc == 1 and len(err) == 1 and "a worker process died" in err[0], err
    assert main(argv) == 0  # the rerun resumes (one job: the same thread count per run)
    client, runs = _store_runs(f"sqlite:///{tmp_path}/m.db", "study-smoke")
    assert sorted(r.info.status for r in runs) == ["FINISHED", "FINISHED"]
    _each_step_once(f"sqlite:///{tmp_path}/m.db", "study-smoke")


# ------------------------------------------------------------------------------------------ concurrency
def test_same_run_from_two_results_dirs_logs_each_step_once(smoke_results, tmp_path):
    """The run lock is on the run's identity in its store: two results dirs, one store, one MLflow run."""
    init = smoke_results / "smoke/checkpoints/coldstart"
    common = [f"tracking.uri=sqlite:///{tmp_path}/m.db", f"init_checkpoint={init}", "train.steps=3", "eval.every=1"]
    procs = [
        subprocess.Popen(
            _cmd("train", f"results_dir={tmp_path / f'r{k}'}", *common),
            env=ENV,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for k in (1, 2)
    ]
    codes = [p.wait(timeout=300) for p in procs]
    errs = [p.stderr.read() for p in procs]
    assert sorted(codes) in ([0, 0], [0, 2]), errs  # refused while the other trains, or found it finished
    if 2 in codes:
        assert "into the same MLflow run" in errs[codes.index(2)]
    client, runs = _store_runs(f"sqlite:///{tmp_path}/m.db", "study-smoke")
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    _each_step_once(f"sqlite:///{tmp_path}/m.db", "study-smoke")


def test_same_run_held_refuses_a_second_results_dir(smoke_cfg, tmp_path, capsys):
    from gspo_study.run import resolve_run, run_lock

    cfg = smoke_cfg("train.steps=1")
    with run_lock(resolve_run(cfg)):
        rc = main(
            [
                "train",
                SMOKE,
                f"results_dir={tmp_path / 'other'}",
                f"tracking.uri={cfg.tracking.uri}",
                f"init_checkpoint={cfg.init_checkpoint}",
                "train.steps=1",
            ]
        )
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "into the same MLflow run" in err and "\n" not in err, err


def _ensure(args: list[str]) -> None:
    from gspo_study.study import ensure_coldstart

    ensure_coldstart("smoke", tuple(args))


def test_two_sweeps_needing_one_cold_start_train_it_once(tmp_path, capfd):
    """Two processes needing a missing cold start at once: one trains it, the other waits and reuses it; a
    cold start retrained to the same weights keeps its fingerprint, so runs from it stay valid."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    args = [f"results_dir={tmp_path}", "sft.steps=20"]
    with ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("spawn")) as pool:
        list(pool.map(_ensure, [args, args]))
    out = capfd.readouterr().out
    assert out.count("missing: training it") == 1, out
    cold = tmp_path / "smoke/checkpoints/coldstart"
    first = fingerprint(cold)
    (cold.parent / ".coldstart.tmp-killed").mkdir()  # what an SFT killed mid-save leaves
    from gspo_study.sft import run_sft

    run_sft(load_config("experiments/smoke/coldstart.yaml", args))  # retrained: another log, same weights
    assert fingerprint(cold) == first
    assert sorted(p.name for p in cold.parent.iterdir()) == ["coldstart"]


def test_store_template_killed_while_built_or_corrupt_is_rebuilt(tmp_path):
    """A new store is a copy of a template migrated once per MLflow version (`tracking._template_path`): a build
    killed at any moment leaves no template or a whole one, and a template cut short or not a store is rebuilt,
    so the stores made from it are whole."""
    from gspo_study import tracking

    cache = tmp_path / "cache"
    env = {**ENV, "XDG_CACHE_HOME": str(cache)}
    code = "import sys; from gspo_study.tracking import _connect; _connect(sys.argv[1], 'race')"
    for attempt in range(2):
        proc = subprocess.Popen([sys.executable, "-c", code, f"sqlite:///{tmp_path}/t{attempt}.db"], env=env)
        time.sleep(KILLS.uniform(2.0, 6.0))  # within the interpreter's start, MLflow's import or the migration
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
        for template in cache.glob("gspo_study/*.db"):  # none yet, or whole
            assert sqlite3.connect(template).execute("SELECT version_num FROM alembic_version").fetchone()
    old = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = str(cache)
    try:
        template = tracking._template_path()
        for bad in (b"", b"not a sqlite file", template.read_bytes()[:4096] if template.exists() else b"x"):
            template.parent.mkdir(parents=True, exist_ok=True)
            template.write_bytes(bad)
            data = tracking._empty_store.__wrapped__()
            assert template.read_bytes() == data and data[:16] == b"SQLite format 3\x00"
        db = tmp_path / "from-template.db"
        db.write_bytes(data)
        assert "runs" in {r[0] for r in sqlite3.connect(db).execute("SELECT name FROM sqlite_master")}
    finally:
        if old is None:
            os.environ.pop("XDG_CACHE_HOME")
        else:
            os.environ["XDG_CACHE_HOME"] = old


def test_store_killed_while_created_is_never_broken(tmp_path):
    """A kill at any moment of a new store's creation leaves no store or a whole one; the next process gets a
    working store (MLflow's migration killed mid-way used to leave it unreachable for good)."""
    from gspo_study.tracking import _connect

    code = "import sys; from gspo_study.tracking import _connect; _connect(sys.argv[1], 'race')"
    for attempt in range(2):
        db = tmp_path / f"m{attempt}.db"
        proc = subprocess.Popen([sys.executable, "-c", code, f"sqlite:///{db}"], env=ENV)
        while proc.poll() is None and not list(tmp_path.glob(f"m{attempt}.db.tmp-*")):
            time.sleep(0.005)
        time.sleep(KILLS.uniform(0.0, 2.0))
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
        if db.exists():  # it finished before the kill: whole
            tables = {r[0] for r in sqlite3.connect(db).execute("SELECT name FROM sqlite_master")}
            assert "runs" in tables and not any(t.startswith("_alembic_tmp") for t in tables)
        client, exp = _connect(f"sqlite:///{db}", "race")
        assert client.get_experiment(exp).name == "race"
        assert not list(tmp_path.glob(f"m{attempt}.db.tmp-*"))


def test_half_migrated_empty_store_is_rebuilt_and_one_with_runs_refused(tmp_path):
    from gspo_study.config import ConfigError
    from gspo_study.tracking import _connect

    db = tmp_path / "m.db"
    with sqlite3.connect(db) as con:  # what a migration killed mid-way (before this fix) left
        con.execute("CREATE TABLE alembic_version (version_num VARCHAR(32))")
        con.execute("CREATE TABLE _alembic_tmp_runs (run_uuid VARCHAR(32))")
    client, exp = _connect(f"sqlite:///{db}", "race")
    assert client.get_experiment(exp).name == "race"
    with sqlite3.connect(db) as con:
        con.execute("CREATE TABLE _alembic_tmp_metrics (key VARCHAR(250))")
    client.create_run(exp)
    with pytest.raises(ConfigError, match="half-migrated .* holds 1 runs"):
        _connect(f"sqlite:///{db}", "race")


# ------------------------------------------------------------------------------------------ checkpoints
@pytest.fixture(scope="module")
def killed_at_3(smoke_results, tmp_path_factory):
    """A run killed after logging step 3 whose last checkpoint is at step 2, and the uninterrupted run."""
    root = tmp_path_factory.mktemp("killed3")
    init = smoke_results / "smoke/checkpoints/coldstart"
    args = ["train.steps=4", "train.checkpoint_every=2", "eval.every=2", f"init_checkpoint={init}"]
    ref = load_config(SMOKE, [f"results_dir={root / 'ref'}", f"tracking.uri=sqlite:///{root}/ref.db", *args])
    train(ref)
    over = [f"results_dir={root / 'k'}", f"tracking.uri=sqlite:///{root}/k.db", *args]
    done = subprocess.run(_cmd("train", *over), env={**ENV, "GSPO_STUDY_KILL_AT_STEP": "3"}, timeout=300)
    assert done.returncode == -signal.SIGKILL
    return ref, load_config(SMOKE, over)


def _tamper_state(ckpt: Path, **changes) -> None:
    state = json.loads((ckpt / "trainer_state.json").read_text())
    (ckpt / "trainer_state.json").write_text(json.dumps({**state, **changes}))


def _flip_byte(ckpt: Path) -> None:
    f = next(ckpt.glob("*.safetensors"))
    data = bytearray(f.read_bytes())
    data[-5] ^= 0xFF
    f.write_bytes(bytes(data))


def _nan_weight(ckpt: Path) -> None:
    from safetensors.torch import load_file, save_file

    f = next(ckpt.glob("*.safetensors"))
    tensors = load_file(str(f))
    next(iter(tensors.values())).view(-1)[0] = float("nan")
    save_file(tensors, str(f), metadata={"format": "pt"})
    write_manifest(ckpt)  # consistent with its manifest: only the NaN gives it away


def _swap_weights(ckpt: Path, other: Path) -> None:
    shutil.copy(next(other.glob("*.safetensors")), next(ckpt.glob("*.safetensors")))


@pytest.mark.parametrize(
    "tamper, warning",
    [
        (lambda c, o: _tamper_state(c, step=99), "does not match its hash"),
        (lambda c, o: _tamper_state(c, step=1), "does not match its hash"),
        (lambda c, o: (_tamper_state(c, step="4"), write_manifest(c)), "step='4' is not a non-negative int"),
        (
            lambda c, o: (_tamper_state(c, step=4), write_manifest(c)),
            "beyond its MLflow run's last logged step 3",
        ),
        (lambda c, o: (_tamper_state(c, step=99), write_manifest(c)), "beyond train.steps=4"),
        (lambda c, o: _flip_byte(c), "model.safetensors does not match its hash"),
        (lambda c, o: _swap_weights(c, o), "model.safetensors does not match its hash"),
        (lambda c, o: _nan_weight(c), "has non-finite weights"),
        (lambda c, o: (c / "extra.pt").write_bytes(b"x"), "extra.pt is not listed"),
    ],
    ids=[
        "step99",
        "step1",
        "step-str",
        "step-ahead-of-store",
        "step-beyond",
        "flipped",
        "swapped",
        "nan",
        "extra-pickle",
    ],  # fmt: skip
)
def test_tampered_checkpoint_is_not_resumed(killed_at_3, tmp_path, tamper, warning):
    ref, cfg = killed_at_3
    ckpt = resolve_run(cfg).dir / "checkpoint"
    copy = shutil.copytree(ckpt, tmp_path / "pristine")
    try:
        run_id = json.loads((ckpt / "trainer_state.json").read_text())["mlflow_run_id"]
        _, _, state, _ = load_run_checkpoint(resolve_run(cfg), run_id, logged_upto=3)
        assert state.step == 2  # untouched, it resumes
        tamper(ckpt, smoke_ckpt(ref))
        with pytest.warns(UserWarning, match=warning):
            _, _, state, optim = load_run_checkpoint(resolve_run(cfg), run_id, logged_upto=3)
        assert state.step == 0 and optim is None  # started over from the cold start
    finally:
        shutil.rmtree(ckpt)
        shutil.copytree(copy, ckpt)


def smoke_ckpt(cfg) -> Path:
    return resolve_run(cfg).dir / "checkpoint"


def test_resume_past_a_tampered_checkpoint_gives_uninterrupted_metrics(killed_at_3):
    """`"step": 99` in trainer_state.json used to finish the run with steps 5-6 and the final eval unlogged."""
    ref, cfg = killed_at_3
    _tamper_state(resolve_run(cfg).dir / "checkpoint", step=99)
    with pytest.warns(UserWarning, match="does not match its hash"):
        train(cfg)
    _same_history(history(ref), history(cfg))
    _each_step_once(cfg.tracking.uri, cfg.tracking.experiment)


def test_stray_files_never_block_a_save(tmp_path):
    tok = build_char_tokenizer()
    model = build_model("qwen3-moe-smoke", tok, seed=0)
    path = tmp_path / "checkpoint"
    (tmp_path / ".checkpoint.old").write_text("stray")  # a file where the save moves the previous one
    save_pretrained(model, tok, path)
    save_pretrained(model, tok, path)
    shutil.rmtree(path)
    path.write_text("not a checkpoint")  # a file where the checkpoint belongs
    save_pretrained(model, tok, path)
    verify(path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint"]
    assert (path / MANIFEST).is_file()


def test_fingerprint_is_of_the_weights_and_legacy_checkpoints_keep_theirs(tmp_path):
    tok = build_char_tokenizer()
    model = build_model("qwen3-moe-smoke", tok, seed=0)
    a = save_pretrained(model, tok, tmp_path / "a", extra={"sft_log.json": {"seconds": 1.0}})
    b = save_pretrained(model, tok, tmp_path / "b", extra={"sft_log.json": {"seconds": 2.0}})
    assert fingerprint(a) == fingerprint(b)  # other timings, same weights
    with torch.no_grad():
        next(model.parameters()).add_(1e-3)
    assert fingerprint(save_pretrained(model, tok, tmp_path / "c")) != fingerprint(a)
    legacy = shutil.copytree(a, tmp_path / "legacy")
    (legacy / MANIFEST).unlink()  # as written before manifests: the old recipe, unchanged
    import hashlib

    h = hashlib.sha256()
    for f in sorted(p for p in legacy.rglob("*") if p.is_file()):
        h.update(f"{f.relative_to(legacy)}:{f.stat().st_size};".encode())
        if f.suffix == ".json" and f.stat().st_size < 1 << 20:
            h.update(f.read_bytes())
    assert fingerprint(legacy) == h.hexdigest()[:16]
    verify(legacy)  # loads unchecked


# ------------------------------------------------------------------------------------------ DeepSpeed files
class _Payload:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_zero_files_never_run_pickled_code(tmp_path):
    """DeepSpeed's ZeRO files are read with weights_only and an allow-list of DeepSpeed's own classes: a file
    whose pickle would run a shell command is refused, what DeepSpeed itself writes loads."""
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    from gspo_study.train.deepspeed_backend import safe_load

    marker = tmp_path / "pwned"
    torch.save({"module": {"w": torch.ones(2)}, "x": _Payload(str(marker))}, tmp_path / "evil.pt")
    with pytest.raises(CheckpointError, match=r"refusing ZeRO checkpoint file .*evil.pt: .*\(posix.system is not"):
        safe_load(str(tmp_path / "evil.pt"))
    assert not marker.exists()
    good = {
        "loss_scaler": LossScaler(1.0),
        "zero_stage": ZeroStageEnum.gradients,
        "param_slice_mappings": [{"w": fragment_address(numel=2, start=0)}],
        "w": torch.ones(2),
    }
    torch.save(good, tmp_path / "good.pt")
    back = safe_load(str(tmp_path / "good.pt"), map_location=lambda storage, loc: storage)
    assert torch.equal(back["w"], good["w"]) and back["zero_stage"] == ZeroStageEnum.gradients
    assert back["param_slice_mappings"][0]["w"].numel == 2
