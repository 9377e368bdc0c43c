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
import hashlib
import json
import math
import random
import shutil
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from gspo_study import stopping
from gspo_study.config import Config, to_flat_dict
from gspo_study.errors import Terminated
from gspo_study.evaluate import sampled_pass1
from gspo_study.models import finish_interrupted_save, load_pretrained, save_pretrained
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
        finish_interrupted_save(partial_path(out))  # and a stopped SFT's state (`partial_path`)
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
    partial = partial_path(run.coldstart)
    resumed = _load_partial(cfg, partial)  # a stopped SFT of this recipe goes on where it stopped
    model, tokenizer = resumed[:2] if resumed else load_policy(cfg, path=cfg.model.path)
    if cfg.model.path is not None:  # a preset override it does not have would be ignored
        from gspo_study.train.checkpointing import check_shape

        check_shape(cfg, model, Path(cfg.model.path))
    from gspo_study.train.memory import check_positions, check_step_fits, longest_prompt
    from gspo_study.train.sizes import check_sft

    prompt_tokens = longest_prompt(task, tokenizer, 1)
    check_positions(cfg, model, prompt_tokens)
    check_step_fits(cfg, model, prompt_tokens, sft=True)
    check_sft(cfg, model, prompt_tokens)  # sft.steps within the stated time
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.sft.lr, weight_decay=cfg.sft.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg.sft.warmup_steps, cfg.sft.steps))
    progress = Progress(step=0, log=[], rng=random.Random(cfg.seed))
    if resumed:
        progress = _restore(resumed[2], opt, sched)
    with stopping.on_sigterm(), stopping.phase("SFT"):
        try:
            _steps(cfg, task, model, tokenizer, opt, sched, progress)
        except stopping.Stop as stop:
            raise _stopped(run, model, tokenizer, opt, sched, progress, stop) from None
    out = run.coldstart
    log = progress.log
    meta = {
        "steps": len(log),
        "seed": cfg.seed,
        "seconds": progress.seconds,
        "final_loss": log[-1]["loss"] if log else None,
    }
    device = next(model.parameters()).device
    if device.type == "cuda":
        meta["device"], meta["peak_gpu_memory_gb"] = str(device), torch.cuda.max_memory_allocated(device) / 2**30
    save_pretrained(model, tokenizer, out, extra={"sft_log.json": {"meta": meta, "log": log}})
    shutil.rmtree(partial, ignore_errors=True)  # after the cold start is whole: a kill in between resumes to it
    print(json.dumps({"checkpoint": str(out), **meta}))
    return out


@dataclass
class Progress:
    """An SFT's position: optimizer steps done, their log, the problem sampler, wall seconds so far."""

    step: int
    log: list[dict]
    rng: random.Random
    seconds: float = 0.0


def _steps(cfg: Config, task, model, tokenizer, opt, sched, progress: Progress) -> None:
    """Train from `progress` to `sft.steps` (or until `sft.target_pass1`); a stop point after every step."""
    target = cfg.sft.target_pass1
    checks = task.sample_train(100, random.Random(cfg.seed + 10_000)) if target is not None else []
    start = time.time() - progress.seconds
    model.train()
    if _check_pending(cfg, progress) and _check(cfg, model, tokenizer, task, checks, progress) >= target:
        return
    steps = range(progress.step, cfg.sft.steps)
    bar = tqdm(steps, desc="sft", dynamic_ncols=True, initial=progress.step, total=cfg.sft.steps)
    for step in bar:
        with stopping.phase("SFT step"):  # the weights and optimizer are between two states inside
            problems = task.sample_train(cfg.sft.batch_size, progress.rng)
            targets = [task.sft_target(p) for p in problems]
            if any(t is None for t in targets):
                raise TaskDataError(f"task {task.name!r} has no SFT targets (its records need a 'solution' field)")
            loss = sft_loss(model, teacher_forced_batch(tokenizer, [p.prompt for p in problems], targets))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            progress.seconds = time.time() - start
            progress.log.append({"step": step, "loss": loss.item(), "seconds": progress.seconds})
            progress.step = step + 1
        bar.set_postfix(loss=f"{loss.item():.3f}")
        stopping.stop_point()
        if _check_pending(cfg, progress) and _check(cfg, model, tokenizer, task, checks, progress) >= target:
            break
    progress.seconds = time.time() - start


def _check_pending(cfg: Config, progress: Progress) -> bool:
    """Whether the last step's `sft.target_pass1` check is due and not made yet (a stop may come between)."""
    due = cfg.sft.target_pass1 is not None and progress.step > 0 and progress.step % cfg.sft.check_every == 0
    return due and "pass@1" not in progress.log[-1]


@stopping.phase("SFT check")
def _check(cfg: Config, model, tokenizer, task, checks, progress: Progress) -> float:
    model.eval()
    with torch.no_grad():
        pass1 = sampled_pass1(model, tokenizer, task, checks, 2, cfg.rollout.max_new_tokens, cfg.seed)
    model.train()
    progress.log[-1]["pass@1"] = pass1
    return pass1


# ------------------------------------------------------------------------------------------- stop and resume
SFT_STATE, SFT_OPTIM = "sft_state.json", "sft_optimizer.pt"


def partial_path(coldstart: Path) -> Path:
    """Where a stopped SFT keeps its state: `<cold start>.partial`, beside the cold start it is making."""
    return coldstart.with_name(f"{coldstart.name}.partial")


def recipe(cfg: Config) -> str:
    """What an SFT's numbers depend on (seed, model, task, sft.*, the check's response length): a stopped SFT
    resumes only into the same recipe. Like a run's identity, not the thread count."""
    flat = to_flat_dict(cfg)
    keep = {
        k: v
        for k, v in flat.items()
        if k.split(".")[0] in ("seed", "model", "task", "sft") or k == "rollout.max_new_tokens"
    }
    return hashlib.sha256(json.dumps(keep, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _stopped(run: RunSetup, model, tokenizer, opt, sched, progress: Progress, stop) -> Terminated:
    """Save a stopped SFT's state (weights, optimizer, scheduler, samplers, log) unless the stop cut a step in two,
    in which case the state saved before stands; the Terminated that says which."""
    cfg, partial = run.cfg, partial_path(run.coldstart)
    if stop.phase != "SFT step" and progress.step > 0:
        state = {
            "recipe": recipe(cfg),
            "step": progress.step,
            "log": progress.log,
            "rng": [progress.rng.getstate()[0], list(progress.rng.getstate()[1]), progress.rng.getstate()[2]],
            "seconds": progress.seconds,
        }
        optim = {"optimizer": opt.state_dict(), "scheduler": sched.state_dict(), "torch_rng": torch.get_rng_state()}
        save_pretrained(model, tokenizer, partial, extra={SFT_STATE: state, SFT_OPTIM: optim})
        kept = f"its state after step {progress.step} saved in {partial}"
    elif partial.exists():
        kept = f"the state saved before in {partial} stands"
    else:
        kept = "nothing saved yet (the rerun starts it again)"
    how = f"the {stop.grace:g} s grace ran out" if stop.late else "at a stop point"
    return Terminated(
        f"SIGTERM: the SFT of {run.coldstart.name} stopped inside its {stop.phase or 'setup'} ({how}) at step "
        f"{progress.step} of {cfg.sft.steps}, {kept}; rerun the same command to resume"
    )


def _load_partial(cfg: Config, partial: Path):
    """(model, tokenizer, state) of a stopped SFT of this recipe at `partial`, else None (a partial state of
    another recipe, or damaged, is skipped with a warning and the SFT starts over)."""
    if not partial.exists():
        return None
    from gspo_study.runtime import DTYPES, place

    try:
        state = json.loads((partial / SFT_STATE).read_text())
        if state.get("recipe") != recipe(cfg):
            warnings.warn(f"{partial} is the state of another SFT recipe; starting over", stacklevel=2)
            return None
        model, tokenizer = load_pretrained(
            partial, dtype=DTYPES[cfg.model.dtype], experts_implementation=cfg.model.experts_implementation
        )  # verified against its manifest first
        state["optim"] = torch.load(partial / SFT_OPTIM, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any unreadable state is skipped, never half-loaded
        warnings.warn(
            f"skipping unreadable SFT state {partial} ({type(exc).__name__}: {exc}); starting over", stacklevel=2
        )
        return None
    return place(cfg, model), tokenizer, state


def _restore(state: dict, opt, sched) -> Progress:
    opt.load_state_dict(state["optim"]["optimizer"])
    sched.load_state_dict(state["optim"]["scheduler"])
    torch.set_rng_state(state["optim"]["torch_rng"])
    rng = random.Random()
    version, internal, gauss = state["rng"]
    rng.setstate((version, tuple(internal), gauss))
    return Progress(step=state["step"], log=state["log"], rng=rng, seconds=state["seconds"])
