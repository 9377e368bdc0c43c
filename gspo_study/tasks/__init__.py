"""Verifiable tasks: prompts, reference answers, reward functions and held-out evaluation splits.

A task is registered by name in `TASKS` and built from a `TaskConfig` with `get_task`. Every task gives
  - `sample_train(n, rng)`: n training problems (disjoint from the evaluation split),
  - `eval_problems(n)`: a fixed held-out list,
  - `reward(completion, problem)`: 1.0 correct / 0.0 otherwise (malformed answers score 0),
  - `sft_target(problem)`: a correct response for cold-start SFT (None when the task has none).
"""

from __future__ import annotations

from collections.abc import Callable

from gspo_study.tasks.arith import ArithTask
from gspo_study.tasks.base import Problem, Task, TaskDataError
from gspo_study.tasks.math_file import MathFileTask

TASKS: dict[str, Callable[..., Task]] = {
    "arith": ArithTask.from_config,
    "math_file": MathFileTask.from_config,
}


def get_task(cfg) -> Task:
    """Build the task named by `cfg.name` (a `TaskConfig`)."""
    if cfg.name not in TASKS:
        raise ValueError(f"unknown task {cfg.name!r}; allowed: {', '.join(sorted(TASKS))}")
    return TASKS[cfg.name](cfg)


__all__ = ["TASKS", "get_task", "Problem", "Task", "TaskDataError", "ArithTask", "MathFileTask"]
