"""Loss aggregation as per-sequence token weights (docs/recipe.md §2).

The batch loss is `sum over loss tokens t of weight[seq(t)] * term_t`. Expressing aggregation as a weight
per sequence, computed once over the whole batch, lets the trainer split the batch into micro-batches
and data-parallel shards and still sum to exactly the aggregated loss.

With P prompts, G_p completions of prompt p and L_s loss tokens in sequence s:

    prompt (ScaleRL): w_s = 1 / (P * sum_{s' of p} L_s')   each prompt weighs 1/P, whatever its lengths
    sample:           w_s = 1 / (P * G_p * L_s)             mean over prompts of the mean per-sample mean
    token:            w_s = 1 / sum_s L_s                   every token in the batch weighs the same

A sequence without loss tokens gets weight 0 (it contributes nothing, in every mode).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor


def _per_prompt(lengths_S: Tensor, prompt_index_S: Tensor) -> tuple[Tensor, Tensor, int]:
    """Each sequence's prompt slot (0..P-1), and the number of prompts."""
    _, slot_S = torch.unique(prompt_index_S, return_inverse=True)
    num_prompts = int(slot_S.max()) + 1 if slot_S.numel() else 0
    return slot_S, lengths_S.to(torch.float64), num_prompts


def _prompt_weights(lengths_S: Tensor, prompt_index_S: Tensor) -> Tensor:
    slot_S, lengths_S, num_prompts = _per_prompt(lengths_S, prompt_index_S)
    tokens_P = torch.zeros(num_prompts, dtype=torch.float64).index_add_(0, slot_S, lengths_S)
    return _safe_reciprocal(num_prompts * tokens_P[slot_S], lengths_S)


def _sample_weights(lengths_S: Tensor, prompt_index_S: Tensor) -> Tensor:
    slot_S, lengths_S, num_prompts = _per_prompt(lengths_S, prompt_index_S)
    samples_P = torch.bincount(slot_S, minlength=num_prompts).to(torch.float64)
    return _safe_reciprocal(num_prompts * samples_P[slot_S] * lengths_S, lengths_S)


def _token_weights(lengths_S: Tensor, prompt_index_S: Tensor) -> Tensor:
    lengths_S = lengths_S.to(torch.float64)
    return _safe_reciprocal(lengths_S.sum().expand_as(lengths_S), lengths_S)


def _safe_reciprocal(denominator_S: Tensor, lengths_S: Tensor) -> Tensor:
    has_tokens_S = lengths_S > 0
    return torch.where(has_tokens_S, 1.0 / denominator_S.clamp_min(1e-300), torch.zeros_like(denominator_S))


AGGREGATIONS: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "prompt": _prompt_weights,
    "sample": _sample_weights,
    "token": _token_weights,
}


def sequence_weights(lengths_S: Tensor, prompt_index_S: Tensor, mode: str = "prompt") -> Tensor:
    """The weight of each loss token of sequence s (float32), for the whole batch at once.

    lengths_S: loss tokens per sequence; prompt_index_S: any integer id shared by a prompt's sequences.
    The weights are computed in float64 and returned in float32.
    """
    if mode not in AGGREGATIONS:
        raise ValueError(f"algo.aggregation: {mode!r} is not one of {list(AGGREGATIONS)}")
    if lengths_S.shape != prompt_index_S.shape or lengths_S.ndim != 1:
        raise ValueError(
            f"lengths and prompt_index must be 1-D of equal length, got {tuple(lengths_S.shape)} and "
            f"{tuple(prompt_index_S.shape)}"
        )
    if lengths_S.numel() == 0:
        return torch.zeros(0, dtype=torch.float32)
    return AGGREGATIONS[mode](lengths_S, prompt_index_S).to(torch.float32)
