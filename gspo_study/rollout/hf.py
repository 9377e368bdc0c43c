"""The `hf` rollout engine: KV-cached sampling written directly on the HF model's forward.

Why not `model.generate`: we need the sampled tokens' log-probs under the engine (for
`old_logprobs: rollout`, §5.4), routing recorded across prefill and every decode step (R3), one explicit
`torch.Generator` per rollout (so every algorithm of a seed draws from the same random stream), and few
Python steps per token. The engine can run a separate lower-precision copy of the policy
(`rollout.dtype: bfloat16`), or a perturbed copy (`rollout.router_precision`, `router_noise`, `head_noise`:
gspo_study.rollout.perturb), to study train–inference mismatch; `sync` copies the trainer's weights in.
"""

from __future__ import annotations

import contextlib
import copy

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from gspo_study.errors import NonFiniteError
from gspo_study.moe import RoutingTrace, record_routing
from gspo_study.rollout.base import RolloutBatch, encode_prompts, position_ids_from_mask  # noqa: F401 (re-exported)
from gspo_study.rollout.perturb import Perturbation, PerturbedCopy

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class HFEngine:
    """The `RolloutEngine` of the policy's own forward."""

    records_routing = True  # recording changes none of its tokens (the hooks only read the routers)
    writes_weights = False

    def __init__(self, model, tokenizer, dtype: str | None = None, perturbation: Perturbation | None = None):
        """`dtype` None: the model's own (no copy; what evaluation uses, also for a bf16 or ZeRO-3 model).
        `perturbation`: what the engine's copy computes differently from the trainer (gspo_study.rollout.perturb)."""
        self.tokenizer = tokenizer
        param_dtype = next(model.parameters()).dtype
        self.dtype = param_dtype if dtype is None else DTYPES[dtype]
        perturbation = perturbation or Perturbation()
        # A separate copy only when the engine's precision differs from the trainer's, or its copy is perturbed.
        same = param_dtype == self.dtype and not perturbation.active
        self.model = model if same else copy.deepcopy(model).to(self.dtype)
        self.shares_weights = self.model is model
        self.perturbed = PerturbedCopy(self.model, perturbation) if perturbation.active else None

    def sync(self, model, gather=None, full_state=None) -> None:
        """Copy the trainer's current weights into the engine (no-op when they share weights); `gather`: a
        context factory in which the weights are whole (DeepSpeed ZeRO-3); `full_state` is not used."""
        if not self.shares_weights:
            with torch.no_grad(), (gather or contextlib.nullcontext)():
                for dst, src in zip(self.model.parameters(), model.parameters()):
                    dst.copy_(src.to(dst.dtype))

    def close(self) -> None:
        """Nothing to release (the engines' common interface: the trainer closes its engine at the end)."""

    # no_grad, not inference_mode: the latter was bit-identical and ~5 % faster per rollout, but under DeepSpeed the
    # parameters it touches become inference tensors and the next training forward fails (docs/LOG.md, 2026-12-07)
    @torch.no_grad()
    def generate(
        self,
        prompts: list[str],
        max_new_tokens: int,
        temperature: float = 1.0,
        generator: torch.Generator | None = None,
        greedy: bool = False,
        capture_routing: bool = False,
        row_seeds: list[int] | None = None,
    ) -> RolloutBatch:
        """Sample one response per prompt (repeat prompts for groups). `capture_routing`: the routers are
        recorded around prefill and decode (`record_routing`), so `batch.routing` spans the batch.
        `row_seeds` gives every response its own random stream (instead of `generator` for the batch), so a
        response does not depend on which other prompts share its batch (sharded rollouts)."""
        seq, mask = encode_prompts(self.tokenizer, prompts)
        if row_seeds is not None:
            if len(row_seeds) != len(prompts):
                raise ValueError(f"{len(row_seeds)} row seeds for {len(prompts)} prompts")
            generator = [torch.Generator().manual_seed(int(s)) for s in row_seeds]
        if self.perturbed is not None:
            self.perturbed.reseed(generator)
        trace = RoutingTrace() if capture_routing else None
        was_training = self.model.training
        self.model.eval()
        try:
            out = self._decode(seq, mask, max_new_tokens, temperature, generator, greedy, trace)
        finally:
            self.model.train(was_training)
        return self._to_batch(mask, *out, routing=trace)

    def _logits(self, ids, mask, pos, cache) -> torch.Tensor:
        """The last position's logits [B, V], float32 on the CPU (the model may sit on a GPU)."""
        device = next(self.model.parameters()).device
        out = self.model(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            position_ids=pos.to(device),
            cache=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        return out.logits[:, -1].float().cpu()

    def _prefill(self, seq, mask, cache, trace) -> torch.Tensor:
        """The prompts' forward over every row: its logits [B, V], the cache filled, the routing appended to
        `trace`."""
        with record_routing(self.model) if trace is not None else contextlib.nullcontext() as recorded:
            logits = self._logits(seq, mask, position_ids_from_mask(mask), cache)
        if trace is not None:
            for layer, ids in recorded.indices.items():
                trace.append(layer, ids)
        return logits

    def _decode(self, seq, mask, max_new_tokens, temperature, generator, greedy, trace):
        eos, pad = self.tokenizer.eos_token_id, self.tokenizer.pad_token_id
        (B, P), N = seq.shape, max_new_tokens
        cache = DynamicCache(config=self.model.config)
        cache.layers = [PreallocatedLayer(P + N - 1) for _ in cache.layers]
        full_mask = torch.zeros(B, P + N, dtype=mask.dtype)  # the prompt's mask, then one column per fed token
        full_mask[:, :P] = mask
        seen = mask.sum(-1, keepdim=True)  # tokens each row has fed so far: the next one's position + 1
        finished = torch.zeros(B, dtype=torch.bool)
        tokens, logps, alive = [], [], []
        logits = self._prefill(seq, mask, cache, trace)
        with record_routing(self.model) if trace is not None else contextlib.nullcontext() as recorded:
            for step in range(N):
                tok, tok_logp = self._sample(logits, step, temperature, generator, greedy)
                live = ~finished
                tok = torch.where(live, tok, torch.full_like(tok, pad))
                tokens.append(tok)
                logps.append(torch.where(live, tok_logp, torch.zeros_like(tok_logp)))
                alive.append(live)
                finished = finished | (tok == eos)
                if finished.all() or step == N - 1:
                    break  # the last sampled token is never fed through the model
                full_mask[:, P + step] = live
                seen = seen + live[:, None]
                logits = self._logits(tok[:, None], full_mask[:, : P + step + 1], seen - 1, cache)
        if trace is not None:
            for layer, ids in recorded.indices.items():
                trace.append(layer, ids)
        return seq, torch.stack(tokens, 1), torch.stack(logps, 1), torch.stack(alive, 1), finished

    def _sample(self, logits, step, temperature, generator, greedy) -> tuple[torch.Tensor, torch.Tensor]:
        """The next token of every row and its log-prob under the engine."""
        if self.perturbed is not None:
            logits = self.perturbed.head(logits)
        if not torch.isfinite(logits).all():
            raise NonFiniteError(f"the policy produced non-finite logits at decode step {step}; the run diverged")
        logprobs = torch.log_softmax(logits / temperature, dim=-1)
        if greedy:
            tok = logprobs.argmax(-1)
        elif isinstance(generator, list):  # one stream per row
            probs = logprobs.exp()
            tok = torch.cat([torch.multinomial(probs[i], 1, generator=g) for i, g in enumerate(generator)])
        else:
            tok = torch.multinomial(logprobs.exp(), 1, generator=generator).squeeze(-1)
        return tok, logprobs.gather(-1, tok[:, None]).squeeze(-1)

    def _to_batch(self, prompt_mask, seq, tokens, logps, alive, finished, routing) -> RolloutBatch:
        (B, N), prompt_len = tokens.shape, seq.shape[1]
        sequences = torch.cat([seq, tokens], dim=1)
        attention_mask = torch.cat([prompt_mask, alive.long()], dim=1)
        response_mask = torch.zeros(B, prompt_len + N - 1, dtype=torch.bool)
        response_mask[:, prompt_len - 1 :] = alive
        rollout_logprobs = torch.zeros(B, prompt_len + N - 1)
        rollout_logprobs[:, prompt_len - 1 :] = logps
        eos = self.tokenizer.eos_token_id
        texts = [
            self.tokenizer.decode([t for t in row if t != eos], skip_special_tokens=True)
            for row in torch.where(alive, tokens, torch.full_like(tokens, eos)).tolist()
        ]
        return RolloutBatch(
            sequences=sequences,
            attention_mask=attention_mask,
            response_mask=response_mask,
            rollout_logprobs=rollout_logprobs,
            response_texts=texts,
            truncated=~finished,
            prompt_len=prompt_len,
            routing=routing,
        )


class PreallocatedLayer(DynamicLayer):
    """A KV-cache layer sized once for the whole rollout (`capacity` positions): each update writes its positions in
    place and returns views of the filled part, the same keys and values `DynamicLayer`'s per-token concatenation
    builds, without copying the whole cache at every decode step."""

    def __init__(self, capacity: int):
        super().__init__()
        self.capacity = capacity
        self.length = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        B, H, _, D = key_states.shape
        self._keys = key_states.new_empty(B, H, self.capacity, D)
        self._values = value_states.new_empty(B, H, self.capacity, value_states.shape[-1])

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.length + key_states.shape[-2]
        if end > self.capacity:
            raise RuntimeError(f"KV cache of {self.capacity} positions asked to hold {end}")
        self._keys[:, :, self.length : end].copy_(key_states)
        self._values[:, :, self.length : end].copy_(value_states)
        self.length = end
        self.keys, self.values = self._keys[:, :, :end], self._values[:, :, :end]
        return self.keys, self.values
