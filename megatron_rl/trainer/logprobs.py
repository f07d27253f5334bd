"""Per-token log-probs and entropy of the sampled tokens, in fp32, without a full [tokens x vocab] tensor.

    logprob_t = z_t[y_t] - logsumexp_v z_t[v]          z_t = h_t W^T  (W: the vocab-parallel LM head)
    entropy_t = logsumexp_v z_t - sum_v p_t[v] z_t[v]

`token_logprobs` walks the tokens in chunks of `chunk` rows: each chunk's logits [chunk x vocab/tp] exist
only while that chunk is processed, in the forward and again in the hand-written backward, which
recomputes them instead of keeping them (d logprob_t / d z_t = onehot(y_t) - p_t). Under tensor
parallelism every rank holds a slice of the vocabulary; the max, the sum of exponentials and the target
logit are all-reduced across the TP group, as in megatron's vocab-parallel cross entropy.

Peak memory is O(chunk x vocab / tp) instead of O(tokens x vocab) for the logits, the softmax and their
gradient (benchmarks/bench_logprobs.py measures it). The matmul runs in fp32 when the LM head is fp32
(docs/recipe.md §3), otherwise in the head's dtype with an fp32 softmax.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor


def _all_reduce(tensor: Tensor, op: Any, group: Any) -> Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(tensor, op=op, group=group)
    return tensor


def _chunk_stats(
    hidden_CH: Tensor, weight_VH: Tensor, targets_C: Tensor, vocab_start: int, group: Any
) -> tuple[Tensor, Tensor, Tensor]:
    """One chunk's (global) log-normaliser of the logits, target log-prob and entropy."""
    logits_CV = (hidden_CH.to(weight_VH.dtype) @ weight_VH.t()).float()
    max_C = _all_reduce(logits_CV.max(dim=-1).values, dist.ReduceOp.MAX, group)
    shifted_CV = logits_CV.sub_(max_C[:, None])  # in place: two [chunk x vocab] buffers at most
    exp_CV = shifted_CV.exp()
    sum_exp_z_C = torch.bmm(exp_CV[:, None, :], shifted_CV[:, :, None]).view(-1)  # no third buffer
    sums_2C = torch.stack([exp_CV.sum(dim=-1), sum_exp_z_C])
    local_C = targets_C - vocab_start
    in_range_C = (local_C >= 0) & (local_C < shifted_CV.shape[-1])
    target_C = shifted_CV.gather(1, local_C.clamp(0, shifted_CV.shape[-1] - 1)[:, None]).squeeze(1)
    target_C = torch.where(in_range_C, target_C, torch.zeros_like(target_C))
    stats_3C = _all_reduce(torch.cat([sums_2C, target_C[None]]), dist.ReduceOp.SUM, group)
    sum_exp_C, sum_exp_z_C, target_C = stats_3C
    log_z_C = sum_exp_C.log()  # log-normaliser of the shifted logits
    logprob_C = target_C - log_z_C
    entropy_C = log_z_C - sum_exp_z_C / sum_exp_C
    return max_C + log_z_C, logprob_C, entropy_C


class _ChunkedLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, hidden_TH: Tensor, weight_VH: Tensor, targets_T: Tensor, chunk: int, vocab_start: int, group: Any
    ) -> tuple[Tensor, Tensor]:
        logprobs, entropies, log_normalisers = [], [], []
        with torch.no_grad():
            for start in range(0, hidden_TH.shape[0], chunk):
                rows = slice(start, start + chunk)
                log_norm_C, logprob_C, entropy_C = _chunk_stats(
                    hidden_TH[rows], weight_VH, targets_T[rows], vocab_start, group
                )
                logprobs.append(logprob_C)
                entropies.append(entropy_C)
                log_normalisers.append(log_norm_C)
        empty = hidden_TH.new_zeros(0, dtype=torch.float32)
        ctx.save_for_backward(hidden_TH, weight_VH, targets_T, torch.cat(log_normalisers) if logprobs else empty)
        ctx.chunk, ctx.vocab_start = chunk, vocab_start
        entropy_T = torch.cat(entropies) if entropies else empty
        ctx.mark_non_differentiable(entropy_T)
        return (torch.cat(logprobs) if logprobs else empty), entropy_T

    @staticmethod
    def backward(ctx: Any, grad_logprob_T: Tensor, grad_entropy_T: Tensor) -> tuple[Any, ...]:
        hidden_TH, weight_VH, targets_T, log_norm_T = ctx.saved_tensors
        grad_hidden_TH = torch.zeros_like(hidden_TH, dtype=torch.float32)
        grad_weight_VH = torch.zeros_like(weight_VH, dtype=torch.float32)
        vocab = weight_VH.shape[0]
        for start in range(0, hidden_TH.shape[0], ctx.chunk):
            rows = slice(start, start + ctx.chunk)
            h_CH = hidden_TH[rows].to(weight_VH.dtype)
            logits_CV = (h_CH @ weight_VH.t()).float()
            # d logprob / d z = onehot(target) - softmax(z), scaled by the incoming gradient
            grad_CV = logits_CV.sub_(log_norm_T[rows, None]).exp_().mul_(-grad_logprob_T[rows, None])
            local_C = targets_T[rows] - ctx.vocab_start
            in_range_C = (local_C >= 0) & (local_C < vocab)
            index = in_range_C.nonzero().squeeze(1)
            grad_CV[index, local_C[index]] += grad_logprob_T[rows][index]
            grad_CV = grad_CV.to(weight_VH.dtype)
            grad_hidden_TH[rows] = (grad_CV @ weight_VH).float()
            grad_weight_VH.addmm_(grad_CV.t().float(), h_CH.float())  # in place: no [vocab x hidden] temporary
        return grad_hidden_TH.to(hidden_TH.dtype), grad_weight_VH.to(weight_VH.dtype), None, None, None, None


def token_logprobs(
    hidden_TH: Tensor, weight_VH: Tensor, targets_T: Tensor, chunk: int = 1024, tp_group: Any = None
) -> tuple[Tensor, Tensor]:
    """fp32 (log-probs, entropies) of `targets_T` under logits `hidden_TH @ weight_VH^T`.

    `weight_VH` is this rank's vocabulary slice (rank r of the TP group holds rows r*V/tp .. (r+1)*V/tp);
    `hidden_TH` must be identical on all TP ranks, and its gradient is this rank's partial sum (megatron's
    `copy_to_tensor_model_parallel_region` before this call all-reduces it in backward). Entropies carry
    no gradient (they are a metric).
    """
    tp_rank = dist.get_rank(tp_group) if tp_group is not None and dist.get_world_size(tp_group) > 1 else 0
    vocab_start = tp_rank * weight_VH.shape[0]
    logprobs_T, entropies_T = _ChunkedLogProbs.apply(hidden_TH, weight_VH, targets_T, chunk, vocab_start, tp_group)
    return logprobs_T, entropies_T.detach()


def naive_token_logprobs(hidden_TH: Tensor, weight_VH: Tensor, targets_T: Tensor) -> tuple[Tensor, Tensor]:
    """The same on one rank with the full [tokens x vocab] fp32 logits (the reference and the baseline)."""
    logp_TV = torch.log_softmax((hidden_TH.float() @ weight_VH.float().t()), dim=-1)
    entropy_T = -(logp_TV.exp() * logp_TV).sum(-1)
    return logp_TV.gather(1, targets_T[:, None]).squeeze(1), entropy_T.detach()
