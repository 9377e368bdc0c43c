"""The gpu scale's sizes, from its configs (experiments/gpu/ and experiments/figures.yaml): per figure, its runs and
RL steps, the suite's own peak-memory estimate of its largest step (`gspo_study.train.memory.estimate`, the
arithmetic every run is checked with before it is tracked), and an estimated time on one GPU.

    python -m benchmarks.gpu_scale            # prints the table
    python -m benchmarks.gpu_scale --write    # rewrites docs/SCALE.md's gpu-scale block (tests/test_gpu_scale.py)

The time is an estimate, not a measurement (no GPU has been lent to this project): RL steps × SECONDS_PER_STEP
plus evaluations × SECONDS_PER_EVAL, both assumed for the 48-layer miniature on one H200, where the step is
bound by kernel launches (48 layers × ~15 kernels per forward, 40 decode steps per rollout), not by FLOPs. The
GPU check's `suite` part measures seconds per step at this scale: replace SECONDS_PER_STEP with it.
"""

from __future__ import annotations

import argparse
import functools
import math
import re
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
BEGIN, END = "<!-- gpu-scale:begin (python -m benchmarks.gpu_scale --write) -->", "<!-- gpu-scale:end -->"
DOC = ROOT / "docs" / "SCALE.md"


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
    for name in figures():
        figure = name.removeprefix("figure-")
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


def block(data: list[dict]) -> str:
    return f"{BEGIN}\n{table(data)}\n{END}"


def written() -> str:
    """The block docs/SCALE.md holds now."""
    text = DOC.read_text()
    found = re.search(re.escape(BEGIN) + r".*?" + re.escape(END), text, re.S)
    return found[0] if found else ""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--write", action="store_true", help="rewrite docs/SCALE.md's block")
    args = p.parse_args(argv)
    new = block(rows())
    if not args.write:
        print(new)
        return 0
    old = written()
    if not old:
        print(f"error: {DOC} has no {BEGIN} … {END} block", file=sys.stderr)
        return 2
    DOC.write_text(DOC.read_text().replace(old, new))
    return 0


if __name__ == "__main__":
    sys.exit(main())
