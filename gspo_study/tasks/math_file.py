"""Math problems from a local JSONL or Parquet file, scored with `math-verify` (paper scale: DAPO-Math, AIME'24).

Records are `{"prompt": str, "answer": str}` (an optional `"solution"` is used as the SFT target). The
held-out split is `eval_path` when given, otherwise the last `num_eval` records of `path`.

Reward rule: `math_verify.verify(parse(answer), parse(completion))` → 1.0, else 0.0; a completion that
cannot be parsed, or a verifier error or timeout, scores 0.0. Nothing is downloaded.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path

from gspo_study.tasks.base import Problem, TaskDataError

REQUIRED = ("prompt", "answer")


def _check_record(rec: object, where: str) -> dict:
    if not isinstance(rec, dict):
        raise TaskDataError(f"{where}: record must be an object with keys {REQUIRED}, got {type(rec).__name__}")
    for key in REQUIRED:
        if key not in rec:
            raise TaskDataError(f"{where}: record has no '{key}' (keys: {', '.join(map(str, rec))})")
        if not isinstance(rec[key], (str, int, float)) or str(rec[key]).strip() == "":
            raise TaskDataError(f"{where}: '{key}' must be a non-empty string, got {rec[key]!r}")
    return rec


def read_records(path: str | Path) -> list[dict]:
    """Validated records from a .jsonl or .parquet file; errors name the file and line (or row)."""
    path = Path(path)
    if not path.is_file():
        raise TaskDataError(f"dataset file not found: {path}")
    if path.suffix == ".parquet":
        import pandas as pd

        try:
            frame = pd.read_parquet(path)
        except Exception as exc:  # noqa: BLE001 - pyarrow raises many types
            raise TaskDataError(f"{path}: not a readable Parquet file ({type(exc).__name__})") from None
        return [_check_record(r, f"{path}: row {i}") for i, r in enumerate(frame.to_dict("records"))]
    if path.suffix not in (".jsonl", ".json"):
        raise TaskDataError(f"{path}: unsupported dataset format {path.suffix!r}; allowed: .jsonl, .parquet")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise TaskDataError(f"{path}: not UTF-8 text (bad byte at offset {exc.start})") from None
    records = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as exc:
            raise TaskDataError(f"{path}:{lineno}: malformed JSON ({exc.msg})") from None
        records.append(_check_record(rec, f"{path}:{lineno}"))
    if not records:
        raise TaskDataError(f"{path}: no records")
    return records


@dataclass
class MathFileTask:
    train: list[dict]
    held_out: list[dict]
    template: str = "{prompt}"
    name: str = "math_file"
    _problems: dict = field(default_factory=dict, repr=False)

    @classmethod
    def from_config(cls, cfg) -> MathFileTask:
        if not cfg.path:
            raise TaskDataError("task 'math_file' needs 'task.path' (a local .jsonl or .parquet file)")
        records = read_records(cfg.path)
        if cfg.eval_path:
            return cls(records, read_records(cfg.eval_path), cfg.prompt_template)
        if len(records) <= cfg.num_eval:
            raise TaskDataError(
                f"{cfg.path}: {len(records)} records cannot hold out task.num_eval={cfg.num_eval}; "
                "lower it or set task.eval_path"
            )
        return cls(records[: -cfg.num_eval], records[-cfg.num_eval :], cfg.prompt_template)

    def _problem(self, rec: dict, uid: str) -> Problem:
        return Problem(prompt=self.template.format(prompt=rec["prompt"]), answer=str(rec["answer"]), uid=uid)

    def sample_train(self, n: int, rng: random.Random) -> list[Problem]:
        idx = [rng.randrange(len(self.train)) for _ in range(n)]
        return [self._problem(self.train[i], f"train-{i}") for i in idx]

    def eval_problems(self, n: int) -> list[Problem]:
        if n > len(self.held_out):
            raise TaskDataError(
                f"eval.num_prompts={n} but the task has {len(self.held_out)} held-out problems; lower eval.num_prompts"
            )
        return [self._problem(r, f"eval-{i}") for i, r in enumerate(self.held_out[:n])]

    def sft_target(self, problem: Problem) -> str | None:
        kind, i = problem.uid.split("-")
        rec = (self.train if kind == "train" else self.held_out)[int(i)]
        return rec.get("solution")

    def reward(self, completion: str, problem: Problem) -> float:
        from math_verify import parse, verify

        try:
            gold = parse(problem.answer if "$" in problem.answer else f"${problem.answer}$")
            pred = parse(completion)
            return 1.0 if pred and verify(gold, pred) else 0.0
        except Exception:  # noqa: BLE001 - a verifier failure is a wrong answer, never a crash
            return 0.0
