"""The sampling context: how every completion of a run is sampled and scored, built once at setup.

A `SamplingSession` holds what one sample needs (the engines' generate call, the prompt encoder, the rollout's
budgets and interruption tokens, the reward workers, the tools the run offers, and the policy version the engines
hold) and its one method, `sample`, draws one completion of a prompt and scores it: a prompt that declares tools is
sampled as a multi-turn trajectory (rollout/trajectory.py), every other one in one or two requests
(rollout/interruption.py). Training groups (rollout/pipeline.py), validation and the
downstream benchmarks (rollout/evaluation.py) and `megatron-rl eval` all sample through it, so a rollout feature
(length control, a tool, a new budget) is added in one place and reaches them all alike.

The policy version is one cell (`EngineVersion`) that the pipeline advances after every weight push and every
sampler reads: it stamps tokens the policy did not sample (interruption's phrase) with the weights in place when
they were added.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from megatron_rl.config import ConfigError, RolloutConfig, SamplingConfig
from megatron_rl.data.datasets import Prompt
from megatron_rl.rewards.workers import RewardResult, RewardWorkers
from megatron_rl.rollout.interruption import Generated, GenerateFn, InterruptionTokens, generate_completion
from megatron_rl.rollout.tools import Tool, schema
from megatron_rl.rollout.trajectory import ToolStats, ToolTokens, generate_trajectory, graded_tokens

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable


@dataclass
class PromptEncoder:
    """Prompt text -> token ids through the tokenizer's chat template (with the tools a prompt declares, which the
    template shows the policy), and completion ids -> text."""

    tokenizer: Any
    system_prompt: str | None = None
    chat_template: bool = True

    def encode(self, prompt: Prompt) -> list[int]:
        if not self.chat_template:
            return list(self.tokenizer(prompt.prompt)["input_ids"])
        messages = [{"role": "user", "content": prompt.prompt}]
        if self.system_prompt:
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        tools = {"tools": [schema(name) for name in prompt.tools]} if prompt.tools else {}
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **tools)
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode(self, tokens: list[int]) -> str:
        # Special tokens stay: `</think>` separates the graded answer from the thinking part.
        text = self.tokenizer.decode(tokens, skip_special_tokens=False)
        return text.replace(self.tokenizer.eos_token, "") if self.tokenizer.eos_token else text


@dataclass
class EngineVersion:
    """The policy version the engines hold: the trainer's step count at the last weight push (0 before any)."""

    current: int = 0


@dataclass
class Sample:
    """One completion as the engines produced it and the reward workers scored it."""

    generated: Generated
    result: RewardResult
    tools: ToolStats | None = None
    """The trajectory's tool use (a prompt with tools), else None."""


@dataclass(frozen=True)
class SamplingSession:
    """Everything a run samples and scores with (module docstring)."""

    generate: GenerateFn
    """(input_ids, max_new_tokens, stop_ids) -> Segment: the engines' generate call (`EngineGroup.generate`)."""
    encoder: PromptEncoder
    rollout: RolloutConfig
    """Budgets, interruption and the prompt-length limit."""
    tokens: InterruptionTokens
    rewards: RewardWorkers
    version: EngineVersion = dataclasses.field(default_factory=EngineVersion)
    tools: dict[str, Tool] = dataclasses.field(default_factory=dict)
    """The tools of `rollout.tools.enabled`, ready to run; a prompt calls those it declares."""
    tool_ids: ToolTokens | None = None
    """What trajectories need of the tokenizer (the call's closing token); set when the run offers tools."""

    def with_sampling(self, sampling: SamplingConfig) -> SamplingSession:
        """The same session sampling with `sampling` instead of the rollout's (downstream benchmarks: their own
        temperature or top-p). The generate call must accept `sampling=` (`EngineGroup.generate` does)."""
        generate: Callable[..., Awaitable[Any]] = self.generate

        async def sampled(input_ids: list[int], max_new_tokens: int, stop_ids: list[int]) -> Any:
            return await generate(input_ids, max_new_tokens, stop_ids, sampling=sampling)

        return dataclasses.replace(self, generate=sampled)

    def encode(self, prompt: Prompt) -> list[int]:
        return self.encoder.encode(prompt)

    def fits(self, prompt_ids: list[int]) -> bool:
        """Whether a prompt of these ids is sampled: longer than `rollout.max_prompt_tokens` it is skipped (and
        counted by the caller)."""
        return len(prompt_ids) <= self.rollout.max_prompt_tokens

    async def sample(self, prompt: Prompt, prompt_ids: list[int], rng: random.Random) -> Sample:
        """One completion of `prompt` (under the rollout's length control, `rng` drawing its thinking budget), a
        multi-turn trajectory when the prompt declares tools, scored by the reward workers on its decoded text (tool
        responses left out: `graded_tokens`)."""
        version = lambda: self.version.current  # noqa: E731
        stats = None
        if prompt.tools:
            assert self.tool_ids is not None, "a run whose prompts declare tools builds its session with tool_ids"
            tools = {name: self.tools[name] for name in prompt.tools}
            generated, stats = await generate_trajectory(
                self.generate, prompt_ids, self.rollout, self.tokens, rng, version, tools, self.tool_ids
            )
        else:
            generated = await generate_completion(self.generate, prompt_ids, self.rollout, self.tokens, rng, version)
        result = await self.rewards.score(self.encoder.decode(graded_tokens(generated.tokens, stats)), prompt)
        return Sample(generated, result, stats)


def interruption_tokens(cfg: RolloutConfig, tokenizer: Any) -> InterruptionTokens:
    """The token ids length control needs: `</think>`, EOS, and the interruption phrase as it is appended.

    With interruption on, the end-of-thinking marker must be one token of the policy's vocabulary (a thinking
    model's special token): a tokenizer without it (Llama-3.1's, say) answers the unknown token's id or None,
    and interruption would then never see a thinking part end."""
    phrase, marker = cfg.interruption.phrase, cfg.interruption.end_of_thinking
    end = tokenizer.convert_tokens_to_ids(marker)
    if cfg.interruption.enabled and (end is None or tokenizer.convert_ids_to_tokens(end) != marker):
        raise ConfigError(
            f"rollout.interruption.end_of_thinking: {marker!r} is not a token of the starting model's tokenizer: "
            "start from a thinking model (or add it as a special token), set the field to the model's own "
            "end-of-thinking token, or turn interruption off (rollout.interruption.enabled=false)"
        )
    return InterruptionTokens(
        end_of_thinking=end,
        eos=tokenizer.eos_token_id,
        phrase=list(
            tokenizer(phrase if phrase.startswith(" ") else " " + phrase, add_special_tokens=False)["input_ids"]
        ),
    )
