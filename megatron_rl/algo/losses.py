"""Policy-gradient losses of docs/recipe.md §2 as per-token terms: CISPO, GSPO, DAPO, GRPO.

All take flat token tensors (one entry per completion token of the micro-batch):

    logprobs_T      trainer log pi_train(y_t), fp32, requires grad
    gen_logprobs_T  generator log pi_gen(y_t), fp32 (the behaviour policy, from the inference engine)
    advantages_T    the sequence's advantage, repeated over its tokens
    mask_T          True for tokens trained on (False: prompt or interruption-injected tokens)
    seq_index_T     the token's sequence within the micro-batch, in [0, num_seqs)

and return a per-token loss term (the negated objective; 0 outside the mask) plus a bool per token
saying whether its ratio was truncated (CISPO) or clipped (PPO-style losses). `policy_loss` weights the
terms with the aggregation weights (aggregation.py) and returns the scalar to minimise.

    rho_t = exp(log pi_train - log pi_gen)
    cispo: -sg(min(rho_t, eps_max)) * A * log pi_train(y_t)       gradient: sg(min(rho, eps_max)) A grad log pi
    dapo / grpo (token PPO clip): -min(rho_t A, clip(rho_t, 1 - eps_low, 1 + eps_high) A)
    gspo:  s = exp(mean_t log rho_t) over the sequence's loss tokens (length-normalised);
           -min(s A, clip(s, 1 - eps_low, 1 + eps_high) A) on every token of the sequence

Corrections for the generator/trainer mismatch (options of any loss, docs/recipe.md §9):

    mismatch_mask = B: a sequence whose geometric-mean ratio exp(mean_t log rho_t) over its loss tokens is
        outside [1/B, B] leaves the loss (all its tokens; counted in `masked_seqs`)
    tis_cap = C (token-level truncated IS): the loss's ratio is taken to the trainer's own detached log-prob
        (rho' = pi_train / sg(pi_train), value 1, gradient grad log pi), and each token's term is weighted by
        w_t = sg(min(rho_t, C)): the policy gradient on the trainer's distribution, importance-weighted from
        the generator's and truncated at C (tokens with rho_t > C count as clipped)
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from megatron_rl.config import AlgoConfig


@dataclass
class TokenTerms:
    loss_T: Tensor
    """Per-token loss (negated objective), 0 where the mask is False."""
    clipped_T: Tensor
    """Per-token bool: ratio truncated (CISPO) or the clipped branch active (PPO-style)."""
    masked_seqs: Tensor | None = None
    """Sequences left out by `mismatch_mask` (a count)."""


def _cispo(
    cfg: AlgoConfig,
    logratio_T: Tensor,
    logprobs_T: Tensor,
    adv_T: Tensor,
    mask_T: Tensor,
    seq_index_T: Tensor,
    num_seqs: int,
) -> TokenTerms:
    rho_T = torch.exp(logratio_T.detach())
    weight_T = torch.clamp(rho_T, max=cfg.eps_max)  # stop-gradient: only scales grad log pi
    loss_T = -(weight_T * adv_T * logprobs_T)
    return TokenTerms(loss_T, rho_T > cfg.eps_max)


def _per_sequence(values_T: Tensor, seq_index_T: Tensor, num_seqs: int) -> Tensor:
    """Sum of each sequence's token values, [num_seqs]."""
    return torch.zeros(num_seqs, dtype=values_T.dtype, device=values_T.device).index_add(0, seq_index_T, values_T)


def _ppo_clip(ratio: Tensor, adv: Tensor, eps_low: float, eps_high: float) -> tuple[Tensor, Tensor]:
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high) * adv
    # The clipped branch is the active one exactly when it is the smaller (pessimistic) objective.
    is_clipped = clipped < unclipped
    return -torch.minimum(unclipped, clipped), is_clipped


def _token_ppo(
    cfg: AlgoConfig,
    logratio_T: Tensor,
    logprobs_T: Tensor,
    adv_T: Tensor,
    mask_T: Tensor,
    seq_index_T: Tensor,
    num_seqs: int,
) -> TokenTerms:
    assert cfg.eps_low is not None and cfg.eps_high is not None  # resolved by AlgoConfig
    loss_T, clipped_T = _ppo_clip(torch.exp(logratio_T), adv_T, cfg.eps_low, cfg.eps_high)
    return TokenTerms(loss_T, clipped_T)


def _gspo(
    cfg: AlgoConfig,
    logratio_T: Tensor,
    logprobs_T: Tensor,
    adv_T: Tensor,
    mask_T: Tensor,
    seq_index_T: Tensor,
    num_seqs: int,
) -> TokenTerms:
    assert cfg.eps_low is not None and cfg.eps_high is not None
    maskf_T = mask_T.to(logratio_T.dtype)
    sum_S = _per_sequence(logratio_T * maskf_T, seq_index_T, num_seqs)
    count_S = _per_sequence(maskf_T, seq_index_T, num_seqs)
    seq_ratio_S = torch.exp(sum_S / count_S.clamp_min(1.0))
    loss_T, clipped_T = _ppo_clip(seq_ratio_S[seq_index_T], adv_T, cfg.eps_low, cfg.eps_high)
    return TokenTerms(loss_T, clipped_T)


LossFn = Callable[[AlgoConfig, Tensor, Tensor, Tensor, Tensor, Tensor, int], TokenTerms]

LOSSES: dict[str, LossFn] = {
    "cispo": _cispo,
    "gspo": _gspo,
    "dapo": _token_ppo,
    "grpo": _token_ppo,  # GRPO's clip is DAPO's with eps_low == eps_high (0.2 / 0.2)
}


def token_terms(
    cfg: AlgoConfig,
    logprobs_T: Tensor,
    gen_logprobs_T: Tensor,
    advantages_T: Tensor,
    mask_T: Tensor,
    seq_index_T: Tensor,
    num_seqs: int,
) -> TokenTerms:
    """Per-token loss terms and clip indicators of the configured loss (zeroed outside the mask)."""
    if cfg.loss not in LOSSES:
        raise ValueError(f"algo.loss: {cfg.loss!r} is not one of {list(LOSSES)}")
    mask_T = mask_T.bool()
    zero_T = torch.zeros_like(logprobs_T)
    logratio_T = torch.where(mask_T, logprobs_T - gen_logprobs_T, zero_T)
    masked_seqs = None
    if cfg.mismatch_mask is not None:
        maskf_T = mask_T.to(logratio_T.dtype)
        sum_S = _per_sequence(logratio_T.detach(), seq_index_T, num_seqs)
        count_S = _per_sequence(maskf_T, seq_index_T, num_seqs)
        outside_S = (sum_S / count_S.clamp_min(1.0)).abs() > math.log(cfg.mismatch_mask)
        masked_seqs = (outside_S & (count_S > 0)).sum()
        mask_T = mask_T & ~outside_S[seq_index_T]
    if cfg.tis_cap is None:
        terms = LOSSES[cfg.loss](cfg, logratio_T, logprobs_T, advantages_T, mask_T, seq_index_T, num_seqs)
        loss_T, clipped_T = terms.loss_T, terms.clipped_T
    else:
        rho_T = torch.exp(logratio_T.detach())
        own_T = torch.where(mask_T, logprobs_T - logprobs_T.detach(), zero_T)  # value 0, gradient grad log pi
        terms = LOSSES[cfg.loss](cfg, own_T, logprobs_T, advantages_T, mask_T, seq_index_T, num_seqs)
        loss_T, clipped_T = terms.loss_T * torch.clamp(rho_T, max=cfg.tis_cap), rho_T > cfg.tis_cap
    return TokenTerms(torch.where(mask_T, loss_T, torch.zeros_like(loss_T)), clipped_T & mask_T, masked_seqs)


def policy_loss(
    cfg: AlgoConfig,
    logprobs_T: Tensor,
    gen_logprobs_T: Tensor,
    advantages_T: Tensor,
    mask_T: Tensor,
    seq_index_T: Tensor,
    num_seqs: int,
    weights_T: Tensor,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The micro-batch's share of the aggregated loss, and metric sums to reduce across micro-batches.

    Returned sums (detached): `loss_tokens`, `clipped_tokens` (ratio truncated or clipped),
    `abs_logratio_sum` (|log pi_train - log pi_gen|, the train/generate mismatch), `kl_sum` (the k3 estimate
    rho - 1 - log rho of KL(pi_gen || pi_train) per token, sampled from the generator), `masked_seqs`
    (sequences left out by `mismatch_mask`). Divide the reduced sums by the reduced `loss_tokens` for
    per-token means.
    """
    terms = token_terms(cfg, logprobs_T, gen_logprobs_T, advantages_T, mask_T, seq_index_T, num_seqs)
    loss = (weights_T * terms.loss_T).sum()
    mask_T = mask_T.bool()
    with torch.no_grad():
        abs_logratio_T = (logprobs_T - gen_logprobs_T).abs()
        metrics = {
            "loss_tokens": mask_T.sum().to(torch.float64),
            "clipped_tokens": terms.clipped_T.sum().to(torch.float64),
            "abs_logratio_sum": torch.where(mask_T, abs_logratio_T, torch.zeros_like(abs_logratio_T))
            .sum()
            .to(torch.float64),
        }
        logratio_T = (logprobs_T - gen_logprobs_T).double()
        k3_T = torch.expm1(logratio_T) - logratio_T
        metrics["kl_sum"] = torch.where(mask_T, k3_T, torch.zeros_like(k3_T)).sum()
        masked = terms.masked_seqs if terms.masked_seqs is not None else torch.zeros(())
        metrics["masked_seqs"] = masked.to(torch.float64)
    return loss, metrics
