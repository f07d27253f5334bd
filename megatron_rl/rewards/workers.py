"""Reward computation off the event loop, in worker processes.

Math-Verify's timeouts rely on SIGALRM, which only works in a process's main thread, and a slow
symbolic comparison must not stall generation: rewards run in a small process pool, and the pipeline
awaits them concurrently with generation. A call that outlives its deadline counts as 'timeout'.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import multiprocessing

from megatron_rl.config import RewardsConfig
from megatron_rl.data.datasets import Prompt
from megatron_rl.rewards import RewardResult, score


class RewardWorkers:
    def __init__(self, cfg: RewardsConfig, processes: int = 2) -> None:
        self.cfg = cfg
        # spawn: the parent holds threads (HTTP clients, torch); forking those is unsafe.
        self.pool = concurrent.futures.ProcessPoolExecutor(processes, mp_context=multiprocessing.get_context("spawn"))
        self.deadline_s = 2 * cfg.math_timeout_s + cfg.sandbox.wall_time_s + 5.0

    async def score(self, completion: str, prompt: Prompt) -> RewardResult:
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(self.pool, score, completion, prompt, self.cfg)
        try:
            return await asyncio.wait_for(future, self.deadline_s)
        except TimeoutError:
            return RewardResult(self.cfg.incorrect, False, "timeout")

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
