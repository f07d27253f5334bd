"""Advantages: rewards centred on their group's mean, then normalised (SCALERL.md §2).

    A_i    = r_i - mean(r of the prompt's group)
    batch: Ahat_i = A_i / (std(all A in the batch) + eps)      (ScaleRL default)
    group: Ahat_i = A_i / (std(r of the prompt's group) + eps)  (GRPO; the `loo-plan` ablation)
    none:  Ahat_i = A_i                                          (Dr. GRPO style)

Standard deviations are population ones (divide by n, ours): with G = 2 the unbiased estimate would
inflate the group std by sqrt(2). Apply the zero-variance filter first: the batch std is then taken
over the groups that are actually trained on.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor


def _batch_norm(centered_PG: Tensor, rewards_PG: Tensor, eps: float) -> Tensor:
    return centered_PG / (centered_PG.std(unbiased=False) + eps)


def _group_norm(centered_PG: Tensor, rewards_PG: Tensor, eps: float) -> Tensor:
    return centered_PG / (rewards_PG.std(dim=1, keepdim=True, unbiased=False) + eps)


def _no_norm(centered_PG: Tensor, rewards_PG: Tensor, eps: float) -> Tensor:
    return centered_PG


ADVANTAGE_NORMS: dict[str, Callable[[Tensor, Tensor, float], Tensor]] = {
    "batch": _batch_norm,
    "group": _group_norm,
    "none": _no_norm,
}


def compute_advantages(rewards_PG: Tensor, norm: str = "batch", eps: float = 1e-6) -> Tensor:
    """Advantages for a [prompts, generations] reward table, in float32."""
    if norm not in ADVANTAGE_NORMS:
        raise ValueError(f"algo.advantage_norm: {norm!r} is not one of {list(ADVANTAGE_NORMS)}")
    if rewards_PG.ndim != 2:
        raise ValueError(f"rewards must be [prompts, generations], got shape {tuple(rewards_PG.shape)}")
    rewards_PG = rewards_PG.to(torch.float32)
    if rewards_PG.numel() == 0:
        return rewards_PG.clone()
    centered_PG = rewards_PG - rewards_PG.mean(dim=1, keepdim=True)
    return ADVANTAGE_NORMS[norm](centered_PG, rewards_PG, eps)
