"""Advantages: rewards centred on their group's mean, then normalised (docs/recipe.md §2).

    A_i    = r_i - mean(r of the prompt's group)
    batch: Ahat_i = A_i / (std(all A in the batch) + eps)      (ScaleRL default)
    group: Ahat_i = A_i / (std(r of the prompt's group) + eps)  (GRPO; the `loo-plan` ablation)
    none:  Ahat_i = A_i                                          (Dr. GRPO style)

Standard deviations are population ones (divide by n, ours): with G = 2 the unbiased estimate would
inflate the group std by sqrt(2). Apply the zero-variance filter first: the batch std is then taken
over the groups that are actually trained on.

Groups may differ in size (truncated completions excluded, `algo.truncated: exclude`): `group_advantages`
takes ragged groups, and `compute_advantages` a mask of the entries that exist; every mean and std is over
the existing entries only.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor


def _batch_norm(centered_PG: Tensor, rewards_PG: Tensor, mask_PG: Tensor, eps: float) -> Tensor:
    values = centered_PG[mask_PG]
    return centered_PG / (values.std(unbiased=False) + eps)


def _group_norm(centered_PG: Tensor, rewards_PG: Tensor, mask_PG: Tensor, eps: float) -> Tensor:
    return centered_PG / (_masked_mean(centered_PG.square(), mask_PG).sqrt() + eps)


def _no_norm(centered_PG: Tensor, rewards_PG: Tensor, mask_PG: Tensor, eps: float) -> Tensor:
    return centered_PG


ADVANTAGE_NORMS: dict[str, Callable[[Tensor, Tensor, Tensor, float], Tensor]] = {
    "batch": _batch_norm,
    "group": _group_norm,
    "none": _no_norm,
}


def _masked_mean(values_PG: Tensor, mask_PG: Tensor) -> Tensor:
    counts_P1 = mask_PG.sum(dim=1, keepdim=True).clamp_min(1)
    return torch.where(mask_PG, values_PG, 0.0).sum(dim=1, keepdim=True) / counts_P1


def compute_advantages(
    rewards_PG: Tensor, norm: str = "batch", eps: float = 1e-6, mask_PG: Tensor | None = None
) -> Tensor:
    """Advantages for a [prompts, generations] reward table, in float32. `mask_PG` (bool, optional) marks
    the entries that exist when groups differ in size; the others get advantage 0."""
    if norm not in ADVANTAGE_NORMS:
        raise ValueError(f"algo.advantage_norm: {norm!r} is not one of {list(ADVANTAGE_NORMS)}")
    if rewards_PG.ndim != 2:
        raise ValueError(f"rewards must be [prompts, generations], got shape {tuple(rewards_PG.shape)}")
    if mask_PG is None:
        mask_PG = torch.ones_like(rewards_PG, dtype=torch.bool)
    elif mask_PG.shape != rewards_PG.shape:
        raise ValueError(f"mask shape {tuple(mask_PG.shape)} differs from rewards {tuple(rewards_PG.shape)}")
    rewards_PG = rewards_PG.to(torch.float32)
    if not mask_PG.any():
        return torch.zeros_like(rewards_PG)
    centered_PG = torch.where(mask_PG, rewards_PG - _masked_mean(rewards_PG, mask_PG), 0.0)
    return ADVANTAGE_NORMS[norm](centered_PG, rewards_PG, mask_PG, eps)


def group_advantages(rewards: list[list[float]], norm: str = "batch", eps: float = 1e-6) -> list[list[float]]:
    """`compute_advantages` for groups of any sizes: one list of advantages per group."""
    width = max((len(g) for g in rewards), default=0)
    rewards_PG = torch.zeros(len(rewards), width, dtype=torch.float64)
    mask_PG = torch.zeros(len(rewards), width, dtype=torch.bool)
    for p, group in enumerate(rewards):
        rewards_PG[p, : len(group)] = torch.tensor(group, dtype=torch.float64)
        mask_PG[p, : len(group)] = True
    advantages_PG = compute_advantages(rewards_PG, norm, eps, mask_PG)
    return [advantages_PG[p, : len(group)].tolist() for p, group in enumerate(rewards)]
