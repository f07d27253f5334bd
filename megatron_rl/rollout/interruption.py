"""Length control by interruption (docs/recipe.md §5), around any engine's generate call.

One completion is generated in up to two phases:

1. thinking: up to a per-sequence budget drawn uniformly in [min_thinking_tokens, max_thinking_tokens],
   ending at the end-of-thinking token (or at EOS);
2. answer: up to `answer_tokens` more, after either the model's own `</think>` or, when the budget ran
   out first, the injected phrase "Okay, time is up. ... </think>".

The engine is asked for the thinking budget without stopping at `</think>`: a model that closes its
thinking early goes on into its answer in the same request, and the answer is then cut to
`answer_tokens` (or continued in a second request when the budget ended first). Sampling is
autoregressive, so this draws exactly the completions the two phases would, with one request instead of
two for most completions (each request costs the engine's HTTP server and scheduler CPU of its own).

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

import numpy as np

from megatron_rl.config import RolloutConfig


@dataclass
class Segment:
    """What one engine call produced (the engine adapter fills it)."""

    tokens: list[int]
    logprobs: list[float]
    versions: list[int]
    finish: Literal["stop", "length", "abort"]
    routing: np.ndarray | None = None
    """The experts chosen for every token the engine ran: the request's input and its tokens but the last,
    [len(input) + len(tokens) - 1, layers, top-k] (only when routing records are asked for)."""


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
    routing: np.ndarray | None = None
    """The last request's routing record: it covers the prompt and every token before (a later request runs
    all earlier tokens again, or reuses their cached routing), [prompt + tokens - 1, layers, top-k]."""

    def extend(self, segment: Segment) -> None:
        if segment.routing is not None:
            self.routing = segment.routing
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
    first = await generate(prompt_ids, out.thinking_budget, [ids.eos])
    if first.finish == "abort":
        out.extend(first)
        out.finish_reason = "abort"
        return out
    if ids.end_of_thinking in first.tokens:  # the model closed its thinking; what follows is its answer
        close = first.tokens.index(ids.end_of_thinking) + 1
        answered = len(first.tokens) - close
        if first.finish == "stop" and answered <= cfg.answer_tokens:  # it answered and stopped in budget
            out.extend(first)
            out.finish_reason = "stop"
            return out
        if answered >= cfg.answer_tokens:  # the answer budget ran out inside this request: cut there
            out.extend(_head(first, close + cfg.answer_tokens, "length"))
            out.finish_reason = "length"
            return out
        out.extend(first)  # the thinking budget ended first: the answer goes on in a second request
        answer = await generate(prompt_ids + out.tokens, cfg.answer_tokens - answered, [ids.eos])
        out.extend(answer)
        out.finish_reason = answer.finish
        return out
    out.extend(first)
    if first.finish == "stop":
        out.finish_reason = "stop"  # EOS inside the thinking budget: the model answered without closing
        return out
    out.inject(ids.phrase, current_version())  # the budget ran out while thinking: interrupt
    answer = await generate(prompt_ids + out.tokens, cfg.answer_tokens, [ids.eos])
    out.extend(answer)
    out.finish_reason = "interrupted" if answer.finish == "stop" else answer.finish
    return out


def _head(segment: Segment, n: int, finish: Literal["stop", "length", "abort"]) -> Segment:
    """The first `n` tokens of `segment` as if the engine had stopped there."""
    cut = len(segment.tokens) - n  # the routing record loses the rows of the tokens cut off
    routing = segment.routing[: len(segment.routing) - cut] if segment.routing is not None else None
    return Segment(segment.tokens[:n], segment.logprobs[:n], segment.versions[:n], finish, routing)
