"""Two commits' RL runs timed pair by pair, and their numbers compared key by key.

    .venv/bin/python -m benchmarks.bench_ab --before REV [--after REV] [--shape study|bench] [--pairs 5] [--steps 25]

The before-and-after of a speed change, as a study sees it: the same short training run (`python -m gspo_study
train`, same config, seed and checkpoint, a fresh results dir and MLflow store each time) from two checkouts, started
in turn (A B A B ..., A = after, B = before; the first pair is a warm-up and not counted), so the machine's drift
falls on both. `--before` / `--after` are git revisions checked out as detached worktrees for the call (`--after`
defaults to this checkout's working tree). Each run uses its own checkout's code (`python -m` from its root) and the
same interpreter, so the packages installed here.

Shapes (the checkpoint from this checkout's results/, for both sides):
- `study`: the routing frontier's run (4 layers, 16 prompts x 8, 40 new tokens, 4 minibatches, lr 4e-5), GRPO,
  1 thread, the 4-layer CPU cold start;
- `bench`: `make bench`'s step (8 layers, same batch, the CPU base's lr), GSPO, 2 threads, the 8-layer cold start.

Reported per run: the whole process's wall seconds and its per-step seconds (the median gap between consecutive steps'
`rollout/reward/mean` log times, steps 2..N, so start-up and evaluation are out); per pair A/B of both; the median
over pairs. Numbers: every non-timing metric of the first counted A run against the first counted B run, at every
step, as keys bit-equal and keys that differ. `--out` writes all of it as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path

from benchmarks.common import machine, median, print_table
from gspo_study.tracking import WALL_CLOCK

ROOT = Path(__file__).resolve().parents[1]
CHECKPOINTS = ROOT / "results" / "cpu" / "checkpoints"

SHAPES = {
    "study": {
        "threads": 1,
        "checkpoint": "coldstart-L4",
        "overrides": ["model.num_hidden_layers=4", "train.lr=4e-5", "algo.objective=grpo"],
    },
    "bench": {
        "threads": 2,
        "checkpoint": "coldstart",
        "overrides": ["model.num_hidden_layers=8", "algo.objective=gspo"],
    },
}
COMMON = [  # the batch both shapes share; evaluation and checkpoints reduced to what a run cannot skip
    "seed=3",
    "rollout.prompts_per_step=16",
    "rollout.group_size=8",
    "rollout.max_new_tokens=40",
    "train.num_minibatches=4",
    "eval.every=100000",
    "eval.num_prompts=16",
    "eval.samples=1",
    "train.checkpoint_every=100000",
]
STEP_KEY = "rollout/reward/mean"  # logged once per step, after the step's work


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before", required=True, help="git revision of the baseline (B)")
    p.add_argument("--after", default=None, help="git revision of the change (A); default: this working tree")
    p.add_argument("--shape", choices=sorted(SHAPES), default="study")
    p.add_argument("--pairs", type=int, default=5, help="counted A/B pairs, after one warm-up pair")
    p.add_argument("--steps", type=int, default=25, help="RL steps per run (at least 3)")
    p.add_argument("--out", type=Path, default=None, help="JSON of every run and the summary")
    args = p.parse_args(argv)
    if args.pairs < 1:
        p.error(f"--pairs {args.pairs}: at least 1")
    if args.steps < 3:
        p.error(f"--steps {args.steps}: at least 3 (per-step times are read from step 2 on)")
    return args


def load_metrics(db: Path) -> dict[tuple[str, int], float]:
    """(key, step) -> value of an MLflow sqlite store holding one run."""
    with sqlite3.connect(db) as con:
        return {(k, s): v for k, s, v in con.execute("SELECT key, step, value FROM metrics")}


def compare(a: dict[tuple[str, int], float], b: dict[tuple[str, int], float]) -> dict[str, list[str]]:
    """Non-timing keys whose values are bit-equal at every step (`same`), that differ at some step (`differ`), or that
    are logged at different steps or by one run only (`unmatched`)."""
    out: dict[str, list[str]] = {"same": [], "differ": [], "unmatched": []}
    by_key: dict[str, tuple[dict, dict]] = {}
    for side, metrics in enumerate((a, b)):
        for (key, step), value in metrics.items():
            if key not in WALL_CLOCK:
                by_key.setdefault(key, ({}, {}))[side][step] = value
    for key, (va, vb) in sorted(by_key.items()):
        if va.keys() != vb.keys():
            out["unmatched"].append(key)
        else:
            out["same" if all(_equal(va[s], vb[s]) for s in va) else "differ"].append(key)
    return out


def _equal(x: float, y: float) -> bool:
    return x == y or (x != x and y != y)  # NaN logged by both is the same number


def seconds_per_step(times: dict[int, float]) -> float:
    """Median gap between consecutive steps' log times: the seconds of steps 2..N (step 1 carries the first calls)."""
    steps = sorted(times)
    return median([times[b] - times[a] for a, b in zip(steps, steps[1:])])


def step_times(db: Path) -> dict[int, float]:
    """Step -> the wall-clock second at which the step's `STEP_KEY` was logged."""
    with sqlite3.connect(db) as con:
        rows = con.execute("SELECT step, timestamp FROM metrics WHERE key = ?", (STEP_KEY,)).fetchall()
    return {s: t / 1000 for s, t in rows}


def pair_summary(runs: list[dict]) -> dict:
    """Per counted pair (A, B) the ratios A/B of wall and per-step seconds, and their medians."""
    a_runs = [r for r in runs if r["side"] == "A" and not r["warmup"]]
    b_runs = [r for r in runs if r["side"] == "B" and not r["warmup"]]
    pairs = [
        {"wall_a_over_b": a["wall_s"] / b["wall_s"], "step_a_over_b": a["step_s"] / b["step_s"]}
        for a, b in zip(a_runs, b_runs)
    ]
    return {
        "pairs": pairs,
        "median_wall_s": {"A": median([r["wall_s"] for r in a_runs]), "B": median([r["wall_s"] for r in b_runs])},
        "median_step_s": {"A": median([r["step_s"] for r in a_runs]), "B": median([r["step_s"] for r in b_runs])},
        "median_wall_a_over_b": median([p["wall_a_over_b"] for p in pairs]),
        "median_step_a_over_b": median([p["step_a_over_b"] for p in pairs]),
    }


@contextmanager
def checkout(rev: str | None):
    """This working tree (rev None), or `rev` as a detached worktree removed afterwards."""
    if rev is None:
        yield ROOT
        return
    path = Path(tempfile.mkdtemp(prefix="bench_ab-"))
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(path), rev], check=True,
                   capture_output=True)  # fmt: skip
    try:
        yield path
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(path)], check=False,
                       capture_output=True)  # fmt: skip


def command(work: Path, shape: str, steps: int) -> list[str]:
    s = SHAPES[shape]
    return [
        sys.executable, "-m", "gspo_study", "train", "experiments/cpu/base.yaml",
        f"results_dir={work}", f"tracking.uri=sqlite:///{work}/mlflow.db",
        f"init_checkpoint={CHECKPOINTS / s['checkpoint']}", f"threads={s['threads']}", f"train.steps={steps}",
        *COMMON, *s["overrides"],
    ]  # fmt: skip


def run_once(tree: Path, shape: str, steps: int, parent: Path) -> dict:
    """One fresh run from `tree` in a new directory under `parent`: its wall seconds, per-step seconds and store."""
    work = Path(tempfile.mkdtemp(prefix="run-", dir=parent))
    threads = str(SHAPES[shape]["threads"])
    env = {**os.environ, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}
    env.pop("PYTHONPATH", None)  # `python -m` from the tree's root imports that tree's package
    start = time.perf_counter()
    done = subprocess.run(command(work, shape, steps), cwd=tree, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["(no output)"]
        raise SystemExit(f"bench_ab: the run from {tree} exited {done.returncode}: {tail[0]}")
    db = work / "mlflow.db"
    return {"wall_s": wall, "step_s": seconds_per_step(step_times(db)), "store": str(db)}


def check_package(tree: Path) -> None:
    """The run from `tree` must import `tree`'s gspo_study, not an installed copy."""
    code = "import gspo_study, pathlib; print(pathlib.Path(gspo_study.__file__).resolve().parents[1])"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    got = subprocess.run([sys.executable, "-c", code], cwd=tree, env=env, capture_output=True, text=True).stdout
    if Path(got.strip()) != tree.resolve():
        raise SystemExit(f"bench_ab: a run from {tree} would import gspo_study from {got.strip() or '?'}")


def main(argv=None) -> None:
    args = parse_args(argv)
    missing = CHECKPOINTS / SHAPES[args.shape]["checkpoint"]
    if not (missing / "config.json").is_file():
        raise SystemExit(f"bench_ab: no cold start at {missing}; `make bench` (or `make coldstart`) trains it")
    with ExitStack() as stack:
        trees = {"A": stack.enter_context(checkout(args.after)), "B": stack.enter_context(checkout(args.before))}
        for tree in trees.values():
            check_package(tree)
        parent = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench_ab-runs-")))  # ~40-80 MB a run
        runs = []
        for i in range(1 + args.pairs):
            for side in ("A", "B"):
                run = run_once(trees[side], args.shape, args.steps, parent)
                runs.append({"side": side, "warmup": i == 0, **run})
                print(f"pair {i}{' (warm-up)' if i == 0 else ''} {side}: wall {run['wall_s']:.1f} s, "
                      f"step {run['step_s']:.3f} s", flush=True)  # fmt: skip
        first_a, first_b = (next(r for r in runs if r["side"] == s and not r["warmup"]) for s in ("A", "B"))
        numbers = compare(load_metrics(Path(first_a.pop("store"))), load_metrics(Path(first_b.pop("store"))))
    for run in runs:
        run.pop("store", None)  # removed with its directory
    summary = pair_summary(runs)
    report(args, summary, numbers)
    if args.out:
        result = {
            "config": {"before": args.before, "after": args.after or "working tree", "shape": args.shape,
                       "shape_settings": SHAPES[args.shape], "common": COMMON, "pairs": args.pairs,
                       "steps": args.steps, "machine": machine()},
            "runs": runs, "summary": summary, "numbers": numbers,
        }  # fmt: skip
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")


def report(args, summary: dict, numbers: dict) -> None:
    rows = [
        ["wall s (whole process)", summary["median_wall_s"]["A"], summary["median_wall_s"]["B"],
         summary["median_wall_a_over_b"]],
        ["s per step (steps 2..N)", summary["median_step_s"]["A"], summary["median_step_s"]["B"],
         summary["median_step_a_over_b"]],
    ]  # fmt: skip
    title = (f"{args.shape} shape, {args.pairs} pairs of {args.steps} steps; A = {args.after or 'working tree'}, "
             f"B = {args.before}; medians, A/B pair by pair")  # fmt: skip
    print_table(["", "A", "B", "A/B"], rows, title)
    print(f"numbers: {len(numbers['same'])} metric keys bit-equal at every step, {len(numbers['differ'])} differ "
          f"{sorted({k.rsplit('/', 1)[0] for k in numbers['differ']})}, {len(numbers['unmatched'])} unmatched "
          f"{numbers['unmatched']}")  # fmt: skip


if __name__ == "__main__":
    main()
