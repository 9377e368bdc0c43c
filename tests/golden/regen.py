"""The golden numbers: the first RL steps of a handful of smoke runs, every metric the trainer logs (wall-clock
readings aside), pinned in tests/golden/numbers.json to the digits a CPU gives at one thread; and the run keys of
every figure's runs, tests/golden/run_keys.json.

    python -m tests.golden.regen              # rewrite numbers.json on purpose: its diff is the review
    python -m tests.golden.regen --run-keys   # add the keys of figure runs not yet pinned (a new figure, scale or
                                              # cell); a key already pinned is never rewritten

Run identity (`run_key`, tests/golden/run_keys.json) says which runs are the same run; these numbers say that the
code still computes what the shipped runs computed. A change to the numerics — a kernel, a reduction order, an
objective's aggregation — keeps every run key, so without them a sweep would skip the shipped runs as finished
while the code computes something else. `tests/test_golden_numbers.py` fails when one number moves.

The runs together cover every objective, every replay mode (none / R2 / R3), both engine dtypes (float32 /
bfloat16), a train–inference correction, π_old from the rollout engine and the token-mean aggregation; each starts
from the smoke scale's cold start (`run_sft` of experiments/smoke/base.yaml, as tests/conftest.py's fixture).

Numbers are bit-identical only along one kernel path (docs/RELIABILITY.md: the CPU's vector extensions choose the
kernels torch, MKL and oneDNN run), so the file holds one entry per path (`kernel_path`: the CPU's AVX / AMX
flags), with the torch and transformers it was written with; regenerating rewrites this machine's entry and keeps
the others. On a path without an entry the test skips, naming this command.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = Path(__file__).with_name("numbers.json")
RUN_KEYS = Path(__file__).with_name("run_keys.json")
PINNED_SEEDS = (1, 2, 3, 4, 5)  # every scale's default seeds and more; a figure's own `seeds:` are added
SMOKE = ROOT / "experiments" / "smoke" / "base.yaml"
STEPS = 2
WALL_CLOCK = ("compute/seconds", "perf/tokens_per_s", "perf/peak_gpu_memory_gb")  # not numbers of the run
# name: (experiments/runs/<file>, overrides) — what each adds to the coverage in its comment
RUNS = {
    "gspo": ("gspo", []),  # GSPO, no replay, float32 engine
    "grpo_r2": ("grpo_r2", []),  # R2
    "grpo_r3_bf16": ("grpo_r3_bf16", []),  # R3 under a bfloat16 engine
    "gspo_bf16_tis": ("gspo_bf16_tis", []),  # a train–inference correction (token TIS)
    "gspo_token_rolloutlp": ("gspo_bf16_rollout", ["algo.objective=gspo_token"]),  # GSPO-token, π_old = μ
    "cispo_r2": ("grpo_r2", ["algo.objective=cispo"]),  # CISPO
    "sapo": ("sapo", []),  # SAPO
    "gmpo_token_mean": ("gmpo", ["algo.aggregation=token_mean"]),  # GMPO, token-mean aggregation
}


def coldstart(results_dir: Path) -> Path:
    """The smoke cold start under `results_dir` (what tests/conftest.py's `smoke_results` holds); its directory."""
    from gspo_study.config import load_config
    from gspo_study.sft import run_sft

    run_sft(load_config(SMOKE, [f"results_dir={results_dir}"]))
    return results_dir / "smoke" / "checkpoints" / "coldstart"


def config(name: str, *overrides: str):
    """Run `name`'s config: the smoke base, its run file, its overrides, then `overrides`."""
    from gspo_study.config import load_config

    file, own = RUNS[name]
    return load_config([SMOKE, ROOT / "experiments" / "runs" / f"{file}.yaml"], [*own, *overrides])


def run_numbers(name: str, start: Path, results_dir: Path) -> list[dict[str, float]]:
    """Steps 1..STEPS of run `name` from the cold start `start`, its results under `results_dir` (fresh: a run
    checkpoint there would be resumed): `trainer.setup`, then `rl_step`, every logged number but wall-clock ones."""
    from gspo_study import trainer
    from gspo_study.run import resolve_run

    ctx = trainer.setup(resolve_run(config(name, f"init_checkpoint={start}", f"results_dir={results_dir}")))
    steps = [trainer.rl_step(ctx, step) for step in range(1, STEPS + 1)]
    return [{k: v for k, v in sorted(m.items()) if k not in WALL_CLOCK} for m in steps]


def kernel_path() -> str:
    """This CPU's AVX and AMX extensions (the provenance.cpu_flags tag's), which choose the kernels a run takes."""
    from gspo_study.provenance import PREFIX, tags

    flags = tags("cpu", "fp32")[PREFIX + "cpu_flags"].split()
    return " ".join(f for f in flags if f.startswith(("avx", "amx"))) or "no avx"


def numbers(start: Path, results_dir: Path) -> dict:
    """This kernel path's entry: the libraries, and every run's numbers."""
    import transformers

    runs = {name: run_numbers(name, start, results_dir) for name in RUNS}
    return {"torch": torch.__version__, "transformers": transformers.__version__, "runs": runs}


def figure_labels() -> dict[str, list[str]]:
    """Per figure of experiments/figures.yaml, `<scale> <run> seed=<s> [<cell overrides>]` for its runs at every
    scale that has a base config and at which the figure is defined (a sweep without values for a scale is not),
    every sweep cell, seeds PINNED_SEEDS and the figure's own: the runs tests/test_identity.py pins."""
    from gspo_study.config import ConfigError
    from gspo_study.study import EXPERIMENTS, _items, figures

    scales = sorted(p.parent.name for p in EXPERIMENTS.glob("*/base.yaml"))
    labels: dict[str, list[str]] = {}
    for name, spec in figures().items():
        labels[name] = []
        for scale in scales:
            seeds = sorted({*PINNED_SEEDS, *spec.get("seeds", {}).get(scale, [])})
            try:
                items = _items(name.removeprefix("figure-"), scale, seeds)
            except ConfigError:  # no sweep cells at this scale: the figure is not drawn there
                continue
            labels[name] += [" ".join([scale, run, f"seed={seed}", *cell]) for cell, run, seed in items]
    return labels


def add_run_keys() -> int:
    """Pin the current key of every figure label without one; keys already pinned stay as they are."""
    from tests.test_identity import current_key

    keys = json.loads(RUN_KEYS.read_text())
    wanted = dict.fromkeys(label for labels in figure_labels().values() for label in labels)
    new = {label: current_key(label) for label in wanted if label not in keys}
    RUN_KEYS.write_text(json.dumps(dict(sorted({**keys, **new}.items())), indent=1) + "\n")
    print(f"{RUN_KEYS.relative_to(ROOT)}: {len(new)} keys added, {len(keys)} kept")
    return 0


def main(argv: list[str] | None = None) -> int:
    if "--run-keys" in (sys.argv[1:] if argv is None else argv):
        return add_run_keys()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        entry = numbers(coldstart(Path(tmp)), Path(tmp) / "runs")
    paths = json.loads(GOLDEN.read_text())["kernel_paths"] if GOLDEN.exists() else {}
    paths[kernel_path()] = entry
    GOLDEN.write_text(json.dumps({"kernel_paths": dict(sorted(paths.items()))}, indent=1) + "\n")
    print(f"wrote {GOLDEN.relative_to(ROOT)}: {len(RUNS)} runs x {STEPS} steps for kernel path {kernel_path()!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
