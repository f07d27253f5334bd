"""Context parallelism over packed rows (THD): how a row is split over the CP group, and the exchanges.

    layout = cp_layout(segment_lengths, cp=2, rank=r, chunk_size=None)   # host, once per micro-batch
    local_ids = row_ids[layout.index]                                    # this rank's tokens
    out = attend(query, key, value, layout, scale, chunked=False, group)  # causal attention of local queries
    full = gather_tokens(local_values, counts, order, group)            # per-token values of the whole row

The partition is Transformer Engine's for THD context parallelism (`thd_get_partitioned_indices`, used by
megatron-core's per-document CP batching): every segment of the row (a sequence, padded to a multiple of
2 x cp, or the row's padding) is cut into 2 x cp equal chunks and rank r holds chunks r and 2cp-1-r of each,
segment after segment. With causal attention the late chunks cost the most, so pairing an early with a late
chunk balances the ranks. megatron-core's RoPE for THD (`_apply_rotary_pos_emb_thd`) picks the same positions
from the row's global `cu_seqlens`, and Transformer Engine's attention exchanges keys and values in that
layout (its ring, cp_comm_type p2p) on GPUs.

`attend` is this project's exchange, used by the local (CPU) layer spec and, on GPUs, by the Llama-4 chunked
layers (Transformer Engine's CP attention has no chunked local attention): all-gather K and V over the CP
group (Transformer Engine's all-gather variant; the backward reduce-scatters their gradients), put them back in
row order, and attend with the rank's own queries. Each of its query runs (a chunk of a segment, cut again at
Llama-4 chunk starts on chunked layers) attends to the keys from its segment's (or attention chunk's) start to
its own last position: causal aligned to the lower right, so no mask is materialised on GPUs. The gathered keys
and values of the whole row stay alive for the backward (2 x row x query groups x head dim per layer, counted
by the memory plan) unless core attention is recomputed.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor


@dataclass(frozen=True)
class QueryRun:
    """Local queries [start, end) of this rank, at row positions [first, first + end - start), attending to the
    keys at row positions [key_start, first + end - start) (causal, aligned to the lower right)."""

    start: int
    end: int
    first: int
    key_start: int


@dataclass(frozen=True)
class CpLayout:
    """One packed row split over `size` CP ranks, as seen from `rank`. All index tensors are on the host."""

    size: int
    rank: int
    index: Tensor
    """[row tokens / cp] row positions this rank holds, in its local order."""
    gather_index: Tensor
    """[row tokens] for each row position, where it lands in the all-gather [cp x row tokens / cp] of all ranks."""
    runs: tuple[QueryRun, ...]
    """The rank's queries as runs within one segment (2 per segment)."""
    chunk_runs: tuple[QueryRun, ...] | None
    """The same cut again at every Llama-4 attention chunk start (chunked layers), or None."""

    def owner_and_local(self) -> tuple[Tensor, Tensor]:
        """For each row position: the CP rank that holds it and its index there."""
        local = self.index.numel()
        return self.gather_index // local, self.gather_index % local


def partition(segments: list[int], cp: int, rank: int) -> list[tuple[int, int]]:
    """Row position ranges [start, end) held by `rank`, in local order: chunks r and 2cp-1-r of each segment."""
    ranges, offset = [], 0
    for n in segments:
        if n % (2 * cp):
            raise ValueError(f"context parallel: a segment of {n} tokens is not a multiple of 2 x cp = {2 * cp}")
        chunk = n // (2 * cp)
        for k in (rank, 2 * cp - 1 - rank):
            ranges.append((offset + k * chunk, offset + (k + 1) * chunk))
        offset += n
    return ranges


def cp_layout(segments: list[int], cp: int, rank: int, chunk_size: int | None = None) -> CpLayout:
    """The layout of a row of `segments` (token counts, each a multiple of 2 x cp) on CP rank `rank` of `cp`."""
    total = sum(segments)
    per_rank = [partition(segments, cp, r) for r in range(cp)]
    local = total // cp
    gather_index = torch.empty(total, dtype=torch.long)
    for r, ranges in enumerate(per_rank):
        positions = torch.cat([torch.arange(a, b) for a, b in ranges])
        gather_index[positions] = torch.arange(r * local, (r + 1) * local)
    mine = per_rank[rank]
    index = torch.cat([torch.arange(a, b) for a, b in mine])
    bounds = [sum(segments[:s]) for s in range(len(segments) + 1)]
    runs, chunk_runs, at = [], [], 0
    for a, b in mine:
        seg_start = bounds[bisect.bisect_right(bounds, a) - 1]  # the start of the segment this range lies in
        runs.append(QueryRun(at, at + b - a, a, seg_start))
        if chunk_size is not None:  # cut at seg_start + k * chunk_size
            p = a
            while p < b:
                chunk_start = seg_start + (p - seg_start) // chunk_size * chunk_size
                stop = min(b, chunk_start + chunk_size)
                chunk_runs.append(QueryRun(at + p - a, at + stop - a, p, chunk_start))
                p = stop
        at += b - a
    return CpLayout(cp, rank, index, gather_index, tuple(runs), tuple(chunk_runs) if chunk_size else None)


def _gather_rows(x: Tensor, group: Any) -> Tensor:
    """All-gather along dim 0 over `group` (backward: reduce-scatter of the gradient), megatron's mapping."""
    from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

    return gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=True, group=group)


def attend(
    query_T: Tensor, key_T: Tensor, value_T: Tensor, layout: CpLayout, scale: float, chunked: bool, group: Any
) -> Tensor:
    """Causal attention of this rank's queries [local, heads, dim] over the keys/values of the whole row (gathered
    from the CP group); `chunked`: Llama-4 chunked local attention. Returns [local, heads * dim]."""
    runs = layout.chunk_runs if chunked else layout.runs
    if runs is None:
        raise ValueError("context parallel: chunked attention needs a layout built with the chunk size")
    gather_index = layout.gather_index.to(key_T.device)
    key_T = _gather_rows(key_T.contiguous(), group).index_select(0, gather_index)  # row order
    value_T = _gather_rows(value_T.contiguous(), group).index_select(0, gather_index)
    from torch.nn.attention.bias import causal_lower_right

    gqa = query_T.shape[1] != key_T.shape[1]  # keys and values stay at the query groups: no repeated copies

    outputs = []
    for run in runs:
        length = run.end - run.start
        keys = slice(run.key_start, run.first + length)
        q, k, v = (x.transpose(0, 1)[None] for x in (query_T[run.start : run.end], key_T[keys], value_T[keys]))
        mask = causal_lower_right(length, keys.stop - keys.start)
        outputs.append(F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)[0])
    out_T = torch.cat(outputs, dim=1).transpose(0, 1)
    return out_T.reshape(out_T.shape[0], -1)


class _GatherTokens(torch.autograd.Function):
    """Per-token values of the whole row from each CP rank's share (all-gather). Every CP rank then computes the
    same loss from the same values, so the gradient of a rank's share is its own slice of the incoming gradient:
    no exchange in backward (the parameter gradients of the CP ranks are summed by the data-parallel reduction,
    which megatron-core runs over data x context parallel ranks)."""

    @staticmethod
    def forward(ctx: Any, local_N: Tensor, counts: list[int], order: Tensor, group: Any) -> Tensor:  # type: ignore[override]
        rank = dist.get_rank(group)
        longest = max(1, *counts)
        padded = local_N.new_zeros(longest)
        padded[: local_N.shape[0]] = local_N
        gathered = local_N.new_empty(len(counts) * longest)
        dist.all_gather_into_tensor(gathered, padded, group=group)
        parts = gathered.view(len(counts), longest)
        values = torch.cat([parts[r, :n] for r, n in enumerate(counts)])
        full = torch.empty_like(values)
        full[order.to(full.device)] = values
        ctx.save_for_backward(order)
        ctx.span = (sum(counts[:rank]), sum(counts[: rank + 1]))
        return full

    @staticmethod
    def backward(ctx: Any, grad_full: Tensor) -> tuple[Any, ...]:
        (order,) = ctx.saved_tensors
        start, end = ctx.span
        return grad_full[order[start:end].to(grad_full.device)], None, None, None


def gather_tokens(local_N: Tensor, counts: list[int], order: Tensor, group: Any) -> Tensor:
    """[sum(counts)] values in the row's token order from each rank's `local_N` (rank r holds `counts[r]` of them,
    at the row's token positions `order[sum(counts[:r]) : sum(counts[:r+1])]`)."""
    return _GatherTokens.apply(local_N, counts, order, group)
