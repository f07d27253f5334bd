"""Advantages against hand numbers and an explicit loop with the statistics module."""

import statistics

import pytest
import torch

from megatron_rl.algo.advantages import compute_advantages, group_advantages

REWARDS = [[1.0, -1.0, -1.0, -1.0], [1.0, 1.0, -1.0, -1.0], [1.0, 1.0, 1.0, -1.0]]


def _reference(rewards, norm, eps=1e-6):
    centered = [[r - statistics.fmean(group) for r in group] for group in rewards]
    if norm == "none":
        return centered
    if norm == "group":
        return [[a / (statistics.pstdev(g) + eps) for a in row] for row, g in zip(centered, rewards, strict=True)]
    flat = [a for row in centered for a in row]
    std = statistics.pstdev(flat)
    return [[a / (std + eps) for a in row] for row in centered]


@pytest.mark.parametrize("norm", ["batch", "group", "none"])
def test_matches_loop_reference(norm):
    got = compute_advantages(torch.tensor(REWARDS), norm)
    assert torch.allclose(got, torch.tensor(_reference(REWARDS, norm)), atol=1e-6)


def test_batch_norm_hand_computed():
    # Group means -0.5 and 0: A = [1.5, -.5, -.5, -.5], [1, 1, -1, -1]; batch std = sqrt(7/8).
    got = compute_advantages(torch.tensor(REWARDS[:2]), "batch", eps=0.0)
    std = (7 / 8) ** 0.5
    expected = torch.tensor([[1.5, -0.5, -0.5, -0.5], [1.0, 1.0, -1.0, -1.0]]) / std
    assert torch.allclose(got, expected, atol=1e-6)
    assert abs(float(got.std(unbiased=False)) - 1.0) < 1e-5


def test_group_norm_gives_unit_scale_per_group():
    got = compute_advantages(torch.tensor(REWARDS), "group", eps=0.0)
    assert torch.allclose(got.std(dim=1, unbiased=False), torch.ones(3), atol=1e-5)
    assert torch.allclose(got.mean(dim=1), torch.zeros(3), atol=1e-6)


def test_uniform_group_has_zero_advantage_and_no_nan():
    got = compute_advantages(torch.tensor([[1.0, 1.0], [-1.0, -1.0]]), "batch")
    assert torch.equal(got, torch.zeros(2, 2))


def test_bad_norm_is_a_clear_error():
    with pytest.raises(ValueError, match="algo.advantage_norm: 'x'"):
        compute_advantages(torch.zeros(1, 2), "x")


RAGGED = [[1.0, -1.0, -1.0], [1.0, 1.0, -1.0, -1.0], [1.0, -1.0]]
"""Groups after truncated completions were excluded: sizes 3, 4 and 2."""


@pytest.mark.parametrize("norm", ["batch", "group", "none"])
def test_ragged_groups_match_loop_reference(norm):
    got = group_advantages(RAGGED, norm)
    want = _reference(RAGGED, norm)
    assert [len(g) for g in got] == [3, 4, 2]
    for row, ref in zip(got, want, strict=True):
        assert row == pytest.approx(ref, abs=1e-6)


def test_equal_groups_give_the_same_advantages_ragged_or_not():
    assert torch.allclose(torch.tensor(group_advantages(REWARDS)), compute_advantages(torch.tensor(REWARDS)))
