"""The gpu scale's sizes, from its configs (experiments/gpu/ and experiments/figures.yaml): per figure, its runs and
RL steps, the suite's own peak-memory estimate of its largest step (`gspo_study.train.memory.estimate`, the
arithmetic every run is checked with before it is tracked), and an estimated time on one GPU.

    python -m benchmarks.gpu_scale            # prints the table and the model's sizes

docs/GPU.md's `gpu-scale` and `gpu-model` blocks are this script's `table` and `model_sizes`, written there by
`python -m analysis.doc_blocks` with the docs' other numbers (tests/test_gpu_scale.py fails when they are stale).

The time is an estimate, not a measurement (no GPU has been lent to this project): RL steps × SECONDS_PER_STEP
plus evaluations × SECONDS_PER_EVAL, both assumed for the 48-layer miniature on one H200, where the step is
bound by kernel launches (48 layers × ~15 kernels per forward, 40 decode steps per rollout), not by FLOPs. The
GPU check's `suite` part measures seconds per step at this scale: replace SECONDS_PER_STEP with it.
"""

from __future__ import annotations

import argparse
import functools
import math
import sys
from pathlib import Path

import torch

from gspo_study.models import build_char_tokenizer, build_model
from gspo_study.run import run_key
from gspo_study.study import figure_configs, figures, parse_seeds
from gspo_study.tasks import get_task
from gspo_study.train.memory import GIB, Shapes, estimate, longest_prompt

ROOT = Path(__file__).resolve().parents[1]

SECONDS_PER_STEP = 1.5  # assumed: one RL step of the gpu base (64 prompts × 8, 40 new tokens) on one H200
SECONDS_PER_EVAL_BATCH = 0.6  # assumed: 40 decode steps of one evaluation batch
STATE_BYTES = 4 + 4 + 8 + 2  # per parameter: fp32 weights, gradients, AdamW's two moments, the bf16 engine copy
MODEL = "qwen3-moe-mini"  # the gpu scale's preset (experiments/gpu/base.yaml)


@functools.cache
def model_of(preset: str, layers: int | None):
    """The model without its weights (built on the meta device)."""
    with torch.device("meta"):
        return build_model(preset, build_char_tokenizer(), 0, num_hidden_layers=layers)


_PROMPTS: dict[str, int] = {}


def prompt_tokens(task, eval_prompts: int) -> int:
    """The longest prompt's tokens (a task config is not hashable: cached by its text)."""
    key = f"{task!r}/{eval_prompts}"
    if key not in _PROMPTS:
        _PROMPTS[key] = longest_prompt(get_task(task), build_char_tokenizer(), eval_prompts)
    return _PROMPTS[key]


def rows() -> list[dict]:
    out = []
    for name, spec in figures().items():
        figure = name.removeprefix("figure-")
        if spec.get("sweep") and "gpu" not in spec["sweep"]:
            continue  # not defined at the gpu scale (the routing frontier's doses are calibrated per scale)
        configs = {run_key(c): c for _, c in figure_configs(figure, "gpu", parse_seeds(None, "gpu", figure))}
        peak, seconds = 0.0, 0.0
        for cfg in configs.values():
            model = model_of(cfg.model.preset, cfg.model.num_hidden_layers)
            peak = max(peak, estimate(cfg, Shapes.of(model), prompt_tokens(cfg.task, cfg.eval.num_prompts))["peak"])
            evals = cfg.train.steps // cfg.eval.every + 2 if cfg.eval.every else 2
            batches = math.ceil(cfg.eval.num_prompts * cfg.eval.samples / cfg.eval.batch_size)
            seconds += cfg.train.steps * SECONDS_PER_STEP + evals * batches * SECONDS_PER_EVAL_BATCH
        steps = sum(c.train.steps for c in configs.values())
        out.append(dict(figure=figure, runs=len(configs), steps=steps, peak_gib=peak / GIB, hours=seconds / 3600))
    return out


def table(data: list[dict]) -> str:
    lines = [
        "| figure | runs | RL steps | estimated peak memory of its largest step | estimated time on one H200 |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in data:
        lines.append(f"| {r['figure']} | {r['runs']} | {r['steps']:,} | {r['peak_gib']:.1f} GiB | {r['hours']:.1f} h |")
    return "\n".join(lines)


def model_sizes(preset: str = MODEL) -> str:
    """The model's shape and sizes, and its training state, in two sentences (docs/GPU.md's `gpu-model` block)."""
    from gspo_study.models.presets import active_params

    model = model_of(preset, None)
    c, total = model.config, sum(p.numel() for p in model.parameters())
    lag = 8
    return (
        f"`{preset}`: {c.num_hidden_layers} layers, {c.num_experts} experts, top-{c.num_experts_per_tok}, hidden size "
        f"{c.hidden_size}; {total / 1e6:.0f} M parameters, {active_params(c) / 1e6:.1f} M of them active per token. "
        f"Its training state at {STATE_BYTES} B per parameter (fp32 weights 4 B, gradients 4 B, AdamW's two moments "
        f"8 B, the bf16 engine copy 2 B) is {STATE_BYTES * total / 1e9:.1f} GB; a policy lag of k adds k + 2 fp32 "
        f"copies, {(lag + 2) * 4 * total / 1e9:.1f} GB more at k = {lag}."
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.parse_args(argv)
    print(table(rows()))
    print(model_sizes())
    return 0


if __name__ == "__main__":
    sys.exit(main())
