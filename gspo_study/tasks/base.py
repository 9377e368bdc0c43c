"""The task protocol shared by every task."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Protocol


class TaskDataError(ValueError):
    """A missing or malformed dataset file or record; the message names the file and line."""


@dataclass(frozen=True)
class Problem:
    prompt: str  # text shown to the model
    answer: str  # reference final answer
    uid: str  # stable identifier (used to keep train and eval disjoint)


class Task(Protocol):
    name: str

    def sample_train(self, n: int, rng: random.Random) -> list[Problem]: ...

    def eval_problems(self, n: int) -> list[Problem]: ...

    def reward(self, completion: str, problem: Problem) -> float: ...

    def sft_target(self, problem: Problem) -> str | None: ...
