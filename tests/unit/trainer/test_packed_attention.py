"""The CPU trainer's packed attention (trainer/attention.py): segments of a row batched by length, padded at
their ends, against torch's attention run on each sequence alone."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron_rl.trainer.attention import PackedCoreAttention, packed_rows, segment_groups


class _Config:
    attention_dropout = 0.0
    kv_channels = 8
    context_parallel_size = 1


def _reference(query_T, key_T, value_T, lengths, scale):
    """Each sequence alone through SDPA's math kernel with an explicit causal mask, GQA by repeating heads."""
    repeat = query_T.shape[1] // key_T.shape[1]
    outputs, start = [], 0
    for length in lengths:
        q, k, v = (x[start : start + length].transpose(0, 1).double() for x in (query_T, key_T, value_T))
        k, v = k.repeat_interleave(repeat, 0), v.repeat_interleave(repeat, 0)
        mask = torch.ones(length, length, dtype=torch.bool).tril()
        outputs.append(F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale).transpose(0, 1))
        start += length
    out = torch.cat(outputs)
    return out.reshape(out.shape[0], -1)


@pytest.mark.parametrize(
    "lengths",
    [[7, 5, 6], [1, 3, 40, 17, 100, 64, 2, 51], [33], [9, 1, 1, 300, 8, 150]],
)
def test_packed_attention_equals_each_sequence_alone_with_gradients(lengths):
    torch.manual_seed(0)
    tokens, heads, groups, dim = sum(lengths), 4, 2, 8
    query_T = torch.randn(tokens, heads, dim, requires_grad=True)
    key_T = torch.randn(tokens, groups, dim, requires_grad=True)
    value_T = torch.randn(tokens, groups, dim, requires_grad=True)
    upstream = torch.randn(tokens, heads * dim)
    attention = PackedCoreAttention(_Config(), layer_number=1)

    out = attention(query_T, key_T, value_T, None, packed_seq_params=packed_rows(lengths, "cpu"))
    (out * upstream).sum().backward()
    grads = [x.grad.clone() for x in (query_T, key_T, value_T)]
    for x in (query_T, key_T, value_T):
        x.grad = None
    expected = _reference(query_T, key_T, value_T, lengths, attention.softmax_scale)
    (expected * upstream.double()).sum().backward()

    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=0)
    for got, x in zip(grads, (query_T, key_T, value_T), strict=True):
        torch.testing.assert_close(got, x.grad, atol=1e-5, rtol=0)


def test_segments_are_batched_with_at_most_twice_their_length_of_padding():
    lengths = [9, 1, 1, 300, 0, 8, 150, 151, 4]
    bounds = [0]
    for length in lengths:
        bounds.append(bounds[-1] + length)
    groups = segment_groups(bounds, "cpu")
    assert sum(g.segments for g in groups) == sum(1 for n in lengths if n)  # the empty segment is dropped
    assert sum(g.keep.numel() for g in groups) == sum(lengths)  # every token kept once
    length_at = {start: n for start, n in zip(bounds[:-1], lengths, strict=True) if n}
    for group in groups:  # each segment in the group is at least half the group's longest
        starts = group.gather.view(group.segments, group.longest)[:, 0].tolist()
        members = [length_at[s] for s in starts]
        assert max(members) == group.longest and 2 * min(members) >= group.longest
    order = torch.cat([g.order for g in groups])
    assert sorted(order.tolist()) == list(range(sum(lengths)))
