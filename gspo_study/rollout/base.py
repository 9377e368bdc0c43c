"""The rollout batch every engine returns, and the token layout the whole trainer shares.

Layout (B sequences, L = P + N positions): `sequences[b]` is the left-padded prompt (P positions) then the
response (N positions, pad after EOS). Log-prob tensors are aligned with the *targets* `sequences[:, 1:]`
(L - 1 positions): entry t is log π(sequences[t + 1] | sequences[≤ t]). A forward over `sequences[:, :-1]`
produces exactly those positions, which is also what KV-cached generation feeds through the model (the
last sampled token never is) — so a routing trace recorded during generation (R3) lines up with the
training forward position for position.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
import torch.nn.functional as F


def encode_prompts(tokenizer, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompt ids (BOS first when the tokenizer has one) and their attention mask."""
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    ids = [bos + tokenizer(p, add_special_tokens=False).input_ids for p in prompts]
    width = max(len(x) for x in ids)
    pad = tokenizer.pad_token_id
    seq = torch.tensor([[pad] * (width - len(x)) + x for x in ids], dtype=torch.long)
    mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids], dtype=torch.long)
    return seq, mask


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that skip left padding, used identically by generation and training forwards."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


@dataclass
class RolloutBatch:
    sequences: torch.Tensor  # [B, L] long: left-padded prompt ++ response (pad after EOS)
    attention_mask: torch.Tensor  # [B, L] long: 1 on prompt and response tokens (EOS included)
    response_mask: torch.Tensor  # [B, L-1] bool: target position is a response token
    rollout_logprobs: torch.Tensor  # [B, L-1] float32: the engine's log-prob of each target (0 off-response)
    response_texts: list[str]  # decoded responses, EOS and padding removed
    truncated: torch.Tensor  # [B] bool: no EOS within max_new_tokens
    prompt_len: int  # P
    routing: object | None = None  # RoutingTrace over the L-1 fed positions (R3), when recorded

    @property
    def response_lengths(self) -> torch.Tensor:
        return self.response_mask.sum(-1)

    def __len__(self) -> int:
        return self.sequences.shape[0]

    def select(self, rows: torch.Tensor) -> RolloutBatch:
        """The batch of `rows` (a 1-D index tensor), same layout (telemetry on a subset of the responses)."""
        idx = rows.tolist()
        return RolloutBatch(
            sequences=self.sequences[rows],
            attention_mask=self.attention_mask[rows],
            response_mask=self.response_mask[rows],
            rollout_logprobs=self.rollout_logprobs[rows],
            response_texts=[self.response_texts[i] for i in idx],
            truncated=self.truncated[rows],
            prompt_len=self.prompt_len,
            routing=None if self.routing is None else self.routing.select(rows),
        )


def merge_batches(batches: list[RolloutBatch], pad_id: int) -> RolloutBatch:
    """One batch of the rows of `batches`, in order, re-laid out on the widest prompt and the longest
    response (what one engine call over all the prompts would have produced). Routing traces are re-padded
    with expert 0 on the padding positions, which every consumer masks."""
    if len(batches) == 1:
        return batches[0]
    P = max(b.prompt_len for b in batches)
    N = max(b.sequences.shape[1] - b.prompt_len for b in batches)
    parts: dict[str, list] = {k: [] for k in ("seq", "att", "resp", "lp", "routing")}
    for b in batches:
        time = (P - b.prompt_len, N - (b.sequences.shape[1] - b.prompt_len))  # pad dim 1: left, right
        parts["seq"].append(F.pad(b.sequences, time, value=pad_id))
        parts["att"].append(F.pad(b.attention_mask, time))
        parts["resp"].append(F.pad(b.response_mask, time, value=False))
        parts["lp"].append(F.pad(b.rollout_logprobs, time))
        if b.routing is not None:  # [B, T, k] per layer
            ids = {layer: F.pad(t, (0, 0, *time)) for layer, t in b.routing.indices.items()}
            parts["routing"].append(type(b.routing)(ids))
    if parts["routing"] and len(parts["routing"]) != len(batches):
        raise ValueError("cannot merge rollout batches where only some carry a routing trace")
    return RolloutBatch(
        sequences=torch.cat(parts["seq"]),
        attention_mask=torch.cat(parts["att"]),
        response_mask=torch.cat(parts["resp"]),
        rollout_logprobs=torch.cat(parts["lp"]),
        response_texts=[t for b in batches for t in b.response_texts],
        truncated=torch.cat([b.truncated for b in batches]),
        prompt_len=P,
        routing=type(parts["routing"][0]).cat(parts["routing"]) if parts["routing"] else None,
    )


@runtime_checkable
class RolloutEngine(Protocol):
    """What the trainer asks of a rollout engine (`hf`, `vllm`, `vllm_server`; `make_engine` builds them).

    `records_routing`: the engine can record each token's experts at no cost to its tokens, so the trainer asks
    for the rollout's routing on every run (train–inference routing telemetry), not only for R3.
    `writes_weights`: the engine writes the weights out (a server pool), so `sync` is handed `full_state` (the
    whole weights gathered onto rank 0, layer by layer) instead of entering `gather` on every rank."""

    model: Any  # the policy the engine samples from (the HF engine: its own copy when its dtype differs)
    records_routing: bool
    writes_weights: bool

    def sync(self, model, gather=None, full_state=None) -> None:
        """The trainer's current weights for the next `generate` (`gather`: a context in which they are whole)."""

    def generate(
        self,
        prompts: list[str],
        max_new_tokens: int,
        temperature: float = 1.0,
        generator: Any = None,
        greedy: bool = False,
        capture_routing: bool = False,
        row_seeds: list[int] | None = None,
    ) -> RolloutBatch:
        """One response per prompt; `capture_routing`: `batch.routing` is the rollout's routing (R3)."""

    def close(self) -> None:
        """Release what the engine holds (a server pool the run started stops)."""


def teacher_forced_batch(tokenizer, prompts: list[str], responses: list[str]) -> RolloutBatch:
    """Given responses (+ EOS) laid out like a rollout: for SFT and for scoring fixed responses."""
    seq, prompt_mask = encode_prompts(tokenizer, prompts)
    resp = [tokenizer(r, add_special_tokens=False).input_ids + [tokenizer.eos_token_id] for r in responses]
    width = max(len(r) for r in resp)
    pad = tokenizer.pad_token_id
    tokens = torch.tensor([r + [pad] * (width - len(r)) for r in resp], dtype=torch.long)
    alive = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in resp], dtype=torch.bool)
    P = seq.shape[1]
    response_mask = torch.zeros(len(prompts), P + width - 1, dtype=torch.bool)
    response_mask[:, P - 1 :] = alive
    return RolloutBatch(
        sequences=torch.cat([seq, tokens], 1),
        attention_mask=torch.cat([prompt_mask, alive.long()], 1),
        response_mask=response_mask,
        rollout_logprobs=torch.zeros(len(prompts), P + width - 1),
        response_texts=list(responses),
        truncated=torch.zeros(len(prompts), dtype=torch.bool),
        prompt_len=P,
    )
