"""Cold-start SFT (loss falls, deterministic, loadable) and evaluation on always-right / always-wrong policies."""

from __future__ import annotations

import json
from types import SimpleNamespace

import torch
from torch import nn

from gspo_study.config import load_config
from gspo_study.evaluate import evaluate
from gspo_study.models import build_char_tokenizer, build_model
from gspo_study.tasks.arith import ArithTask


def test_sft_loss_falls_and_is_deterministic(smoke_results, tmp_path):
    from gspo_study.sft import run_sft

    log = json.loads((smoke_results / "smoke/checkpoints/coldstart/sft_log.json").read_text())["log"]
    first, last = log[0]["loss"], log[-1]["loss"]
    assert last < 0.7 * first
    again = run_sft(load_config("experiments/smoke/base.yaml", [f"results_dir={tmp_path}"]))
    log2 = json.loads((again / "sft_log.json").read_text())["log"]
    assert [r["loss"] for r in log2] == [r["loss"] for r in log]


def test_sft_stops_at_target_pass1(smoke_results, tmp_path):
    """`sft.target_pass1`: training stops at the first check whose sampled pass@1 reaches the target, and the
    saved checkpoint records how many steps it took; the per-depth cold start lands in its own directory."""
    from gspo_study.sft import run_sft

    over = [
        f"results_dir={tmp_path}",
        "sft.target_pass1=0.0",
        "sft.check_every=7",
        "model.num_hidden_layers=1",
    ]
    out = run_sft(load_config("experiments/smoke/base.yaml", over))
    meta = json.loads((out / "sft_log.json").read_text())
    assert out.name == "coldstart-L1" and meta["meta"]["steps"] == 7 and len(meta["log"]) == 7
    assert "pass@1" in meta["log"][-1] and "pass@1" not in meta["log"][0]


class OraclePolicy(nn.Module):
    """A stand-in *policy* (not the thing under test): emits a fixed response per prompt, with KV-cache
    call semantics like a causal LM (prefill, then one token per call)."""

    def __init__(self, tokenizer, answer_fn):
        super().__init__()
        self.tok, self.answer_fn = tokenizer, answer_fn
        self.config = build_model("qwen3-moe-smoke", tokenizer, 0).config
        self.dummy = nn.Parameter(torch.zeros(1))
        self.plans, self.pos = [], 0

    def forward(self, input_ids, **kw):
        if input_ids.shape[1] > 1:  # prefill: plan each row's response
            prompts = [self.tok.decode(r, skip_special_tokens=True) for r in input_ids.tolist()]
            self.plans = [
                self.tok(self.answer_fn(p), add_special_tokens=False).input_ids + [self.tok.eos_token_id]
                for p in prompts
            ]
            self.pos = 0
        logits = torch.full((input_ids.shape[0], 1, len(self.tok)), -1e4)
        for i, plan in enumerate(self.plans):
            logits[i, 0, plan[min(self.pos, len(plan) - 1)]] = 1e4
        self.pos += 1
        return SimpleNamespace(logits=logits)


def test_eval_always_right_and_always_wrong():
    tok, task = build_char_tokenizer(), ArithTask(num_terms=3, digits=2)
    by_prompt = {p.prompt: p for p in task.eval_problems(12)}
    right = OraclePolicy(tok, lambda prompt: task.sft_target(by_prompt[prompt]))
    res = evaluate(right, tok, task, num_prompts=12, samples=3, max_new_tokens=40)
    assert res["pass@1"] == 1.0 and res["stderr"] == 0.0 and res["greedy"] == 1.0
    assert (res["n_prompts"], res["samples"]) == (12, 3)
    wrong = OraclePolicy(tok, lambda prompt: task.sft_target(by_prompt[prompt]) + "1")
    assert evaluate(wrong, tok, task, num_prompts=12, samples=3, max_new_tokens=40)["pass@1"] == 0.0
    truncated = OraclePolicy(tok, lambda prompt: task.sft_target(by_prompt[prompt]))
    assert evaluate(truncated, tok, task, num_prompts=12, samples=1, max_new_tokens=10)["pass@1"] == 0.0


def test_eval_cli_json(smoke_results, capsys):
    from gspo_study.cli import main

    ckpt = smoke_results / "smoke/checkpoints/coldstart"
    rc = main(
        [
            "eval",
            "--checkpoint",
            str(ckpt),
            "--task",
            "arith",
            "--samples",
            "2",
            "--json",
            "--config",
            "experiments/smoke/base.yaml",
        ]
    )
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0 and {"pass@1", "stderr", "n_prompts", "samples"} <= set(out) and out["samples"] == 2
    assert 0.0 <= out["pass@1"] <= 1.0


def test_eval_scale_honours_overrides(smoke_results, capsys):
    """`make coldstart SCALE=smoke OVERRIDES='results_dir=…'`: the cold start is looked up (and would be
    trained) under the overridden results dir, not under ./results."""
    import json

    from gspo_study.cli import main

    assert main(["eval", "--scale", "smoke", "--json", "--samples", "1", f"results_dir={smoke_results}"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["checkpoint"] == str(smoke_results / "smoke" / "checkpoints" / "coldstart")


def test_eval_of_a_run_checkpoint_uses_the_runs_own_config(smoke_cfg, capsys):
    """A run checkpoint carries its run's config: `eval --checkpoint` without `--config` evaluates it on the
    run's task and settings (here the smoke task), as `--config <the run's base>` does."""
    from gspo_study.cli import main
    from gspo_study.run import resolve_run
    from gspo_study.train.checkpointing import RUN_CONFIG
    from gspo_study.trainer import train

    cfg = smoke_cfg("train.steps=1", "eval.every=0", "task.digits=1")
    train(cfg)
    ckpt = str(resolve_run(cfg).dir / "checkpoint")
    assert load_config(f"{ckpt}/{RUN_CONFIG}") == cfg

    def run(*extra: str) -> dict:
        assert main(["eval", "--checkpoint", ckpt, "--json", "--samples", "2", *extra]) == 0
        return json.loads(capsys.readouterr().out.strip().splitlines()[-1])

    own = run()
    assert own == run("--config", "experiments/smoke/base.yaml", "task.digits=1")
    assert own["n_prompts"] == cfg.eval.num_prompts
