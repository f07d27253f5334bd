"""What a run reads before anything starts, each source checked: the training data (unchanged since the checkpoint
resumed from), the downstream benchmarks, the sandbox (code tasks), the starting policy (warm-started on first use)
and its tokenizer with the budgets it implies. `megatron-rl train` reads them from a worker thread while Ray starts;
`megatron-rl eval` reads the benchmarks and builds the same prompt encoder and interruption tokens."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from megatron_rl.config import RunConfig
from megatron_rl.data.benchmarks import BenchmarkSet, load_benchmark
from megatron_rl.data.datasets import Splits, load_splits
from megatron_rl.orchestration.resume import check_data

if TYPE_CHECKING:
    from megatron_rl.orchestration.engines import LocalLaunch
    from megatron_rl.rollout.interruption import InterruptionTokens
    from megatron_rl.rollout.session import PromptEncoder


@dataclass
class Inputs:
    """A run's checked inputs."""

    splits: Splits
    downstream: dict[str, BenchmarkSet]
    policy: Path
    """The starting policy (a Hugging Face directory)."""
    encoder: PromptEncoder
    tokens: InterruptionTokens


def prepare_inputs(run: RunConfig, launch: LocalLaunch | None = None, resumed: Path | None = None) -> Inputs:
    """The run's inputs (module docstring), read and checked in that order; `launch` then starts the local
    engines' servers from the starting policy, as soon as it is known."""
    splits = load_splits(run.data)
    if resumed is not None:
        check_data(splits.fingerprints(), resumed)
    _report_data(splits)
    downstream = load_downstream(run)
    if any(d.task == "code" for d in run.data.datasets):
        from megatron_rl.rewards.sandbox import get_sandbox

        get_sandbox(run.rewards.sandbox)  # no isolation for model-written code: stop now, not at the first reward
    from megatron_rl.orchestration.warmstart import prepare_policy

    policy = prepare_policy(run, splits)
    run.check_context(policy)  # the engines would refuse a context beyond the checkpoint's positions
    run.check_engine_attention()  # ... and serve chunked attention wrongly on CPU
    if launch is not None:  # the engines' imports are the start-up's longest chain: start them first
        launch.start(policy)
    from megatron_rl.data.tokenizer import load_tokenizer  # transformers, without torch: while Ray starts

    encoder, tokens = prompt_encoding(run, load_tokenizer(policy))
    run.check_row_budget(len(tokens.phrase))  # the longest row fits a micro-batch: stop now, not in a collective
    run.rollout.check_phrase(len(tokens.phrase))  # and the engines' context
    return Inputs(splits, downstream, policy, encoder, tokens)


def prompt_encoding(run: RunConfig, tokenizer: Any) -> tuple[PromptEncoder, InterruptionTokens]:
    """The prompt encoder (the data's chat template and system prompt) and length control's token ids."""
    from megatron_rl.rollout.session import PromptEncoder, interruption_tokens

    encoder = PromptEncoder(tokenizer, run.data.system_prompt, run.data.chat_template)
    return encoder, interruption_tokens(run.rollout, tokenizer)


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
