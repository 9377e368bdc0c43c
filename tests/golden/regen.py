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
from the smoke scale's cold start (`run_sft` of experiments/smoke/base.yaml).

The numbers are computed in a child process whose kernels are forced to one instruction set (`FORCED`: ATen's
AVX2 kernels, MKL's reproducible SSE2 branch, oneDNN off) rather than the CPU's own best kernels, whose numbers
differ by machine (docs/RELIABILITY.md); the child trains its own smoke cold start under the same forcing. A CPU
without AVX2 skips the test.

The forcing does not give one set of numbers on every CPU: on 2026-12-05 an Intel Xeon (AVX-512-BF16, AMX) moved
772 of the numbers an AMD EPYC pinned, under the same forcing, torch, transformers and MKL. So the file keeps one
entry per CPU vendor (`vendor()`: /proc/cpuinfo's vendor_id), and a vendor without one skips, naming the command
that adds it. Within a vendor the forced numbers are expected to hold across its CPUs (not measured beyond the
machines the entries came from).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from gspo_study.tracking import WALL_CLOCK

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = Path(__file__).with_name("numbers.json")
RUN_KEYS = Path(__file__).with_name("run_keys.json")
PINNED_SEEDS = (1, 2, 3, 4, 5)  # every scale's default seeds and more; a figure's own `seeds:` are added
SMOKE = ROOT / "experiments" / "smoke" / "base.yaml"
STEPS = 2
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
    "dppo_tv_r3": ("dppo_r3", []),  # DPPO-Binary-TV + KL against μ, R3
    "dppo_kl_aux": (
        "dppo",
        [
            "algo.objective=dppo_kl",
            "algo.hparams.mask_low=0.05",
            "algo.hparams.mask_high=0.05",
            "algo.hparams.kl_tau=0",
            "train.aux_loss_coef=0.001",
        ],
    ),  # DPPO-Binary-KL, load-balance loss
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


# The kernels the pinned numbers are computed with, whatever the CPU, set in the child's environment before torch
# loads. Each was measured on an AVX-512-BF16 CPU (docs/LOG.md): ATen's and MKL's settings each move the numbers
# there, and the child gives the same numbers run after run.
FORCED = {
    "ATEN_CPU_CAPABILITY": "avx2",  # ATen's own kernels (DispatchStub): their AVX2 + FMA build, on any CPU
    # MKL's BLAS (every fp32 matmul) on its Conditional Numerical Reproducibility branch meant to give the same bits
    # on any Intel or compatible CPU (SSE2). The MKL torch links here reads the other branch names (AVX2, AVX512) as
    # AUTO, the CPU's own branch, and ignores MKL_ENABLE_INSTRUCTIONS: neither would pin anything.
    "MKL_CBWR": "COMPATIBLE",
    "ONEDNN_MAX_CPU_ISA": "AVX2",  # should anything reach oneDNN (the child turns torch's use of it off)
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
}
NO_AVX2 = "this CPU lacks AVX2 or FMA, the instructions of the kernels the golden numbers are pinned on"


def vendor() -> str:
    """The key of this CPU's entry in numbers.json."""
    from gspo_study.provenance import cpu_vendor

    return cpu_vendor()


def has_avx2() -> bool:
    """Whether this CPU has AVX2 and FMA, what ATen's AVX2 kernels need. Asked before the child starts: torch takes
    ATEN_CPU_CAPABILITY at its word, so on a CPU without them the child would die of an illegal instruction."""
    from gspo_study.provenance import PREFIX, tags

    return {"avx2", "fma"} <= set(tags("cpu", "fp32")[PREFIX + "cpu_flags"].split())


def numbers(start: Path, results_dir: Path) -> dict:
    """The libraries and BLAS, and every run's numbers, computed in this process."""
    from gspo_study.provenance import PREFIX, tags

    runs = {name: run_numbers(name, start, results_dir) for name in RUNS}
    lib = tags("cpu", "fp32")
    return {key: lib[PREFIX + key] for key in ("torch", "transformers", "blas")} | {"runs": runs}


def forced_child(out: Path) -> int:
    """The child's side (`--forced-child OUT`), under `FORCED` and with oneDNN off: train the smoke cold start, then
    the pinned runs; their numbers to `out`."""
    if torch.backends.cpu.get_cpu_capability() != "AVX2":  # a torch built without AVX2 kernels
        print(f"ATen runs {torch.backends.cpu.get_cpu_capability()} kernels here, not AVX2", file=sys.stderr)
        return 1
    # a bf16 matmul takes oneDNN's AVX-512-BF16 kernel where the CPU has one and MKL's elsewhere: MKL's everywhere
    torch.backends.mkldnn.enabled = False
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        entry = numbers(coldstart(Path(tmp)), Path(tmp) / "runs")
    out.write_text(json.dumps(entry))
    return 0


def forced_numbers(timeout: float = 600) -> dict | None:
    """The pinned runs' numbers (`numbers`) from a child process under `FORCED`; None on a CPU without AVX2."""
    if not has_avx2():
        return None
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "numbers.json"
        child = subprocess.run(
            [sys.executable, "-m", "tests.golden.regen", "--forced-child", str(out)],
            cwd=ROOT,
            env={**os.environ, **FORCED},
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if child.returncode != 0:
            tail = " | ".join(child.stderr.strip().splitlines()[-3:])
            raise RuntimeError(f"the golden runs' child process failed (exit {child.returncode}): {tail}")
        return json.loads(out.read_text())


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
    args = sys.argv[1:] if argv is None else argv
    if "--run-keys" in args:
        return add_run_keys()
    if "--forced-child" in args:
        return forced_child(Path(args[args.index("--forced-child") + 1]))
    entry = forced_numbers()
    if entry is None:
        print(f"not written: {NO_AVX2}", file=sys.stderr)
        return 1
    before = json.loads(GOLDEN.read_text()) if GOLDEN.is_file() else {}
    kept = before.get("by_vendor", {}) if before.get("forced") == FORCED else {}  # another forcing: none apply
    here = vendor()
    GOLDEN.write_text(json.dumps({"forced": FORCED, "by_vendor": {**kept, here: entry}}, indent=1) + "\n")
    print(f"wrote {GOLDEN.relative_to(ROOT)}: {here}'s entry, {len(RUNS)} runs x {STEPS} steps under {FORCED}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
