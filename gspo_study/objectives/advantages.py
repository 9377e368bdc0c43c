"""Group-normalised advantages (GRPO/GSPO): Â_i = (r_i − mean_j r_j) / (std_j r_j + eps) within each group.

Rows are laid out group-contiguously (prompt p's G responses are rows p·G … p·G+G−1). The std is the
unbiased sample std (as TRL and verl); a group whose rewards are all equal gets Â = 0 for every member.
"""

from __future__ import annotations

import torch


def group_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-6) -> torch.Tensor:
    """rewards: [B] with B = groups · group_size → advantages [B] (float32)."""
    if rewards.dim() != 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards of shape {tuple(rewards.shape)} do not split into groups of {group_size}")
    r = rewards.float().view(-1, group_size)
    adv = (r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + eps)
    return adv.view(-1)


def zero_std_group_frac(rewards: torch.Tensor, group_size: int) -> float:
    """Share of groups whose rewards are all equal (no learning signal)."""
    r = rewards.float().view(-1, group_size)
    return (r.max(1).values == r.min(1).values).float().mean().item()
