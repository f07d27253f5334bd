"""The balancer sends a continuation (interruption's answer request, a tool call's next turn) back to the engine that
ran the request it continues, whose prefix cache holds its start, unless that engine is down or too busy; requests
that continue nothing are spread by load as before.

The engines are fakes that record the inputs they ran and answer 48 tokens that name them; which engine ran what is
read from those records, independently of the balancer's own bookkeeping."""

from __future__ import annotations

import asyncio
from typing import cast

from megatron_rl.config import SamplingConfig
from megatron_rl.generator.balancer import EngineBalancer, PrefixAffinity
from megatron_rl.generator.client import EngineUnavailableError, SGLangClient
from megatron_rl.rollout.interruption import Segment


class RecordingEngine:
    def __init__(self, index: int) -> None:
        self.url, self.index = f"engine{index}", index
        self.outstanding, self.inputs, self.down = 0, [], False

    async def generate(self, input_ids: list[int], max_new_tokens: int, stop_ids: list[int], sampling: object):
        self.outstanding += 1
        try:
            await asyncio.sleep(0.001)
            if self.down:
                raise EngineUnavailableError(self.url, "connection refused")
            self.inputs.append(list(input_ids))
            tokens = [500 + self.index] * 48
            return Segment(tokens, [-0.1] * 48, [0] * 48, "length")
        finally:
            self.outstanding -= 1

    async def health(self) -> bool:
        return not self.down


def _balancer(engines: list[RecordingEngine], **kwargs) -> EngineBalancer:
    return EngineBalancer(cast(list[SGLangClient], engines), SamplingConfig(), **kwargs)


def _prompt(i: int, length: int = 70) -> list[int]:
    return [1] * 20 + [100 + i] * (length - 20)  # a shared chat-template head, then the prompt's own ids


def _ran(engines: list[RecordingEngine], ids: list[int]) -> list[int]:
    return [e.index for e in engines for seen in e.inputs if seen == ids]


def test_a_continuation_goes_back_to_the_engine_that_ran_its_prefix():
    engines = [RecordingEngine(i) for i in range(3)]
    balancer = _balancer(engines)
    prompts = [_prompt(i) for i in range(6)]

    async def scenario() -> list[Segment]:
        return await asyncio.gather(*(balancer(p, 64, []) for p in prompts))

    firsts = asyncio.run(scenario())
    assert sorted(len(e.inputs) for e in engines) == [2, 2, 2]  # nothing to continue: spread by load
    phrase = [7, 7, 7]
    # interruption's second request: the thinking cut to a budget, the phrase appended; a tool turn: all of it, the
    # tool's output appended
    continuations = [p + first.tokens[:40] + phrase for p, first in zip(prompts[:3], firsts[:3], strict=True)]
    continuations += [p + first.tokens + [9] * 30 for p, first in zip(prompts[3:], firsts[3:], strict=True)]

    async def again() -> None:
        await asyncio.gather(*(balancer(c, 16, []) for c in continuations))

    asyncio.run(again())
    for prompt, continuation in zip(prompts, continuations, strict=True):
        assert _ran(engines, continuation) == _ran(engines, prompt)
    assert balancer.metrics()["rollout/affinity_hits"] == 6


def test_a_continuation_whose_engine_is_down_or_busy_is_prefilled_elsewhere():
    for fault in ("down", "busy"):
        engines = [RecordingEngine(i) for i in range(2)]
        balancer = _balancer(engines, max_retries=1, affinity_slack=2)
        prompt = _prompt(0)
        first = asyncio.run(balancer(prompt, 64, []))
        (home,) = _ran(engines, prompt)
        if fault == "down":  # the engine died (or is restarting)
            engines[home].down = True
        else:  # three requests beyond the other engine's load, over the slack of 2
            engines[home].outstanding = 3
        continuation = prompt + first.tokens + [9] * 8
        asyncio.run(balancer(continuation, 16, []))
        assert _ran(engines, continuation) == [1 - home], fault
        assert balancer.metrics()["rollout/affinity_hits"] == (1 if fault == "down" else 0)


def test_prefixes_are_matched_whole_chunks_at_a_time_and_the_memory_is_bounded():
    affinity = PrefixAffinity(chunk=32, tail=3, capacity=6)
    affinity.remember(list(range(100)), engine=1)  # links at 32, 64 and 96 ids
    assert affinity.engine_for(list(range(96)) + [5, 5]) == 1
    assert affinity.engine_for(list(range(31))) is None  # shorter than a chunk: nothing to match
    assert affinity.engine_for([1] + list(range(1, 100))) is None  # differs in the first chunk: no shared prefix
    for engine in range(2, 5):  # 3 more sequences of 3 links each: the oldest links are dropped
        affinity.remember([engine] * 96, engine)
    assert affinity.engine_for(list(range(100))) is None
    assert affinity.engine_for([4] * 200) == 4
