"""SGLangClient on garbled /generate answers from a real HTTP server (a local aiohttp app, no SGLang).

Every answer that is not a generation is an EngineRequestError with status 200 (which the balancer retries
on another engine) whose message names what is wrong, never a KeyError or TypeError from deep inside the
parsing; a well-formed answer parses into tokens, log-probs, versions and the finish reason.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from aiohttp import web

from megatron_rl.config import SamplingConfig
from megatron_rl.generator.balancer import EngineBalancer
from megatron_rl.generator.client import EngineRequestError, SGLangClient
from megatron_rl.rollout.interruption import Segment
from megatron_rl.rollout.types import RoutingShape

GOOD: dict[str, Any] = {
    "text": "ab",
    "output_ids": [5, 7],
    "meta_info": {
        "finish_reason": {"type": "stop", "matched": 7},
        "output_token_logprobs": [[-0.5, 5, None], [-1.25, 7, None]],
        "weight_version": "3",
        "weight_versions": [{"start": 0, "end": 1, "version": "2"}, {"start": 1, "end": 2, "version": "3"}],
    },
}


def _with(meta: dict[str, Any] | None = None, **top: Any) -> str:
    """GOOD as JSON text, with some meta_info fields (or top-level fields) replaced; None removes one."""
    answer = {**GOOD, "meta_info": {**GOOD["meta_info"], **(meta or {})}, **top}
    for fields in (answer, answer.get("meta_info") or {}):
        for key in [key for key, value in fields.items() if value is None]:
            del fields[key]
    return json.dumps(answer)


def _answering(bodies: list[tuple[str, str]]):
    """A /generate handler that answers 200 with the next (body, content type) in turn."""

    async def generate(request: web.Request) -> web.Response:
        await request.read()
        body, content_type = bodies.pop(0)
        return web.Response(status=200, body=body.encode(), headers={"Content-Type": content_type})

    return generate


def _generate(serve, body: str, content_type: str = "application/json", routing: RoutingShape | None = None) -> Segment:
    async def main() -> Segment:
        runner, url = await serve(_answering([(body, content_type)]))
        client = SGLangClient(url, timeout_s=10, routing=routing)
        try:
            return await client.generate([1, 2], 4, [])
        finally:
            await client.close()
            await runner.cleanup()

    return asyncio.run(main())


def test_a_well_formed_answer_parses(generate_server):
    assert _generate(generate_server, json.dumps(GOOD)) == Segment([5, 7], [-0.5, -1.25], [2, 3], "stop")
    # A server without per-token spans: every token has the answer's one version.
    assert _generate(generate_server, _with({"weight_versions": None})).versions == [3, 3]


GARBLED = [
    ("<html><body>502 Bad Gateway</body></html>", "text/html", "not a JSON object"),
    ('{"text": "ab", "meta_info": {"finish_reason": {"type": "st', "application/json", "invalid JSON"),
    ("", "application/json", "not a JSON object"),
    ("[1, 2]", "application/json", "not a JSON object"),
    (json.dumps({"text": "ab", "output_ids": [5, 7]}), "application/json", "no meta_info"),
    (_with(meta_info=None), "application/json", "no meta_info"),
    (_with({"output_token_logprobs": None}), "application/json", "output_token_logprobs"),
    (_with({"output_token_logprobs": "ab"}), "application/json", "output_token_logprobs"),
    (_with({"output_token_logprobs": [[-0.5, 5, None], ["x", 7, None]]}), "application/json", "[1]"),
    (_with({"output_token_logprobs": [[-0.5, 5, None], [None, 7, None]]}), "application/json", "[1]"),
    (_with({"output_token_logprobs": [[-0.5, 5, None], [-1.25, "7", None]]}), "application/json", "[1]"),
    (_with({"output_token_logprobs": [[-0.5, 5, None], [-1.25, 7.5, None]]}), "application/json", "[1]"),
    (_with({"output_token_logprobs": [[-0.5, 5, None], [-1.25]]}), "application/json", "[1]"),
    (_with({"output_token_logprobs": [[-0.5, 5, None], 7]}), "application/json", "[1]"),
    (_with(output_ids=[5, 8]), "application/json", "output_ids"),
    (_with(output_ids=5), "application/json", "output_ids"),
    (_with({"finish_reason": None}), "application/json", "finish_reason"),
    (_with({"finish_reason": "stop"}), "application/json", "finish_reason"),
    (_with({"finish_reason": {"type": "eos"}}), "application/json", "finish_reason"),
    (_with({"weight_versions": [{"start": 0, "end": 1, "version": "2"}]}), "application/json", "do not cover"),
    (_with({"weight_versions": [{"start": 0, "version": "2"}]}), "application/json", "weight_versions"),
    (_with({"weight_versions": {"start": 0, "end": 2}}), "application/json", "weight_versions"),
    (
        _with({"weight_versions": [{"start": 0, "end": 2, "version": "v2"}]}),
        "application/json",
        "weight_versions[0].version",
    ),
    (_with({"weight_versions": None, "weight_version": None}), "application/json", "meta_info.weight_version"),
]


@pytest.mark.parametrize(("body", "content_type", "named"), GARBLED)
def test_a_garbled_answer_is_a_request_error_naming_what_is_wrong(generate_server, body, content_type, named):
    with pytest.raises(EngineRequestError) as error:
        _generate(generate_server, body, content_type)
    assert error.value.status == 200
    assert "/generate" in str(error.value) and named in str(error.value)


def test_the_balancer_retries_a_garbled_answer_on_another_engine(generate_server):
    async def main() -> tuple[Segment, EngineBalancer]:
        garbled, garbled_url = await generate_server(_answering([(_with({"finish_reason": None}), "application/json")]))
        good, good_url = await generate_server(_answering([(json.dumps(GOOD), "application/json")]))
        clients = [SGLangClient(garbled_url, timeout_s=10), SGLangClient(good_url, timeout_s=10)]
        balancer = EngineBalancer(clients, SamplingConfig(), max_retries=1)
        try:
            return await balancer([1, 2], 4, []), balancer
        finally:
            for client in clients:
                await client.close()
            await garbled.cleanup()
            await good.cleanup()

    segment, balancer = asyncio.run(main())
    assert segment.tokens == [5, 7]
    assert (balancer.failures, balancer.retries, balancer.failures_by_engine) == (1, 1, [1, 0])


SHAPE = RoutingShape(layers=2, topk=2, experts=4)


def _routed(ids: list[int]) -> str:
    """GOOD with SGLang's routed_experts: base64 of int32 ids."""
    import base64

    import numpy as np

    return _with({"routed_experts": base64.b64encode(np.array(ids, dtype=np.int32).tobytes()).decode()})


def test_routing_records_parse_into_compact_ids(generate_server):
    """2 input + 2 output tokens: the engine ran 3 of them forward, 3 x 2 layers x top-2 ids."""
    ids = [0, 1, 2, 3, 3, 0, 1, 2, 0, 2, 1, 3]
    segment = _generate(generate_server, _routed(ids), routing=SHAPE)
    assert segment.routing is not None and segment.routing.dtype.name == "uint8"
    assert segment.routing.reshape(-1).tolist() == ids and segment.routing.shape == (3, 2, 2)


@pytest.mark.parametrize(
    ("body", "named"),
    [
        (json.dumps(GOOD), "no meta_info.routed_experts"),
        (_with({"routed_experts": "%%%"}), "not base64 int32"),
        (_routed([0, 1, 2]), "not a multiple of layers x top-k = 4"),
        (_routed([0, 1] * 4), "expected [tokens=3, layers=2, top-k=2]"),  # routing for some tokens only
        (_routed([0, 1, 2, 3, 3, 0, 1, 2, 0, 2, 1, 7]), "the model has 4 experts"),
    ],
)
def test_a_missing_or_misshapen_routing_record_is_a_request_error(generate_server, body, named):
    with pytest.raises(EngineRequestError) as error:
        _generate(generate_server, body, routing=SHAPE)
    assert error.value.status == 200 and "routed_experts" in str(error.value) and named in str(error.value)


def test_routing_records_sglang_never_wrote_stop_the_run_naming_the_engine_flag(generate_server):
    """SGLang's fused-kernel MoE runners leave every record at 0, which passes the shape and range checks: at top-2
    one such record is refused (two picks of expert 0 are no top-2) as a configuration error, which no other
    engine would answer differently, so the balancer neither retries it nor restarts engines over it."""

    async def main() -> EngineBalancer:
        runner, url = await generate_server(_answering([(_routed([0] * 12), "application/json")] * 2))
        clients = [SGLangClient(url, timeout_s=10, routing=SHAPE), SGLangClient(url, timeout_s=10, routing=SHAPE)]
        balancer = EngineBalancer(clients, SamplingConfig(), max_retries=1)
        try:
            with pytest.raises(ValueError, match=r"every routing record is expert 0 .*--moe-runner-backend,triton"):
                await balancer([1, 2], 4, [])
            return balancer
        finally:
            for client in clients:
                await client.close()
            await runner.cleanup()

    balancer = asyncio.run(main())
    assert (balancer.failures, balancer.retries) == (0, 0)
    # top-1 (Llama-4): one sequence routed to expert 0 throughout may be real; the trainer judges the whole batch
    top1 = RoutingShape(layers=2, topk=1, experts=4)
    assert _generate(generate_server, _routed([0] * 6), routing=top1).routing.tolist() == [[[0], [0]]] * 3


def test_a_batch_of_records_all_at_expert_0_is_refused_whatever_the_top_k():
    import numpy as np

    top1 = RoutingShape(layers=2, topk=1, experts=4)
    zeros = [np.zeros((n, 2, 1), np.uint8) for n in (3, 5)]
    with pytest.raises(ValueError, match="the batch: every routing record is expert 0 at every layer"):
        top1.check_captured(zeros, "the batch")
    top1.check_captured([*zeros, np.ones((2, 2, 1), np.uint8)], "the batch")  # one token elsewhere: a router
    top1.check_captured([np.zeros((0, 2, 1), np.uint8)], "the batch")  # nothing routed, nothing to judge
