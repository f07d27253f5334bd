"""Interruption length control: budgets, injection, masking, finish reasons.

The generator here is a scripted token source (a list of tokens the "model" would emit), so the
control logic is checked exactly; the same logic runs against a real SGLang server in
tests/integration.
"""

import asyncio
import random

import pytest

from megatron_rl.config import InterruptionConfig, RolloutConfig
from megatron_rl.rollout.interruption import InterruptionTokens, Segment, generate_completion

THINK_END, EOS = 4, 2
IDS = InterruptionTokens(end_of_thinking=THINK_END, eos=EOS, phrase=[90, 91, THINK_END])


def scripted(script, version=7):
    """A GenerateFn emitting `script` after the 3-token prompt, continuing from where its input ends.

    Script positions covered by an injected phrase are skipped (the tests put placeholders there)."""
    calls = []

    async def generate(input_ids, max_new_tokens, stop_ids):
        calls.append((len(input_ids), max_new_tokens, tuple(stop_ids)))
        tokens = []
        for token in script[len(input_ids) - 3 :]:
            tokens.append(token)
            if token in stop_ids:
                return Segment(tokens, [-0.5] * len(tokens), [version] * len(tokens), "stop")
            if len(tokens) == max_new_tokens:
                break
        return Segment(tokens, [-0.5] * len(tokens), [version] * len(tokens), "length")

    return generate, calls


def _cfg(enabled=True, lo=5, hi=5, answer=3, lookahead=0):
    return RolloutConfig(
        interruption=InterruptionConfig(
            enabled=enabled, min_thinking_tokens=lo, max_thinking_tokens=hi, lookahead_tokens=lookahead
        ),
        answer_tokens=answer,
    )


def run(script, cfg, version_now=9):
    generate, calls = scripted(script)
    out = asyncio.run(generate_completion(generate, [1, 1, 1], cfg, IDS, random.Random(0), lambda: version_now))
    return out, calls


def test_model_closes_thinking_within_budget():
    out, calls = run([3, 10, 11, THINK_END, 20, EOS], _cfg())
    assert out.tokens == [3, 10, 11, THINK_END, 20, EOS]
    assert all(out.loss_mask) and out.finish_reason == "stop"
    # the thinking budget ended one token into the answer: the answer goes on with what is left of its budget
    assert calls == [(3, 5, (EOS,)), (3 + 5, 2, (EOS,))]


@pytest.mark.parametrize("lookahead, calls_made", [(1, [(3, 6, (EOS,)), (3 + 6, 1, (EOS,))]), (3, [(3, 8, (EOS,))])])
def test_a_lookahead_past_the_thinking_budget_answers_in_the_first_request(lookahead, calls_made):
    out, calls = run([3, 10, 11, THINK_END, 20, 21, EOS], _cfg(lookahead=lookahead))
    assert out.tokens == [3, 10, 11, THINK_END, 20, 21, EOS] and out.finish_reason == "stop"
    assert calls == calls_made


def test_a_closed_thinking_and_its_answer_in_one_request():
    out, calls = run([3, THINK_END, 20, EOS], _cfg())
    assert out.tokens == [3, THINK_END, 20, EOS] and out.finish_reason == "stop" and len(calls) == 1


def test_an_answer_past_its_budget_inside_the_thinking_request_is_cut_and_truncated():
    out, calls = run([3, THINK_END, 20, 21, 22, 23], _cfg(answer=2))
    assert out.tokens == [3, THINK_END, 20, 21] and out.finish_reason == "length" and len(calls) == 1
    assert len(out.logprobs) == len(out.versions) == len(out.loss_mask) == 4
    out, calls = run([3, THINK_END, 20, 21, EOS], _cfg(answer=2))  # EOS one token past the answer budget
    assert out.tokens == [3, THINK_END, 20, 21] and out.finish_reason == "length" and len(calls) == 1


@pytest.mark.parametrize("lookahead", [0, 1, 3, 10])
@pytest.mark.parametrize("seed", range(20))
def test_one_request_draws_what_the_two_phases_drew(seed, lookahead):
    """Against the two-phase procedure (thinking stopped at </think>, then the answer budget), on random scripts:
    the same tokens, mask and finish reason."""
    rng = random.Random(seed)
    script = [rng.choice([3, 10, 11, THINK_END, EOS]) for _ in range(30)]
    cfg = _cfg(lo=4, hi=9, answer=3, lookahead=lookahead)
    out, _ = run(script, cfg)

    async def two_phases():
        generate, _ = scripted(script)
        budget = random.Random(0).randint(4, 9)
        thinking = await generate([1, 1, 1], budget, [THINK_END, EOS])
        tokens = list(thinking.tokens)
        if thinking.tokens and thinking.tokens[-1] == EOS:
            return tokens, "stop"
        closed = bool(tokens) and tokens[-1] == THINK_END
        if not closed:
            tokens += IDS.phrase
        answer = await generate([1, 1, 1] + tokens, 3, [EOS])
        finish = "interrupted" if (answer.finish == "stop" and not closed) else answer.finish
        return tokens + answer.tokens, finish

    tokens, finish = asyncio.run(two_phases())
    assert (out.tokens, out.finish_reason) == (tokens, finish)


def test_budget_reached_injects_masked_phrase_then_answers():
    out, calls = run([3, 10, 11, 12, 13, 14, 15, 16, 17], _cfg())
    # 5 thinking tokens, then the phrase (masked, log-prob 0, current version), then the answer phase.
    assert out.tokens[:5] == [3, 10, 11, 12, 13]
    assert out.tokens[5:8] == IDS.phrase
    assert out.loss_mask == [True] * 5 + [False] * 3 + [True] * (len(out.tokens) - 8)
    assert out.logprobs[5:8] == [0.0, 0.0, 0.0] and out.versions[5:8] == [9, 9, 9]
    assert calls[1][0] == 3 + 5 + 3  # the answer phase sees prompt + thinking + phrase


def test_interrupted_answer_that_stops_is_interrupted_and_one_that_runs_out_is_truncated():
    generate_stop_script = [3, 10, 11, 12, 13]  # the answer phase then continues from index 8
    out, _ = run(generate_stop_script + [0, 0, 0, 30, EOS], _cfg(answer=3))
    assert out.finish_reason == "interrupted" and out.tokens[-1] == EOS
    out, _ = run(generate_stop_script + [0, 0, 0, 30, 31, 32, 33], _cfg(answer=3))
    assert out.finish_reason == "length" and len(out.tokens) == 5 + 3 + 3


def test_an_abort_inside_the_thinking_budget_ends_the_completion_as_aborted():
    async def aborting(input_ids, max_new_tokens, stop_ids):
        return Segment([3, 10], [-0.5, -0.5], [7, 7], "abort")

    out = asyncio.run(generate_completion(aborting, [1, 1, 1], _cfg(lookahead=3), IDS, random.Random(0), lambda: 9))
    assert out.tokens == [3, 10] and out.finish_reason == "abort"


def test_a_close_past_the_thinking_budget_is_dropped_and_the_completion_interrupted():
    # the first request closes past the budget of 5; the phrase then covers THINK_END, 20, EOS
    out, calls = run([3, 10, 11, 12, 13, THINK_END, 20, EOS, 30, EOS], _cfg(lookahead=3))
    assert out.tokens == [3, 10, 11, 12, 13, *IDS.phrase, 30, EOS] and out.finish_reason == "interrupted"
    assert len(calls) == 2


def test_eos_inside_thinking_ends_the_completion():
    out, calls = run([3, 10, EOS], _cfg())
    assert out.finish_reason == "stop" and len(calls) == 1


def test_budget_is_drawn_per_sequence_in_range():
    budgets = set()
    for seed in range(50):
        generate, _ = scripted([3] * 100)
        out = asyncio.run(
            generate_completion(generate, [1, 1, 1], _cfg(lo=10, hi=20), IDS, random.Random(seed), lambda: 0)
        )
        budgets.add(out.thinking_budget)
    assert min(budgets) >= 10 and max(budgets) <= 20 and len(budgets) > 5


@pytest.mark.parametrize("finish", ["stop", "length"])
def test_disabled_is_one_phase_of_the_whole_budget(finish):
    script = [3, 10, EOS] if finish == "stop" else [3] * 50
    out, calls = run(script, _cfg(enabled=False, lo=5, hi=5, answer=3))
    assert len(calls) == 1 and calls[0][1] == 8 and out.finish_reason == finish and all(out.loss_mask)


def test_a_tokenizer_without_the_end_of_thinking_token_is_refused_when_interruption_is_on(tmp_path):
    """Llama-3.1's tokenizer has no `</think>`: convert_tokens_to_ids answers None (or the unknown token's id),
    and interruption would never see thinking end. The start is refused naming the field; the CPU run's own
    tokenizer has the token."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from megatron_rl.config import ConfigError, load_config
    from megatron_rl.data.tokenizer import build_tokenizer
    from megatron_rl.rollout.session import interruption_tokens

    run = load_config("scalerl-cpu")
    tiny = AutoTokenizer.from_pretrained(build_tokenizer(tmp_path / "tiny"))
    assert tiny.convert_ids_to_tokens(interruption_tokens(run.rollout, tiny).end_of_thinking) == "</think>"
    plain = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(WordLevel({"a": 0, "<unk>": 1, "<eos>": 2}, unk_token="<unk>")),
        unk_token="<unk>",
        eos_token="<eos>",
    )
    with pytest.raises(ConfigError, match=r"rollout.interruption.end_of_thinking: '</think>' is not a token"):
        interruption_tokens(run.rollout, plain)
    off = load_config("scalerl-cpu", None, ["rollout.interruption.enabled=false", "algo.length_penalty.enabled=true"])
    interruption_tokens(off.rollout, plain)  # the loo-lp way: no interruption, no marker needed


def _routed(generate):
    """A GenerateFn that adds a routing record to every answer, one row per token it ran: row i = [[i]]."""
    import numpy as np

    async def with_routing(input_ids, max_new_tokens, stop_ids):
        segment = await generate(input_ids, max_new_tokens, stop_ids)
        rows = len(input_ids) + len(segment.tokens) - 1
        segment.routing = np.arange(rows, dtype=np.uint8).reshape(rows, 1, 1)
        return segment

    return with_routing


@pytest.mark.parametrize(
    "script, answer",
    [
        ([3, 10, 11, THINK_END, 20, EOS], 3),  # the answer goes on in a second request
        ([3, THINK_END, 20, 21, 22, 23], 2),  # cut inside the first request
        ([3, 10, 11, 12, 13, 0, 0, 0, 30, EOS], 3),  # interrupted: the phrase, then the answer request
        ([3, THINK_END, 20, EOS], 3),  # one request
    ],
    ids=["two_requests", "cut", "interrupted", "one_request"],
)
def test_the_routing_record_covers_every_token_but_the_last(script, answer):
    generate, _ = scripted(script)
    cfg = _cfg(answer=answer)
    out = asyncio.run(generate_completion(_routed(generate), [1, 1, 1], cfg, IDS, random.Random(0), lambda: 9))
    assert out.routing is not None
    # the last request's record: row i belongs to token i of prompt + completion
    assert out.routing[:, 0, 0].tolist() == list(range(3 + len(out.tokens) - 1))
