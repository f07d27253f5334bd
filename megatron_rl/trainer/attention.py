"""Core attention over packed sequences (THD): causal within each sequence, no L x L mask anywhere.

The trainer packs several sequences into one row and describes the row with megatron-core's
`PackedSeqParams` (`qkv_format="thd"`, `cu_seqlens` = the sequences' boundaries). The same description
drives both backends, chosen in `trainer/model.py`:

- GPUs (Transformer Engine spec): `TEDotProductAttention` reads `cu_seqlens` natively (flash / cuDNN
  fused attention with `padding_causal`). TE ignores dense masks under the `causal` mask type, which is
  why there is no mask path at all.
- CPU (megatron-core's local spec): `PackedCoreAttention` below replaces megatron's `DotProductAttention`
  (which refuses packed sequences and keeps the whole [heads, L, L] score matrix). It runs torch's
  `scaled_dot_product_attention(is_causal=True)` once per group of similar-length sequences, each padded at
  its end to the group's longest (`segment_groups`): torch's CPU flash kernel, memory
  linear in the sequence length.

Llama-4 adds two rules on top, as transformers' `Llama4TextAttention` and SGLang's `llama4.py` apply
them (`Llama4Attention` below, used by both backends):

- chunked local attention on the RoPE layers: a token attends to earlier tokens of its own
  `attention_chunk_size`-token chunk only. Chunk starts are extra sequence boundaries in `cu_seqlens`
  (counted from each sequence's start), applied after RoPE so that positions keep counting through the
  chunk boundaries.
- attention-temperature tuning on the NoPE layers: the query at position p (within its sequence) is
  scaled by 1 + attn_scale * log(floor((p + 1) / floor_scale) + 1).

Context parallelism (`parallel.cp`, trainer/context_parallel.py): `cu_seqlens` stay the whole row's (every
segment padded to 2 x cp chunks), as Transformer Engine and megatron-core's RoPE expect, while each rank holds
its chunks only; positions are those of the rank's own tokens. Transformer Engine exchanges keys and values
itself (its ring); `PackedCoreAttention`, and the Llama-4 chunked layers on either backend, exchange them with
`context_parallel.attend`.

Limits: no attention dropout (RL fine-tuning runs without it), no sliding windows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
from torch import Tensor

from megatron_rl.config import ModelConfig
from megatron_rl.trainer.context_parallel import CpLayout, attend


@dataclass
class PackedRows(PackedSeqParams):
    """megatron's `PackedSeqParams` (THD) for one packed row, with what the Llama-4 rules need precomputed
    on the host (no device sync inside a layer)."""

    chunk_cu_seqlens: Tensor | None = None
    """Sequence boundaries plus a cut at every chunk start inside each sequence (chunked layers)."""
    chunk_max_seqlen: int | None = None
    positions: Tensor | None = None
    """Position of each (of this rank's) token within its own sequence (temperature-tuned layers)."""
    cp: CpLayout | None = None
    """Context parallel: how the row is split over the CP group (None without CP)."""
    segment_groups: list[SegmentGroup] | None = field(default=None, init=False, repr=False, compare=False)
    """PackedCoreAttention's batches of these boundaries, made on first use (a copy with other boundaries from
    `dataclasses.replace` starts without)."""


def packed_rows(
    lengths: list[int], device: torch.device | str, chunk_size: int | None = None, layout: CpLayout | None = None
) -> PackedRows:
    """The THD description of a row holding segments of `lengths` tokens, back to back; with a context-parallel
    `layout` (context_parallel.cp_layout of these lengths), of the whole row as the layout's rank holds it."""
    bounds = [0]
    for length in lengths:
        bounds.append(bounds[-1] + length)
    cu_seqlens = torch.tensor(bounds, dtype=torch.int32, device=device)
    longest = max(lengths)
    positions = torch.cat([torch.arange(n, dtype=torch.int32) for n in lengths])
    rows = PackedRows(
        qkv_format="thd",
        cu_seqlens_q=cu_seqlens,
        cu_seqlens_kv=cu_seqlens,
        max_seqlen_q=longest,
        max_seqlen_kv=longest,
        positions=(positions if layout is None else positions[layout.index]).to(device),
        cp=layout,
    )
    if layout is not None:  # segments hold their own padding: the padded boundaries are the boundaries
        rows.cu_seqlens_q_padded = rows.cu_seqlens_kv_padded = cu_seqlens
        return rows  # chunked layers cut with the layout's chunk runs
    if chunk_size is not None:
        spans = zip(bounds[:-1], bounds[1:], strict=True)
        cuts = [b for start, end in spans for b in range(start, end, chunk_size)] + [bounds[-1]]
        rows.chunk_cu_seqlens = torch.tensor(cuts, dtype=torch.int32, device=device)
        rows.chunk_max_seqlen = min(longest, chunk_size)
    return rows


@dataclass(frozen=True)
class Llama4Attention:
    """Llama-4's per-layer attention rule: chunked on RoPE layers, temperature-tuned on NoPE layers."""

    chunk_size: int | None
    """Chunk length on this layer, or None (a NoPE layer, or no chunking)."""
    floor_scale: int | None
    """Temperature step on this layer, or None (a RoPE layer, or no temperature tuning)."""
    attn_scale: float = 0.1

    @staticmethod
    def for_layer(model: ModelConfig, layer_number: int) -> Llama4Attention | None:
        """The rule of layer `layer_number` (1-based, as megatron numbers layers); None = plain causal."""
        # HF: layer i is NoPE when (i + 1) % no_rope_layer_interval == 0; every other layer uses RoPE.
        nope = bool(model.no_rope_freq) and layer_number % model.no_rope_freq == 0
        rule = Llama4Attention(
            chunk_size=None if nope else model.attention_chunk_size,
            floor_scale=model.floor_scale if nope and model.attn_temperature_tuning else None,
            attn_scale=model.attn_scale,
        )
        return rule if rule.chunk_size is not None or rule.floor_scale is not None else None

    def packed_seq_params(self, rows: PackedRows) -> PackedRows:
        """The attention's segments: `rows` with the chunk cuts on a chunked layer."""
        if self.chunk_size is None:
            return rows
        if rows.chunk_cu_seqlens is None or rows.chunk_max_seqlen is None:
            raise ValueError(f"chunked attention ({self.chunk_size} tokens): the packed rows carry no chunk boundaries")
        return replace(
            rows,
            cu_seqlens_q=rows.chunk_cu_seqlens,
            cu_seqlens_kv=rows.chunk_cu_seqlens,
            max_seqlen_q=rows.chunk_max_seqlen,
            max_seqlen_kv=rows.chunk_max_seqlen,
        )

    def scale_query(self, query_T: Tensor, rows: PackedRows) -> Tensor:
        """Queries [tokens, heads, dim] scaled by the temperature of their position in their sequence."""
        if self.floor_scale is None:
            return query_T
        if rows.positions is None:
            raise ValueError("attention-temperature tuning: the packed rows carry no positions")
        scale_T = torch.log1p(torch.floor((rows.positions.float() + 1.0) / self.floor_scale)) * self.attn_scale + 1.0
        return (query_T * scale_T[:, None, None]).to(query_T.dtype)


class PackedCoreAttention(torch.nn.Module):
    """megatron's core-attention interface over packed sequences, for the local (CPU) layer spec.

    Takes megatron's constructor arguments (`config`, `layer_number`, ...) and `forward(query, key, value,
    attention_mask, attn_mask_type=None, attention_bias=None, packed_seq_params=None)`. With packed
    sequences, query is [tokens, heads/tp, dim] and key/value [tokens, groups/tp, dim]; without them
    (one sequence per batch row, e.g. a checkpoint's logit check) [seq, batch, heads, dim].
    """

    def __init__(
        self,
        config: Any,
        layer_number: int,
        attn_mask_type: Any = None,
        attention_type: str = "self",
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: Any = None,
        llama4: Llama4Attention | None = None,
    ) -> None:
        super().__init__()
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout:
            raise ValueError(f"PackedCoreAttention: attention dropout is not supported (got {dropout})")
        self.config = config
        self.layer_number = layer_number
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(config.kv_channels)
        self.llama4 = llama4

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Tensor | None,
        attn_mask_type: Any = None,
        attention_bias: Tensor | None = None,
        packed_seq_params: Any = None,
    ) -> Tensor:
        if attention_mask is not None or attention_bias is not None:
            raise ValueError(
                "PackedCoreAttention is causal within each sequence; describe packed rows with packed_seq_params "
                "(cu_seqlens), not with an attention mask or bias"
            )
        if packed_seq_params is None:  # [s, b, h, d]: every batch row is one sequence
            if self.config.context_parallel_size > 1:
                raise ValueError("PackedCoreAttention: context parallelism needs packed rows (packed_seq_params)")
            seq, batch = query.shape[:2]
            flat = lambda x: x.transpose(0, 1).reshape(seq * batch, *x.shape[2:])  # noqa: E731
            rows = packed_rows([seq] * batch, query.device, self.llama4.chunk_size if self.llama4 else None)
            out = self._packed(flat(query), flat(key), flat(value), rows)
            return out.view(batch, seq, -1).transpose(0, 1).contiguous()
        if packed_seq_params.qkv_format != "thd":
            raise ValueError(f"PackedCoreAttention: qkv_format {packed_seq_params.qkv_format!r}, expected 'thd'")
        return self._packed(query, key, value, packed_seq_params)

    def _packed(self, query_T: Tensor, key_T: Tensor, value_T: Tensor, rows: PackedRows) -> Tensor:
        """[tokens, heads, dim] -> [tokens, heads * dim], causal attention within each segment."""
        if rows.cp is not None:
            return cp_attention(query_T, key_T, value_T, rows, self.llama4, self.softmax_scale)
        if self.llama4 is not None:
            query_T = self.llama4.scale_query(query_T, rows)
            rows = self.llama4.packed_seq_params(rows)
        repeat = query_T.shape[1] // key_T.shape[1]
        if repeat > 1:  # GQA: torch's flash kernels (CPU, and CUDA under the dispatcher's rules) want equal heads
            key_T = key_T.repeat_interleave(repeat, dim=1)
            value_T = value_T.repeat_interleave(repeat, dim=1)
        if rows.segment_groups is None:
            rows.segment_groups = segment_groups(rows.cu_seqlens_q.tolist(), query_T.device)
        if len(rows.segment_groups) == 1 and rows.segment_groups[0].order is None:
            return rows.segment_groups[0].attend(query_T, key_T, value_T, self.softmax_scale)
        outputs = [group.attend(query_T, key_T, value_T, self.softmax_scale) for group in rows.segment_groups]
        order = torch.cat([group.order for group in rows.segment_groups if group.order is not None])
        out = torch.cat(outputs)
        return torch.empty_like(out).index_copy_(0, order, out)


@dataclass(frozen=True)
class SegmentGroup:
    """Segments of a row of similar lengths, attended to in one padded batch: [segments, heads, longest, dim].

    Each segment is padded at its end, so causal attention is exact for its real tokens (a query attends to
    earlier keys only, all of them real); the padding's outputs are dropped. One SDPA call and one gather /
    scatter per group replace a call per segment, whose slices cost a zero-filled row-sized gradient each in
    backward (O(segments x row) per layer)."""

    gather: Tensor
    """[segments * longest] token index of each padded slot (a padding slot repeats its segment's last token)."""
    keep: Tensor
    """Index of the real slots in the flattened padded batch, in token order."""
    order: Tensor | None
    """The row positions of `keep`'s tokens when the row has other groups (None: this group is the whole row)."""
    segments: int
    longest: int
    start: int
    """The first segment's start in the row (the view taken when the group is one sequence)."""

    def attend(self, query_T: Tensor, key_T: Tensor, value_T: Tensor, scale: float) -> Tensor:
        """[tokens, heads, dim] -> [group tokens, heads * dim]."""
        if self.segments == 1:  # one sequence: views of the row, no padded copy held for backward (long rows)
            span = slice(self.start, self.start + self.longest)
            q, k, v = (x[span].transpose(0, 1)[None] for x in (query_T, key_T, value_T))
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)[0]
            return out.transpose(0, 1).reshape(self.longest, -1)
        q, k, v = (
            x.index_select(0, self.gather).view(self.segments, self.longest, *x.shape[1:]).transpose(1, 2)
            for x in (query_T, key_T, value_T)
        )
        # [segments, heads, longest, dim], 4-D: torch's CPU flash kernel (memory linear in `longest`); the math
        # kernel that 3-D inputs fall back to keeps the [heads, longest, longest] scores.
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        return out.transpose(1, 2).reshape(self.segments * self.longest, -1).index_select(0, self.keep)


def segment_groups(bounds: list[int], device: torch.device | str) -> list[SegmentGroup]:
    """A row's segments (`bounds` = cu_seqlens) in groups whose padding costs at most 2x each segment's length:
    sorted by length, a group takes segments down to half its longest."""
    spans = sorted(((b - a, a) for a, b in zip(bounds[:-1], bounds[1:], strict=True) if b > a), reverse=True)
    batches: list[list[tuple[int, int]]] = []
    for length, start in spans:
        if batches and 2 * length >= batches[-1][0][0]:
            batches[-1].append((length, start))
        else:
            batches.append([(length, start)])
    groups = []
    for batch in batches:
        batch.sort(key=lambda span: span[1])  # row order within the group
        lengths = torch.tensor([length for length, _ in batch])
        starts = torch.tensor([start for _, start in batch])
        longest = int(lengths.max())
        slots = torch.arange(longest)
        gather = starts[:, None] + torch.minimum(slots[None, :], lengths[:, None] - 1)
        real = slots[None, :] < lengths[:, None]
        order = gather[real] if len(batches) > 1 else None
        keep = real.flatten().nonzero().squeeze(1)
        groups.append(
            SegmentGroup(
                gather.flatten().to(device),
                keep.to(device),
                None if order is None else order.to(device),
                len(batch),
                longest,
                batch[0][1],
            )
        )
    return groups


def cp_attention(
    query_T: Tensor, key_T: Tensor, value_T: Tensor, rows: PackedRows, llama4: Llama4Attention | None, scale: float
) -> Tensor:
    """Context-parallel attention of this rank's queries (context_parallel.attend), with the layer's Llama-4 rule."""
    from megatron.core import parallel_state

    assert rows.cp is not None
    if llama4 is not None:
        query_T = llama4.scale_query(query_T, rows)
    chunked = llama4 is not None and llama4.chunk_size is not None
    group = parallel_state.get_context_parallel_group()
    return attend(query_T, key_T, value_T, rows.cp, scale, chunked, group)


def te_packed_attention_class() -> type:
    """Transformer Engine's attention with the Llama-4 rules applied to its inputs (GPU only)."""
    from megatron.core.extensions.transformer_engine import TEDotProductAttention

    class TELlama4Attention(TEDotProductAttention):  # type: ignore[misc,valid-type]
        def __init__(self, config: Any, *args: Any, llama4: Llama4Attention | None, **kwargs: Any) -> None:
            super().__init__(config, *args, **kwargs)
            self.llama4 = llama4
            self.cp_softmax_scale = kwargs.get("softmax_scale") or 1.0 / math.sqrt(config.kv_channels)

        def forward(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Any, **kwargs: Any) -> Tensor:
            if self.llama4 is None:  # a layer without a rule (e.g. NoPE layers when only chunking is on)
                return super().forward(query, key, value, attention_mask, **kwargs)
            rows = kwargs.get("packed_seq_params")
            if not isinstance(rows, PackedRows) or rows.qkv_format != "thd":
                raise ValueError("Llama-4 attention rules need the trainer's packed rows (PackedRows, THD format)")
            if rows.cp is not None and self.llama4.chunk_size is not None:  # TE's CP has no chunked attention
                return cp_attention(query, key, value, rows, self.llama4, self.cp_softmax_scale)
            query = self.llama4.scale_query(query, rows)
            kwargs["packed_seq_params"] = self.llama4.packed_seq_params(rows)
            return super().forward(query, key, value, attention_mask, **kwargs)

    return TELlama4Attention
