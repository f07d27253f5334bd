"""Stopping a run on a signal: SIGTERM / SIGUSR1 (Slurm's pre-timeout signal) checkpoint and end it, or cancel
its start."""

from __future__ import annotations

import asyncio
import signal
from typing import Any


class StopFlag:
    """Set by SIGTERM / SIGUSR1 (Slurm's pre-timeout signal): checkpoint at the end of this step and exit. During
    start-up there is nothing to checkpoint and a start takes minutes (engines loading weights): the signal cancels
    the start (`cancels`), which shuts down what it started.

    `ray.init` installs Ray's own SIGTERM handler in the driver (it ends the process at once, wherever it is), so
    `ray_head.start_ray` keeps this one while Ray starts, and `install` runs again once Ray is up (Ray's core worker
    adds a handler that prints a stack dump)."""

    def __init__(self, enabled: bool) -> None:
        self.signal: str | None = None
        self.enabled = enabled
        self._start: asyncio.Future[Any] | None = None
        self.install()

    def install(self) -> None:
        if self.enabled:
            for sig in (signal.SIGTERM, signal.SIGUSR1):
                signal.signal(sig, self._handle)

    def cancels(self, start: asyncio.Future[Any]) -> None:
        """Until `start` is done, a signal cancels it (one that came already does so now)."""
        self._start = start
        if self.signal is not None:
            start.cancel()

    def _handle(self, signum: int, frame: Any) -> None:
        self.signal = signal.Signals(signum).name
        if self._start is not None and not self._start.done():
            # As asyncio's own Ctrl-C handling: the cancellation lands at the start's next await, and the loop is
            # woken in case it sleeps in select().
            self._start.cancel()
            self._start.get_loop().call_soon_threadsafe(lambda: None)

    def __bool__(self) -> bool:
        return self.signal is not None
