"""Held-out evaluation: mean pass@1 over K samples per prompt (the paper's avg@K) and greedy accuracy.

pass@1 = mean over prompts of (correct samples / K); its standard error is the standard deviation of the
per-prompt means divided by √(number of prompts). Truncated responses score 0.
"""

from __future__ import annotations

import math

import torch

from gspo_study import stopping
from gspo_study.rollout.hf import HFEngine


def safe_reward(task, text: str, problem) -> tuple[float, bool]:
    """(reward, raised): a reward function that raises scores 0 and is counted, never crashes a run."""
    try:
        return float(task.reward(text, problem)), False
    except Exception:  # noqa: BLE001 - user reward code may raise anything
        return 0.0, True


def score(task, problems, batch) -> tuple[torch.Tensor, int]:
    """(rewards [B], number of reward calls that raised) for a rollout batch whose row i answers
    `problems[i]`; truncated rows score 0."""
    out = [
        (0.0, False) if bool(cut) else safe_reward(task, text, p)
        for text, p, cut in zip(batch.response_texts, problems, batch.truncated)
    ]
    return torch.tensor([r for r, _ in out], dtype=torch.float32), sum(e for _, e in out)


def _rewards(engine, task, problems, samples, max_new_tokens, batch_size, generator, greedy, temperature=1.0):
    rows = [p for p in problems for _ in range(samples)]
    out = []
    for start in range(0, len(rows), batch_size):
        stopping.stop_point()  # between batches: a job asked to stop need not wait for the whole evaluation
        chunk = rows[start : start + batch_size]
        batch = engine.generate([p.prompt for p in chunk], max_new_tokens, temperature, generator, greedy=greedy)
        out.append(score(task, chunk, batch)[0])
    return torch.cat(out).view(len(problems), samples)


def sampled_pass1(model, tokenizer, task, problems, samples: int, max_new_tokens: int, seed: int = 0) -> float:
    """Mean pass@1 of `samples` temperature-1 samples per problem (no greedy pass)."""
    gen = torch.Generator().manual_seed(seed)
    engine = HFEngine(model, tokenizer)
    return _rewards(engine, task, problems, samples, max_new_tokens, 256, gen, False).mean().item()


def evaluate(
    model,
    tokenizer,
    task,
    num_prompts: int,
    samples: int,
    max_new_tokens: int,
    seed: int = 0,
    batch_size: int = 256,
    temperature: float = 1.0,
    greedy: bool = True,
) -> dict:
    """`{"pass@1", "stderr", "n_prompts", "samples", "greedy"}` on the task's held-out prompts."""
    problems = task.eval_problems(num_prompts)
    engine = HFEngine(model, tokenizer)
    gen = torch.Generator().manual_seed(seed)
    rewards = _rewards(engine, task, problems, samples, max_new_tokens, batch_size, gen, False, temperature)
    per_prompt = rewards.mean(1)
    n = len(problems)
    stderr = per_prompt.std(unbiased=True).item() / math.sqrt(n) if n > 1 else float("nan")
    result = {"pass@1": per_prompt.mean().item(), "stderr": stderr, "n_prompts": n, "samples": samples}
    if greedy:
        result["greedy"] = (
            _rewards(engine, task, problems, 1, max_new_tokens, batch_size, gen, greedy=True).mean().item()
        )
    return result
