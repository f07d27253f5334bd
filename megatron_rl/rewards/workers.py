"""Reward computation off the event loop, in worker processes that each score one completion at a time.

Math-Verify's timeouts rely on SIGALRM, which only works in a process's main thread, and a slow
symbolic comparison must not stall generation: rewards run in `processes` worker processes, and the
pipeline awaits them concurrently with generation. Completions wait in the parent, first come first
served, for a free worker; a job's deadline starts when it is handed to a worker, so a burst of thousands
of completions waits as long as the burst takes and none times out in the queue.

    workers = RewardWorkers(cfg, processes=2)
    result = await workers.score(completion_text, prompt)        # RewardResult
    workers.close()

A job's deadline is the longest its reward takes when nothing hangs (`rewards.time_bound_s`: Math-Verify's
parses and comparisons, or the sandbox runs of a code prompt, each under its own limit) plus
`DEADLINE_MARGIN_S`. Failures cost their sample only, counted, and the run goes on:

- a job past its deadline counts as 'timeout'; its worker is presumed hung (a native library spinning with
  signals blocked, a deadlock), SIGKILLed together with its sandboxes (they die with their parent) and
  replaced (`hung_workers`). Without that, hung workers would hold their slots and stall the run.
- a worker process that dies (a segfault in a native library, the OOM killer, `os._exit`) costs the job it
  held, 'reward_crash', and a fresh process takes its place (`pool_restarts`).
- a `score` call cancelled while its job runs (the pipeline shutting down) retires that worker too: its
  late answer must not be read as the next job's.
An exception the reward function raises (SandboxUnavailable: no isolation for model code) is raised by
`score`, as from a plain call.

Workers are `spawn`ed: the parent holds threads (HTTP clients, torch), and forking those is unsafe. Each
imports the reward libraries before taking its first job, so import time is charged to no deadline.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import multiprocessing
import pickle
import signal
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from megatron_rl.config import RewardsConfig
from megatron_rl.data.datasets import Prompt
from megatron_rl.rewards import RewardResult, score, time_bound_s

log = logging.getLogger(__name__)

ScoreFn = Callable[[str, Prompt, RewardsConfig], RewardResult]

DEADLINE_MARGIN_S = 10.0
"""Slack over a reward's own limits before its worker is presumed hung: scheduling on a loaded host,
pickling, the sandbox pool's first start in a worker."""

START_TIMEOUT_S = 120.0
"""How long a new worker may take to import the reward libraries and report ready."""


class RewardWorkers:
    """`processes` reward worker processes fed one job each at a time; see the module docstring."""

    def __init__(
        self,
        cfg: RewardsConfig,
        processes: int = 2,
        fn: ScoreFn = score,
        deadline_s: Callable[[Prompt], float] | None = None,
    ) -> None:
        """`fn` runs in the workers (a module-level function: it is pickled by name). `deadline_s` is how
        long a job on a prompt may hold its worker before the worker is presumed hung; by default the
        prompt's `time_bound_s` plus `DEADLINE_MARGIN_S`."""
        if processes < 1:
            raise ValueError(f"RewardWorkers: processes must be >= 1, got {processes}")
        self.cfg, self.processes, self.fn = cfg, processes, fn
        self.deadline_s = deadline_s or (lambda prompt: time_bound_s(prompt, cfg) + DEADLINE_MARGIN_S)
        self.pool_restarts = 0
        """Workers that died and were replaced (their jobs: 'reward_crash')."""
        self.hung_workers = 0
        """Workers killed and replaced because a job ran past its deadline (their jobs: 'timeout')."""
        self._context = multiprocessing.get_context("spawn")
        self._workers = [self._start() for _ in range(processes)]
        self._idle: list[_Worker] = list(self._workers)
        self._waiting: collections.deque[asyncio.Future[_Worker]] = collections.deque()

    async def score(self, completion: str, prompt: Prompt) -> RewardResult:
        deadline = self.deadline_s(prompt)
        worker = await self._acquire()
        healthy = False
        try:
            await worker.wait_ready()
            try:
                worker.conn.send((completion, prompt))
                answered = await _readable(worker.conn, deadline)
                reply = worker.conn.recv() if answered else None
            except (EOFError, OSError):  # it died before or while answering
                log.warning(
                    "a reward worker process died (prompt %s, exit code %s); starting a new one",
                    prompt.id,
                    worker.exit_code(),
                )
                self.pool_restarts += 1
                return RewardResult(self.cfg.incorrect, False, "reward_crash")
            if reply is None:
                log.warning(
                    "a reward job ran past its %.0f s deadline (prompt %s); killing worker %s and starting a new one",
                    deadline,
                    prompt.id,
                    worker.process.pid,
                )
                self.hung_workers += 1
                return RewardResult(self.cfg.incorrect, False, "timeout")
            healthy = True
            kind, value = reply
            if kind == "raise":
                raise value
            return value
        finally:
            self._release(worker if healthy else self._replace(worker))

    @property
    def pids(self) -> list[int]:
        """The worker processes' ids."""
        return [worker.process.pid for worker in self._workers]

    def metrics(self) -> dict[str, float]:
        """Cumulative counts of reward worker processes replaced (a crash, a hang) for the step's row."""
        return {"rewards/worker_crashes": float(self.pool_restarts), "rewards/hung_workers": float(self.hung_workers)}

    def close(self) -> None:
        for worker in self._workers:
            worker.stop()
        self._idle.clear()

    # Worker slots

    def _start(self) -> _Worker:
        return _Worker(self._context, self.fn, self.cfg)

    def _replace(self, worker: _Worker) -> _Worker:
        worker.stop()
        fresh = self._start()
        self._workers[self._workers.index(worker)] = fresh
        return fresh

    async def _acquire(self) -> _Worker:
        if self._idle:
            return self._idle.pop()
        waiter: asyncio.Future[_Worker] = asyncio.get_running_loop().create_future()
        self._waiting.append(waiter)
        try:
            return await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():  # handed a worker just as it was cancelled
                self._release(waiter.result())
            raise

    def _release(self, worker: _Worker) -> None:
        while self._waiting:
            waiter = self._waiting.popleft()
            if not waiter.done():  # skip callers cancelled while waiting
                waiter.set_result(worker)
                return
        self._idle.append(worker)


class _Worker:
    """One reward process and the parent's end of its pipe; it holds at most one job at a time."""

    def __init__(self, context: Any, fn: ScoreFn, cfg: RewardsConfig) -> None:
        self.conn, child = context.Pipe()
        self.process = context.Process(target=_serve, args=(child, fn, cfg), name="reward-worker", daemon=True)
        self.process.start()
        child.close()
        self.ready = False

    async def wait_ready(self) -> None:
        """Wait for the worker's imports (once); a worker that cannot start is an error, not a sample."""
        if self.ready:
            return
        if await _readable(self.conn, START_TIMEOUT_S):
            with contextlib.suppress(EOFError, OSError):  # it died while starting: reported below
                self.ready = self.conn.recv() == "ready"
        if not self.ready:
            raise RuntimeError(
                f"a reward worker process did not start within {START_TIMEOUT_S:.0f} s (exit code "
                f"{self.exit_code()}); see its stderr above"
            )

    def exit_code(self) -> int | None:
        self.process.join(timeout=1.0)  # a dead worker's end of the pipe closes just before it is reaped
        return self.process.exitcode

    def stop(self) -> None:
        """SIGKILL the process (a hung one would not stop otherwise) and reap it."""
        self.conn.close()
        if self.process.is_alive():
            self.process.kill()
        self.process.join(timeout=5.0)
        if self.process.is_alive():
            log.error("reward worker %s survived SIGKILL", self.process.pid)


async def _readable(conn: Connection, timeout_s: float) -> bool:
    """Wait until `conn` has data or is closed (True), or `timeout_s` passes (False), without blocking the
    event loop."""
    if conn.poll():
        return True
    loop = asyncio.get_running_loop()
    ready: asyncio.Future[None] = loop.create_future()

    def wake() -> None:  # called on every readiness until the reader is removed
        if not ready.done():
            ready.set_result(None)

    fd = conn.fileno()
    loop.add_reader(fd, wake)
    try:
        await asyncio.wait_for(ready, timeout_s)
        return True
    except TimeoutError:
        return False
    finally:
        loop.remove_reader(fd)


def _serve(conn: Connection, fn: ScoreFn, cfg: RewardsConfig) -> None:
    """A worker's main loop: (completion, prompt) in, ("ok", RewardResult) or ("raise", exception) out."""
    # The parent decides when workers end: Ctrl-C reaches the whole process group, and a worker interrupted
    # mid-job would read as a crash. It ends when the parent closes its end of the pipe.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    import math_verify  # noqa: F401  imported here, not in the first job's deadline

    conn.send("ready")
    while True:
        try:
            completion, prompt = conn.recv()
        except (EOFError, OSError):  # closed by the parent; a reset if a reply was still unread on its side
            return
        try:
            reply: tuple[str, Any] = ("ok", fn(completion, prompt, cfg))
        except Exception as exc:  # raised by score in the caller
            reply = ("raise", _portable(exc))
        try:
            conn.send(reply)
        except OSError:  # the parent is gone
            return


def _portable(exc: Exception) -> Exception:
    """`exc` if it survives pickling both ways (the parent must be able to raise it), else a RuntimeError
    naming it: an exception holding a lock, or whose constructor needs other arguments, would not."""
    try:
        pickle.loads(pickle.dumps(exc))
    except Exception as error:
        return RuntimeError(f"{type(exc).__name__}: {exc} (raised by the reward function; does not pickle: {error})")
    return exc
