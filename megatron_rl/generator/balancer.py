"""Several SGLang engines as one `GenerateFn` for the rollout pipeline: least outstanding requests first, a
continuation sent back to the engine that holds its prefix, failed requests retried on another engine,
per-engine failures and utilisation counted.

    generate = EngineBalancer([client, ...], sampling, max_retries)          # a GenerateFn
    segment = await generate(input_ids, max_new_tokens, stop_token_ids)
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable

import numpy as np

from megatron_rl.config import SamplingConfig
from megatron_rl.generator.client import EngineError, EngineRequestError, EngineUnavailableError, SGLangClient
from megatron_rl.rollout.interruption import Segment

log = logging.getLogger(__name__)


def _retryable(exc: EngineError) -> bool:
    # A 4xx is the request's fault (e.g. a prompt over the context length): another engine says the same.
    # A garbled answer (status 200 that does not parse) is the engine's: retried, like a 5xx.
    return not isinstance(exc, EngineRequestError) or exc.status >= 500 or exc.status == 200


class PrefixAffinity:
    """Which engine last ran a sequence that a new request starts with. A completion that goes on in a further
    request (interruption's answer after the injected phrase, the next turn after a tool's output) sends its whole
    sequence so far: the previous request's input and the tokens it generated (cut to the thinking budget, or
    whole), then what was added. On the engine that ran the previous request SGLang's radix cache still holds that
    prefix, so only the added tokens are prefilled.

    Sequences are keyed in chunks of `chunk` ids: a chain of hashes, one link per whole chunk, each over the previous
    link and the chunk's bytes (~L/32 hashing steps for L ids). After a request the last `tail` links of its input
    and output are remembered with its engine; a new request matches the longest link of its own input's chain that
    is remembered. At most `capacity` links are kept, least recently used dropped. The match is a preference, never
    a pin: `EngineBalancer` passes over an engine that is down or loaded beyond the least loaded one by more than its
    slack, and the request is then prefilled elsewhere (as after an engine restart)."""

    def __init__(self, chunk: int = 32, tail: int = 3, capacity: int = 16384) -> None:
        self.chunk, self.tail, self.capacity = chunk, tail, capacity
        self._engine: OrderedDict[tuple[int, int], int] = OrderedDict()

    def _links(self, ids: list[int]) -> list[tuple[int, int]]:
        array = np.asarray(ids, dtype=np.int64)
        links, link = [], 0
        for k in range(len(array) // self.chunk):
            link = hash((link, array[k * self.chunk : (k + 1) * self.chunk].tobytes()))
            links.append((k + 1, link))
        return links

    def engine_for(self, input_ids: list[int]) -> int | None:
        """The engine remembered for the longest remembered prefix of `input_ids`, if any."""
        for link in reversed(self._links(input_ids)):
            engine = self._engine.get(link)
            if engine is not None:
                self._engine.move_to_end(link)
                return engine
        return None

    def remember(self, sequence: list[int], engine: int) -> None:
        """`engine` ran `sequence` (a request's input and the tokens it generated)."""
        for link in self._links(sequence)[-self.tail :]:
            self._engine[link] = engine
            self._engine.move_to_end(link)
        while len(self._engine) > self.capacity:
            self._engine.popitem(last=False)


class EngineBalancer:
    """A `GenerateFn` over several engines: least outstanding requests first (round robin among ties).

    A request whose engine fails with a retryable EngineError (unavailable, timeout, HTTP 5xx) is retried
    on another engine, up to `max_retries` times; `failures` counts failed attempts and `retries` the
    re-sends. An engine whose connection failed is avoided for `down_s` seconds (then tried again), so
    the least-outstanding rule does not pour requests into a dead engine. `on_failure`, if set, is awaited
    with the failed client before the retry (the orchestrator restarts the engine there, and may change
    `client.url`).

    A request whose input begins with one an engine ran recently goes back to that engine (`PrefixAffinity`:
    its prefix cache holds the start) unless it is down or has more than `affinity_slack` requests outstanding
    beyond the least loaded engine; `rollout/affinity_hits` counts those sent back.

    Utilisation: an engine is busy while at least one request sent through this balancer is outstanding on
    it (a failed attempt counts until it fails). `metrics()` reports the busy seconds summed over engines
    and the idle share 1 - busy / (elapsed x engines), both cumulative since creation or `reset_usage()`.
    """

    def __init__(
        self,
        clients: list[SGLangClient],
        sampling: SamplingConfig,
        max_retries: int = 3,
        down_s: float = 10.0,
        affinity_slack: int = 4,
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
        self.affinity, self.affinity_slack, self.affinity_hits = PrefixAffinity(), affinity_slack, 0

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

    def _pick(self, exclude: set[int], preferred: int | None = None) -> int:
        n, now = len(self.clients), time.monotonic()
        order = [(self._next + i) % n for i in range(n)]
        fresh = [i for i in order if i not in exclude]
        candidates = [i for i in fresh if self._down_until[i] <= now] or fresh or order
        best = min(candidates, key=lambda i: self.clients[i].outstanding)  # first minimum: round robin on ties
        slack = self.affinity_slack
        if preferred is not None and preferred in candidates and self._load(preferred) <= self._load(best) + slack:
            self.affinity_hits += 1
            return preferred
        self._next = (best + 1) % n
        return best

    def _load(self, index: int) -> int:
        return self.clients[index].outstanding

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
        preferred = self.affinity.engine_for(input_ids) if len(self.clients) > 1 else None
        while True:
            index = self._pick(failed, preferred)
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
            if len(self.clients) > 1:
                self.affinity.remember(input_ids + segment.tokens, index)
            return segment

    def metrics(self) -> dict[str, float]:
        busy = sum(self.busy_seconds())
        capacity = (time.monotonic() - self._usage_t0) * len(self.clients)
        return {
            "rollout/engine_requests": float(self.requests),
            "rollout/engine_retries": float(self.retries),
            "rollout/engine_failures": float(self.failures),
            "rollout/affinity_hits": float(self.affinity_hits),
            "rollout/generator_busy_s": busy,
            "rollout/generator_idle_share": 1.0 - busy / capacity if capacity > 0 else 0.0,
        }
