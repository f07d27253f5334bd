"""A reward function that raises costs one sample, counted, never the run; a missing sandbox or an unknown
task still stops it (rewards/__init__.py `score`, run in worker processes by rewards/workers.py)."""

import asyncio

import pytest

from megatron_rl.config import RewardsConfig
from megatron_rl.data.datasets import Prompt
from megatron_rl.rewards import REWARDS, score
from megatron_rl.rewards.sandbox import SandboxUnavailable
from megatron_rl.rewards.workers import RewardWorkers
from megatron_rl.rollout.pipeline import BatchStats

CFG = RewardsConfig(correct=1.0, incorrect=-1.0)


def test_a_reward_raising_in_a_worker_process_is_a_counted_failure():
    # A math prompt without a reference answer makes the math reward function itself raise (it asserts
    # one exists), in the spawned worker process where the pipeline runs rewards.
    good = Prompt("good", "math", "1+1?", "2")
    broken = Prompt("broken", "math", "1+1?", None)
    workers = RewardWorkers(CFG, processes=1)

    async def both():
        return await asyncio.gather(workers.score("\\boxed{2}", good), workers.score("\\boxed{2}", broken))

    try:
        ok, failed = asyncio.run(both())
    finally:
        workers.close()
    assert (ok.reward, ok.passed, ok.failure) == (1.0, True, None)
    assert (failed.reward, failed.passed, failed.failure) == (-1.0, False, "reward_error")


def test_reward_failures_are_logged_per_reason():
    stats = BatchStats(completions=4, failures={"reward_error": 1, "wrong_answer": 2})
    metrics = stats.as_metrics()
    assert metrics["train/failures/reward_error"] == 1.0 and metrics["train/failures/wrong_answer"] == 2.0


def test_a_missing_sandbox_or_an_unknown_task_is_not_swallowed(monkeypatch):
    def no_sandbox(completion, prompt, cfg):
        raise SandboxUnavailable("no isolation here")

    monkeypatch.setitem(REWARDS, "code", no_sandbox)
    with pytest.raises(SandboxUnavailable):
        score("print(1)", Prompt("c", "code", "print 1", tests={"inputs": [""], "outputs": ["1"]}), CFG)
    with pytest.raises(ValueError, match="no reward function"):
        score("x", Prompt("t", "poetry", "a poem"), CFG)


def _die_on_crash_prompt(completion, prompt, cfg):
    """Runs in the worker process: the 'crash' prompt kills it, as a segfault or the OOM killer would."""
    import os

    if prompt.id == "crash":
        os._exit(1)
    return score(completion, prompt, cfg)


def test_a_dying_reward_worker_costs_its_samples_and_the_pool_is_replaced():
    workers = RewardWorkers(CFG, processes=1, fn=_die_on_crash_prompt)
    good = Prompt("good", "math", "1+1?", "2")

    async def run():
        crashed = await workers.score("\\boxed{2}", Prompt("crash", "math", "1+1?", "2"))
        after = await asyncio.gather(*(workers.score("\\boxed{2}", good) for _ in range(3)))
        return crashed, after

    try:
        crashed, after = asyncio.run(run())
    finally:
        workers.close()
    assert (crashed.reward, crashed.passed, crashed.failure) == (-1.0, False, "reward_crash")
    assert all(r.passed and r.reward == 1.0 for r in after)  # the replacement pool scores the rest
    assert workers.pool_restarts == 1
