"""Cold-start SFT: the paper's RL starts from a model fine-tuned on correct reasoning traces (§5.1).

Trains a fresh preset model (or a local checkpoint) with the token-mean cross-entropy of correct
responses, AdamW with linear warm-up and cosine decay to 10% of the peak lr, then saves a standard HF
checkpoint (atomically) with the tokenizer and a small JSON log. Deterministic for a seed on CPU.

One process at a time makes a cold start: an OS file lock on its path (under
`<temp dir>/gspo_study-locks-<user>/`, released when a holder dies) serialises `sft` and the sweeps that
train a missing cold start, which wait and then reuse the one made meanwhile (`ensure_coldstart`); holding
it, an SFT first clears what a killed save left (`.<name>.tmp-*`).
"""

from __future__ import annotations

import contextlib
import json
import math
import random
import time
from pathlib import Path

import torch
from tqdm import tqdm

from gspo_study.config import Config
from gspo_study.evaluate import sampled_pass1
from gspo_study.models import finish_interrupted_save, save_pretrained
from gspo_study.models.checkpoint import is_complete
from gspo_study.rollout.base import teacher_forced_batch
from gspo_study.run import MIN_FREE_BYTES, RunSetup, lock_file, probe_directory, require_model_path, resolve_run
from gspo_study.runtime import load_policy, seed_everything
from gspo_study.tasks import TaskDataError, get_task
from gspo_study.train.forward import token_logprobs


def lr_lambda(warmup: int, total: int, floor: float = 0.1):
    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total - warmup)
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return f


def sft_loss(model, batch) -> torch.Tensor:
    logprobs, _ = token_logprobs(model, batch.sequences, batch.attention_mask)
    mask = batch.response_mask
    return -torch.where(mask, logprobs, torch.zeros_like(logprobs)).sum() / mask.sum().clamp(min=1)


@contextlib.contextmanager
def coldstart_lock(run: RunSetup):
    """Held while this process makes the cold start `run.coldstart`; waits for another holder (a cold start takes
    minutes), saying so once."""
    from filelock import FileLock, Timeout

    out = run.coldstart
    lock = FileLock(lock_file(f"coldstart:{out.resolve()}"))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        print(f"waiting for another process making cold start {out}", flush=True)
        lock.acquire()
    try:
        finish_interrupted_save(out)  # what a killed save left; nobody else is saving it now
        yield out
    finally:
        lock.release()


def run_sft(cfg: Config) -> Path:
    """Train the cold-start model and return its checkpoint directory (replacing one already there)."""
    run = resolve_run(cfg)
    _preflight(run)
    with coldstart_lock(run):
        return _train(run)


def ensure_trained(cfg: Config) -> Path:
    """The cold start `cfg` describes, trained first if it is missing — once, whatever the number of processes
    asking at the same time: the others wait for it and reuse it."""
    run = resolve_run(cfg)
    if is_complete(run.coldstart):
        return run.coldstart
    _preflight(run)
    with coldstart_lock(run):
        if not is_complete(run.coldstart):
            print(f"cold-start checkpoint {run.coldstart} missing: training it", flush=True)
            _train(run)
    return run.coldstart


def _preflight(run: RunSetup) -> None:
    """Before minutes of training: the checkpoint can be written, and the task has SFT targets."""
    from gspo_study.runtime import training_device

    cfg = run.cfg
    training_device(cfg)  # a CUDA device torch does not see
    require_model_path(cfg)
    probe_directory(run.coldstart.parent, MIN_FREE_BYTES, "results_dir", cfg.results_dir)
    task = get_task(cfg.task)
    if any(task.sft_target(p) is None for p in task.sample_train(1, random.Random(cfg.seed))):
        raise TaskDataError(f"task {task.name!r} has no SFT targets (its records need a 'solution' field)")


def _train(run: RunSetup) -> Path:
    cfg = run.cfg
    seed_everything(cfg.seed, cfg.threads)
    task = get_task(cfg.task)
    model, tokenizer = load_policy(cfg, path=cfg.model.path)
    if cfg.model.path is not None:  # a preset override it does not have would be ignored
        from gspo_study.train.checkpointing import check_shape

        check_shape(cfg, model, Path(cfg.model.path))
    from gspo_study.train.memory import check_positions, check_step_fits, longest_prompt

    prompt_tokens = longest_prompt(task, tokenizer, 1)
    check_positions(cfg, model, prompt_tokens)
    check_step_fits(cfg, model, prompt_tokens, sft=True)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.sft.lr, weight_decay=cfg.sft.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg.sft.warmup_steps, cfg.sft.steps))
    rng, log, start = random.Random(cfg.seed), [], time.time()
    target = cfg.sft.target_pass1
    checks = task.sample_train(100, random.Random(cfg.seed + 10_000)) if target is not None else []
    model.train()
    bar = tqdm(range(cfg.sft.steps), desc="sft", dynamic_ncols=True)
    for step in bar:
        problems = task.sample_train(cfg.sft.batch_size, rng)
        targets = [task.sft_target(p) for p in problems]
        if any(t is None for t in targets):
            raise TaskDataError(f"task {task.name!r} has no SFT targets (its records need a 'solution' field)")
        loss = sft_loss(model, teacher_forced_batch(tokenizer, [p.prompt for p in problems], targets))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        log.append({"step": step, "loss": loss.item(), "seconds": time.time() - start})
        bar.set_postfix(loss=f"{loss.item():.3f}")
        if target is not None and (step + 1) % cfg.sft.check_every == 0:
            model.eval()
            with torch.no_grad():
                log[-1]["pass@1"] = sampled_pass1(
                    model, tokenizer, task, checks, 2, cfg.rollout.max_new_tokens, cfg.seed
                )
            model.train()
            if log[-1]["pass@1"] >= target:
                break
    out = run.coldstart
    meta = {
        "steps": len(log),
        "seed": cfg.seed,
        "seconds": time.time() - start,
        "final_loss": log[-1]["loss"] if log else None,
    }
    device = next(model.parameters()).device
    if device.type == "cuda":
        meta["device"], meta["peak_gpu_memory_gb"] = str(device), torch.cuda.max_memory_allocated(device) / 2**30
    save_pretrained(model, tokenizer, out, extra={"sft_log.json": {"meta": meta, "log": log}})
    print(json.dumps({"checkpoint": str(out), **meta}))
    return out
