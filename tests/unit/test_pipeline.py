"""The rollout pipeline's bookkeeping: per-task statistics, and prompts too long to generate from.

The engine here is scripted (a fixed answer per prompt) so the batch statistics are known exactly; the
pipeline itself, the sampler, the tokenizer and the reward workers are the real ones. The loop with
SGLang is tested in tests/integration/test_loop.py.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from megatron_rl.algo.filters import NoPositiveResampling
from megatron_rl.config import AlgoConfig, InterruptionConfig, RewardsConfig, RolloutConfig
from megatron_rl.data.datasets import Prompt
from megatron_rl.data.sampler import CurriculumSampler
from megatron_rl.rewards.workers import RewardWorkers
from megatron_rl.rollout.interruption import InterruptionTokens, Segment
from megatron_rl.rollout.pipeline import PromptEncoder, RolloutPipeline


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


def _pipeline(encoder, rewards, train, cfg: RolloutConfig, answer: str) -> RolloutPipeline:
    tok = encoder.tokenizer
    tokens = InterruptionTokens(tok.convert_tokens_to_ids("</think>"), tok.eos_token_id, [])
    completion = tok(f"<think>1+1=2</think>{answer}", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]

    async def generate(input_ids: list[int], max_new_tokens: int, stop_ids: list[int]) -> Segment:
        await asyncio.sleep(0)
        return Segment(completion, [-0.5] * len(completion), [pipeline.version] * len(completion), "stop")

    sampler = CurriculumSampler(train, {s: 1.0 for s in train}, seed=0, no_positive=NoPositiveResampling(None))
    pipeline = RolloutPipeline(cfg, AlgoConfig(), sampler, rewards, generate, encoder, tokens, seed=0)
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


def test_ppo_off_policy_replaces_stale_groups_within_the_round(encoder, rewards):
    train = {"math": [Prompt(f"s{i}", "math", f"What is {i} + 1?", answer=str(i + 1)) for i in range(8)]}
    cfg = _rollout(mode="ppo_off_policy", k=1)  # a round is exactly one batch of 4 groups
    pipeline = _pipeline(encoder, rewards, train, cfg, answer="\\boxed{2}")
    pipeline.version = 3
    calls = 0
    scripted = pipeline.generate

    async def old_then_current(input_ids: list[int], max_new_tokens: int, stop_ids: list[int]) -> Segment:
        nonlocal calls
        calls += 1
        stale = calls <= 4  # the first four completions come from policy version 0: too stale for k=1
        segment = await scripted(input_ids, max_new_tokens, stop_ids)
        if stale:
            segment.versions = [0] * len(segment.versions)
        return segment

    pipeline.generate = old_then_current
    groups, stats = asyncio.run(_batch(pipeline, version=3))
    assert stats.stale_dropped >= 2 and stats.sampled_groups == 4  # refilled, not waiting forever
    assert stats.staleness == [0, 0, 0, 0]
