"""Length control by interruption (docs/recipe.md §5), around any engine's generate call.

One completion is generated in up to two phases:

1. thinking: up to a per-sequence budget drawn uniformly in [min_thinking_tokens, max_thinking_tokens],
   ending at the end-of-thinking token (or at EOS);
2. answer: up to `answer_tokens` more, after either the model's own `</think>` or, when the budget ran
   out first, the injected phrase "Okay, time is up. ... </think>".

The engine is asked for the thinking budget plus `interruption.lookahead_tokens` (0 by default), stopping only
at EOS, not at `</think>`: a model that closes its thinking early goes on into its answer in the same request,
cut to `answer_tokens` after its close (or continued in a second request when the first ended before). One that
does not close within the budget is cut at the budget (tokens past it dropped) and answers after the phrase in
a second request. Sampling is autoregressive, so this draws exactly the completions the two phases would,
with fewer requests (each costs the engine's HTTP server and scheduler CPU, and a second one waits for the
first and prefills its context again when a weight push flushed the cache in between). On the default CPU
run (`lookahead_tokens` 16, its whole answer budget): 131 requests per 128 completions instead of 177, and
6.3-6.4 engine seconds per 1,000 completions instead of 6.7-7.6.

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

    budget = out.thinking_budget = rng.randint(control.min_thinking_tokens, control.max_thinking_tokens)
    first = await generate(prompt_ids, budget + min(control.lookahead_tokens, cfg.answer_tokens), [ids.eos])
    thinking = first.tokens[:budget]
    if ids.end_of_thinking in thinking:  # the model closed its thinking in budget; what follows is its answer
        end = thinking.index(ids.end_of_thinking) + 1 + cfg.answer_tokens
        if len(first.tokens) > end or len(first.tokens) == end and first.finish == "length":
            out.extend(cut_segment(first, end, "length"))  # the answer budget ran out inside this request: cut there
            out.finish_reason = "length"
            return out
        out.extend(first)
        if first.finish != "length":  # it answered and stopped in budget (or was aborted)
            out.finish_reason = first.finish
            return out
        # the request ended before the answer did: the answer goes on in a second request
        answer = await generate(prompt_ids + out.tokens, end - len(first.tokens), [ids.eos])
        out.extend(answer)
        out.finish_reason = answer.finish
        return out
    if len(first.tokens) <= budget and first.finish != "length":  # EOS (or an abort) in budget, without a close
        out.extend(first)
        out.finish_reason = first.finish
        return out
    # the budget ran out while thinking: cut there (what came after is dropped) and interrupt
    out.extend(cut_segment(first, budget, "length"))
    out.inject(ids.phrase, current_version())
    answer = await generate(prompt_ids + out.tokens, cfg.answer_tokens, [ids.eos])
    out.extend(answer)
    out.finish_reason = "interrupted" if answer.finish == "stop" else answer.finish
    return out


def cut_segment(segment: Segment, n: int, finish: Literal["stop", "length", "abort"]) -> Segment:
    """The first `n` tokens of `segment` as if the engine had stopped there."""
    cut = len(segment.tokens) - n  # the routing record loses the rows of the tokens cut off
    routing = segment.routing[: len(segment.routing) - cut] if segment.routing is not None else None
    return Segment(segment.tokens[:n], segment.logprobs[:n], segment.versions[:n], finish, routing)
