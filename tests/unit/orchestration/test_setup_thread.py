"""The driver reads its data and tokenizer in a daemon thread while Ray starts (orchestration/train.py): its
outcome reaches the event loop, its error too, and a start stopped meanwhile (Ctrl-C during a first run's
one-minute warm-up) does not wait for it."""

from __future__ import annotations

import asyncio
import threading

import pytest

from megatron_rl.orchestration.train import _in_daemon_thread


def _refuse(message: str) -> None:
    raise ValueError(message)


def test_the_threads_result_and_error_reach_the_loop():
    async def main() -> int:
        with pytest.raises(ValueError, match="data.datasets"):
            await _in_daemon_thread(_refuse, "data.datasets[0]: bad row")
        return await _in_daemon_thread(lambda x: x + 1, 41)

    assert asyncio.run(main()) == 42


def test_a_stopped_start_does_not_wait_for_the_thread():
    release = threading.Event()

    def warm_up() -> None:
        release.wait(60)

    async def main() -> None:
        pending = _in_daemon_thread(warm_up)
        await asyncio.sleep(0)
        pending.cancel()

    asyncio.run(main())  # returns with the thread still running (asyncio.to_thread would hold it here)
    running = [t for t in threading.enumerate() if t.name == "warm_up"]
    assert running and running[0].daemon and not release.is_set()
    release.set()
    running[0].join(5)
    assert not running[0].is_alive()
