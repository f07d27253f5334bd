"""Several SGLang engines as one `GenerateFn` for the rollout pipeline: least outstanding requests first,
failed requests retried on another engine, per-engine failures and utilisation counted.

    generate = EngineBalancer([client, ...], sampling, max_retries)          # a GenerateFn
    segment = await generate(input_ids, max_new_tokens, stop_token_ids)
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable

from megatron_rl.config import SamplingConfig
from megatron_rl.generator.client import EngineError, EngineRequestError, EngineUnavailableError, SGLangClient
from megatron_rl.rollout.interruption import Segment

log = logging.getLogger(__name__)


def _retryable(exc: EngineError) -> bool:
    # A 4xx is the request's fault (e.g. a prompt over the context length): another engine says the same.
    # A garbled answer (status 200 that does not parse) is the engine's: retried, like a 5xx.
    return not isinstance(exc, EngineRequestError) or exc.status >= 500 or exc.status == 200


class EngineBalancer:
    """A `GenerateFn` over several engines: least outstanding requests first (round robin among ties).

    A request whose engine fails with a retryable EngineError (unavailable, timeout, HTTP 5xx) is retried
    on another engine, up to `max_retries` times; `failures` counts failed attempts and `retries` the
    re-sends. An engine whose connection failed is avoided for `down_s` seconds (then tried again), so
    the least-outstanding rule does not pour requests into a dead engine. `on_failure`, if set, is awaited
    with the failed client before the retry (the orchestrator restarts the engine there, and may change
    `client.url`).

    Utilisation: an engine is busy while at least one request sent through this balancer is outstanding on
    it (a failed attempt counts until it fails). `metrics()` reports the busy seconds summed over engines
    and the idle share 1 - busy / (elapsed x engines), both cumulative since creation or `reset_usage()`.
    """

    def __init__(
        self, clients: list[SGLangClient], sampling: SamplingConfig, max_retries: int = 3, down_s: float = 10.0
    ) -> None:
        if not clients:
            raise ValueError("EngineBalancer needs at least one engine")
        if max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {max_retries}")
        self.clients, self.sampling, self.max_retries, self.down_s = list(clients), sampling, max_retries, down_s
        self.requests = 0
        self.retries = 0
        self.failures = 0
        self.failures_by_engine = [0] * len(self.clients)
        self.on_failure: Callable[[SGLangClient], Awaitable[None]] | None = None
        self._down_until = [0.0] * len(self.clients)
        self._next = 0
        self._inflight = [0] * len(self.clients)
        self._busy_since = [0.0] * len(self.clients)
        self._busy_s = [0.0] * len(self.clients)
        self._usage_t0 = time.monotonic()

    def reset_usage(self) -> None:
        """Start a new utilisation window now (busy seconds back to zero; in-flight requests keep counting)."""
        now = time.monotonic()
        self._usage_t0 = now
        self._busy_s = [0.0] * len(self.clients)
        self._busy_since = [now] * len(self.clients)

    def busy_seconds(self) -> list[float]:
        """Per engine: seconds with at least one outstanding request since the window started."""
        now, spans = time.monotonic(), zip(self._busy_s, self._busy_since, self._inflight, strict=True)
        return [busy + (now - since if inflight else 0.0) for busy, since, inflight in spans]

    async def _send(
        self, index: int, input_ids: list[int], max_new_tokens: int, stop_ids: list[int], sampling: SamplingConfig
    ) -> Segment:
        if self._inflight[index] == 0:
            self._busy_since[index] = time.monotonic()
        self._inflight[index] += 1
        try:
            return await self.clients[index].generate(input_ids, max_new_tokens, stop_ids, sampling)
        finally:
            self._inflight[index] -= 1
            if self._inflight[index] == 0:
                self._busy_s[index] += time.monotonic() - self._busy_since[index]

    def _pick(self, exclude: set[int]) -> int:
        n, now = len(self.clients), time.monotonic()
        order = [(self._next + i) % n for i in range(n)]
        fresh = [i for i in order if i not in exclude]
        candidates = [i for i in fresh if self._down_until[i] <= now] or fresh or order
        best = min(candidates, key=lambda i: self.clients[i].outstanding)  # first minimum: round robin on ties
        self._next = (best + 1) % n
        return best

    async def __call__(
        self,
        input_ids: list[int],
        max_new_tokens: int,
        stop_token_ids: list[int],
        sampling: SamplingConfig | None = None,
    ) -> Segment:
        """One request on the least busy engine, retried on failure; `sampling` overrides the balancer's (an
        evaluation's temperature)."""
        self.requests += 1
        failed: set[int] = set()
        attempt = 0
        while True:
            index = self._pick(failed)
            client = self.clients[index]
            try:
                segment = await self._send(index, input_ids, max_new_tokens, stop_token_ids, sampling or self.sampling)
            except EngineError as exc:
                self.failures += 1
                self.failures_by_engine[index] += 1
                if self.failures <= 20:
                    log.warning("engine %s failed a request (failure %d): %s", client.url, self.failures, exc)
                if isinstance(exc, EngineUnavailableError):
                    self._down_until[index] = time.monotonic() + self.down_s
                if not _retryable(exc) or attempt == self.max_retries:
                    raise
                failed.add(index)
                attempt += 1
                self.retries += 1
                if self.on_failure is not None:
                    await self.on_failure(client)
                    if await client.health():
                        self._down_until[index] = 0.0
                continue
            self._down_until[index] = 0.0
            return segment

    def metrics(self) -> dict[str, float]:
        busy = sum(self.busy_seconds())
        capacity = (time.monotonic() - self._usage_t0) * len(self.clients)
        return {
            "rollout/engine_requests": float(self.requests),
            "rollout/engine_retries": float(self.retries),
            "rollout/engine_failures": float(self.failures),
            "rollout/generator_busy_s": busy,
            "rollout/generator_idle_share": 1.0 - busy / capacity if capacity > 0 else 0.0,
        }
