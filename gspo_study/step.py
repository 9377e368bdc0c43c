"""What every phase of an RL step shares (`gspo_study.trainer` runs the phases, `gspo_study.telemetry` reads them):
the run's `Context`, the records a step passes between its phases (`OldPolicy`, `StepInputs`, `MinibatchResult`), the
no-grad policy pass over a batch (`policy_pass`, natural, replayed or axis R's noisy routing), and the routing an
update forward takes (`routing_context`: R2 / R3 replay, axis R's dose, or free; `route_dose`)."""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from gspo_study import stopping
from gspo_study.config import Config
from gspo_study.moe import (
    REPLAY_MODES,
    NoisyChoice,
    ReplayMode,
    RouterOutputs,
    RoutingTrace,
    has_moe,
    noisy_routing,
    record_router_outputs,
    record_routing,
    replay_routing,
)
from gspo_study.objectives import Objective
from gspo_study.rollout import RolloutBatch
from gspo_study.rollout.base import RolloutEngine
from gspo_study.run import RunSetup
from gspo_study.runtime import derive_seed
from gspo_study.tasks.base import Task
from gspo_study.tracking import Tracker
from gspo_study.train import TrainingBackend
from gspo_study.train.checkpointing import RunState
from gspo_study.train.forward import token_logprobs
from gspo_study.train.lag import PolicyLag


@dataclass
class Context:
    """Everything a step needs; built once per run."""

    run: RunSetup
    cfg: Config
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    task: Task
    engine: RolloutEngine
    objective: Objective
    backend: TrainingBackend
    tracker: Tracker | None
    state: RunState
    flops_per_token: float
    rank: int = 0  # this process's rank (deepspeed backend); rank 0 logs and checkpoints
    world: int = 1
    samples_text: list[str] = field(default_factory=list)
    lag: PolicyLag | None = None  # rollout.policy_lag > 0: the stale behaviour policy

    @property
    def behaviour(self):
        """The policy that generates the rollout and gives π_old: the trainer's model, or its stale copy."""
        return self.model if self.lag is None else self.lag.model


def chunks(n: int, size: int | None) -> list[torch.Tensor]:
    return list(torch.arange(n).split(size or n))


@torch.no_grad()
def policy_pass(
    ctx: Context,
    batch: RolloutBatch,
    replay: RoutingTrace | None,
    model=None,
    choose: Callable[[torch.Tensor], NoisyChoice | None] | None = None,
    outputs: list[RouterOutputs] | None = None,
) -> tuple[torch.Tensor, RoutingTrace | None]:
    """Log-probs of the whole batch under `model` (default: the current policy; no grad) and its routing (None for a
    model without MoE layers): natural, or chosen by `choose(rows)` (axis R's noisy choice) where it gives one.
    `outputs`: a list that gets each micro-batch's router outputs (`RouterOutputs`, `cat_outputs` joins them)."""
    model = ctx.model if model is None else model
    lps, traces = [], []
    moe = has_moe(model)
    for rows in chunks(len(batch), ctx.cfg.train.micro_batch_size):
        stopping.stop_point()  # between micro-batches: a stop asked now need not wait for the pass to end
        with ExitStack() as stack:
            if outputs is not None and moe:
                outputs.append(stack.enter_context(record_router_outputs(model)))
            if replay is None:
                choice = choose(rows) if choose is not None else None
                if choice is not None:
                    stack.enter_context(noisy_routing(model, choice))
                trace = stack.enter_context(record_routing(model)) if moe else None
                lp, _ = token_logprobs(
                    model, batch.sequences[rows], batch.attention_mask[rows], ctx.cfg.rollout.temperature
                )
            else:
                handle = stack.enter_context(replay_routing(model, replay.select(rows), record_natural=True))
                lp, _ = token_logprobs(
                    model, batch.sequences[rows], batch.attention_mask[rows], ctx.cfg.rollout.temperature
                )
                trace = handle.natural
        lps.append(lp)
        traces.append(trace)
    return torch.cat(lps), RoutingTrace.cat(traces) if moe else None


def cat_outputs(outputs: list[RouterOutputs]) -> tuple[dict[int, torch.Tensor], RoutingTrace]:
    """Micro-batches' router outputs joined along the batch: (logits per layer [B, T, E], gate weights [B, T, k])."""
    logits = {layer: torch.cat([o.logits[layer] for o in outputs]) for layer in outputs[0].logits}
    return logits, RoutingTrace.cat(o.gates for o in outputs)


def route_dose(ctx: Context, step: int, in_old: bool = False) -> Callable[[torch.Tensor], NoisyChoice] | None:
    """Axis R (`train.route_noise`, `train.route_random`): the noisy top-k choice for a forward over rows of step
    `step`'s batch, or None where the forward routes clean. π_θ's update forwards take it; π_old's pass (`in_old`)
    only under the sham (`train.route_sham`). A token's draw is keyed by (seed, step, row, layer), so a row draws the
    same noise in every forward of its step, whatever else shares the forward."""
    t, seed = ctx.cfg.train, ctx.cfg.seed
    if not (t.route_noise > 0 or t.route_random) or (in_old and not t.route_sham):
        return None
    sigma = math.inf if t.route_random else t.route_noise

    def draw(row: int, layer: int, seq: int, experts: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(derive_seed(seed, step, f"route_noise/{row}/{layer}"))
        return torch.randn(seq, experts, generator=gen)

    return lambda rows: NoisyChoice(sigma, rows, draw)


def replay_mode(cfg: Config) -> ReplayMode:
    return REPLAY_MODES[cfg.algo.routing_replay]


def old_pass_trains(cfg: Config) -> bool:
    """Whether the π_old forward is training compute: its log-probs are the objective's π_old, or its routing is
    replayed (R2). Otherwise (rollout log-probs without R2) it only feeds telemetry: the train–inference mismatch
    and π_old's routing for the volatility metric."""
    return cfg.algo.old_logprobs == "recompute" or replay_mode(cfg).old_pass_trains


@dataclass
class OldPolicy:
    """π_old of one step (from `old_policy`)."""

    logprobs: torch.Tensor  # the objective's π_old: train_logprobs, or μ under `algo.old_logprobs: rollout`
    train_logprobs: torch.Tensor  # the training engine's π_old log-probs (mismatch, rollout correction)
    natural: RoutingTrace | None  # π_old's routing in that pass (under R3: what its routers would choose; under
    # axis R's sham: its noisy choice)
    replay: RoutingTrace | None  # the routing the updates replay (R2: `natural`, R3: the rollout's), or None
    gates: RoutingTrace | None = None  # the gate weights of the experts that pass used (gate-drift telemetry)


@dataclass
class StepInputs:
    """What every update of a step reads, and the telemetry's reference."""

    batch: RolloutBatch
    advantages: torch.Tensor
    old: OldPolicy
    weights: torch.Tensor | None = None  # the rollout correction's per-token multipliers, or None
    # π_old's log-probs, routing and gate weights with its routers free (`route_baseline`), None without MoE layers:
    # what the routing telemetry compares the updated policy with
    baseline: tuple[torch.Tensor, RoutingTrace, RoutingTrace | None] | None = None
    step: int = 0  # the RL step (axis R's draws are keyed by it)
    telemetry_rows: torch.Tensor | None = None  # the rows the routing telemetry reads (None: all)


@dataclass
class MinibatchResult:
    metrics: dict[str, float]  # the objective's metrics over the whole minibatch (every rank's parts)
    grad_norm: float
    entropy_sum: float  # Σ over the minibatch's response tokens of the policy's entropy
    tokens: float  # the minibatch's response tokens
    rows: torch.Tensor  # this rank's rows of the minibatch
    routing: RoutingTrace | None  # this rank's rows' natural routing in the update's forward, when asked
    replayed_calls: int = 0  # router calls of this rank's forwards that replayed a trace (R2/R3; 0 without)
    seen: dict[str, float] | None = None  # `objective_route`'s reading (telemetry.update_route), else None
    aux_loss: float | None = None  # the load-balance loss, row-weighted over the minibatch (train.aux_loss_coef)


@contextmanager
def routing_context(model, replay: RoutingTrace | None, micro, record: bool, choose=None):
    """The update forward's routing: replayed (R2/R3), else chosen by `choose` (axis R) or free; recorded when
    `record` (under replay, what the routers would have chosen given the replayed upstream activations). Yields the
    replay handle, the recorded trace, or None."""
    if replay is not None:
        with replay_routing(model, replay.select(micro), record_natural=record) as handle:
            yield handle
        return
    with ExitStack() as stack:
        if choose is not None:
            stack.enter_context(noisy_routing(model, choose(micro)))
        yield stack.enter_context(record_routing(model)) if record else None
