"""Will a job finish? Every size a run or command takes, against what the machine can hold and what it can do in a
stated time, checked before anything is tracked (a step's memory: `memory.check_step_fits`).

- hold: what a size keeps in memory at once — the held-out problems and each sample's result of an evaluation, the
  rows of a study archive — against the memory available (`memory.available_bytes`);
- do: a floor on the time of a job's phase — its FLOPs at the machine's peak rate (`peak_flops`), one forward per
  layer per generated token at `LAYER_FLOOR_S`, `PROBLEM_FLOOR_S` per held-out problem built — against
  `STATED_S` (30 days). Every term is optimistic (measured here: 5-10 ms per layer-step, 1.2 ms per arith problem),
  so a refusal is certain: the phase could not end in 30 days even at the machine's peak. A size that passes may
  still take long; SIGTERM stops it (gspo_study.stopping);
- count: what is pure host work before anything runs (a sweep's runs, an archive's rows) against fixed ceilings.
Each refusal is one line naming the field and the range allowed on this machine.
"""

from __future__ import annotations

import os

from gspo_study.errors import ConfigError
from gspo_study.train.memory import GIB, available_bytes

STATED_S = 30 * 86_400  # the time a phase must be able to end in, at the machine's peak
CPU_CORE_FLOPS = 256e9  # fp32 FLOP/s of one core at best: 2 AVX-512 FMA units × 16 lanes × 2 FLOPs × 4 GHz
GPU_FLOPS = 2.5e15  # above any GPU's dense bf16 peak (H200 0.99e15, B200 2.25e15)
LAYER_FLOOR_S = 50e-6  # one layer's forward: eager PyTorch launches tens of kernels per layer, each ≥ ~2 µs
PROBLEM_FLOOR_S = 10e-6  # building one held-out problem (arith: ~16 hashed draws; a math_file record: a dict)
PROBLEM_BYTES = 200  # one held-out problem in memory, at least (measured: 332 for an arith problem)
SAMPLE_BYTES = 12  # one evaluated sample: its row's reference (8) and its reward (4)
MAX_RUNS = 10_000  # runs one sweep or archive may name: planning resolves each run's config (~5-10 ms)


def peak_flops(device=None) -> float:
    """What this machine can compute per second at best: its CPU cores, or the GPU the model is on."""
    if device is not None and device.type == "cuda":
        return GPU_FLOPS
    return (os.cpu_count() or 1) * CPU_CORE_FLOPS


def _refuse(field: str, value: int, high: int, why: str, low: int = 1) -> None:
    if value > high:
        raise ConfigError(f"bad value {value} for '{field}'; allowed: an integer in [{low}, {max(high, low)}] ({why})")


def _days(seconds: float) -> str:
    return f"{seconds / 86_400:,.0f} days"


def sequence_seconds(tokens: int, new_tokens: int, batch: int, flops_per_token: float, layers: int, peak: float):
    """Floor on the seconds one generated sequence costs: its tokens' forward FLOPs at peak, plus its share of the
    batch's decode steps (one forward per layer per new token)."""
    return tokens * 2 * flops_per_token / peak + new_tokens * layers * LAYER_FLOOR_S / batch


def check_eval(cfg, model, evaluations: int = 1, available: float | None = None, peak: float | None = None) -> None:
    """`eval.num_prompts` and `eval.samples` (of a run's `evaluations` evaluations, or of the `eval` command): the
    held-out problems and every sample's result fit in memory, and the evaluations can end within STATED_S."""
    from gspo_study.models.presets import active_params

    e, device = cfg.eval, next(model.parameters()).device
    have = available_bytes() if available is None else available  # problems and results live on the host
    peak = peak_flops(device) if peak is None else peak
    seq_s = sequence_seconds(
        cfg.rollout.max_new_tokens, cfg.rollout.max_new_tokens, e.batch_size, active_params(model.config),
        model.config.num_hidden_layers, peak,
    )  # fmt: skip
    by_time = STATED_S / (evaluations * (seq_s + PROBLEM_FLOOR_S))  # sequences (and problems) per evaluation
    hold = f"{have / GIB:,.1f} GiB available"
    do = f"{evaluations} evaluation(s) within {_days(STATED_S)} at this machine's peak"
    prompts = int(min(have / (PROBLEM_BYTES + SAMPLE_BYTES), by_time))
    _refuse("eval.num_prompts", e.num_prompts, prompts, f"its problems and results in the {hold}, and {do}")
    samples = int(min((have - e.num_prompts * PROBLEM_BYTES) / SAMPLE_BYTES, by_time) // e.num_prompts)
    _refuse(
        "eval.samples", e.samples, samples, f"at eval.num_prompts={e.num_prompts}: its results in the {hold}, and {do}"
    )


def step_seconds(cfg, model, peak: float) -> float:
    """Floor on one RL step's seconds: generation, π_old and the updates' FLOPs at peak, one forward per layer per
    new token of the rollout."""
    from gspo_study.models.presets import active_params

    r = cfg.rollout
    tokens = r.group_size * r.prompts_per_step * r.max_new_tokens
    return (2 + 2 + 6) * active_params(model.config) * tokens / peak + r.max_new_tokens * (
        model.config.num_hidden_layers * LAYER_FLOOR_S
    )


def evaluations(cfg) -> int:
    """How many evaluations a run makes: at the start, every `eval.every` steps and at the end."""
    t, every = cfg.train.steps, cfg.eval.every
    return 1 + (t // every + (t % every != 0) if every else (t > 0))


def check_run(cfg, model, available: float | None = None, peak: float | None = None) -> None:
    """A run's sizes before it is tracked: `train.steps` can end within STATED_S, then its evaluations."""
    peak = peak_flops(next(model.parameters()).device) if peak is None else peak
    steps = int(STATED_S / step_seconds(cfg, model, peak))
    _refuse("train.steps", cfg.train.steps, steps, f"its steps within {_days(STATED_S)} at this machine's peak", 0)
    check_eval(cfg, model, evaluations(cfg), available, peak)


def check_sft(cfg, model, prompt_tokens: int, peak: float | None = None) -> None:
    """`sft.steps`: an SFT's steps (forward and backward of `sft.batch_size` traces) can end within STATED_S."""
    from gspo_study.models.presets import active_params

    peak = peak_flops(next(model.parameters()).device) if peak is None else peak
    tokens = cfg.sft.batch_size * (prompt_tokens + cfg.rollout.max_new_tokens)
    step_s = 6 * active_params(model.config) * tokens / peak + 3 * model.config.num_hidden_layers * LAYER_FLOOR_S
    steps = int(STATED_S / step_s)
    _refuse("sft.steps", cfg.sft.steps, steps, f"its steps within {_days(STATED_S)} at this machine's peak", 0)


def check_runs(what: str, runs: int, per_seed: int) -> None:
    """A sweep or an export naming `runs` runs (`per_seed` per seed): at most MAX_RUNS."""
    if runs > MAX_RUNS:
        raise ConfigError(
            f"bad SEEDS for {what}: {runs:,} runs ({per_seed} per seed); allowed: at most {MAX_RUNS // per_seed:,} "
            f"seeds ({MAX_RUNS:,} runs: planning resolves each run's config)"
        )


def check_archive(path, rows: int, data_bytes: int, available: float | None = None) -> None:
    """A study archive to import: at most MAX_RUNS rows, its data (uncompressed) within the memory available."""
    have = available_bytes() if available is None else available
    if rows > MAX_RUNS or data_bytes > have:
        raise ConfigError(
            f"study archive {path} holds {rows:,} runs and {data_bytes / GIB:,.1f} GiB of data uncompressed; "
            f"allowed: at most {MAX_RUNS:,} runs and the {have / GIB:,.1f} GiB this machine has available"
        )


EXPORT_METRICS = 30  # metrics every step of a run logs, at least (the trainer's required ones: 37)
EXPORT_POINT_BYTES = 100  # one metric value read back from MLflow, at least (a Metric object)


def check_export(configs: list, available: float | None = None) -> None:
    """An export of `configs`' runs: at most MAX_RUNS, their metric histories (read whole) in the memory available."""
    have = available_bytes() if available is None else available
    points = sum((cfg.train.steps + 1) * EXPORT_METRICS for cfg in configs)
    if len(configs) > MAX_RUNS or points * EXPORT_POINT_BYTES > have:
        raise ConfigError(
            f"export-study: {len(configs):,} runs holding at least {points:,} metric values "
            f"({points * EXPORT_POINT_BYTES / GIB:,.1f} GiB); allowed: at most {MAX_RUNS:,} runs whose histories fit "
            f"the {have / GIB:,.1f} GiB this machine has available (fewer --seeds or --figures)"
        )
