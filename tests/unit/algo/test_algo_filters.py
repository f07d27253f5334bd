"""Zero-variance filter, no-positive resampling state, overlong penalty."""

import json

import pytest

from megatron_rl.algo.filters import NoPositiveResampling, has_reward_variance
from megatron_rl.algo.length_penalty import overlong_penalty


def test_zero_variance_keeps_only_mixed_groups():
    groups = [[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0], [1.0, -1.0, -1.0], [0.5, 0.5, 0.25], [0.7], []]
    assert [has_reward_variance(g) for g in groups] == [False, False, True, True, False, False]


def test_no_positive_resampling_uses_the_latest_group_and_round_trips():
    state = NoPositiveResampling(threshold=0.9)
    state.update("a", [True] * 9 + [False])  # 0.9 -> retired
    state.update("b", [True] * 8 + [False] * 2)  # 0.8 -> stays
    state.update("c", [True] * 10)
    assert not state.is_active("a") and state.is_active("b") and not state.is_active("c")
    state.update("b", [True, False])  # the latest group's pass rate is what is tracked
    assert state.pass_rates["b"] == 0.5
    restored = NoPositiveResampling()
    restored.load_state_dict(json.loads(json.dumps(state.state_dict())))  # survives a JSON checkpoint
    assert restored == state


def test_no_positive_resampling_off():
    state = NoPositiveResampling(threshold=None)
    state.update("a", [True, True])
    assert state.is_active("a") and state.pass_rates["a"] == 1.0


@pytest.mark.parametrize(
    ("length", "expected"), [(0, 0.0), (12288, 0.0), (12289, -1 / 2048), (13312, -0.5), (14336, -1.0), (20000, -1.0)]
)
def test_overlong_penalty(length, expected):
    assert overlong_penalty(length, 14336, 2048) == pytest.approx(expected)


def test_overlong_penalty_rejects_bad_cache():
    with pytest.raises(ValueError, match="cache_length"):
        overlong_penalty(1, 10, 20)
