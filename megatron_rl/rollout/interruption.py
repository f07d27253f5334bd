"""Length control by interruption (SCALERL.md §5), around any engine's generate call.

One completion is generated in up to two phases:

1. thinking: up to a per-sequence budget drawn uniformly in [min_thinking_tokens, max_thinking_tokens],
   stopping early at the end-of-thinking token (or at EOS);
2. answer: up to `answer_tokens` more, after either the model's own `</think>` or, when the budget ran
   out first, the injected phrase "Okay, time is up. ... </think>".

Injected tokens are part of the sequence the model conditions on but are masked out of the loss
(`loss_mask` False, generator log-prob 0). A completion whose answer phase hits its budget is truncated
(`finish_reason` "length"); one that was interrupted and then stopped normally is "interrupted".
With interruption disabled there is one phase of `interruption.max_thinking_tokens + answer_tokens`.
"""

from __future__ import annotations

import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Literal

from megatron_rl.config import RolloutConfig


@dataclass
class Segment:
    """What one engine call produced (the engine adapter fills it)."""

    tokens: list[int]
    logprobs: list[float]
    versions: list[int]
    finish: Literal["stop", "length", "abort"]


GenerateFn = Callable[[list[int], int, list[int]], Awaitable[Segment]]
"""(input_ids, max_new_tokens, stop_token_ids) -> Segment. Stop tokens that ended the segment are
included in its tokens (the model sampled them; they are trained on)."""


@dataclass
class Generated:
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    loss_mask: list[bool] = field(default_factory=list)
    finish_reason: Literal["stop", "length", "interrupted", "abort"] = "stop"
    thinking_budget: int = 0

    def extend(self, segment: Segment) -> None:
        self.tokens += segment.tokens
        self.logprobs += segment.logprobs
        self.versions += segment.versions
        self.loss_mask += [True] * len(segment.tokens)

    def inject(self, tokens: list[int], version: int) -> None:
        self.tokens += tokens
        self.logprobs += [0.0] * len(tokens)
        self.versions += [version] * len(tokens)
        self.loss_mask += [False] * len(tokens)


@dataclass
class InterruptionTokens:
    """Token ids the controller needs, from the tokenizer."""

    end_of_thinking: int
    eos: int
    phrase: list[int]
    """The injected phrase; it ends with the end-of-thinking token."""


async def generate_completion(
    generate: GenerateFn,
    prompt_ids: list[int],
    cfg: RolloutConfig,
    ids: InterruptionTokens,
    rng: random.Random,
    current_version: Callable[[], int],
) -> Generated:
    out = Generated()
    control = cfg.interruption
    if not control.enabled:
        segment = await generate(prompt_ids, cfg.max_completion_tokens, [ids.eos])
        out.extend(segment)
        out.finish_reason = segment.finish
        return out

    out.thinking_budget = rng.randint(control.min_thinking_tokens, control.max_thinking_tokens)
    thinking = await generate(prompt_ids, out.thinking_budget, [ids.end_of_thinking, ids.eos])
    out.extend(thinking)
    if thinking.finish == "abort":
        out.finish_reason = "abort"
        return out
    closed = bool(thinking.tokens) and thinking.tokens[-1] == ids.end_of_thinking
    if thinking.finish == "stop" and not closed:
        out.finish_reason = "stop"  # EOS inside the thinking budget: the model answered without closing
        return out
    interrupted = not closed
    if interrupted:
        out.inject(ids.phrase, current_version())
    answer = await generate(prompt_ids + out.tokens, cfg.answer_tokens, [ids.eos])
    out.extend(answer)
    if answer.finish == "stop" and interrupted:
        out.finish_reason = "interrupted"
    else:
        out.finish_reason = answer.finish
    return out
