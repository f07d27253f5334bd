"""Multi-turn generation: the policy reasons, calls tools, reads their results and goes on.

A trajectory is one token sequence after the prompt, made of policy segments (the ids the engine sampled, kept
as sampled: nothing is decoded and encoded again, so the trainer trains on exactly the engine's ids, with the
engine's log-probs) and environment segments (a tool's result, tokenised once and injected with `loss_mask`
False and generator log-prob 0, as the interruption phrase is). Each policy request continues the whole
sequence so far, so the last request's routing record covers every token before its own (MoE replay).

Length control is the recipe's (rollout/interruption.py), over the whole trajectory: the thinking budget counts
policy tokens only, across turns; when it runs out the phrase is injected and the answer gets `answer_tokens`
(policy tokens, again across turns). Environment tokens count against nothing of the policy's but are bounded
by `rollout.tools.max_environment_tokens`; calls by `max_calls`; tool time by `call_time_s` per call and
`trajectory_time_s` per trajectory. A trajectory that reaches a tool limit ends there (finish "length"). Every
token of a trajectory carries the version of the weights that produced it; the trajectory's own version for
the staleness rule is that of its first token, its first turn's.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from megatron_rl.config import RolloutConfig, ToolsConfig
from megatron_rl.rewards.sandbox import SandboxUnavailable
from megatron_rl.rollout.interruption import Generated, GenerateFn, InterruptionTokens, cut_segment
from megatron_rl.rollout.tools import Call, Tool, ToolResult, bounded, parse_call


@dataclass
class ToolTokens:
    """What a trajectory needs of the tokenizer besides the interruption tokens."""

    call_end: int
    """The id of `rollout.tools.call_end`: the engine stops there."""
    decode: Callable[[list[int]], str]
    encode: Callable[[str], list[int]]
    """Text to ids without special tokens added (a tool's response is spliced mid-sequence)."""


def tool_tokens(tokenizer, cfg: ToolsConfig) -> ToolTokens:  # type: ignore[no-untyped-def]
    """The tool tokens of a Hugging Face tokenizer; the call's closing marker must be one token."""
    ids = tokenizer.encode(cfg.call_end, add_special_tokens=False)
    if len(ids) != 1:
        raise ValueError(
            f"rollout.tools.call_end: {cfg.call_end!r} is {len(ids)} tokens of this tokenizer, and the engine can "
            "stop only at one token; use a marker the tokenizer holds as one token (Qwen's </tool_call>)"
        )
    return ToolTokens(
        call_end=ids[0],
        decode=lambda t: tokenizer.decode(t, skip_special_tokens=False),
        encode=lambda s: tokenizer.encode(s, add_special_tokens=False),
    )


@dataclass
class ToolStats:
    """One trajectory's tool use."""

    calls: int = 0
    """Calls the policy wrote (run or not)."""
    errors: int = 0
    """Calls that ran and failed (an exception, a crash, a memory or output limit)."""
    timeouts: int = 0
    malformed: int = 0
    """Calls that could not be read or named an unknown tool or wrong arguments (answered, not run)."""
    truncated: int = 0
    """Responses cut to the output or environment-token bound."""
    limit_hits: int = 0
    """1 when the trajectory ended at a tool limit (calls, tool time, environment tokens)."""
    turns: int = 0
    """Policy segments (a trajectory without calls has one)."""
    environment_tokens: int = 0
    tool_time_s: float = 0.0
    responses: list[tuple[int, int]] = field(default_factory=list)
    """[start, end) of each tool response in the trajectory's tokens: the environment's text, left out of what the
    reward grades (`graded_tokens`)."""

    @property
    def used_tools(self) -> bool:
        return self.calls > 0


def graded_tokens(tokens: list[int], stats: ToolStats | None) -> list[int]:
    """A trajectory's tokens as its reward grades them: the policy's own, tool responses left out.

    A tool's output is written by the policy's program, and the graders read text: a call printing
    `</think>\\boxed{N}` would otherwise place an answer past the last `</think>` from inside a masked environment
    segment, outside the answer budget of the length control. The interruption phrase, injected as well, stays: it
    closes the thinking of an interrupted completion."""
    if stats is None or not stats.responses:
        return tokens
    kept, start = [], 0
    for begin, end in stats.responses:
        kept += tokens[start:begin]
        start = end
    return kept + tokens[start:]


async def generate_trajectory(
    generate: GenerateFn,
    prompt_ids: list[int],
    cfg: RolloutConfig,
    ids: InterruptionTokens,
    rng: random.Random,
    current_version: Callable[[], int],
    tools: dict[str, Tool],
    tool_ids: ToolTokens,
) -> tuple[Generated, ToolStats]:
    out, stats = Generated(), ToolStats()
    limits = cfg.tools
    control = cfg.interruption
    stop = [ids.eos, tool_ids.call_end]
    if control.enabled:
        thinking_left = out.thinking_budget = rng.randint(control.min_thinking_tokens, control.max_thinking_tokens)
    else:
        thinking_left = 0  # one phase: the whole completion budget is the answer's
    answer_left = cfg.answer_tokens if control.enabled else cfg.max_completion_tokens
    thinking = control.enabled
    interrupted = False
    turn_start = 0  # where the current policy stretch starts in out.tokens (a call is read from it)

    while True:
        if thinking and thinking_left <= 0:  # the budget ran out while thinking: interrupt
            out.inject(ids.phrase, current_version())
            thinking, interrupted, turn_start = False, True, len(out.tokens)
            continue
        if not thinking and answer_left <= 0:
            out.finish_reason = "length"
            return out, stats
        segment = await generate(prompt_ids + out.tokens, thinking_left if thinking else answer_left, stop)
        stats.turns += 1
        if thinking and ids.end_of_thinking in segment.tokens:  # it closed its thinking: the rest is answer
            close = segment.tokens.index(ids.end_of_thinking) + 1
            thinking_left -= close
            thinking = False
            answer = len(segment.tokens) - close
            if answer > answer_left:
                out.extend(cut_segment(segment, close + answer_left, "length"))
                out.finish_reason = "length"
                return out, stats
            answer_left -= answer
        elif thinking:
            thinking_left -= len(segment.tokens)
        else:
            answer_left -= len(segment.tokens)
        out.extend(segment)

        if segment.finish == "abort":
            out.finish_reason = "abort"
            return out, stats
        if segment.finish == "stop" and segment.tokens and segment.tokens[-1] == tool_ids.call_end:
            response = await _answer_call(tool_ids.decode(out.tokens[turn_start:]), tools, limits, stats)
            if response is None:  # a tool limit is reached: the trajectory ends here
                stats.limit_hits = 1
                out.finish_reason = "length"
                return out, stats
            room = limits.max_environment_tokens - stats.environment_tokens
            tokens = tool_ids.encode(limits.response_template.format(output=response))
            if len(tokens) > room:  # cut to what is left, the closing tag kept so the policy sees it ended
                closing = tool_ids.encode(limits.response_template.split("{output}")[1])
                tokens = tokens[: max(room - len(closing), 0)] + closing[:room]
                stats.truncated += 1
            stats.environment_tokens += len(tokens)
            stats.responses.append((len(out.tokens), len(out.tokens) + len(tokens)))
            out.inject(tokens, current_version())
            turn_start = len(out.tokens)
            continue
        if segment.finish == "length" and thinking:
            continue  # the thinking budget ran out: the loop's head interrupts
        if segment.finish == "length":
            out.finish_reason = "length"
        else:
            out.finish_reason = "interrupted" if interrupted else "stop"
        return out, stats


async def _answer_call(text: str, tools: dict[str, Tool], limits: ToolsConfig, stats: ToolStats) -> str | None:
    """The text answering the call that ends `text` (counted in `stats`), or None when a tool limit forbids
    another call."""
    if (
        stats.calls >= limits.max_calls
        or stats.tool_time_s + limits.call_time_s > limits.trajectory_time_s
        or stats.environment_tokens >= limits.max_environment_tokens
    ):
        stats.calls += 1
        return None
    stats.calls += 1
    start = text.rfind(limits.call_start)
    if start < 0:
        result: Call | ToolResult = ToolResult(f"error: {limits.call_end} without {limits.call_start}", "malformed")
    else:
        result = parse_call(text[start + len(limits.call_start) : len(text) - len(limits.call_end)], tools)
    if isinstance(result, Call):
        began = time.monotonic()
        try:
            result = await asyncio.to_thread(tools[result.name].run, result.arguments, limits)
        except SandboxUnavailable:
            raise  # the machine cannot isolate tool calls: a setup error, not the policy's
        except Exception as e:  # a tool's own failure is the policy's observation, not the run's end
            result = ToolResult(bounded(f"error: the tool failed: {type(e).__name__}: {e}", 512)[0], "error")
        stats.tool_time_s += time.monotonic() - began
    stats.errors += result.status == "error"
    stats.timeouts += result.status == "timeout"
    stats.malformed += result.status == "malformed"
    stats.truncated += result.truncated
    return result.text
