"""SGLangClient prefills a prompt that several calls of one turn share once, ahead of them (a local aiohttp server
that records what it is sent, no SGLang): the completions then find it in the engine's prefix cache."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from aiohttp import web

from megatron_rl.generator.client import SGLangClient
from megatron_rl.rollout.interruption import Segment
from megatron_rl.rollout.types import RoutingShape

ANSWER = {
    "output_ids": [5],
    "meta_info": {
        "finish_reason": {"type": "length"},
        "output_token_logprobs": [[-0.5, 5, None]],
        "weight_version": "0",
    },
}
PROMPT = list(range(3, 3 + SGLangClient.PRIME_MIN_TOKENS))
OTHER = list(range(100, 100 + SGLangClient.PRIME_MIN_TOKENS))


def _recording(sent: list[dict[str, Any]], prime_status: int = 200):
    """A /generate handler that records each payload and answers it (a prefill-only batch with `prime_status`)."""

    async def generate(request: web.Request) -> web.Response:
        payload = await request.json()
        sent.append(payload)
        batch = isinstance(payload["input_ids"][0], list)
        if not isinstance(payload["sampling_params"], list) or payload["sampling_params"][0]["max_new_tokens"]:
            body: Any = [ANSWER] * len(payload["input_ids"]) if batch else ANSWER
            return web.json_response(body)
        return web.json_response([{"output_ids": []}] * len(payload["input_ids"]), status=prime_status)

    return generate


def _turn(serve, prompts: list[list[int]], prime_status: int = 200):
    """One turn of generate calls for `prompts`: what the server was sent, in order, and the segments."""

    async def main() -> tuple[list[dict[str, Any]], list[Segment]]:
        sent: list[dict[str, Any]] = []
        runner, url = await serve(_recording(sent, prime_status))
        client = SGLangClient(url, timeout_s=10)
        try:
            segments = await asyncio.gather(*(client.generate(p, 1, []) for p in prompts))
        finally:
            await client.close()
            await runner.cleanup()
        return sent, segments

    return asyncio.run(main())


def test_a_prompt_asked_for_several_times_in_a_turn_is_prefilled_once_first(generate_server):
    sent, segments = _turn(generate_server, [PROMPT, OTHER, PROMPT, PROMPT, PROMPT[:-1]])
    prime, batch = sent
    assert prime["input_ids"] == [PROMPT] and prime["sampling_params"] == [{"max_new_tokens": 0}]
    assert batch["input_ids"] == [PROMPT, OTHER, PROMPT, PROMPT, PROMPT[:-1]]
    assert segments == [Segment([5], [-0.5], [0], "length")] * 5


def test_no_prefill_ahead_for_prompts_asked_once_or_short(generate_server):
    short = PROMPT[: SGLangClient.PRIME_MIN_TOKENS - 1]
    sent, _ = _turn(generate_server, [PROMPT, OTHER, short, short])
    assert len(sent) == 1 and sent[0]["input_ids"] == [PROMPT, OTHER, short, short]


def test_a_failed_prefill_ahead_still_sends_the_completions(generate_server):
    sent, segments = _turn(generate_server, [PROMPT, PROMPT], prime_status=503)
    assert [json.dumps(s["input_ids"]) for s in sent] == [json.dumps([PROMPT]), json.dumps([PROMPT, PROMPT])]
    assert len(segments) == 2


def test_no_prefill_ahead_with_routing_replay(generate_server):
    """With routing replay each completion's experts come from its own prefill: nothing goes ahead."""
    routing = RoutingShape(layers=1, topk=1, experts=4)

    async def main() -> list[dict[str, Any]]:
        sent: list[dict[str, Any]] = []
        runner, url = await generate_server(_recording(sent))
        client = SGLangClient(url, timeout_s=10, routing=routing)
        try:
            await client._prime([(PROMPT, {}, asyncio.get_running_loop().create_future()) for _ in range(2)])
        finally:
            await client.close()
            await runner.cleanup()
        return sent

    assert asyncio.run(main()) == []
