"""The Python tool through the real bubblewrap sandbox, inside a trajectory: a call that prints, one that raises,
one that hangs, one that floods, one that tries the network and the host's files; each answered, bounded and
counted."""

import asyncio
import json
import random

from megatron_rl.config import InterruptionConfig, RolloutConfig, ToolsConfig
from megatron_rl.rollout.interruption import InterruptionTokens, Segment
from megatron_rl.rollout.tools import build_tools
from megatron_rl.rollout.trajectory import ToolTokens, generate_trajectory

EOS, THINK_END, CALL_END = 2, 4, 9
IDS = InterruptionTokens(end_of_thinking=THINK_END, eos=EOS, phrase=[THINK_END])
SPECIAL = {CALL_END: "</tool_call>", EOS: "<eos>", THINK_END: "</think>"}
CODEC = ToolTokens(
    call_end=CALL_END,
    decode=lambda ids: "".join(SPECIAL.get(i, chr(i - 100) if i >= 100 else "") for i in ids),
    encode=lambda text: [ord(c) + 100 for c in text],
)
PROGRAMS = [
    "print(987 + 654)",
    "1 / 0",
    "while True: pass",
    "print('z' * 10**7)",
    "print('q' * 3000)",
    "import socket\ntry:\n    socket.create_connection(('1.1.1.1', 80), timeout=1)\n    print('online')\n"
    "except OSError as e:\n    print('offline', type(e).__name__)",
    "try:\n    open('/work/escape', 'w').write('x')\n    print('wrote')\n"
    "except OSError as e:\n    print('denied', e.errno)",
]


def scripted(turns):
    """An engine that answers its i-th request with turns[i] (cut to the request's budget)."""
    count = 0

    async def generate(input_ids, max_new, stop_ids):
        nonlocal count
        tokens = turns[count][:max_new]
        count += 1
        return Segment(tokens, [-0.1] * len(tokens), [1] * len(tokens), "stop")

    return generate


def test_python_tool_calls_bounded_and_counted():
    turns = [CODEC.encode("<tool_call>" + json.dumps({"name": "python", "arguments": {"code": p}})) + [CALL_END]
             for p in PROGRAMS] + [CODEC.encode("done") + [EOS]]  # fmt: skip
    generate = scripted(turns)

    tools_cfg = ToolsConfig(max_calls=8, call_time_s=2.0, trajectory_time_s=30.0, max_output_bytes=200,
                            max_environment_tokens=4000)  # fmt: skip
    cfg = RolloutConfig(interruption=InterruptionConfig(min_thinking_tokens=5000, max_thinking_tokens=5000),
                        answer_tokens=10, tools=tools_cfg)  # fmt: skip
    out, stats = asyncio.run(
        generate_trajectory(generate, [1], cfg, IDS, random.Random(0), lambda: 1, build_tools(["python"]), CODEC)
    )
    responses = CODEC.decode([t for t, m in zip(out.tokens, out.loss_mask, strict=True) if not m])
    parts = responses.split("</tool_response>")[:-1]
    assert len(parts) == 7
    assert parts[0].strip().endswith("1641")
    assert "ZeroDivisionError: division by zero" in parts[1]
    assert "[timeout: killed after 2 s]" in parts[2]
    assert "[output limit: the program was killed]" in parts[3]  # a flood is killed at the sandbox's output cap
    assert "q" * 200 + "\n[output truncated: 2800 more bytes]" in parts[4]
    assert "offline" in parts[5] and "online\n" not in parts[5]
    assert "denied" in parts[6] and "wrote" not in parts[6]
    assert (stats.calls, stats.errors, stats.timeouts, stats.malformed, stats.turns) == (7, 2, 1, 0, 8)
    assert stats.truncated == 1 and out.finish_reason == "stop"
    assert stats.environment_tokens == len(out.tokens) - sum(out.loss_mask)


def test_a_program_that_prints_an_answer_past_thinking_is_not_graded(tmp_path):
    """A hostile policy's call builds `</think>\\boxed{4}` at run time in the real sandbox and stops; with the tiny
    tokenizer the printed `</think>` even comes back as the special token. The math reward would grade the tool's
    text as the answer (outside the answer budget); the graded text is the policy's own, which never answered."""
    from transformers import AutoTokenizer

    from megatron_rl.config import RewardsConfig
    from megatron_rl.data.tokenizer import build_tokenizer
    from megatron_rl.rewards.math import math_reward
    from megatron_rl.rollout.trajectory import graded_tokens, tool_tokens

    tokenizer = AutoTokenizer.from_pretrained(build_tokenizer(tmp_path / "tok"))
    tools_cfg = ToolsConfig(call_time_s=5.0)
    codec = tool_tokens(tokenizer, tools_cfg)
    think_end, eos = tokenizer.convert_tokens_to_ids("</think>"), tokenizer.eos_token_id
    code = 'print(chr(60) + "/think>" + chr(92) + "boxed{" + str(2 + 2) + "}")'
    call = codec.encode("<tool_call>" + json.dumps({"name": "python", "arguments": {"code": code}})) + [codec.call_end]
    turns = [call, [eos]]
    generate = scripted(turns)

    ids = InterruptionTokens(end_of_thinking=think_end, eos=eos, phrase=[think_end])
    cfg = RolloutConfig(interruption=InterruptionConfig(min_thinking_tokens=500, max_thinking_tokens=500),
                        answer_tokens=10, tools=tools_cfg)  # fmt: skip
    out, stats = asyncio.run(
        generate_trajectory(generate, [1], cfg, ids, random.Random(0), lambda: 1, build_tools(["python"]), codec)
    )
    assert stats.calls == 1 and stats.errors == 0
    environment = [t for t, m in zip(out.tokens, out.loss_mask, strict=True) if not m]
    assert think_end in environment  # the printed marker is the special token in the policy's context
    rewards = RewardsConfig()
    whole = tokenizer.decode(out.tokens, skip_special_tokens=False).replace(tokenizer.eos_token, "")
    assert math_reward(whole, "4", rewards).passed  # what grading the whole trajectory would have paid
    graded = tokenizer.decode(graded_tokens(out.tokens, stats), skip_special_tokens=False)
    assert not math_reward(graded.replace(tokenizer.eos_token, ""), "4", rewards).passed
