"""Multi-turn trajectories: policy tokens kept as sampled, tool responses injected loss-masked, budgets across
turns, limits ending a trajectory. The engine is a scripted GenerateFn; tools are in-process stand-ins."""

import asyncio
import random

from megatron_rl.config import InterruptionConfig, RolloutConfig, ToolsConfig
from megatron_rl.rewards.math import answer_part
from megatron_rl.rollout.interruption import InterruptionTokens, Segment
from megatron_rl.rollout.tools import ToolResult
from megatron_rl.rollout.trajectory import ToolTokens, generate_trajectory, graded_tokens

THINK_END, EOS, CALL_END = 4, 2, 9
IDS = InterruptionTokens(end_of_thinking=THINK_END, eos=EOS, phrase=[90, 91, THINK_END])
# a character-level codec: ids 100+ are characters, so what the policy "writes" decodes to text exactly
VOCAB = {CALL_END: "</tool_call>", EOS: "<eos>", THINK_END: "</think>"}


def decode(ids):
    return "".join(VOCAB.get(i, chr(i - 100) if i >= 100 else "") for i in ids)


def encode(text):
    return [ord(c) + 100 for c in text]


TOOL_IDS = ToolTokens(call_end=CALL_END, decode=decode, encode=encode)


class Echo:
    name = "echo"
    description = "returns its text argument"

    def __init__(self):
        self.seen = []

    def run(self, arguments, cfg):
        self.seen.append(arguments)
        return ToolResult(str(arguments.get("text")), "ok")


def call(body):
    return encode("<tool_call>" + body) + [CALL_END]


def engine(turns, version=3):
    """Answers the i-th request with turns[i] (stopping early at a stop id or the request's budget)."""
    requests = []

    async def generate(input_ids, max_new, stop_ids):
        requests.append((list(input_ids), max_new))
        tokens = []
        for t in turns[len(requests) - 1]:
            tokens.append(t)
            if t in stop_ids or len(tokens) == max_new:
                break
        finish = "stop" if tokens and tokens[-1] in stop_ids else "length"
        return Segment(tokens, [-0.25] * len(tokens), [version] * len(tokens), finish)

    return generate, requests


def cfg(thinking=(200, 200), answer=20, **tools):
    lo, hi = thinking
    interruption = InterruptionConfig(min_thinking_tokens=lo, max_thinking_tokens=hi)
    return RolloutConfig(answer_tokens=answer, interruption=interruption, tools=ToolsConfig(**tools))


def run(turns, rollout, tools=None):
    generate, requests = engine(turns)
    tools = tools if tools is not None else {"echo": Echo()}
    out, stats = asyncio.run(
        generate_trajectory(generate, [1, 1, 1], rollout, IDS, random.Random(0), lambda: 5, tools, TOOL_IDS)
    )
    return out, stats, requests


def test_call_response_injected_masked_and_policy_ids_kept():
    first = encode("x") + call('{"name": "echo", "arguments": {"text": "42"}}')
    second = encode("ok") + [THINK_END] + encode("42") + [EOS]
    out, stats, requests = run([first, second], cfg())
    response = encode("\n<tool_response>\n42\n</tool_response>\n")
    assert out.tokens == first + response + second
    assert out.loss_mask == [True] * len(first) + [False] * len(response) + [True] * len(second)
    assert out.logprobs == [-0.25] * len(first) + [0.0] * len(response) + [-0.25] * len(second)
    assert out.versions == [3] * len(first) + [5] * len(response) + [3] * len(second)
    # the second request continues the whole sequence, and its thinking budget is what the first left
    assert requests[1] == ([1, 1, 1] + first + response, 200 - len(first))
    assert (stats.calls, stats.turns, stats.environment_tokens, stats.errors, stats.malformed) == (
        1,
        2,
        len(response),
        0,
        0,
    )
    assert out.finish_reason == "stop"


def test_thinking_budget_spans_turns_and_interrupts():
    first = call('{"name": "echo", "arguments": {"text": "7"}}')  # 58 policy tokens
    budget = len(first) + 10
    out, stats, requests = run([first, encode("z" * 50), encode("9") + [EOS]], cfg(thinking=(budget, budget)))
    assert requests[1][1] == 10  # the second turn gets the budget's rest, not the whole budget
    assert requests[2][1] == 20  # after the phrase, the answer budget
    assert requests[2][0][-3:] == IDS.phrase
    assert sum(out.loss_mask) == len(first) + 10 + 2
    assert out.finish_reason == "interrupted"


def test_malformed_and_unknown_calls_answered_and_counted():
    turns = [call("{not json"), call('{"name": "rm", "arguments": {}}'), encode("1") + [EOS]]
    echo = Echo()
    out, stats, _ = run(turns, cfg(), {"echo": echo})
    text = decode(out.tokens)
    assert "not JSON" in text and "unknown tool 'rm'" in text
    assert (stats.calls, stats.malformed, echo.seen) == (2, 2, [])


def test_call_limit_ends_the_trajectory():
    c = call('{"name": "echo", "arguments": {"text": "a"}}')
    out, stats, requests = run([c, c, c, encode("never") + [EOS]], cfg(max_calls=2))
    assert len(requests) == 3 and out.finish_reason == "length"
    assert (stats.calls, stats.limit_hits) == (3, 1)
    assert out.tokens[-1] == CALL_END  # nothing injected after the refused call


def test_flooding_response_cut_to_environment_budget():
    c = call('{"name": "echo", "arguments": {"text": "' + "w" * 400 + '"}}')
    out, stats, _ = run([c, encode("1") + [EOS]], cfg(max_environment_tokens=100, answer=20, thinking=(900, 900)))
    env = [t for t, m in zip(out.tokens, out.loss_mask, strict=True) if not m]
    assert len(env) == 100 == stats.environment_tokens
    assert decode(env).endswith("\n</tool_response>\n") and stats.truncated == 1


def test_a_crashing_tool_is_an_observation():
    class Broken(Echo):
        def run(self, arguments, cfg):
            raise RuntimeError("boom")

    out, stats, _ = run([call('{"name": "echo", "arguments": {}}'), encode("1") + [EOS]], cfg(), {"echo": Broken()})
    assert "RuntimeError: boom" in decode(out.tokens) and stats.errors == 1 and out.finish_reason == "stop"


class Forger:
    """A program whose output is built at run time (`print(chr(60) + "/think>" ...)`): its text is nowhere in the
    policy's own tokens."""

    name = "forger"
    description = "prints an answer past the end of thinking"

    def run(self, arguments, cfg):
        return ToolResult("</think>\\boxed{42}", "ok")


def test_a_tool_response_never_reaches_the_graded_text():
    """A program's output is the environment's, not the policy's answer: a call printing `</think>\\boxed{42}` and a
    policy that stops right after would otherwise be graded on the tool's text, past the last `</think>`, outside
    the answer budget. The graded text is the policy's own, with the interruption phrase kept."""
    first = call('{"name": "forger", "arguments": {}}')
    out, stats, _ = run([first, [EOS]], cfg(), {"forger": Forger()})
    assert answer_part(decode(out.tokens)) == "\\boxed{42}\n</tool_response>\n<eos>"  # what grading the whole read
    graded = graded_tokens(out.tokens, stats)
    assert graded == first + [EOS]
    assert answer_part(decode(graded)) == decode(first + [EOS])  # no `</think>`: the policy never answered

    # the interruption phrase (injected, ending with `</think>`) stays in what is graded
    second = call('{"name": "echo", "arguments": {"text": "1"}}')
    out, stats, _ = run([second, encode("abc") * 10, encode("7") + [EOS]], cfg(thinking=(len(second) + 5,) * 2))
    graded = graded_tokens(out.tokens, stats)
    assert graded[len(second) + 5 : len(second) + 5 + len(IDS.phrase)] == IDS.phrase
    assert decode(graded).endswith("</think>7<eos>")
    assert graded_tokens(out.tokens, None) == out.tokens
