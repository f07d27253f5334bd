"""Rewards per task: a registry from task name to reward function, and failure accounting.

    REWARDS["math"](completion_text, prompt, cfg) -> RewardResult
    REWARDS["code"](completion_text, prompt, cfg) -> RewardResult   (rewards/code.py, in the sandbox)

`score` is what the pipeline calls: it looks the task up and turns an exception inside a reward
function into a counted failure ('reward_error') with the incorrect reward, never a crash.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from megatron_rl.config import RewardsConfig
from megatron_rl.data.datasets import Prompt
from megatron_rl.rewards.code import code_reward
from megatron_rl.rewards.math import RewardResult, math_reward
from megatron_rl.rewards.sandbox import SandboxUnavailable

log = logging.getLogger(__name__)

RewardFn = Callable[[str, Prompt, RewardsConfig], RewardResult]


def _math(completion: str, prompt: Prompt, cfg: RewardsConfig) -> RewardResult:
    assert prompt.answer is not None  # the math schema requires it (data/datasets.py)
    return math_reward(completion, prompt.answer, cfg)


def _code(completion: str, prompt: Prompt, cfg: RewardsConfig) -> RewardResult:
    assert prompt.tests is not None  # the code schema requires it (data/datasets.py)
    return code_reward(completion, prompt.tests, cfg)


REWARDS: dict[str, RewardFn] = {
    "math": _math,
    "code": _code,
}


def score(completion: str, prompt: Prompt, cfg: RewardsConfig) -> RewardResult:
    """The reward of one completion; a failing reward function gives a counted 'reward_error'."""
    if prompt.task not in REWARDS:
        raise ValueError(f"task {prompt.task!r} of prompt {prompt.id} has no reward function; known: {list(REWARDS)}")
    try:
        return REWARDS[prompt.task](completion, prompt, cfg)
    except SandboxUnavailable:
        raise  # no isolation for model-written code: stop the run, never score code unisolated silently
    except Exception as exc:  # a reward bug must cost one sample, not the run; it is logged and counted
        log.warning(
            "reward function for %s failed on prompt %s: %s: %s", prompt.task, prompt.id, type(exc).__name__, exc
        )
        return RewardResult(cfg.incorrect, False, "reward_error")
