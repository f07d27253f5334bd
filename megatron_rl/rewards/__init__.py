"""Rewards per task: a registry from task name to reward function, and failure accounting.

    REWARDS["math"](completion_text, prompt, cfg) -> RewardResult
    REWARDS["code"](completion_text, prompt, cfg) -> RewardResult   (rewards/code.py, in the sandbox)

`score` is what the pipeline calls: it looks the task up and turns an exception inside a reward
function into a counted failure ('reward_error') with the incorrect reward, never a crash. `time_bound_s`
is the longest `score` takes on a prompt when nothing hangs (rewards/workers.py presumes a worker past
it, plus a margin, hung).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from megatron_rl.config import RewardsConfig
from megatron_rl.data.datasets import Prompt
from megatron_rl.rewards.code import code_reward, code_time_bound_s
from megatron_rl.rewards.math import RewardResult, math_reward, math_time_bound_s
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

TIME_BOUNDS: dict[str, Callable[[Prompt, RewardsConfig], float]] = {
    "math": lambda prompt, cfg: math_time_bound_s(cfg),
    "code": lambda prompt, cfg: code_time_bound_s(prompt.tests or {}, cfg),
}
"""Per task: the longest its reward function takes on a prompt when nothing hangs, in seconds."""


def time_bound_s(prompt: Prompt, cfg: RewardsConfig) -> float:
    """The longest `score` takes on this prompt when nothing hangs."""
    if prompt.task not in TIME_BOUNDS:
        raise ValueError(f"task {prompt.task!r} of prompt {prompt.id} has no time bound; known: {list(TIME_BOUNDS)}")
    return TIME_BOUNDS[prompt.task](prompt, cfg)


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
