"""The rollout pipeline's bookkeeping: per-task statistics, prompts too long to generate from, the staleness
bound (the trainer waits; nothing dropped, no length bias), truncated completions and the loo-lp penalty.

The engine here is scripted (a fixed answer per prompt) so the batch statistics are known exactly; the
pipeline itself, the sampler, the tokenizer and the reward workers are the real ones. The loop with
SGLang is tested in tests/integration/orchestration/test_loop.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import pytest

from megatron_rl.algo.filters import NoPositiveResampling
from megatron_rl.config import AlgoConfig, InterruptionConfig, LengthPenaltyConfig, RewardsConfig, RolloutConfig
from megatron_rl.data.datasets import Prompt
from megatron_rl.data.sampler import CurriculumSampler
from megatron_rl.rewards.workers import RewardWorkers
from megatron_rl.rollout.interruption import InterruptionTokens, Segment
from megatron_rl.rollout.pipeline import RolloutPipeline
from megatron_rl.rollout.session import PromptEncoder, SamplingSession


@pytest.fixture(scope="module")
def encoder(tmp_path_factory) -> PromptEncoder:
    from transformers import AutoTokenizer

    from megatron_rl.data.tokenizer import build_tokenizer

    path = build_tokenizer(Path(tmp_path_factory.mktemp("tok")))
    return PromptEncoder(AutoTokenizer.from_pretrained(path))


@pytest.fixture(scope="module")
def rewards():
    workers = RewardWorkers(RewardsConfig(), processes=1)
    yield workers
    workers.close()


def _pipeline(
    encoder, rewards, train, cfg: RolloutConfig, answer: str, algo: AlgoConfig | None = None
) -> RolloutPipeline:
    tok = encoder.tokenizer
    tokens = InterruptionTokens(tok.convert_tokens_to_ids("</think>"), tok.eos_token_id, [])
    completion = tok(f"<think>1+1=2</think>{answer}", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]

    async def generate(input_ids: list[int], max_new_tokens: int, stop_ids: list[int]) -> Segment:
        await asyncio.sleep(0)
        return Segment(completion, [-0.5] * len(completion), [pipeline.version] * len(completion), "stop")

    sampler = CurriculumSampler(train, {s: 1.0 for s in train}, seed=0, no_positive=NoPositiveResampling(None))
    session = SamplingSession(generate, encoder, cfg, tokens, rewards)
    pipeline = RolloutPipeline(session, algo or AlgoConfig(), sampler, seed=0)
    return pipeline


def _rollout(**overrides) -> RolloutConfig:
    base = dict(prompts_per_step=4, generations_per_prompt=2, k=2, max_prompt_tokens=64)
    return RolloutConfig(interruption=InterruptionConfig(enabled=False), **{**base, **overrides})


async def _batch(pipeline: RolloutPipeline, version: int = 0):
    pipeline.start()
    try:
        return await asyncio.wait_for(pipeline.next_batch(version), timeout=60)
    finally:
        await pipeline.close()


def test_batch_statistics_are_kept_per_task(encoder, rewards):
    train = {
        "math": [Prompt("m1", "math", "What is 1 + 1?", answer="2")],
        "code": [Prompt("c1", "code", "Write f.", tests={"inputs": ["1\n"], "outputs": ["2\n"]})],
    }
    pipeline = _pipeline(encoder, rewards, train, _rollout(prompts_per_step=8), answer="\\boxed{2}")
    groups, stats = asyncio.run(_batch(pipeline))
    metrics = stats.as_metrics()
    n_math, _, _ = stats.by_task["math"]
    n_code, _, _ = stats.by_task["code"]
    assert n_math + n_code == stats.completions == 16 and n_math > 0 and n_code > 0
    # the boxed answer is right for the math prompt; the code prompt gets no program
    assert metrics["train/pass_rate/math"] == 1.0 and metrics["train/reward/math"] == 1.0
    assert metrics["train/pass_rate/code"] == 0.0 and metrics["train/reward/code"] == -1.0
    assert metrics["train/failures/no_code"] == n_code
    assert metrics["train/reward"] == pytest.approx((n_math - n_code) / 16)
    assert groups == []  # every group is all-correct or all-wrong: zero-variance, filtered
    assert stats.effective_groups == 0 and stats.sampled_groups == 8


@pytest.mark.parametrize("mode", ["pipeline", "ppo_off_policy"])
def test_prompts_over_the_length_limit_are_skipped_counted_and_replaced(encoder, rewards, mode):
    long = Prompt("long", "math", "What is " + " + ".join(["1"] * 60) + "?", answer="60")
    short = [Prompt(f"s{i}", "math", f"What is {i} + 1?", answer=str(i + 1)) for i in range(3)]
    train = {"math": [long, *short]}
    cfg = _rollout(mode=mode, k=1, max_prompt_tokens=32)
    pipeline = _pipeline(encoder, rewards, train, cfg, answer="\\boxed{2}")
    groups, stats = asyncio.run(_batch(pipeline))
    # the batch is full of short prompts although the long one was drawn (1 in 4 of the first epoch)
    assert stats.sampled_groups == 4 and stats.long_prompts_skipped >= 1
    assert stats.as_metrics()["train/long_prompts_skipped"] == stats.long_prompts_skipped
    assert all(g.prompt_id != "long" for g in groups)


def test_the_push_cadence_is_the_pipelines(encoder, rewards):
    """PipelineRL pushes after every step; PPO-off-policy-k after every k-th, and generates nothing of the next
    round until the push, whose version the next round's tokens carry."""
    train = {"math": [Prompt(f"s{i}", "math", f"What is {i} + 1?", answer=str(i + 1)) for i in range(8)]}
    algo = AlgoConfig(zero_variance_filter=False)
    pipeline = _pipeline(encoder, rewards, train, _rollout(mode="pipeline", k=4), "\\boxed{2}", algo)
    assert all(pipeline.push_due(version) for version in range(1, 9))
    ppo = _pipeline(encoder, rewards, train, _rollout(mode="ppo_off_policy", k=2), "\\boxed{2}", algo)
    assert [ppo.push_due(version) for version in range(1, 7)] == [False, True, False, True, False, True]

    async def two_rounds() -> list[int]:
        ppo.start()
        try:
            for version in range(2):  # one round: k batches generated from frozen weights
                await asyncio.wait_for(ppo.next_batch(version), timeout=60)
            await asyncio.sleep(0.2)
            assert not ppo.buffer and not ppo.generating  # the next round waits for the push
            ppo.pushed(2)
            groups, _ = await asyncio.wait_for(ppo.next_batch(2), timeout=60)
            return [v for g in groups for c in g.completions for v in c.versions]
        finally:
            await ppo.close()

    versions = asyncio.run(two_rounds())
    assert versions and set(versions) == {2}


def test_a_held_push_starts_no_group_until_the_next_push(encoder, rewards):
    """PipelineRL with a push held back (the engines keep weights they are evaluating for one more trainer step):
    the trainer's next batch comes from groups already started, no group starts meanwhile (one started on the
    held weights could be trained on more than k versions later), and the next push restarts generation."""
    train = {"math": [Prompt(f"h{i}", "math", f"What is {i} + 1?", answer=str(i + 1)) for i in range(8)]}
    algo = AlgoConfig(zero_variance_filter=False)
    pipeline = _pipeline(encoder, rewards, train, _rollout(mode="pipeline", k=2), "\\boxed{2}", algo)

    async def held() -> tuple[int, int, list[int]]:
        pipeline.start()
        try:
            await asyncio.wait_for(pipeline.next_batch(0), timeout=60)
            pipeline.pushed(1)
            await asyncio.sleep(0.2)  # the slots the batch freed are refilled at version 1
            pipeline.hold()
            before = len(pipeline.buffer) + sum(pipeline.generating.values())
            await asyncio.wait_for(pipeline.next_batch(1), timeout=60)  # from groups started before the hold
            await asyncio.sleep(0.2)
            during = len(pipeline.buffer) + sum(pipeline.generating.values())
            pipeline.pushed(3)
            await asyncio.sleep(0.2)
            starts = [sampled.start_version for sampled in pipeline.buffer]
            return before, during, starts
        finally:
            await pipeline.close()

    before, during, starts = asyncio.run(held())
    capacity = 2 * 4  # 2 x prompts_per_step groups buffered or generating
    assert before == capacity and during == capacity - 4  # the batch taken while held was not replaced
    assert len(starts) == capacity and starts.count(3) == 4  # the push refilled its slots at the new version


def test_ppo_off_policy_replaces_stale_groups_within_the_round(encoder, rewards):
    train = {"math": [Prompt(f"s{i}", "math", f"What is {i} + 1?", answer=str(i + 1)) for i in range(8)]}
    cfg = _rollout(mode="ppo_off_policy", k=1, staleness="drop")  # a round is exactly one batch of 4 groups
    pipeline = _pipeline(encoder, rewards, train, cfg, answer="\\boxed{2}")
    pipeline.version = 3
    calls = 0
    scripted = pipeline.session.generate

    async def old_then_current(input_ids: list[int], max_new_tokens: int, stop_ids: list[int]) -> Segment:
        nonlocal calls
        calls += 1
        stale = calls <= 4  # the first four completions come from policy version 0: too stale for k=1
        segment = await scripted(input_ids, max_new_tokens, stop_ids)
        if stale:
            segment.versions = [0] * len(segment.versions)
        return segment

    pipeline.session = dataclasses.replace(pipeline.session, generate=old_then_current)
    groups, stats = asyncio.run(_batch(pipeline, version=3))
    assert stats.stale_dropped >= 2 and stats.sampled_groups == 4  # refilled, not waiting forever
    assert stats.staleness == [0, 0, 0, 0]


LONG, SHORT = 48, 4
"""Completion lengths of the scripted engine: a long one takes 50 times as long to generate."""


def _timed_engine(pipeline: RolloutPipeline, encoder, long_prompts: set[str]):
    """Long prompts' completions take 0.5 s, short ones 0.01 s; every token carries the version it started at."""
    tok = encoder.tokenizer
    by_prompt = {}
    for prompt_list in pipeline.sampler.train.values():
        for prompt in prompt_list:
            by_prompt[tuple(pipeline.session.encode(prompt))] = prompt.id

    async def generate(input_ids: list[int], max_new_tokens: int, stop_ids: list[int]) -> Segment:
        version = pipeline.version
        long = by_prompt[tuple(input_ids)] in long_prompts
        await asyncio.sleep(0.5 if long else 0.01)
        n = LONG if long else SHORT
        body = tok("<think>", add_special_tokens=False)["input_ids"] * (n - 1) + [tok.eos_token_id]
        return Segment(body, [-0.5] * n, [version] * n, "stop")

    return generate


async def _train_loop(pipeline: RolloutPipeline, steps: int) -> tuple[list[int], list[int], int]:
    """Consume `steps` batches like the driver (a 20 ms optimizer step, then a weight push): the lengths
    trained on, each group's staleness, and the groups dropped as stale."""
    lengths, staleness, dropped = [], [], 0
    pipeline.start()
    try:
        for version in range(steps):
            groups, stats = await asyncio.wait_for(pipeline.next_batch(version), timeout=60)
            lengths += [len(c.tokens) for g in groups for c in g.completions]
            staleness += stats.staleness
            dropped += stats.stale_dropped
            await asyncio.sleep(0.02)
            pipeline.version = version + 1
    finally:
        await pipeline.close()
    return lengths, staleness, dropped


@pytest.mark.parametrize("staleness", ["wait", "drop"])
def test_staleness_bound_waits_for_long_completions_instead_of_dropping_them(encoder, rewards, staleness):
    """A quarter of the prompts take 50x longer to generate. Waiting (the default, the paper's rule) trains on
    them as often as they are sampled, never more than k versions old; dropping loses nearly all of them."""
    prompts = [Prompt(f"p{i}", "math", f"What is {i} + 1?", answer=str(i + 1)) for i in range(8)]
    long_prompts = {"p0", "p1"}
    cfg = _rollout(prompts_per_step=4, k=2, staleness=staleness)
    algo = AlgoConfig(zero_variance_filter=False)  # every sampled group is trained on: lengths are comparable
    pipeline = _pipeline(encoder, rewards, {"math": prompts}, cfg, answer="", algo=algo)
    pipeline.session = dataclasses.replace(pipeline.session, generate=_timed_engine(pipeline, encoder, long_prompts))
    lengths, staleness_seen, dropped = asyncio.run(_train_loop(pipeline, steps=12))

    long_share = lengths.count(LONG) / len(lengths)
    if staleness == "wait":
        assert dropped == 0 and max(staleness_seen) <= cfg.k
        assert len(lengths) == 12 * 4 * 2
        # 2 of every 8 prompts drawn are long (one per epoch each); the in-flight tail shifts this by < 1/8
        assert 0.25 - 0.125 <= long_share <= 0.25 + 0.125
    else:
        assert dropped > 0 and long_share < 0.1  # the length bias the wait rule removes


def _finish_engine(pipeline: RolloutPipeline, encoder, script: list[tuple[str, str]]):
    """The i-th completion of a group is `script[i]`: (answer text, finish reason)."""
    tok = encoder.tokenizer
    calls = 0

    async def generate(input_ids: list[int], max_new_tokens: int, stop_ids: list[int]) -> Segment:
        nonlocal calls
        text, finish = script[calls % len(script)]
        calls += 1
        ids = tok(text, add_special_tokens=False)["input_ids"] + ([tok.eos_token_id] if finish == "stop" else [])
        return Segment(ids, [-0.5] * len(ids), [pipeline.version] * len(ids), finish)

    return generate


@pytest.mark.parametrize("mode", ["exclude", "keep"])
def test_truncated_completions_are_excluded_from_the_batch_and_counted(encoder, rewards, mode):
    prompts = [Prompt("p", "math", "What is 1 + 1?", answer="2")]
    script = [("<think>1+1=2</think>\\boxed{2}", "stop"), ("<think>1+1=3</think>\\boxed{3}", "stop")]
    script += [("<think>1+1 is", "length"), ("<think>1+1=2</think>\\boxed{2}", "stop")]
    cfg = _rollout(prompts_per_step=1, generations_per_prompt=4)
    pipeline = _pipeline(encoder, rewards, {"math": prompts}, cfg, answer="", algo=AlgoConfig(truncated=mode))
    pipeline.session = dataclasses.replace(pipeline.session, generate=_finish_engine(pipeline, encoder, script))
    groups, stats = asyncio.run(_batch(pipeline))
    metrics = stats.as_metrics()

    assert stats.completions == 4 and metrics["train/truncation_rate"] == 0.25  # sampled: all four counted
    assert metrics["train/reward"] == pytest.approx((1 - 1 - 1 + 1) / 4)
    (group,) = groups
    if mode == "exclude":
        assert metrics["train/truncated_excluded"] == 1.0
        assert [c.finish_reason for c in group.completions] == ["stop"] * 3 and group.rewards == [1.0, -1.0, 1.0]
    else:
        assert metrics["train/truncated_excluded"] == 0.0
        assert len(group.completions) == 4 and group.rewards == [1.0, -1.0, -1.0, 1.0]


def test_a_group_left_with_one_answer_after_exclusion_is_zero_variance(encoder, rewards):
    prompts = [Prompt("p", "math", "What is 1 + 1?", answer="2")]
    script = [("<think>1+1=2</think>\\boxed{2}", "stop"), ("<think>1+1 is", "length")]
    cfg = _rollout(prompts_per_step=1, generations_per_prompt=2)
    pipeline = _pipeline(encoder, rewards, {"math": prompts}, cfg, answer="")
    pipeline.session = dataclasses.replace(pipeline.session, generate=_finish_engine(pipeline, encoder, script))
    groups, stats = asyncio.run(_batch(pipeline))
    assert groups == [] and stats.sampled_groups == 1 and stats.truncated_excluded == 1


def test_overlong_penalty_applies_to_correct_completions_only(encoder, rewards):
    """loo-lp, the paper's Eq. 9: R = r + penalty(length) when correct, r otherwise. Two completions of the same
    length inside the soft ramp: the correct one is penalised, the wrong one stays at -1 (an all-wrong group
    stays zero-variance instead of living on differing penalties)."""
    prompts = [Prompt("p", "math", "What is 1 + 1?", answer="2")]
    right, wrong = "<think>1+1=2</think>\\boxed{2}", "<think>1+1=3</think>\\boxed{3}"
    tok = encoder.tokenizer
    length = len(tok(right, add_special_tokens=False)["input_ids"]) + 1
    assert length == len(tok(wrong, add_special_tokens=False)["input_ids"]) + 1
    penalty = LengthPenaltyConfig(enabled=True, max_length=length + 2, cache_length=8)
    algo = AlgoConfig(length_penalty=penalty, zero_variance_filter=False)
    cfg = _rollout(prompts_per_step=1, generations_per_prompt=2)
    pipeline = _pipeline(encoder, rewards, {"math": prompts}, cfg, answer="", algo=algo)
    pipeline.session = dataclasses.replace(
        pipeline.session, generate=_finish_engine(pipeline, encoder, [(right, "stop"), (wrong, "stop")])
    )
    (group,), _ = asyncio.run(_batch(pipeline))
    soft_start = penalty.max_length - penalty.cache_length
    assert group.rewards == [pytest.approx(1.0 + (soft_start - length) / penalty.cache_length), -1.0]


def test_a_prompt_with_tools_is_sampled_as_a_trajectory_and_its_tool_use_counted(tmp_path, rewards):
    """A prompt that declares the Python tool is sampled through the session as a multi-turn trajectory: the call
    runs in the sandbox, its response is spliced in loss-masked, the engine's ids are kept, and the batch counts
    the calls, turns, environment tokens and the pass rate with and without calls."""
    from transformers import AutoTokenizer

    from megatron_rl.config import ToolsConfig
    from megatron_rl.data.tokenizer import build_tokenizer
    from megatron_rl.rollout.tools import build_tools
    from megatron_rl.rollout.trajectory import tool_tokens

    tok = AutoTokenizer.from_pretrained(build_tokenizer(tmp_path / "tok"))
    tok.add_special_tokens({"additional_special_tokens": ["</tool_call>"]})  # one token, as in Qwen's vocabulary
    one_group = _rollout(prompts_per_step=1, generations_per_prompt=2, mode="ppo_off_policy", k=1)  # a round of one
    cfg = dataclasses.replace(one_group, tools=ToolsConfig(["python"]))
    ids = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    call = ids('<tool_call>\n{"name": "python", "arguments": {"code": "print(17 + 25)"}}\n') + ids("</tool_call>")
    answer, wrong = ids("<think>so</think>\\boxed{42}") + [tok.eos_token_id], ids("\\boxed{41}") + [tok.eos_token_id]
    first_requests = []

    async def generate(input_ids: list[int], max_new_tokens: int, stop_ids: list[int]) -> Segment:
        if tool_ids.call_end in input_ids:  # the turn after the tool's response
            tokens = answer
        else:  # a first turn: one trajectory calls the tool, the other answers (wrongly) without
            first_requests.append(len(first_requests))
            tokens = call if len(first_requests) == 1 else wrong
        return Segment(tokens, [-0.5] * len(tokens), [0] * len(tokens), "stop")

    tool_ids = tool_tokens(tok, cfg.tools)
    prompt = Prompt("t1", "math", "What is 17 + 25?", answer="42", tools=("python",))
    sampler = CurriculumSampler({"math": [prompt]}, {"math": 1.0}, seed=0, no_positive=NoPositiveResampling(None))
    interruption = InterruptionTokens(tok.convert_tokens_to_ids("</think>"), tok.eos_token_id, [])
    session = SamplingSession(
        generate, PromptEncoder(tok), cfg, interruption, rewards, tools=build_tools(["python"]), tool_ids=tool_ids
    )
    (group,), stats = asyncio.run(_batch(RolloutPipeline(session, AlgoConfig(), sampler, seed=0)))

    used = next(c for c in group.completions if tool_ids.call_end in c.tokens)
    plain = next(c for c in group.completions if tool_ids.call_end not in c.tokens)
    response = used.tokens[len(call) : len(used.tokens) - len(answer)]
    assert used.tokens[: len(call)] == call and used.tokens[-len(answer) :] == answer  # the engine's ids, as sampled
    assert "42" in tok.decode(response) and "<tool_response>" in tok.decode(response)
    assert used.loss_mask == [True] * len(call) + [False] * len(response) + [True] * len(answer)
    assert used.gen_logprobs == [-0.5] * len(call) + [0.0] * len(response) + [-0.5] * len(answer)
    assert (used.reward, plain.reward, plain.tokens) == (1.0, -1.0, wrong)
    metrics = stats.as_metrics()
    assert metrics["tools/trajectories"] == 2 and metrics["tools/calls"] == 1 and metrics["tools/errors"] == 0
    assert metrics["tools/turns_per_trajectory"] == 1.5 and metrics["tools/environment_tokens"] == len(response) / 2
    assert metrics["tools/pass_rate_with_calls"] == 1.0 and metrics["tools/pass_rate_without_calls"] == 0.0
