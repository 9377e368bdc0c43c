"""`grouped_mm_index`: transformers' `grouped_mm` experts kernel with its two gathers done by `index_select`.

transformers' `grouped_mm_experts_forward` gathers the (token, expert) rows with advanced indexing
(`x[perm // k]`, `out[inv_perm]`), whose backward is an accumulating `index_put_` — on CPU it sorts the
indices on every backward pass and costs about a fifth of an RL update of the tiny preset. `index_select`
does the same gather and its backward (`index_add_`) accumulates in index order, so this kernel gives
bit-identical outputs and gradients to a single-threaded `grouped_mm` (tests/test_moe.py checks both); the
expert GEMMs, the gate and the per-token sum are transformers' own. With more than one thread `grouped_mm`'s
backward is not even deterministic on CPU (its gradients change from call to call: a 16-layer cold-start SFT
at 2 threads diverged from itself at step 1–7), while this kernel's are the same every time
(tests/test_moe.py) — one more reason it is the suite's default. Registered with transformers'
`ExpertsInterface` on import, so a model loaded with `experts_implementation="grouped_mm_index"` uses it.
Expert parallelism, expert biases and post-expert norms (none of them in Qwen3-MoE) are left to transformers'
kernel.
"""

from __future__ import annotations

import torch
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, _grouped_linear, grouped_mm_experts_forward

NAME = "grouped_mm_index"


def grouped_mm_index_experts_forward(
    self: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    if self._is_expert_parallel or self.has_bias or self.has_post_expert_norm or not self.has_gate:
        return grouped_mm_experts_forward(self, hidden_states, top_k_index, top_k_weights)
    num_tokens, hidden_dim = hidden_states.shape
    k = top_k_index.size(-1)
    expert_ids_g, perm = torch.sort(top_k_index.reshape(-1))
    x = hidden_states.index_select(0, perm // k)  # (S, hidden): rows grouped by expert
    weights = top_k_weights.reshape(-1).index_select(0, perm)
    histc_input = expert_ids_g.float() if hidden_states.device.type in ("cpu", "mps") else expert_ids_g.int()
    tokens_per_expert = torch.histc(histc_input, bins=self.num_experts, min=0, max=self.num_experts - 1)
    offsets = torch.cumsum(tokens_per_expert, dim=0, dtype=torch.int32)
    h = _grouped_linear(x, self.gate_up_proj, offsets, is_transposed=self.is_transposed)
    h = self._apply_gate(h)
    h = _grouped_linear(h, self.down_proj, offsets, is_transposed=self.is_transposed)
    h = h * weights.unsqueeze(-1)
    inv_perm = torch.empty_like(perm)
    inv_perm[perm] = torch.arange(perm.size(0), device=perm.device)
    out = h.index_select(0, inv_perm).view(num_tokens, k, hidden_dim).sum(dim=1)
    return out.to(hidden_states.dtype)


ALL_EXPERTS_FUNCTIONS.register(NAME, grouped_mm_index_experts_forward)
