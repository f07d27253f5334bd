"""An async client for one SGLang engine's native HTTP API, and the errors an engine call can end in.

    client = SGLangClient(server.url)
    segment = await client.generate(input_ids, max_new_tokens, stop_ids, sampling)   # -> interruption.Segment
    await client.pause(); await client.update_weights_from_distributed(...); await client.resume()

What the pipeline gets back per call (`interruption.Segment`): the sampled token ids, SGLang's per-token
log-probs of the sampling distribution (log-softmax of logits / temperature, computed in fp32; top-p/top-k
truncation is not folded in), the policy version of every token, and the finish reason (stop | length |
abort); with `routing` (MoE routing replay) also the experts SGLang chose at every layer for every token it ran
(`return_routed_experts`, int32 ids base64-encoded by SGLang, kept as RoutingShape's compact ids).
Versions come from SGLang itself: each answer carries `weight_versions`, spans of output tokens
with the weight version that produced them. The server starts at version 0 and every weight update sets
the trainer's step as the new version (generator/weight_sync.py), so a sequence that lived through in-flight
updates says exactly which tokens came from which policy (PipelineRL). The model's own EOS always ends a
segment, as in any SGLang deployment; `stop_token_ids` add to it, and a stop token that ended a segment
is part of its tokens.

Failures are typed so the pipeline can catch and count them: `EngineUnavailableError` (refused or dropped
connection: the server is dead or restarting), `EngineTimeoutError`, `EngineRequestError` (the server
answered with an HTTP error), all `EngineError`. The client retries only what cannot have reached the
server (a connection that was never established); the balancer (generator/balancer.py) retries a failed
request on another engine. A weight update that did not reach every engine ends in a `SyncError` (raised by
generator/weight_sync.py, defined here without torch: the driver catches it and holds no torch).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
from collections.abc import Iterable
from typing import Any, Literal

import aiohttp
import numpy as np
import orjson

from megatron_rl.config import SamplingConfig
from megatron_rl.rollout.interruption import GenerateFn, Segment
from megatron_rl.rollout.types import RoutingShape

CLIENT_KEEPALIVE_S = 4.0
"""The client drops an idle connection after this, before any SGLang server (default 5 s) closes it. A
client that keeps it longer (aiohttp's default is 15 s) sometimes sends a request on a connection the
server is closing at that moment, which fails as 'connection lost' although nothing is wrong: 3-5% of
requests sent ~5 s after the previous one on the same connection, measured against uvicorn."""


class EngineError(RuntimeError):
    """An engine could not answer a request."""

    def __init__(self, url: str, message: str) -> None:
        super().__init__(f"{url}: {message}")
        self.url = url


class EngineUnavailableError(EngineError):
    """No connection to the engine (refused, reset, dropped mid-request): it is dead or restarting."""


class EngineTimeoutError(EngineError):
    """The engine took longer than the client's timeout."""


class EngineRequestError(EngineError):
    """The engine answered with an HTTP error (`status`), or with a malformed answer (`status` 200)."""

    def __init__(self, url: str, message: str, status: int) -> None:
        super().__init__(url, message)
        self.status = status


class SyncError(RuntimeError):
    """A weight update did not reach every engine. `engines`: the sender's indices of the engines that
    failed a call or had not answered by the deadline (the ones to restart); empty when none is to blame."""

    def __init__(self, message: str, engines: Iterable[int] = ()) -> None:
        super().__init__(message)
        self.engines = sorted(set(engines))

    def __reduce__(self) -> tuple[Any, ...]:  # keep `engines` through pickling (Ray)
        return (SyncError, (str(self), self.engines))


FinishReason = Literal["stop", "length", "abort"]
_FINISH: dict[str, FinishReason] = {"stop": "stop", "length": "length", "abort": "abort"}
_JSON = {"Content-Type": "application/json"}


def _parse_version(url: str, value: Any, field: str = "weight version") -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        raise EngineRequestError(
            url, f"{field} {value!r} is not an integer (start SGLang with --weight-version 0)", 200
        ) from None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


class SGLangClient:
    """Async client for one engine's native API (aiohttp; one session per event loop).

    `timeout_s` bounds every request (generation included); a connection that cannot be established is
    retried `connect_retries` times with a growing pause, then raises EngineUnavailableError.
    `outstanding` counts this client's in-flight generate calls (the balancer reads it).

    Generate calls made in the same turn of the event loop (the G completions of a group, a validation's
    prompts) go out as one batched `/generate` request of up to `batch_max` items: SGLang schedules each item
    as its own request, and the HTTP and JSON work is paid once per batch instead of once per completion (at
    a small model's speed that work, ~1 ms of CPU per request on each side, was a fifth of the loop's CPU).
    Each call still gets its own answer, parsed and checked on its own; a failed batch fails each of its calls,
    which the balancer retries one by one.
    The same code runs on GPU nodes, where SGLang's HTTP server takes batches the same way. The price there is
    latency: a batch answers when its slowest item ends, so a completion whose thinking budget ran out early
    starts its answer request when the last of its batch does (the engine keeps decoding the others meanwhile).

    A prompt asked for more than once in a turn (a group's G completions, a validation's samples) is prefilled
    once: a `/generate` of those prompts with no new token goes first, and the completions then find the prompt
    in SGLang's prefix cache, as SGLang's own parallel sampling (`n` > 1) caches the prompt before its samples.
    Without it the engine prefilled each completion's copy of the prompt, in one batch where none could reuse
    another's. Not with `routing`: a completion's routed experts then come from its own prefill.
    """

    PRIME_MIN_TOKENS = 16
    """Shortest prompt prefilled ahead of its copies: shorter ones cost less than the extra request."""

    def __init__(
        self,
        url: str,
        timeout_s: float = 1800.0,
        connect_timeout_s: float = 10.0,
        connect_retries: int = 2,
        retry_backoff_s: float = 0.5,
        tp: int = 1,
        batch_max: int = 64,
        routing: RoutingShape | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self.routing = routing
        """Ask for the routed experts of every request (the server runs with --enable-return-routed-experts)."""
        self.timeout_s, self.connect_timeout_s = timeout_s, connect_timeout_s
        self.connect_retries, self.retry_backoff_s = connect_retries, retry_backoff_s
        self.tp = tp
        self.batch_max = batch_max
        self.outstanding = 0
        self._session: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._queued: list[tuple[list[int], dict[str, Any], asyncio.Future[Any]]] = []
        self._batches: set[asyncio.Task[None]] = set()

    def __repr__(self) -> str:
        return f"SGLangClient({self.url!r})"

    def _get_session(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        if self._session is None or self._session.closed or self._loop is not loop:
            # A session belongs to the loop that made it; a client reused from a new loop gets a new one.
            timeout = aiohttp.ClientTimeout(total=self.timeout_s, sock_connect=self.connect_timeout_s)
            # limit=0: no client-side cap on concurrent requests; SGLang schedules them itself.
            connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=CLIENT_KEEPALIVE_S)
            self._session = aiohttp.ClientSession(timeout=timeout, connector=connector)
            self._loop = loop
        return self._session

    async def request(
        self,
        method: str,
        path: str,
        payload: dict[str, Any] | None = None,
        timeout_s: float | None = None,
        connect_retries: int | None = None,
    ) -> Any:
        """One HTTP call; returns the decoded JSON body (or the text body, or None when empty)."""
        session = self._get_session()
        timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=self.connect_timeout_s) if timeout_s else None
        retries = self.connect_retries if connect_retries is None else connect_retries
        for attempt in range(retries + 1):
            try:
                body = None if payload is None else orjson.dumps(payload)
                async with session.request(
                    method, f"{self.url}{path}", data=body, headers=_JSON if body else None, timeout=timeout
                ) as response:
                    raw = await response.read()
                    if response.status != 200:
                        text = raw.decode(errors="replace")
                        raise EngineRequestError(
                            self.url, f"{path}: HTTP {response.status}: {text[:500]}", response.status
                        )
                    return self._decode(path, raw, response.content_type)
            except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as exc:
                # The connection was never established, so the request never reached the server: safe to retry.
                if attempt == retries:
                    raise EngineUnavailableError(self.url, f"{path}: cannot connect: {exc}") from exc
                await asyncio.sleep(self.retry_backoff_s * 2**attempt)
            except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError, aiohttp.ClientPayloadError) as exc:
                raise EngineUnavailableError(self.url, f"{path}: connection lost: {type(exc).__name__}: {exc}") from exc
            except TimeoutError as exc:
                limit = timeout_s or self.timeout_s
                raise EngineTimeoutError(self.url, f"{path}: no answer within {limit:.0f} s") from exc
            except aiohttp.ClientError as exc:
                raise EngineUnavailableError(self.url, f"{path}: {type(exc).__name__}: {exc}") from exc
        raise AssertionError("unreachable")

    def _decode(self, path: str, raw: bytes, content_type: str) -> Any:
        if not raw:
            return None
        if "json" not in content_type:
            return raw.decode(errors="replace")  # e.g. /flush_cache answers in plain text
        try:
            # orjson: a batch's answer (token ids and a [log-prob, id, text] triple per generated token) parses
            # ~3x faster than with the json module, whose float parsing was ~40% of the driver's busy time.
            return orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            text = raw.decode(errors="replace")
            raise EngineRequestError(self.url, f"{path}: invalid JSON ({exc}): {text[:500]}", 200) from exc

    async def post(self, path: str, payload: dict[str, Any] | None = None, timeout_s: float | None = None) -> Any:
        return await self.request("POST", path, payload or {}, timeout_s)

    async def get(self, path: str, timeout_s: float | None = None) -> Any:
        return await self.request("GET", path, None, timeout_s)

    async def _post_checked(self, path: str, payload: dict[str, Any], timeout_s: float | None = None) -> Any:
        """POST to an endpoint that answers {"success": bool, "message": str}; raise unless success."""
        out = await self.post(path, payload, timeout_s)
        if not isinstance(out, dict) or not out.get("success", False):
            raise EngineRequestError(self.url, f"{path} failed: {out}", 200)
        return out

    # --- generation -------------------------------------------------------------------------------

    async def generate(
        self,
        input_ids: list[int],
        max_new_tokens: int,
        stop_token_ids: list[int],
        sampling: SamplingConfig | None = None,
        extra_params: dict[str, Any] | None = None,
    ) -> Segment:
        """Sample up to `max_new_tokens` after `input_ids`; tokens, fp32 log-probs, versions, finish.

        `extra_params` are added to SGLang's sampling params verbatim (e.g. `{"ignore_eos": True}`, which
        also ignores `stop_token_ids`, for fixed-length benchmarks and tests)."""
        if max_new_tokens <= 0:
            return Segment([], [], [], "length")
        sampling = sampling or SamplingConfig()
        params = {
            "max_new_tokens": max_new_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "top_k": sampling.top_k,
            "stop_token_ids": list(stop_token_ids),
            "skip_special_tokens": False,
            "no_stop_trim": True,
            **(extra_params or {}),
        }
        self.outstanding += 1
        try:
            future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
            self._queued.append((list(input_ids), params, future))
            if len(self._queued) == 1:  # the first of this turn: send once the turn's other calls are queued
                asyncio.get_running_loop().call_soon(self._send_queued)
            out = await future
        finally:
            self.outstanding -= 1
        return self._segment(out, len(input_ids))

    def _send_queued(self) -> None:
        queued, self._queued = self._queued, []
        task = asyncio.ensure_future(self._send_turn(queued))
        self._batches.add(task)
        task.add_done_callback(self._batches.discard)

    async def _send_turn(self, queued: list[tuple[list[int], dict[str, Any], asyncio.Future[Any]]]) -> None:
        """A turn's calls: their shared prompts prefilled first, then batches of up to `batch_max`."""
        try:
            await self._prime(queued)
        except asyncio.CancelledError:
            for _, _, future in queued:
                future.cancel()
            raise
        chunks = [queued[start : start + self.batch_max] for start in range(0, len(queued), self.batch_max)]
        await asyncio.gather(*(self._generate_batch(chunk) for chunk in chunks))

    async def _prime(self, queued: list[tuple[list[int], dict[str, Any], asyncio.Future[Any]]]) -> None:
        """Prefill, with no new token, each prompt that more than one of `queued` asks for (class docstring)."""
        if self.routing is not None:
            return
        copies: dict[tuple[int, ...], int] = {}
        for ids, _, future in queued:
            if len(ids) >= self.PRIME_MIN_TOKENS and not future.done():
                copies[tuple(ids)] = copies.get(tuple(ids), 0) + 1
        shared = [list(ids) for ids, n in copies.items() if n > 1]
        if not shared:
            return
        payload = {"input_ids": shared, "sampling_params": [{"max_new_tokens": 0} for _ in shared]}
        with contextlib.suppress(EngineError):  # the completions meet whatever went wrong, and are retried
            await self.post("/generate", payload)

    async def _generate_batch(self, batch: list[tuple[list[int], dict[str, Any], asyncio.Future[Any]]]) -> None:
        """One `/generate` for the calls in `batch` (a plain request for one); each future gets its answer."""
        batch = [item for item in batch if not item[2].done()]  # calls cancelled while queued
        if not batch:
            return
        try:
            if len(batch) == 1:
                ids, params, _ = batch[0]
                payload = {"input_ids": ids, "sampling_params": params, "return_logprob": True}
                answers = [await self.post("/generate", payload | self._routing_flag())]
            else:
                payload = {
                    "input_ids": [ids for ids, _, _ in batch],
                    "sampling_params": [params for _, params, _ in batch],
                    "return_logprob": True,
                    **self._routing_flag(),
                }
                answers = await self.post("/generate", payload)
                if not isinstance(answers, list) or len(answers) != len(batch):
                    raise self._malformed(f"a batch of {len(batch)} answered with {type(answers).__name__}", answers)
        except Exception as exc:  # every waiting call gets the failure (the balancer retries each)
            for _, _, future in batch:
                if not future.done():
                    future.set_exception(exc)
            return
        except BaseException:  # cancelled (close()): so are the calls waiting on it
            for _, _, future in batch:
                future.cancel()
            raise
        for (_, _, future), answer in zip(batch, answers, strict=True):
            if not future.done():
                future.set_result(answer)

    def _routing_flag(self) -> dict[str, bool]:
        return {"return_routed_experts": True} if self.routing is not None else {}

    def _segment(self, out: Any, num_input: int) -> Segment:
        """SGLang's /generate answer as a Segment.

        Anything else (a proxy's error page, a truncated body, a field missing or of the wrong type) is
        EngineRequestError(200) naming the field, never a KeyError or TypeError from in here: the balancer
        retries it on another engine and counts it, and nothing half-parsed reaches the pipeline.
        """
        if not isinstance(out, dict):
            raise self._malformed(f"not a JSON object but {type(out).__name__}", out)
        meta = out.get("meta_info")
        if not isinstance(meta, dict):
            raise self._malformed("no meta_info object", out)
        triples = meta.get("output_token_logprobs")
        if not isinstance(triples, list):
            raise self._malformed("meta_info.output_token_logprobs is not a list", out)
        tokens: list[int] = []
        logprobs: list[float] = []
        for i, triple in enumerate(triples):
            if not (isinstance(triple, list) and len(triple) == 3 and _is_real(triple[0]) and _is_int(triple[1])):
                raise self._malformed(
                    f"meta_info.output_token_logprobs[{i}] = {triple!r} is not [logprob, id, text]", out
                )
            logprobs.append(float(triple[0]))
            tokens.append(triple[1])
        output_ids = out.get("output_ids")
        if output_ids is not None and output_ids != tokens:
            raise self._malformed("output_ids and meta_info.output_token_logprobs disagree", out)
        finish = meta.get("finish_reason")
        if not isinstance(finish, dict) or finish.get("type") not in _FINISH:
            raise self._malformed(f"meta_info.finish_reason {finish!r} is not one of {sorted(_FINISH)}", out)
        routing = self._routing(meta, num_input + len(tokens) - 1, out) if self.routing is not None else None
        return Segment(tokens, logprobs, self._versions(meta, len(tokens), out), _FINISH[finish["type"]], routing)

    def _routing(self, meta: dict[str, Any], rows: int, out: Any) -> np.ndarray:
        """meta_info.routed_experts (base64 of int32 [rows, layers, top-k]) as compact ids, checked against the
        model's shape: a missing or short record is a malformed answer, never a silently unreplayed sequence; a
        record SGLang never filled in (all 0, RoutingShape.check_captured) stops the run with the engine flag
        to change."""
        assert self.routing is not None
        raw = meta.get("routed_experts")
        if not isinstance(raw, str):
            raise self._malformed(
                "no meta_info.routed_experts (is the server running with --enable-return-routed-experts?)", out
            )
        try:
            ids = np.frombuffer(base64.b64decode(raw, validate=True), dtype=np.int32)
        except (binascii.Error, ValueError) as exc:
            raise self._malformed(f"meta_info.routed_experts is not base64 int32 ({exc})", out) from exc
        width = self.routing.layers * self.routing.topk
        if ids.size % width:
            raise self._malformed(
                f"meta_info.routed_experts holds {ids.size} ids, not a multiple of layers x top-k = {width}", out
            )
        record = ids.reshape(-1, self.routing.layers, self.routing.topk)
        try:
            self.routing.check(record, rows, "/generate: meta_info.routed_experts")
        except ValueError as exc:
            raise EngineRequestError(self.url, str(exc), 200) from exc
        if self.routing.topk > 1:
            # A record never written (all 0) is the engine's configuration, the same on every engine: a ValueError
            # the balancer does not retry (nor restart engines over), not a garbled answer. Top-1 records are
            # judged by the batch, in the trainer.
            self.routing.check_captured([record], f"/generate from {self.url}: meta_info.routed_experts")
        return record.astype(self.routing.dtype)

    def _versions(self, meta: dict[str, Any], n: int, out: Any) -> list[int]:
        spans = meta.get("weight_versions")
        if spans is None:  # a server without per-token spans: the whole answer has its one version
            return [_parse_version(self.url, meta.get("weight_version"), "/generate: meta_info.weight_version")] * n
        if not isinstance(spans, list) or not all(
            isinstance(span, dict) and _is_int(span.get("start")) and _is_int(span.get("end")) and "version" in span
            for span in spans
        ):
            raise self._malformed(f"meta_info.weight_versions {spans!r} are not {{start, end, version}} spans", out)
        versions: list[int | None] = [None] * n
        for i, span in enumerate(spans):
            version = _parse_version(self.url, span["version"], f"/generate: meta_info.weight_versions[{i}].version")
            for t in range(max(span["start"], 0), min(span["end"], n)):
                versions[t] = version
        if any(v is None for v in versions):
            raise EngineRequestError(self.url, f"/generate: weight_versions {spans} do not cover {n} tokens", 200)
        return [v for v in versions if v is not None]

    def _malformed(self, what: str, out: Any) -> EngineRequestError:
        return EngineRequestError(self.url, f"/generate: malformed answer: {what}: {str(out)[:500]}", 200)

    # --- control ------------------------------------------------------------------------------------

    async def health(self, timeout_s: float = 5.0) -> bool:
        """True when `/health` answers 200 (no retries: a probe)."""
        try:
            await self.request("GET", "/health", timeout_s=timeout_s, connect_retries=0)
        except EngineError:
            return False
        return True

    async def model_info(self) -> dict[str, Any]:
        return await self.get("/model_info")

    async def weight_version(self) -> int:
        return _parse_version(self.url, (await self.model_info())["weight_version"])

    async def pause(self, mode: Literal["in_place", "retract", "abort"] = "in_place") -> None:
        """Stop scheduling forward passes. in_place: running sequences keep their KV cache and continue
        after `resume()`; retract: they go back to the queue (KV recomputed on resume, cache flushable);
        abort: they end now with finish reason "abort"."""
        await self.post("/pause_generation", {"mode": mode})

    async def resume(self) -> None:
        await self.post("/continue_generation", {})

    async def abort_all(self) -> None:
        await self.post("/abort_request", {"abort_all": True})

    async def flush_cache(self, timeout_s: float = 0.0) -> bool:
        """Drop the prefix cache; False when SGLang refuses because requests are running or queued."""
        try:
            await self.post(f"/flush_cache?timeout={timeout_s}")
        except EngineRequestError as exc:
            if exc.status == 400:
                return False
            raise
        return True

    async def get_weights_by_name(self, name: str, truncate_size: int = 100) -> Any:
        """The engine's parameter `name` (HF naming), first `truncate_size` rows, as nested lists."""
        return await self.post("/get_weights_by_name", {"name": name, "truncate_size": truncate_size})

    # --- weight updates (sync.WeightSender drives these) ---------------------------------------------

    async def update_weights_from_disk(self, model_path: str, version: int, flush_cache: bool = True) -> None:
        """Load the safetensors under `model_path` (HF names) and set `version`. With `flush_cache` the
        prefix cache is dropped too, which SGLang refuses (an error here) while requests are running."""
        payload = {"model_path": model_path, "weight_version": str(version), "flush_cache": flush_cache}
        await self._post_checked("/update_weights_from_disk", payload)

    async def init_weights_update_group(
        self, master_address: str, master_port: int, rank_offset: int, world_size: int, group_name: str, backend: str
    ) -> None:
        payload = {
            "master_address": master_address,
            "master_port": master_port,
            "rank_offset": rank_offset,
            "world_size": world_size,
            "group_name": group_name,
            "backend": backend,
        }
        await self._post_checked("/init_weights_update_group", payload)

    async def destroy_weights_update_group(self, group_name: str) -> None:
        await self._post_checked("/destroy_weights_update_group", {"group_name": group_name})

    async def begin_weight_update(self) -> None:
        await self._post_checked("/begin_weight_update", {})

    async def end_weight_update(self) -> None:
        await self._post_checked("/end_weight_update", {})

    async def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str,
        version: int | None = None,
        flattened: bool = False,
    ) -> None:
        """Receive one bucket the caller broadcasts as rank 0 of `group_name` (per tensor in this order,
        or one uint8 tensor of their bytes back to back when `flattened`)."""
        payload: dict[str, Any] = {
            "names": names,
            "dtypes": dtypes,
            "shapes": shapes,
            "group_name": group_name,
            "flush_cache": False,  # running sequences keep their KV cache (in-flight update)
        }
        if flattened:
            payload["load_format"] = "flattened_bucket"
        if version is not None:
            payload["weight_version"] = str(version)
        await self._post_checked("/update_weights_from_distributed", payload)

    async def close(self) -> None:
        for task in list(self._batches):
            task.cancel()
        await asyncio.gather(*self._batches, return_exceptions=True)
        if self._session is not None and not self._session.closed:
            with contextlib.suppress(RuntimeError):  # its loop may be gone already
                await self._session.close()
        self._session = None


def as_generate_fn(client: SGLangClient, sampling: SamplingConfig) -> GenerateFn:
    """One engine as the pipeline's `GenerateFn` (no retries; see EngineBalancer for several engines)."""

    async def generate(input_ids: list[int], max_new_tokens: int, stop_token_ids: list[int]) -> Segment:
        return await client.generate(input_ids, max_new_tokens, stop_token_ids, sampling)

    return generate
