"""What a run reads before anything starts, each source checked: the training data (unchanged since the checkpoint
resumed from), the downstream benchmarks, the sandbox (code tasks), the starting policy (warm-started on first use)
and its tokenizer with the budgets it implies. `megatron-rl train` reads them from a worker thread while Ray starts;
`megatron-rl eval` reads the benchmarks and builds the same prompt encoding. `sampling_session` builds the one
sampling context both sample through (rollout/session.py)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from megatron_rl.config import ConfigError, RunConfig
from megatron_rl.data.benchmarks import BenchmarkSet, load_benchmark
from megatron_rl.data.datasets import DatasetError, Splits, load_splits
from megatron_rl.orchestration.resume import check_data

if TYPE_CHECKING:
    from megatron_rl.orchestration.engines import LocalLaunch
    from megatron_rl.rewards.workers import RewardWorkers
    from megatron_rl.rollout.interruption import GenerateFn, InterruptionTokens
    from megatron_rl.rollout.session import PromptEncoder, SamplingSession
    from megatron_rl.rollout.trajectory import ToolTokens


@dataclass
class Encoding:
    """How prompts become ids and what length control and tool calls need of the tokenizer."""

    encoder: PromptEncoder
    tokens: InterruptionTokens
    tool_ids: ToolTokens | None
    """Set when the run offers tools (rollout.tools.enabled)."""


@dataclass
class Inputs:
    """A run's checked inputs."""

    splits: Splits
    downstream: dict[str, BenchmarkSet]
    policy: Path
    """The starting policy (a Hugging Face directory)."""
    encoding: Encoding


def prepare_inputs(run: RunConfig, launch: LocalLaunch | None = None, resumed: Path | None = None) -> Inputs:
    """The run's inputs (module docstring), read and checked in that order; `launch` then starts the local
    engines' servers from the starting policy, as soon as it is known."""
    splits = load_splits(run.data)
    if resumed is not None:
        check_data(splits.fingerprints(), resumed)
    _report_data(splits)
    downstream = load_downstream(run)
    _check_tools(run, splits, downstream)
    if any(d.task == "code" for d in run.data.datasets) or run.rollout.tools.enabled:
        from megatron_rl.rewards.sandbox import get_sandbox

        get_sandbox(run.rewards.sandbox)  # no isolation for model-written code: stop now, not at the first call
    from megatron_rl.orchestration.warmstart import prepare_policy

    policy = prepare_policy(run, splits)
    run.check_context(policy)  # the engines would refuse a context beyond the checkpoint's positions
    run.check_engine_attention()  # ... and serve chunked attention wrongly on CPU
    if launch is not None:  # the engines' imports are the start-up's longest chain: start them first
        launch.start(policy)
    from megatron_rl.data.tokenizer import load_tokenizer  # transformers, without torch: while Ray starts

    encoding = prompt_encoding(run, load_tokenizer(policy))
    phrase = len(encoding.tokens.phrase)
    run.check_row_budget(phrase)  # the longest row fits a micro-batch: stop now, not in a collective
    run.rollout.check_phrase(phrase)  # and the engines' context
    return Inputs(splits, downstream, policy, encoding)


def prompt_encoding(run: RunConfig, tokenizer: Any) -> Encoding:
    """The prompt encoder (the data's chat template and system prompt), length control's token ids and, when the
    run offers tools, the tool call's closing token."""
    from megatron_rl.rollout.session import PromptEncoder, interruption_tokens
    from megatron_rl.rollout.trajectory import tool_tokens

    encoder = PromptEncoder(tokenizer, run.data.system_prompt, run.data.chat_template)
    tool_ids = None
    if run.rollout.tools.enabled:
        try:
            tool_ids = tool_tokens(tokenizer, run.rollout.tools)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    return Encoding(encoder, interruption_tokens(run.rollout, tokenizer), tool_ids)


def sampling_session(
    run: RunConfig, encoding: Encoding, generate: GenerateFn, rewards: RewardWorkers
) -> SamplingSession:
    """The run's sampling context over the engines' `generate`, with the tools of `rollout.tools.enabled`."""
    from megatron_rl.rollout.session import SamplingSession
    from megatron_rl.rollout.tools import build_tools

    try:
        tools = build_tools(run.rollout.tools.enabled, run.rewards.sandbox.allow_unisolated)
    except ValueError as exc:
        raise ConfigError(f"rollout.tools.enabled: {exc}") from None
    return SamplingSession(
        generate, encoding.encoder, run.rollout, encoding.tokens, rewards, tools=tools, tool_ids=encoding.tool_ids
    )


def _check_tools(run: RunConfig, splits: Splits, downstream: dict[str, BenchmarkSet]) -> None:
    """Every tool a prompt declares is one the run offers (rollout.tools.enabled)."""
    offered = set(run.rollout.tools.enabled)
    for prompts in [*splits.train.values(), *splits.val.values(), *(b.prompts for b in downstream.values())]:
        for prompt in prompts:
            unknown = [name for name in prompt.tools if name not in offered]
            if unknown:
                raise DatasetError(
                    f"prompt {prompt.id} ({prompt.task}): field 'tools' names {unknown}, not in "
                    f"rollout.tools.enabled={sorted(offered)}"
                )


def load_downstream(run: RunConfig) -> dict[str, BenchmarkSet]:
    """The downstream benchmarks of `eval.downstream`, one line each (problems, rows skipped)."""
    sets = {}
    for config in run.eval.downstream.benchmarks:
        bench = sets[config.name] = load_benchmark(config)
        line = f"downstream: {bench.name}: {len(bench.prompts)} problems from {bench.source}"
        if bench.window:
            line += f" ({bench.window})"
        if bench.skipped:
            line += f", {bench.skipped} of {bench.rows} rows skipped; first: {bench.errors[0]}"
        print(line, flush=True)
    return sets


def _report_data(splits: Splits) -> None:
    """One line per dataset (training prompts, malformed rows skipped) and the validation prompts per task."""
    for key, stats in splits.stats.items():
        line = f"data: {key}: {len(splits.train[key])} training prompts"
        if stats.skipped:
            line += f", {stats.skipped} of {stats.rows} rows skipped (data.bad_rows=skip); first: {stats.errors[0]}"
        print(line, flush=True)
    print("data: validation " + ", ".join(f"{task} {len(p)}" for task, p in splits.val.items()), flush=True)
