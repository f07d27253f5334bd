"""Reward computation off the event loop, in worker processes.

Math-Verify's timeouts rely on SIGALRM, which only works in a process's main thread, and a slow
symbolic comparison must not stall generation: rewards run in a small process pool, and the pipeline
awaits them concurrently with generation. A call that outlives its deadline counts as 'timeout'. A worker
process that dies (a segfault in a native library, the OOM killer, `os._exit`) breaks the pool: every
sample it held counts as 'reward_crash' and a fresh pool takes over, so the run goes on.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import multiprocessing
from collections.abc import Callable
from concurrent.futures.process import BrokenProcessPool

from megatron_rl.config import RewardsConfig
from megatron_rl.data.datasets import Prompt
from megatron_rl.rewards import RewardResult, score

log = logging.getLogger(__name__)

ScoreFn = Callable[[str, Prompt, RewardsConfig], RewardResult]


class RewardWorkers:
    def __init__(self, cfg: RewardsConfig, processes: int = 2, fn: ScoreFn = score) -> None:
        self.cfg, self.processes, self.fn = cfg, processes, fn
        self.pool = self._new_pool()
        self.deadline_s = 2 * cfg.math_timeout_s + cfg.sandbox.wall_time_s + 5.0
        self.pool_restarts = 0

    def _new_pool(self) -> concurrent.futures.ProcessPoolExecutor:
        # spawn: the parent holds threads (HTTP clients, torch); forking those is unsafe.
        return concurrent.futures.ProcessPoolExecutor(self.processes, mp_context=multiprocessing.get_context("spawn"))

    async def score(self, completion: str, prompt: Prompt) -> RewardResult:
        loop = asyncio.get_running_loop()
        pool = self.pool
        try:
            future = loop.run_in_executor(pool, self.fn, completion, prompt, self.cfg)
            return await asyncio.wait_for(future, self.deadline_s)
        except TimeoutError:
            return RewardResult(self.cfg.incorrect, False, "timeout")
        except BrokenProcessPool:
            if pool is self.pool:  # the first sample to notice replaces the pool; the others just count
                log.warning("a reward worker process died (prompt %s); starting a new reward pool", prompt.id)
                pool.shutdown(wait=False, cancel_futures=True)
                self.pool = self._new_pool()
                self.pool_restarts += 1
            return RewardResult(self.cfg.incorrect, False, "reward_crash")

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
