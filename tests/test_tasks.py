"""Tasks: rewards for correct, wrong and malformed answers; disjoint splits; dataset file errors."""

from __future__ import annotations

import json
import random

import pytest

from gspo_study.config import TaskConfig
from gspo_study.tasks import TaskDataError, get_task
from gspo_study.tasks.arith import ArithTask


def test_arith_reward_and_targets():
    task = ArithTask(num_terms=3, digits=2)
    p = task.sample_train(1, random.Random(0))[0]
    target = task.sft_target(p)
    assert target.endswith("#" + p.answer) and 20 <= len(target) <= 60
    assert task.reward(target, p) == 1.0
    assert task.reward(target.replace("#" + p.answer, "#" + str(int(p.answer) + 1)), p) == 0.0  # wrong
    for malformed in ("", "no answer", target.split("#")[0], target + "x", target.rsplit("#", 1)[0] + "#"):
        assert task.reward(malformed, p) == 0.0


def test_arith_splits_disjoint_and_deterministic():
    task = ArithTask(num_terms=3, digits=2)
    held = {p.uid for p in task.eval_problems(300)}
    assert len(held) == 300 and held == {p.uid for p in task.eval_problems(300)}
    train = {p.uid for p in task.sample_train(20000, random.Random(1))}
    assert not held & train
    assert [p.uid for p in task.sample_train(5, random.Random(3))] == [
        p.uid for p in task.sample_train(5, random.Random(3))
    ]


def test_arith_difficulty_configurable():
    hard = get_task(TaskConfig(name="arith", num_terms=5, digits=3))
    p = hard.eval_problems(1)[0]
    assert p.prompt.count("+") == 4 and hard.reward(hard.sft_target(p), p) == 1.0


def _write(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return path


def test_math_file_reward_with_math_verify(tmp_path):
    recs = [json.dumps({"prompt": f"What is {i}*2?", "answer": str(2 * i)}) for i in range(6)]
    cfg = TaskConfig(name="math_file", path=str(_write(tmp_path / "d.jsonl", recs)), num_eval=2)
    task = get_task(cfg)
    p = task.eval_problems(2)[0]
    assert p.prompt == "What is 4*2?"
    assert task.reward("so the answer is $\\boxed{8}$", p) == 1.0
    assert task.reward("the answer is 9", p) == 0.0
    assert task.reward("", p) == 0.0 and task.reward("\\frac{", p) == 0.0  # malformed scores 0
    assert {q.uid for q in task.sample_train(50, random.Random(0))}.isdisjoint({q.uid for q in task.eval_problems(2)})


def test_math_file_parquet(tmp_path):
    import pandas as pd

    pd.DataFrame({"prompt": ["1+1?", "2+2?", "3+3?"], "answer": ["2", "4", "6"]}).to_parquet(tmp_path / "d.parquet")
    task = get_task(TaskConfig(name="math_file", path=str(tmp_path / "d.parquet"), num_eval=1))
    assert task.eval_problems(1)[0].answer == "6"


@pytest.mark.parametrize(
    "lines, fragment",
    [
        (['{"prompt": "a", "answer": "1"}', "{not json"], "d.jsonl:2: malformed JSON"),
        (['{"prompt": "a"}'], "d.jsonl:1: record has no 'answer'"),
        (['{"prompt": "", "answer": "1"}'], "d.jsonl:1: 'prompt' must be a non-empty string"),
        (["[1, 2]"], "d.jsonl:1: record must be an object"),
    ],
)
def test_math_file_malformed_records(tmp_path, lines, fragment):
    path = _write(tmp_path / "d.jsonl", lines)
    with pytest.raises(TaskDataError, match=fragment.replace("(", r"\(")):
        get_task(TaskConfig(name="math_file", path=str(path), num_eval=0))


def test_math_file_missing(tmp_path):
    with pytest.raises(TaskDataError, match="dataset file not found"):
        get_task(TaskConfig(name="math_file", path=str(tmp_path / "none.jsonl")))
