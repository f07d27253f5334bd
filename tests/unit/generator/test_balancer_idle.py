"""EngineBalancer's busy / idle accounting against the union of the request intervals a fake engine saw.

The fake client only sleeps and records when each call started and ended; the expected busy time of an
engine is the total length of the union of its intervals, computed here independently of the balancer.
Durations are compared with a tolerance for the microseconds between the two clocks' readings; nothing
here asserts how long anything took.
"""

from __future__ import annotations

import asyncio
import time
from typing import cast

from megatron_rl.config import SamplingConfig
from megatron_rl.generator.balancer import EngineBalancer
from megatron_rl.generator.client import EngineRequestError, EngineTimeoutError, SGLangClient

TOL_S = 0.01


class Answer(str):
    """A fake engine's answer: its name, and no generated tokens (what the balancer reads of a Segment)."""

    tokens: list[int] = []


class FakeClient:
    """Stands in for SGLangClient: `generate` sleeps `durations` in turn; `fail` makes the next call time out."""

    def __init__(self, name: str, durations: list[float]) -> None:
        self.url = name
        self.outstanding = 0
        self.durations = list(durations)
        self.fail = False
        self.intervals: list[tuple[float, float]] = []

    async def generate(self, input_ids: list[int], max_new_tokens: int, stop_ids: list[int], sampling: object) -> str:
        start = time.monotonic()
        self.outstanding += 1
        try:
            await asyncio.sleep(self.durations.pop(0))
            if self.fail:
                self.fail = False
                raise EngineTimeoutError(self.url, "fake timeout")
            return Answer(self.url)
        finally:
            self.outstanding -= 1
            self.intervals.append((start, time.monotonic()))

    async def health(self) -> bool:
        return True


def make_balancer(clients: list[FakeClient], max_retries: int) -> EngineBalancer:
    """A balancer over fakes: it only uses their `generate`, `outstanding`, `health` and `url`."""
    return EngineBalancer(cast(list[SGLangClient], clients), SamplingConfig(), max_retries=max_retries)


def union_length(intervals: list[tuple[float, float]], since: float = float("-inf")) -> float:
    """Total length covered by the intervals, clipped to start no earlier than `since`."""
    total, end = 0.0, float("-inf")
    for a, b in sorted((max(a, since), b) for a, b in intervals if b > since):
        if a > end:
            total += b - a
            end = b
        elif b > end:
            total += b - end
            end = b
    return total


def test_union_length_reference() -> None:
    assert union_length([(0.0, 2.0), (1.0, 3.0), (5.0, 6.0)]) == 4.0
    assert union_length([(0.0, 2.0), (0.5, 1.0)]) == 2.0
    assert union_length([(0.0, 2.0), (3.0, 4.0)], since=1.5) == 1.5


async def _call(balancer: EngineBalancer, delay: float) -> object:
    await asyncio.sleep(delay)
    return await balancer([1, 2, 3], 8, [])


def test_busy_time_is_union_of_outstanding_intervals() -> None:
    async def scenario() -> tuple[EngineBalancer, list[FakeClient], float, float]:
        clients = [FakeClient("a", [0.08] * 6), FakeClient("b", [0.05] * 6)]
        before = time.monotonic()
        balancer = make_balancer(clients, 0)
        after = time.monotonic()
        # Overlapping requests (both engines busy, then one), a gap with nothing outstanding, then more.
        await asyncio.gather(*(_call(balancer, d) for d in (0.0, 0.0, 0.02, 0.03)))
        await asyncio.sleep(0.1)
        await asyncio.gather(*(_call(balancer, d) for d in (0.0, 0.01)))
        await asyncio.sleep(0.05)
        return balancer, clients, before, after

    balancer, clients, created_lo, created_hi = asyncio.run(scenario())
    busy = balancer.busy_seconds()
    for client, seconds in zip(clients, busy, strict=True):
        assert client.intervals, "every engine should have served requests"
        assert abs(seconds - union_length(client.intervals)) < TOL_S

    metrics_lo = time.monotonic()
    metrics = balancer.metrics()
    metrics_hi = time.monotonic()
    assert abs(metrics["rollout/generator_busy_s"] - sum(busy)) < 1e-9  # nothing outstanding: no growth
    # The balancer's own elapsed time lies between these bounds, so its idle share does too.
    expected_busy = sum(union_length(c.intervals) for c in clients)
    idle_lo = 1 - (expected_busy + TOL_S) / ((metrics_lo - created_hi) * len(clients))
    idle_hi = 1 - (expected_busy - TOL_S) / ((metrics_hi - created_lo) * len(clients))
    assert idle_lo <= metrics["rollout/generator_idle_share"] <= idle_hi
    assert 0.0 < metrics["rollout/generator_idle_share"] < 1.0


def test_in_flight_request_counts_and_reset_starts_a_new_window() -> None:
    async def scenario() -> tuple[list[float], float, list[float], FakeClient, float]:
        client = FakeClient("a", [0.1, 0.1])
        balancer = make_balancer([client], 0)
        await _call(balancer, 0.0)
        task = asyncio.create_task(_call(balancer, 0.0))
        await asyncio.sleep(0.04)
        mid = balancer.busy_seconds()  # first request done, second still running
        mid_t = time.monotonic()
        balancer.reset_usage()
        reset_t = time.monotonic()
        await task
        await asyncio.sleep(0.02)
        return mid, mid_t, balancer.busy_seconds(), client, reset_t

    mid, mid_t, after, client, reset_t = asyncio.run(scenario())
    (first, second) = client.intervals
    assert abs(mid[0] - ((first[1] - first[0]) + (mid_t - second[0]))) < TOL_S
    # After the reset only the rest of the running request counts.
    assert abs(after[0] - union_length(client.intervals, since=reset_t)) < TOL_S
    assert after[0] < second[1] - second[0]


def test_failed_attempt_counts_until_it_fails_and_retry_is_accounted_on_the_other_engine() -> None:
    async def scenario() -> tuple[EngineBalancer, list[FakeClient], object]:
        bad, good = FakeClient("bad", [0.03]), FakeClient("good", [0.05])
        bad.fail = True
        balancer = make_balancer([bad, good], 1)
        result = await _call(balancer, 0.0)
        return balancer, [bad, good], result

    balancer, clients, result = asyncio.run(scenario())
    assert result == "good"
    assert balancer.failures == 1 and balancer.retries == 1
    for client, seconds in zip(clients, balancer.busy_seconds(), strict=True):
        assert len(client.intervals) == 1
        assert abs(seconds - union_length(client.intervals)) < TOL_S


class GarblingClient(FakeClient):
    """Answers its first request with something that is not a generation (EngineRequestError, status 200)."""

    async def generate(self, input_ids: list[int], max_new_tokens: int, stop_ids: list[int], sampling: object) -> str:
        if not self.intervals:
            self.intervals.append((time.monotonic(), time.monotonic()))
            raise EngineRequestError(self.url, "/generate: malformed answer (KeyError('meta_info'))", 200)
        return await super().generate(input_ids, max_new_tokens, stop_ids, sampling)


def test_a_garbled_answer_is_counted_and_retried_and_a_bad_request_is_not() -> None:
    async def scenario() -> tuple[object, EngineBalancer]:
        balancer = make_balancer([GarblingClient("a", [0.01] * 3), FakeClient("b", [0.01] * 3)], max_retries=1)
        return await balancer([1, 2, 3], 8, []), balancer

    answer, balancer = asyncio.run(scenario())
    assert answer == "b"  # the same request, answered by the other engine
    assert balancer.metrics()["rollout/engine_failures"] == 1 and balancer.metrics()["rollout/engine_retries"] == 1

    class Refusing(FakeClient):
        async def generate(self, *args: object) -> str:
            raise EngineRequestError(self.url, "/generate: HTTP 400: prompt too long", 400)

    async def refused() -> None:
        await make_balancer([Refusing("a", []), FakeClient("b", [0.01])], max_retries=2)([1], 8, [])

    try:
        asyncio.run(refused())
        raise AssertionError("a 400 was retried")
    except EngineRequestError as exc:
        assert exc.status == 400
