"""Synthetic multi-step addition with a chain of thought: the CPU-scale study's task.

Prompt `23+45+67=`; correct response `23+45=68,68+67=135#135` (≈ 23 tokens for 3 two-digit terms; each
extra term adds ≈ 9): a running sum written out step by step, then `#` and the final answer. Responses
are long enough for per-token ratio noise to add up over a sequence, as the paper's argument needs.

Reward rule: the text after the last `#` (end of sequence stripped) must be an integer literal equal to
the sum → 1.0. Anything else scores 0.0: a wrong sum, no `#`, an empty or non-integer answer, or a
truncated response (never reached `#`). The chain of thought itself is not graded.

Split: a problem belongs to the held-out split when a stable hash of its terms falls in the first 1/16;
training samples reject those, so train and eval never share a problem.
"""

from __future__ import annotations

import hashlib
import random
import re
from dataclasses import dataclass

from gspo_study.errors import ConfigError
from gspo_study.tasks.base import Problem

EVAL_SEED = 20250717  # fixed: the held-out list never depends on the run's seed
EVAL_SHARE = 16  # 1 problem in 16 is held out
_ANSWER = re.compile(r"-?\d+")


@dataclass
class ArithTask:
    num_terms: int = 3
    digits: int = 2
    name: str = "arith"

    @classmethod
    def from_config(cls, cfg) -> ArithTask:
        if cfg.num_terms < 2:
            raise ConfigError(f"bad value {cfg.num_terms} for 'task.num_terms'; allowed: an integer >= 2")
        if not 1 <= cfg.digits <= 6:
            raise ConfigError(f"bad value {cfg.digits} for 'task.digits'; allowed: an integer in [1, 6]")
        return cls(num_terms=cfg.num_terms, digits=cfg.digits)

    def _draw(self, rng: random.Random) -> tuple[int, ...]:
        lo, hi = 10 ** (self.digits - 1), 10**self.digits - 1
        return tuple(rng.randint(lo, hi) for _ in range(self.num_terms))

    @staticmethod
    def _held_out(terms: tuple[int, ...]) -> bool:
        digest = hashlib.sha256(",".join(map(str, terms)).encode()).digest()
        return digest[0] % EVAL_SHARE == 0

    def _problem(self, terms: tuple[int, ...]) -> Problem:
        return Problem(prompt="+".join(map(str, terms)) + "=", answer=str(sum(terms)), uid=",".join(map(str, terms)))

    def sample_train(self, n: int, rng: random.Random) -> list[Problem]:
        out = []
        while len(out) < n:
            terms = self._draw(rng)
            if not self._held_out(terms):
                out.append(self._problem(terms))
        return out

    def eval_problems(self, n: int) -> list[Problem]:
        space = (9 * 10 ** (self.digits - 1)) ** self.num_terms  # distinct problems
        if n > space:  # at once: the draws below would run 800·n times before saying so
            raise ConfigError(
                f"arith with {self.num_terms} terms of {self.digits} digits has only {space} distinct problems, so "
                f"fewer than {n} held-out problems; lower eval.num_prompts or raise task.digits"
            )
        rng, seen, out = random.Random(EVAL_SEED), set(), []
        drawn: set | None = set() if space <= 100_000 else None  # a small space is used up long before 800·n draws
        for _ in range(EVAL_SHARE * 50 * n + 10_000):
            if len(out) == n:
                return out
            terms = self._draw(rng)
            if self._held_out(terms) and terms not in seen:
                seen.add(terms)
                out.append(self._problem(terms))
            if drawn is not None:
                drawn.add(terms)
                if len(drawn) == space:  # every problem drawn: no held-out one is left to find
                    break
        if len(out) < n:
            raise ConfigError(
                f"arith with {self.num_terms} terms of {self.digits} digits has only about "
                f"{len(out)} held-out problems; lower eval.num_prompts or raise task.digits"
            )
        return out

    def sft_target(self, problem: Problem) -> str:
        terms = [int(t) for t in problem.uid.split(",")]
        steps, acc = [], terms[0]
        for t in terms[1:]:
            steps.append(f"{acc}+{t}={acc + t}")
            acc += t
        return ",".join(steps) + f"#{acc}"

    def reward(self, completion: str, problem: Problem) -> float:
        if "#" not in completion:
            return 0.0
        answer = completion.rsplit("#", 1)[1].strip()
        return 1.0 if _ANSWER.fullmatch(answer) and int(answer) == int(problem.answer) else 0.0
