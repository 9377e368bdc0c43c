"""The shared trainer core: one loop runs every algorithm; runs differ only in their switches.

Each RL step:
  1. sample `prompts_per_step` prompts and G responses each from the rollout engine (R3 records routing);
  2. reward, group-normalised advantages;
  3. π_old: the training engine's log-probs (recording routing for R2; replaying the rollout's for R3),
     or the rollout engine's own (`algo.old_logprobs: rollout`, §5.4);
  4. split the batch into `num_minibatches` and update once per minibatch (update 1 is on-policy,
     the rest off-policy, as in §5.1), micro-batching with whole-minibatch denominators;
  5. telemetry: routing volatility of the updated policy vs π_old on the same rollout, the share of the
     importance log-ratio that is routing (what R2 removes), train–inference mismatch; then periodic
     evaluation, MLflow logging and checkpoints.

Every random draw is keyed by (seed, step, purpose), so for a seed every algorithm sees the same prompts
and sampling streams, and a resumed run needs no saved RNG state. Metric names and formulas:
docs/METRICS.md.
"""

from __future__ import annotations

import math
import os
import random
import signal
import time
from collections import defaultdict
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from tqdm import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from gspo_study import stopping
from gspo_study.config import Config, ConfigError, objective_hparams
from gspo_study.errors import NonFiniteError, Terminated
from gspo_study.evaluate import evaluate, score
from gspo_study.models.presets import active_params
from gspo_study.moe import (
    RouterOutputs,
    RoutingTrace,
    has_moe,
)
from gspo_study.objectives import combine_metrics, get_objective, group_advantages, zero_std_group_frac
from gspo_study.objectives.correction import correction_weights
from gspo_study.rollout import Perturbation, RolloutBatch, make_engine
from gspo_study.rollout.base import merge_batches
from gspo_study.run import RunSetup, check_start, resolve_run, run_lock
from gspo_study.runtime import derive_seed
from gspo_study.step import (
    Context,
    MinibatchResult,
    OldPolicy,
    StepInputs,
    cat_outputs,
    old_pass_trains,
    policy_pass,
    replay_mode,
    route_dose,
    routing_context,
)
from gspo_study.tasks import get_task
from gspo_study.telemetry import (
    objective_route,
    per_update_volatility,
    pooled_route,
    route_baseline,
    telemetry,
    telemetry_rows,
)
from gspo_study.tracking import NullTracker, Tracker
from gspo_study.train import make_backend
from gspo_study.train.checkpointing import RunState, load_run_checkpoint, save_run_checkpoint, settle_interrupted_save
from gspo_study.train.dist import gather
from gspo_study.train.forward import token_logprobs
from gspo_study.train.lag import SNAPSHOTS, PolicyLag
from gspo_study.train.memory import check_positions, check_step_fits, longest_prompt
from gspo_study.train.sizes import check_run


# ---------------------------------------------------------------------------------------------- phases
def sync_hooks(ctx: Context) -> dict:
    """How an engine gets whole weights under ZeRO-3: `gather` (every rank holds the whole model while inside;
    the in-process engines), and for an engine that writes them out (vllm_server) `full_state` (gathered layer
    by layer onto rank 0's CPU). The stale behaviour policy (policy lag, torch backend only) is whole anyway."""
    hooks = {"gather": ctx.backend.gathered_parameters}
    if ctx.engine.writes_weights and ctx.lag is None:
        hooks["full_state"] = ctx.backend.full_state_dict
    return hooks


def rollout(ctx: Context, step: int) -> tuple[list, RolloutBatch]:
    cfg = ctx.cfg
    problems = ctx.task.sample_train(
        cfg.rollout.prompts_per_step, random.Random(derive_seed(cfg.seed, step, "prompts"))
    )
    rows = [p for p in problems for _ in range(cfg.rollout.group_size)]
    ctx.engine.sync(ctx.behaviour, **sync_hooks(ctx))
    capture = records_rollout_routing(ctx)
    if not cfg.rollout.sharded:  # one random stream for the batch; every rank generates all of it
        gen = torch.Generator().manual_seed(derive_seed(cfg.seed, step, "rollout"))
        prompts = [p.prompt for p in rows]
        batch = ctx.engine.generate(
            prompts, cfg.rollout.max_new_tokens, cfg.rollout.temperature, gen, capture_routing=capture
        )
        return rows, batch
    # Sharded: rank r generates rows r·B/W … (r+1)·B/W − 1, response i from its own stream; then every rank
    # gets the whole batch (advantages need whole groups, the updates split minibatches again).
    mine = torch.arange(len(rows)).tensor_split(ctx.world)[ctx.rank].tolist()
    local = ctx.engine.generate(
        [rows[i].prompt for i in mine],
        cfg.rollout.max_new_tokens,
        cfg.rollout.temperature,
        capture_routing=capture,
        row_seeds=[derive_seed(cfg.seed, step, f"rollout/{i}") for i in mine],
    )
    return rows, merge_batches(gather(local, ctx.world), ctx.tokenizer.pad_token_id)


def records_rollout_routing(ctx: Context) -> bool:
    """Whether the rollout engine records each token's experts: for R3 (which replays them), and wherever the
    engine can do so at no cost to its tokens (the HF engine), for the train–inference routing telemetry."""
    if replay_mode(ctx.cfg).records_rollout:
        return True
    return ctx.engine.records_routing and has_moe(ctx.engine.model)


def old_policy(ctx: Context, batch: RolloutBatch, step: int = 0) -> OldPolicy:
    source = replay_mode(ctx.cfg).replays
    outputs: list[RouterOutputs] = []
    train_lp, natural = policy_pass(
        ctx,
        batch,
        batch.routing if source == "rollout" else None,
        ctx.behaviour,
        choose=route_dose(ctx, step, in_old=True),  # the sham's noise, else None
        outputs=outputs,
    )
    replay = {None: None, "old": natural, "rollout": batch.routing}[source]
    old_lp = batch.rollout_logprobs if ctx.cfg.algo.old_logprobs == "rollout" else train_lp
    return OldPolicy(old_lp, train_lp, natural, replay, cat_outputs(outputs)[1] if outputs else None)


def rollout_correction(
    cfg: Config, train_lp: torch.Tensor, batch: RolloutBatch
) -> tuple[torch.Tensor | None, dict[str, float]]:
    """The train–inference correction's per-token weights (π_old / μ, truncated or masked as
    `algo.rollout_correction` says) and its metrics; (None, {}) without one."""
    a = cfg.algo
    if a.rollout_correction == "none":
        return None, {}
    return correction_weights(
        old_logprobs=train_lp,
        rollout_logprobs=batch.rollout_logprobs,
        mask=batch.response_mask,
        mode=a.rollout_correction,
        cap=a.rollout_correction_cap,
        geo_cap=a.rollout_correction_geo_cap,
        icepop=(a.icepop_low, a.icepop_high),
    )


def learning_rate(cfg: Config, step: int) -> float:
    warm = cfg.train.warmup_steps
    return cfg.train.lr * (min(1.0, step / warm) if warm else 1.0)


def update_minibatch(
    ctx: Context, inputs: StepInputs, rows: torch.Tensor, lr: float, record: bool = False
) -> MinibatchResult:
    """One optimizer update on minibatch `rows` (`record`: keep the forward's natural routing, for the
    per-update volatility)."""
    batch, adv, old, weights = inputs.batch, inputs.advantages, inputs.old, inputs.weights
    mask = batch.response_mask
    normalizer = ctx.objective.batch_normalizer(mask[rows])  # the whole minibatch's count, on every rank
    local = rows[ctx.rank :: ctx.world]
    parts, ent_sum, traces, replayed, aux_sum = [], 0.0, [], 0, 0.0
    micros = local.split(ctx.cfg.train.micro_batch_size or len(local))
    coef = ctx.cfg.train.aux_loss_coef
    choose = route_dose(ctx, inputs.step)
    for i, micro in enumerate(micros):
        with routing_context(ctx.model, old.replay, micro, record, choose) as routed:
            aux = [] if coef > 0 else None
            lp, ent = token_logprobs(
                ctx.backend.train_module,
                batch.sequences[micro],
                batch.attention_mask[micro],
                ctx.cfg.rollout.temperature,
                with_entropy=True,
                aux_out=aux,
            )
            loss, metrics = ctx.objective(
                logprobs=lp,
                old_logprobs=old.logprobs[micro],
                advantages=adv[micro],
                mask=mask[micro],
                normalizer=normalizer,
                weights=None if weights is None else weights[micro],
            )
            if aux:  # each micro-batch's load-balance loss, weighted by its share of the minibatch's rows
                loss = loss + coef * aux[0] * (len(micro) / len(rows))
                aux_sum += aux[0].item() * len(micro)
            ctx.backend.backward(loss, last=i == len(micros) - 1)
        if record:
            traces.append(routed.natural if old.replay is not None else routed)
        replayed += getattr(routed, "replayed_calls", 0)  # the replay handle's count; 0 without one
        parts.append(metrics)
        ent_sum += torch.where(mask[micro], ent, torch.zeros_like(ent)).sum().item()
    seen = objective_route(ctx, inputs, local) if ctx.cfg.telemetry.update_route else None  # before the step
    grad_norm = ctx.backend.step(lr)
    everyone = gather((parts, ent_sum, aux_sum), ctx.world)
    parts, ent_sum = [p for ps, _, _ in everyone for p in ps], sum(e for _, e, _ in everyone)
    aux_loss = sum(a for _, _, a in everyone) / len(rows) if coef > 0 else None
    routing = RoutingTrace.cat(traces) if traces else None
    return MinibatchResult(
        combine_metrics(parts), grad_norm, ent_sum, mask[rows].sum().item(), local, routing, replayed, seen, aux_loss
    )


OnUpdate = Callable[[StepInputs, int, MinibatchResult], None]


def update(ctx: Context, inputs: StepInputs, step: int, on_update: OnUpdate | None = None) -> dict[str, float]:
    """`num_minibatches` updates over a seeded permutation of the batch (with π_old's natural routing, the second
    update's forward also measures the routing volatility after one update). `on_update(inputs, i, result)` is
    called after update i, for a caller that reads the policy between updates (the GPU check: routing volatility
    after every update); it must leave the model, its gradients and every random stream as it found them."""
    cfg, batch, weights, natural_old = ctx.cfg, inputs.batch, inputs.weights, inputs.old.natural
    perm = torch.randperm(len(batch), generator=torch.Generator().manual_seed(derive_seed(cfg.seed, step, "minibatch")))
    sums, out, norms, seen = defaultdict(float), {}, [], []
    ent_sum = ent_tokens = 0.0
    lr = learning_rate(cfg, step)
    for i, rows in enumerate(perm.chunk(cfg.train.num_minibatches)):
        if i:  # between two updates: a stop asked now stops here where that loses no finished step (the step in
            stopping.stop_point()  # progress is redone from its start on resume, with the same numbers)
        record = i == 1 and natural_old is not None
        res = update_minibatch(ctx, inputs, rows, lr, record=record)
        if on_update is not None:
            on_update(inputs, i, res)
        metrics, norm = res.metrics, res.grad_norm
        ent_sum, ent_tokens = ent_sum + res.entropy_sum, ent_tokens + res.tokens
        if record:
            out.update(per_update_volatility(natural_old, res, batch.response_mask))
        out[f"policy/clip_frac/token/mb_{i}"] = metrics["policy/clip_frac/token"]
        out[f"policy/kl/k3/mb_{i}"] = metrics["policy/kl/k3"]  # the first (on-policy) update's against the rest
        if res.aux_loss is not None:
            sums["moe/aux_loss"] += res.aux_loss / cfg.train.num_minibatches
        if res.seen is not None:
            seen.append(res.seen)
            out.update({f"moe/route_obj/mb_{i}/{k}": res.seen[k] for k in ("flips", "r2_removed_share", "total_var")})
        if weights is not None:  # fixed for the step: minibatch i's share of the masked tokens
            m = batch.response_mask[rows]
            dropped = (m & (weights[rows] == 0)).sum().item()
            out[f"correction/masked_frac/token/mb_{i}"] = dropped / max(m.sum().item(), 1)
        for k, v in metrics.items():
            sums[k] += v / cfg.train.num_minibatches
        norms.append(norm)
        ctx.state.note_update(norm)
        if ctx.state.nonfinite_streak >= cfg.train.max_nonfinite_updates:
            raise NonFiniteError(
                f"{ctx.state.nonfinite_streak} consecutive updates had a non-finite loss or gradient "
                f"(train.max_nonfinite_updates={cfg.train.max_nonfinite_updates}); lower train.lr"
            )
    finite = [n for n in norms if n == n and abs(n) != float("inf")]
    out.update(sums)
    out.update(pooled_route(seen))
    out.update(
        {
            "train/grad_norm": sum(finite) / len(finite) if finite else float("nan"),
            "train/lr": lr,
            "train/entropy": ent_sum / max(ent_tokens, 1.0),
            "train/nonfinite_skipped": float(ctx.state.nonfinite_total),
        }
    )
    return out


def rollout_metrics(cfg: Config, rewards: torch.Tensor, batch: RolloutBatch) -> dict[str, float]:
    lengths = batch.response_lengths.float()
    return {
        "rollout/reward/mean": rewards.mean().item(),
        "rollout/reward/std": rewards.std().item() if len(rewards) > 1 else 0.0,
        "rollout/zero_std_group_frac": zero_std_group_frac(rewards, cfg.rollout.group_size),
        "rollout/response_len/mean": lengths.mean().item(),
        "rollout/response_len/max": lengths.max().item(),
        "rollout/truncated_frac": batch.truncated.float().mean().item(),
    }


def compute_metrics(ctx: Context, batch: RolloutBatch, seconds: float) -> dict[str, float]:
    """compute/flops: 2·N_active per token for generation and the π_old pass (when it is training compute,
    `old_pass_trains`), 6·N_active per token for the updates (forward + backward), counting the non-pad tokens
    fed. Telemetry is not counted."""
    fed = batch.attention_mask[:, :-1].sum().item()
    passes = 2 + (2 if old_pass_trains(ctx.cfg) else 0) + 6
    ctx.state.flops += passes * ctx.flops_per_token * fed
    ctx.state.seconds += seconds
    out = {
        "compute/flops": ctx.state.flops,
        "compute/seconds": ctx.state.seconds,
        "perf/tokens_per_s": batch.response_lengths.sum().item() / max(seconds, 1e-9),
    }
    device = next(ctx.model.parameters()).device
    if device.type == "cuda":  # the process's peak so far (the GPU check reads it; no CPU counterpart is logged)
        out["perf/peak_gpu_memory_gb"] = torch.cuda.max_memory_allocated(device) / 2**30
    return out


class Stopwatch:
    """Wall seconds of a step's phases; `training_seconds` sums the spans that are training compute, so telemetry
    is left out of `compute/seconds` by construction. A span is also the phase a stop names (`stopping.phase`)."""

    def __init__(self):
        self.spans: dict[str, float] = {}
        self.diagnostic: set[str] = set()

    @contextmanager
    def span(self, name: str, training: bool = True):
        start = time.time()
        try:
            with stopping.phase(name):
                yield
        finally:
            self.spans[name] = self.spans.get(name, 0.0) + time.time() - start
            if not training:
                self.diagnostic.add(name)

    def training_seconds(self) -> float:
        return sum(s for name, s in self.spans.items() if name not in self.diagnostic)


def rl_step(
    ctx: Context, step: int, on_update: OnUpdate | None = None, watch: Stopwatch | None = None
) -> dict[str, float]:
    """One step as its five phases (module docstring); compute_metrics counts the training spans only.
    `on_update`: see `update`; `watch`: the caller's Stopwatch, to read the phases' seconds (a benchmark)."""
    watch = Stopwatch() if watch is None else watch
    with watch.span("rollout"):
        if ctx.lag is not None:
            ctx.lag.advance(ctx.model)
        rows, batch = rollout(ctx, step)
        rewards, reward_errors = score(ctx.task, rows, batch)
        adv = group_advantages(rewards, ctx.cfg.rollout.group_size, ctx.cfg.algo.advantage_eps)
    with watch.span("old_policy", training=old_pass_trains(ctx.cfg)):  # else it only feeds telemetry
        old = old_policy(ctx, batch, step)
    with watch.span("route_baseline", training=False):
        baseline = route_baseline(ctx, batch, old)
    with watch.span("update"):
        metrics = rollout_metrics(ctx.cfg, rewards, batch)
        metrics["rollout/reward_errors"] = float(reward_errors)
        weights, correction = rollout_correction(ctx.cfg, old.train_logprobs, batch)
        metrics.update(correction)
        rows_read = telemetry_rows(ctx, len(batch), step)
        inputs = StepInputs(batch, adv, old, weights, baseline, step, rows_read)
        metrics.update(update(ctx, inputs, step, on_update))
    with watch.span("telemetry", training=False):
        metrics.update(telemetry(ctx, inputs, step))
    metrics.update(compute_metrics(ctx, batch, watch.training_seconds()))
    ctx.samples_text = [
        f"[{r:.0f}] {p.prompt}{t!r}" for p, t, r in zip(rows[:16], batch.response_texts, rewards.tolist())
    ]
    return metrics


@stopping.phase("evaluation")
def eval_metrics(ctx: Context) -> dict[str, float]:
    cfg = ctx.cfg
    res = evaluate(
        ctx.model,
        ctx.tokenizer,
        ctx.task,
        cfg.eval.num_prompts,
        cfg.eval.samples,
        cfg.rollout.max_new_tokens,
        seed=derive_seed(cfg.seed, 0, "eval"),
        batch_size=cfg.eval.batch_size,
        temperature=cfg.rollout.temperature,
        greedy=False,
    )
    return {"eval/pass@1": res["pass@1"], "eval/pass@1_stderr": res["stderr"]}


# ------------------------------------------------------------------------------------------------ loop
def setup(run: RunSetup, mlflow_run_id: str | None = None, logged_upto: int | None = None) -> Context:
    """Build everything a run needs, from its checkpoint or its start; every bad input fails here, before the run
    is tracked."""
    cfg = run.cfg
    torch.manual_seed(cfg.seed)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    model, tokenizer, state, optim_state = load_run_checkpoint(run, mlflow_run_id, logged_upto)
    return build_context(run, model, tokenizer, state, optim_state)


def build_context(
    run: RunSetup,
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    state: RunState | None = None,
    optim_state: dict | None = None,
) -> Context:
    """The run's Context around a model in memory, on its device (`setup` loads it; the GPU check builds its own):
    the task, the checks that refuse a step that cannot work, the training backend (with the optimizer state to
    resume), the rollout engine and the objective."""
    cfg, state = run.cfg, RunState() if state is None else state
    task = get_task(cfg.task)
    check_run(cfg, model)  # train.steps and eval.* against this machine, before any problem is built
    task.eval_problems(cfg.eval.num_prompts)  # a task with fewer held-out problems fails here, not at step 0
    prompt_tokens = longest_prompt(task, tokenizer, cfg.eval.num_prompts)
    check_positions(cfg, model, prompt_tokens)  # prompt + response within the model's positions
    check_step_fits(cfg, model, prompt_tokens)  # before the run is tracked: a step that cannot fit is refused
    if replay_mode(cfg).replays is not None and not has_moe(model):
        raise ConfigError(
            f"algo.routing_replay={cfg.algo.routing_replay!r} needs a model with MoE layers; this model has "
            "none (allowed here: routing_replay=none)"
        )
    rank, world, backend = make_backend(cfg, model)
    if backend.sharded and state.step > 0:  # deepspeed: every rank reads its ZeRO partition
        if state.zero_tag:
            backend.load_sharded(run.dir / "zero", state.zero_tag)
        else:
            backend.load_state_dict(None)  # a checkpoint from before ZeRO state was saved: fresh optimizer
    elif optim_state is not None:
        backend.load_state_dict(optim_state)
    r = cfg.rollout
    lag = None
    if r.policy_lag:  # a resumed run takes the stale weights its checkpoint kept
        saved = PolicyLag.load(run.checkpoint / SNAPSHOTS) if state.step > 0 else []
        lag = PolicyLag(model, r.policy_lag, saved)
    behaviour = model if lag is None else lag.model
    engine = make_engine(
        r.engine,
        behaviour,
        tokenizer,
        r.dtype,
        r.vllm_gpu_memory_utilization,
        r.server,
        run.dir / "server-weights",
        Perturbation.from_config(r),
    )
    objective = get_objective(cfg.algo.objective, cfg.algo.aggregation, **objective_hparams(cfg))
    return Context(
        run=run,
        cfg=cfg,
        model=model,
        tokenizer=tokenizer,
        task=task,
        engine=engine,
        objective=objective,
        backend=backend,
        tracker=None,
        state=state,
        flops_per_token=float(active_params(model.config)),
        rank=rank,
        world=world,
        lag=lag,
    )


def _fault_injection(step: int) -> None:
    """Tests of resume set GSPO_STUDY_KILL_AT_STEP=N: the process SIGKILLs itself after logging step N."""
    if os.environ.get("GSPO_STUDY_KILL_AT_STEP") == str(step):
        os.kill(os.getpid(), signal.SIGKILL)


def _stop_asked(ctx: Context) -> bool:
    """Whether any rank got SIGTERM (every rank must stop at the same step: the checkpoint is collective)."""
    mine = stopping.asked()
    return any(gather(mine, ctx.world)) if ctx.world > 1 else mine


def _due(step: int, every: int, last: int) -> bool:
    return step == last or (every > 0 and step % every == 0)


def train(cfg: Config) -> dict[str, float]:
    """Run (or resume, or skip if finished) the run this config describes; returns the last metrics. One
    process at a time per run (`run_lock`); SIGTERM stops it early, resumable (`gspo_study.stopping`)."""
    run = resolve_run(cfg)
    with run_lock(run), stopping.on_sigterm() as job:
        ctx = open_run(run)
        return {} if ctx is None else loop(ctx, job)


def open_run(run: RunSetup) -> Context | None:
    """The run ready for its next step: what a killed save left settled, its start checked, its MLflow run found
    or created, everything a step needs built. None when its MLflow run has already finished."""
    settle_interrupted_save(run)
    origin = check_start(run)
    # Every rank finds the run (its id names the checkpoint to resume); rank 0 creates it if there is none.
    tracker = Tracker.open(run, create=False, origin=origin)
    if tracker is not None and tracker.finished():
        print(f"run {tracker.run_id} ({run.dir.name}) already finished; skipping")
        return None
    ctx = setup(run, *((tracker.run_id, tracker.logged_upto) if tracker is not None else (None, None)))
    if ctx.rank == 0 and tracker is not None:  # resuming
        tracker.log_missing_params(run)
    opened = (tracker or Tracker.open(run, origin=origin, model=ctx.model)) if ctx.rank == 0 else None
    ctx.tracker = opened or NullTracker()
    return ctx


def loop(ctx: Context, job: stopping.Job | None = None) -> dict[str, float]:
    """The run's steps from the one after its checkpoint to `train.steps`: each logged, checkpointed when due, and
    stopped early when `job` (`stopping.on_sigterm`) is asked to stop; the MLflow run ends FINISHED, KILLED (a stop,
    SIGINT) or FAILED."""
    run, tracker = ctx.run, ctx.tracker
    metrics: dict[str, float] = {}
    try:
        metrics = _steps(ctx, job or stopping.Job(grace=math.inf))
    except BaseException as exc:
        tracker.set_status("KILLED" if isinstance(exc, (KeyboardInterrupt, Terminated)) else "FAILED")
        raise
    finally:
        ctx.engine.close()  # a vllm_server pool the run started stops with it
    tracker.set_status("FINISHED")
    if ctx.rank == 0 and "eval/pass@1" in metrics:
        print(
            f"{run.dir.name}: step {ctx.state.step}, held-out pass@1 {metrics['eval/pass@1']:.3f}; "
            f"MLflow run {tracker.run_id} in {run.store}"
        )
    return metrics


# Phases that leave the weights (and the optimizer) as the last finished step left them.
BEFORE_UPDATES = ("rollout", "old_policy", "route_baseline")


@dataclass
class Progress:
    """Where the loop is, for a stop: the step in progress (0: the start's evaluation), the checkpoint on disk."""

    step: int
    saved: int


def _steps(ctx: Context, job: stopping.Job) -> dict[str, float]:
    cfg, run, tracker = ctx.cfg, ctx.run, ctx.tracker
    at = Progress(step=0, saved=ctx.state.step)  # the checkpoint resumed (or the start: nothing to lose)
    # A stop point stops at once where that loses no finished step: anywhere in the step after the checkpointed
    # one, or before the updates (the last step is then checkpointed first); elsewhere the step ends first.
    job.free = lambda: at.saved == ctx.state.step or (ctx.lag is None and stopping.current_phase() in BEFORE_UPDATES)
    job.agree = (lambda mine: any(gather(mine, ctx.world))) if ctx.world > 1 else (lambda mine: mine)
    metrics: dict[str, float] = {}
    try:
        if ctx.state.step == 0:
            metrics = eval_metrics(ctx)
            with stopping.uncut():
                tracker.log_step(0, metrics)
            _fault_injection(0)
        bar = tqdm(
            range(ctx.state.step + 1, cfg.train.steps + 1),
            desc=run.dir.name,
            dynamic_ncols=True,
            initial=ctx.state.step,
            total=cfg.train.steps,
        )
        for step in bar:
            at.step = step
            metrics = rl_step(ctx, step)
            if _due(step, cfg.eval.every, cfg.train.steps):
                metrics.update(eval_metrics(ctx))
            with stopping.uncut():  # the grace never cuts a step's record or its checkpoint
                tracker.log_step(step, metrics)
                ctx.state.step = step
                if _due(step, cfg.tracking.log_samples_every, cfg.train.steps):
                    tracker.log_text("\n".join(ctx.samples_text), f"samples/step_{step:05d}.txt")
                if _due(step, cfg.train.checkpoint_every, cfg.train.steps):
                    save_run_checkpoint(ctx)
                    at.saved = step
            _fault_injection(step)
            if step < cfg.train.steps and _stop_asked(ctx):  # a safe point: the step is logged
                stopping.settle()
                if at.saved != step:
                    save_run_checkpoint(ctx)
                raise Terminated(
                    f"SIGTERM: {run.dir.name} stopped after step {step} of {cfg.train.steps}, checkpointed, "
                    "marked KILLED; rerun the same command to resume"
                )
            bar.set_postfix(
                reward=f"{metrics['rollout/reward/mean']:.3f}",
                clip=f"{metrics['policy/clip_frac/token']:.4f}",
            )
    except stopping.Stop as stop:
        raise _stopped_inside(ctx, stop, at) from None
    return metrics


def _stopped_inside(ctx: Context, stop: stopping.Stop, at: Progress) -> Terminated:
    """A stop inside a step (or the start's evaluation). Before the step's updates, or once the step is logged, the
    weights are the last finished step's: they are checkpointed, unless the grace ran out on one rank of several
    (a checkpoint is collective). Otherwise the checkpoint on disk stands and the rerun redoes the steps since,
    logging each once."""
    done = ctx.state.step
    logged = at.step == done  # the step in progress is logged (or none began): its weights are finished ones
    before = stop.phase in BEFORE_UPDATES and ctx.lag is None  # a stale policy has moved on at the rollout
    if at.saved < done and (logged or before) and (not stop.late or ctx.world == 1):
        save_run_checkpoint(ctx)
        at.saved = done
    if not stop.phase:
        where = f"the end of step {done}" if logged and done else "its setup"
    else:
        where = f"step {at.step}'s {stop.phase}" if at.step else f"the start's {stop.phase}"
    how = f"the {stop.grace:g} s grace ran out" if stop.late else "at a stop point"
    if done == 0:
        kept = "no step finished yet"
    elif at.saved == done:
        kept = f"checkpointed at step {done}"
    else:
        redo = f"the rerun redoes steps {at.saved + 1}-{done}, logging each once"
        kept = f"its checkpoint of step {at.saved} stands ({redo})"
    return Terminated(
        f"SIGTERM: {ctx.run.dir.name} stopped inside {where} ({how}), {kept}, marked KILLED; rerun the same "
        "command to resume"
    )
