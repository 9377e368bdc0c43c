"""Record and replay the experts chosen by Qwen3-MoE routers (Routing Replay: R2 and R3).

Modes (`routing_replay: none | r2 | r3`, records in `gspo_study.moe.modes`); this module only provides
primitives:
- none: routers route freely in every forward.
- r2 (the GSPO paper's Routing Replay): record while the training engine computes π_old on the rollout
  batch; replay that trace in every forward that computes π_θ for the importance ratio.
- r3 (Rollout Routing Replay, arXiv 2510.11370): record while the rollout engine generates (KV-cached:
  the prefill, then one chunk per decode step, appended along T); replay it in the π_old and π_θ forwards.

Beside replay, one more way to override a router (`noisy_routing`, the routing frontier's axis R): each token's
top-k experts are chosen from its router logits plus a seeded draw, while the gate weights stay the clean softmax at
the chosen experts. And one more recorder (`record_router_outputs`): each router's logits and the gate weights it
used, for the load and gate telemetry.

Mechanism: while a `record_routing` / `replay_routing` context is open, every sparse MoE block gets a
forward pre-hook (its router sees tokens flattened to [B*T, H], so the block tells us [B, T]) and every
router a forward hook. Under replay the hook swaps the router's (scores, indices) for the recorded
experts, with gate weights gathered from the *current* softmax (renormalised as the router would), so
the router keeps its gradient. Recorders then store the indices actually used, so recording nests
inside replay. Only routers are touched: the experts implementation (eager, grouped_mm, ...) is free.
Hooks are removed when the last context on a model exits, exceptions included.
"""

from __future__ import annotations

import math
import re
import warnings
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

from gspo_study.moe.trace import RoutingTrace

# Routers with Qwen3MoeTopKRouter's contract: forward([N, H]) -> (logits, scores, indices),
# attributes top_k and norm_topk_prob; held as `.gate` of their sparse block.
ROUTER_TYPES: tuple[type[nn.Module], ...] = (Qwen3MoeTopKRouter,)

_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@dataclass(frozen=True)
class _MoeLayer:
    layer: int  # decoder layer index
    block: nn.Module
    router: nn.Module


def _find_moe_layers(model: nn.Module) -> list[_MoeLayer]:
    found = []
    for name, module in model.named_modules():
        router = getattr(module, "gate", None)
        if not isinstance(router, ROUTER_TYPES):
            continue
        match = _LAYER_RE.search(name + ".")
        if match is None:
            raise ValueError(f"cannot tell the decoder layer index of MoE block {name!r}")
        found.append(_MoeLayer(int(match.group(1)), module, router))
    layers = [f.layer for f in found]
    if len(set(layers)) != len(layers):
        raise ValueError(f"several MoE blocks claim one decoder layer: {layers}")
    _check_against_config(model, layers)
    return sorted(found, key=lambda f: f.layer)


def _check_against_config(model: nn.Module, layers: list[int]) -> None:
    # Guards the classic silent failure: hooks on the wrong modules / layer ids shifted by dense layers.
    config = getattr(model, "config", None)
    if getattr(config, "model_type", None) != "qwen3_moe":
        return
    from gspo_study.models.presets import moe_layer_indices

    expected = moe_layer_indices(config)
    if sorted(layers) != expected:
        raise RuntimeError(f"found MoE routers at decoder layers {sorted(layers)}, config says {expected}")


def moe_layers(model: nn.Module) -> list[int]:
    """Decoder layer indices that hold a (supported) MoE router, ascending."""
    return [f.layer for f in _find_moe_layers(model)]


def routers(model: nn.Module) -> list[tuple[int, nn.Module]]:
    """(decoder layer index, router module) of every supported MoE router, by layer."""
    return [(f.layer, f.router) for f in _find_moe_layers(model)]


def count_moe_layers(model: nn.Module) -> int:
    return len(_find_moe_layers(model))


def has_moe(model: nn.Module) -> bool:
    return count_moe_layers(model) > 0


def _in_backward() -> bool:
    # True while gradient checkpointing re-runs a forward inside backward: that is not a new forward.
    return torch._C._current_graph_task_id() != -1


class ReplayHandle:
    """Yielded by `replay_routing`: the trace being replayed and proof that replay happened.

    `replayed_calls` counts router calls that used the trace (one per MoE layer per forward, plus
    re-runs under gradient checkpointing); `calls_per_layer` splits it by decoder layer. With
    `record_natural=True`, `natural` is the trace of what the current routers would have chosen in the
    latest replayed forward (given the replayed upstream activations): free volatility telemetry.
    """

    def __init__(self, trace: RoutingTrace, layers: list[_MoeLayer], record_natural: bool):
        _validate_trace(trace, layers)
        self.trace = trace
        self.replayed_calls = 0
        self.calls_per_layer = {f.layer: 0 for f in layers}
        self._record_natural = record_natural
        self._natural: dict[int, torch.Tensor] = {}
        self._on_device: dict[tuple[int, torch.device], torch.Tensor] = {}
        self._grad_forward_calls = 0
        self._recompute_calls = 0

    @property
    def natural(self) -> RoutingTrace:
        if not self._record_natural:
            raise RuntimeError("replay_routing(..., record_natural=True) is needed for the natural routing")
        return RoutingTrace(self._natural)

    def _ids(self, layer: int, device: torch.device) -> torch.Tensor:
        # One host->device copy per layer and context, not per call.
        key = (layer, device)
        if key not in self._on_device:
            self._on_device[key] = self.trace.indices[layer].to(device=device, dtype=torch.long)
        return self._on_device[key]

    def route(
        self, layer: int, router: nn.Module, logits: torch.Tensor, natural: torch.Tensor, bt: tuple[int, int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(scores, indices) for the recorded experts; mirrors Qwen3MoeTopKRouter.forward's arithmetic."""
        ids = self._ids(layer, logits.device)
        if tuple(ids.shape[:2]) != bt:
            raise RuntimeError(
                f"replay_routing: MoE layer {layer} routes a batch of [B, T] = {list(bt)} tokens but the trace "
                f"holds {list(ids.shape[:2])}; replay the rows of this micro-batch (trace.select(rows)) over "
                "the same positions (a trace recorded during generation covers input_ids[:, :-1])"
            )
        ids = ids.reshape(-1, ids.shape[-1])
        probs = F.softmax(logits, dim=-1, dtype=torch.float)
        scores = probs.gather(1, ids)  # same values, in the same order, as topk would give for these ids
        if router.norm_topk_prob:
            scores = scores / scores.sum(dim=-1, keepdim=True)
        self._log_call(layer, natural, bt)
        return scores.to(logits.dtype), ids

    def _log_call(self, layer: int, natural: torch.Tensor, bt: tuple[int, int]) -> None:
        self.replayed_calls += 1
        self.calls_per_layer[layer] += 1
        if _in_backward():
            self._recompute_calls += 1
            return
        self._grad_forward_calls += torch.is_grad_enabled()
        if self._record_natural:
            self._natural[layer] = natural.detach().view(*bt, -1)

    def _check_active(self, model: nn.Module) -> None:
        if self.replayed_calls == 0:
            raise RuntimeError(
                "replay_routing: no MoE router was replayed inside the context (no forward ran through the "
                "model's MoE layers), so nothing used the recorded routing"
            )
        missing = [layer for layer, n in self.calls_per_layer.items() if n == 0]
        if missing:
            raise RuntimeError(f"replay_routing: MoE layers {missing} were never replayed")
        if _checkpointed(model) and self._grad_forward_calls and not self._recompute_calls:
            warnings.warn(
                "replay_routing exited before backward on a gradient-checkpointed model: the recomputed "
                "forward will route freely; call backward inside the replay context",
                stacklevel=3,
            )


def _checkpointed(model: nn.Module) -> bool:
    flag = getattr(model, "is_activation_checkpointing", None)  # transformers >= 5 name
    if flag is None:
        flag = getattr(model, "is_gradient_checkpointing", False)
    return bool(flag)


def _validate_trace(trace: RoutingTrace, layers: list[_MoeLayer]) -> None:
    if trace.is_empty():
        raise ValueError("replay_routing: the routing trace is empty (nothing was recorded)")
    model_layers = [f.layer for f in layers]
    if trace.layers != model_layers:
        missing = sorted(set(model_layers) - set(trace.layers))
        extra = sorted(set(trace.layers) - set(model_layers))
        raise ValueError(
            f"replay_routing: trace layers {trace.layers} do not match the model's MoE layers {model_layers} "
            f"(missing {missing}, unexpected {extra})"
        )
    top_k = {f.router.top_k for f in layers}
    if top_k != {trace.top_k}:
        raise ValueError(f"replay_routing: trace has top-k {trace.top_k}, the model's routers use {top_k}")


class _Hub:
    """The hooks on one set of routers, shared by all record/replay contexts open on them."""

    def __init__(self, layers: list[_MoeLayer]):
        self.layers = layers
        self.recorders: list[RoutingTrace] = []
        self.outputs: list[RouterOutputs] = []
        self.replay: ReplayHandle | NoisyChoice | None = None  # the override: replayed or noisy choices
        self._bt: dict[int, tuple[int, int]] = {}
        self._hooks = []
        for f in self.layers:
            self._hooks.append(f.block.register_forward_pre_hook(partial(self._on_block, f.layer), with_kwargs=True))
            self._hooks.append(f.router.register_forward_hook(partial(self._on_router, f.layer)))

    def idle(self) -> bool:
        return not self.recorders and not self.outputs and self.replay is None

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()

    def _on_block(self, layer: int, module: nn.Module, args: tuple, kwargs: dict) -> None:
        hidden = args[0] if args else kwargs["hidden_states"]
        if hidden.dim() != 3:
            raise RuntimeError(f"MoE layer {layer}: expected hidden states [B, T, H], got {tuple(hidden.shape)}")
        self._bt[layer] = (hidden.shape[0], hidden.shape[1])

    def _on_router(self, layer: int, router: nn.Module, args: tuple, output: tuple) -> tuple:
        bt = self._bt.pop(layer, None)  # pop: a stale shape must never describe a later call
        logits, scores, ids = output
        if bt is None or bt[0] * bt[1] != logits.shape[0]:
            raise RuntimeError(f"MoE layer {layer}: router called outside its block's forward ({bt=})")
        if self.replay is not None:
            scores, ids = self.replay.route(layer, router, logits, ids, bt)
        if not _in_backward():
            if self.recorders:
                chunk = ids.detach().view(*bt, -1)
                for trace in self.recorders:
                    trace.append(layer, chunk)
            for rec in self.outputs:
                rec.append(layer, logits.detach().view(*bt, -1), scores.detach().view(*bt, -1))
        return logits, scores, ids


# Keyed by the first router, not the model, so contexts on a model and on its submodule share one hub
# (two hubs would stack hooks whose order decides whether a recorder sees replayed experts).
_HUBS: weakref.WeakKeyDictionary[nn.Module, _Hub] = weakref.WeakKeyDictionary()


@contextmanager
def _hub(model: nn.Module) -> Iterator[_Hub]:
    layers = _find_moe_layers(model)
    if not layers:
        raise ValueError(
            f"{type(model).__name__} has no MoE router ({', '.join(t.__name__ for t in ROUTER_TYPES)}): "
            "routing record/replay needs a MoE model"
        )
    key = layers[0].router
    hub = _HUBS.get(key)
    if hub is None:
        hub = _HUBS[key] = _Hub(layers)
    try:
        yield hub
    finally:
        if hub.idle():
            hub.remove()
            del _HUBS[key]


@contextmanager
def record_routing(model: nn.Module) -> Iterator[RoutingTrace]:
    """Record every MoE router's top-k experts during the forwards run inside the context.

    Each forward call appends its [B, t, k] choices along T, so a KV-cached generation (prefill, then
    decode steps) yields the routing of the whole sequence except its last sampled token, i.e. exactly
    the positions of a log-prob forward over input_ids[:, :-1]. Forwards re-run inside backward
    (gradient checkpointing) are not recorded. Under `replay_routing`, the replayed experts are recorded.
    """
    trace = RoutingTrace()
    with _hub(model) as hub:
        hub.recorders.append(trace)
        try:
            yield trace
        finally:
            hub.recorders = [t for t in hub.recorders if t is not trace]


@contextmanager
def replay_routing(model: nn.Module, trace: RoutingTrace, *, record_natural: bool = False) -> Iterator[ReplayHandle]:
    """Route every token of the forwards inside the context to the experts recorded in `trace`.

    The forward's tokens must be the trace's [B, T] (select a micro-batch's rows with `trace.select`).
    Gate weights are the current router's softmax at the recorded experts, renormalised when the config
    says `norm_topk_prob`, so the router still gets gradients. Raises on exit if no router was replayed
    (unless an exception is already propagating); with gradient checkpointing, call backward inside.
    """
    with _hub(model) as hub:
        if hub.replay is not None:
            raise RuntimeError(
                "replay_routing is already active on this model (or noisy_routing): nested overrides are ambiguous"
            )
        handle = ReplayHandle(trace, hub.layers, record_natural)
        hub.replay = handle
        try:
            yield handle
        finally:
            hub.replay = None
        handle._check_active(model)


class NoisyChoice:
    """Yielded by `noisy_routing`: every MoE router of the forwards inside chooses its top-k experts from its logits
    plus σ times a seeded standard-normal draw per (row, position, expert) — `draw(row, layer, T, E)` gives row
    `row`'s [T, E] draw for `layer`, so a token's draw never depends on which other rows share its forward — or, at
    σ = inf, from the draw alone (k experts uniformly at random). The gate weights stay the clean softmax at the
    chosen experts (renormalised when the router does), so the dose changes which experts a token uses, never how a
    chosen expert is weighted, and the router keeps its gradient. `rows` are the forward's rows' indices in the
    batch the draw is keyed by. `calls` counts the router calls it chose for (`noisy_routing` checks it is > 0)."""

    def __init__(self, sigma: float, rows: torch.Tensor, draw):
        if not sigma > 0:
            raise ValueError(f"bad routing noise σ {sigma!r}; allowed: a number > 0, or inf (random top-k)")
        self.sigma, self.rows, self.draw = sigma, [int(r) for r in rows], draw
        self.calls = 0

    def noise(self, layer: int, seq: int, experts: int) -> torch.Tensor:
        """[len(rows) * seq, experts] float32: the rows' draws for `layer`, stacked as the router sees its tokens."""
        return torch.stack([self.draw(row, layer, seq, experts) for row in self.rows]).view(-1, experts)

    def route(
        self, layer: int, router: nn.Module, logits: torch.Tensor, natural: torch.Tensor, bt: tuple[int, int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if bt[0] != len(self.rows):
            raise RuntimeError(
                f"noisy_routing: MoE layer {layer} routes {bt[0]} rows, the draw was keyed for {len(self.rows)}"
            )
        z = self.noise(layer, bt[1], logits.shape[-1]).to(logits.device)
        chooser = z if math.isinf(self.sigma) else logits.float() + self.sigma * z
        ids = torch.topk(chooser, router.top_k, dim=-1).indices
        probs = F.softmax(logits, dim=-1, dtype=torch.float)
        scores = probs.gather(1, ids)
        if router.norm_topk_prob:
            scores = scores / scores.sum(dim=-1, keepdim=True)
        if not _in_backward():
            self.calls += 1
        return scores.to(logits.dtype), ids


@contextmanager
def noisy_routing(model: nn.Module, choice: NoisyChoice) -> Iterator[NoisyChoice]:
    """Route every token of the forwards inside the context by `choice` (`NoisyChoice`); recorders opened inside see
    the experts it chose. Refused inside `replay_routing` (a replayed forward has its experts already); raises on exit
    if no router was reached (unless an exception is already propagating)."""
    with _hub(model) as hub:
        if hub.replay is not None:
            raise RuntimeError("noisy_routing inside another routing override (replay or noise) is ambiguous")
        hub.replay = choice
        try:
            yield choice
        finally:
            hub.replay = None
        if choice.calls == 0:
            raise RuntimeError("noisy_routing: no MoE router was called inside the context")


class RouterOutputs:
    """Yielded by `record_router_outputs`: per decoder layer, the router logits [B, T, E] and the gate weights
    [B, T, k] of the experts each token used (after any replay or noisy choice), appended along T per forward."""

    def __init__(self):
        self._logits: dict[int, list[torch.Tensor]] = {}
        self._gates: dict[int, list[torch.Tensor]] = {}

    def append(self, layer: int, logits: torch.Tensor, gates: torch.Tensor) -> None:
        self._logits.setdefault(layer, []).append(logits)
        self._gates.setdefault(layer, []).append(gates.float())

    @property
    def logits(self) -> dict[int, torch.Tensor]:
        return {layer: torch.cat(c, dim=1) for layer, c in sorted(self._logits.items())}

    @property
    def gates(self) -> RoutingTrace:
        """The gate weights as a trace (a [B, T, k] float tensor per layer: `select`, `cat` as for expert ids)."""
        return RoutingTrace({layer: torch.cat(c, dim=1) for layer, c in sorted(self._gates.items())})


@contextmanager
def record_router_outputs(model: nn.Module) -> Iterator[RouterOutputs]:
    """Record every MoE router's logits and used gate weights during the forwards inside the context (not those
    re-run inside backward)."""
    rec = RouterOutputs()
    with _hub(model) as hub:
        hub.outputs.append(rec)
        try:
            yield rec
        finally:
            hub.outputs = [r for r in hub.outputs if r is not rec]
