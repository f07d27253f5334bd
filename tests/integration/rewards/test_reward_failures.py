"""A reward function that raises costs one sample, counted, never the run; a missing sandbox or an unknown
task still stops it (rewards/__init__.py `score`, run in worker processes by rewards/workers.py)."""

import asyncio

import psutil
import pytest

from megatron_rl.config import RewardsConfig, SandboxConfig
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


def _slow_score(completion, prompt, cfg):
    """Runs in the worker process: a reward that takes its time (0.2 s), well within any deadline."""
    import time

    time.sleep(0.2)
    return score(completion, prompt, cfg)


def test_a_burst_waits_for_workers_without_timing_out():
    # 30 jobs of 0.2 s on one worker take 6 s, past the 5 s a deadline counted from submission gave these
    # limits: only the time a job holds a worker counts.
    cfg = RewardsConfig(correct=1.0, incorrect=-1.0, math_timeout_s=0.0, sandbox=SandboxConfig(wall_time_s=0.0))
    workers = RewardWorkers(cfg, processes=1, fn=_slow_score)
    prompt = Prompt("p", "math", "1+1?", "2")

    async def burst():
        return await asyncio.gather(*(workers.score("\\boxed{2}", prompt) for _ in range(30)))

    try:
        results = asyncio.run(burst())
    finally:
        workers.close()
    assert [r.failure for r in results] == [None] * 30
    assert workers.hung_workers == 0 and workers.pool_restarts == 0


def _hang_on_hang_prompt(completion, prompt, cfg):
    """Runs in the worker process: the 'hang' prompt never returns, as a native library stuck in a loop."""
    import time

    if prompt.id == "hang":
        time.sleep(3600)
    return score(completion, prompt, cfg)


def test_a_hung_worker_is_killed_and_replaced():
    workers = RewardWorkers(CFG, processes=1, fn=_hang_on_hang_prompt, deadline_s=lambda prompt: 2.0)
    good = Prompt("good", "math", "1+1?", "2")

    async def run():
        await workers.score("\\boxed{2}", good)  # the worker is up
        [hung_pid] = workers.pids
        # Three jobs queued behind the hung one: with the only worker stuck they would never run.
        results = await asyncio.gather(
            workers.score("\\boxed{2}", Prompt("hang", "math", "1+1?", "2")),
            *(workers.score("\\boxed{2}", good) for _ in range(3)),
        )
        return hung_pid, results

    try:
        hung_pid, (hung, *after) = asyncio.run(run())
        assert (hung.reward, hung.passed, hung.failure) == (-1.0, False, "timeout")
        assert all(r.passed and r.reward == 1.0 for r in after)
        assert workers.hung_workers == 1 and workers.pool_restarts == 0
        assert not psutil.pid_exists(hung_pid)  # killed and reaped, not left holding a slot
        assert len(workers.pids) == 1 and psutil.Process(workers.pids[0]).is_running()  # its replacement
    finally:
        workers.close()


def test_a_cancelled_job_retires_its_worker_and_its_late_answer_is_never_read():
    workers = RewardWorkers(CFG, processes=1, fn=_slow_score)
    prompt = Prompt("p", "math", "1+1?", "2")

    async def run():
        await workers.score("\\boxed{2}", prompt)  # the worker is up
        wrong = asyncio.create_task(workers.score("\\boxed{3}", prompt))
        await asyncio.sleep(0.1)  # its job is in the worker, which answers 0.1 s later
        wrong.cancel()
        right = await workers.score("\\boxed{2}", prompt)
        return wrong, right

    try:
        wrong, right = asyncio.run(run())
    finally:
        workers.close()
    assert wrong.cancelled()
    assert (right.passed, right.failure) == (True, None)  # not the cancelled job's 'wrong_answer'
    assert workers.pool_restarts == 0 and workers.hung_workers == 0


def _no_sandbox(completion, prompt, cfg):
    raise SandboxUnavailable("no isolation here")


def test_an_exception_of_the_reward_function_is_raised_by_score():
    workers = RewardWorkers(CFG, processes=1, fn=_no_sandbox)
    try:
        with pytest.raises(SandboxUnavailable, match="no isolation here"):
            asyncio.run(workers.score("print(1)", Prompt("c", "math", "1+1?", "2")))
        # the worker that raised is healthy and keeps serving
        with pytest.raises(SandboxUnavailable):
            asyncio.run(workers.score("print(1)", Prompt("c", "math", "1+1?", "2")))
        assert workers.pool_restarts == 0 and workers.hung_workers == 0
    finally:
        workers.close()


class _Unpicklable(Exception):
    def __init__(self, detail, code):  # two arguments: unpickling calls it with one, and fails
        super().__init__(f"{detail} ({code})")


def _raise_unpicklable(completion, prompt, cfg):
    raise _Unpicklable("odd failure", 7)


def test_an_exception_that_does_not_pickle_is_raised_as_a_runtime_error_naming_it():
    workers = RewardWorkers(CFG, processes=1, fn=_raise_unpicklable)
    try:
        with pytest.raises(RuntimeError, match="_Unpicklable: odd failure"):
            asyncio.run(workers.score("x", Prompt("p", "math", "1+1?", "2")))
        assert workers.pool_restarts == 0
    finally:
        workers.close()
