"""The rollout section: the asynchronous pipeline, sampling, length control by interruption, the engines."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from megatron_rl.config.errors import fail


@dataclass
class InterruptionConfig:
    """Length control by interruption (docs/recipe.md §5)."""

    enabled: bool = True
    min_thinking_tokens: int = 10240
    """Lower end of the per-sequence thinking budget, drawn uniformly (paper: 10k)."""
    max_thinking_tokens: int = 12288
    """Upper end of the draw and the hard thinking budget (paper: 12k of 12,288)."""
    phrase: str = "Okay, time is up. Let me stop thinking and formulate a final answer now. </think>"
    """Injected when thinking reaches its budget without `</think>`; masked out of the loss."""
    end_of_thinking: str = "</think>"
    lookahead_tokens: int = 0
    """(ours) Tokens past the thinking budget the first request may generate (at most `answer_tokens` of them
    count), so that a model closing its thinking near the budget answers in the same request instead of a
    second one. The tokens past the budget of a completion that did not close are dropped: worth it where
    interruptions are rare and requests dear relative to tokens (the CPU recipe), not where an interrupted
    completion would throw away up to `answer_tokens` (2,048 at ScaleRL's budgets). 0: the first request stops
    at the budget."""

    def __post_init__(self) -> None:
        if self.lookahead_tokens < 0:
            fail("lookahead_tokens", f"must be >= 0, got {self.lookahead_tokens}")
        if not 0 < self.min_thinking_tokens <= self.max_thinking_tokens:
            fail(
                "min_thinking_tokens",
                f"must be in (0, max_thinking_tokens={self.max_thinking_tokens}], got {self.min_thinking_tokens}",
            )


@dataclass
class SamplingConfig:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1

    def __post_init__(self) -> None:
        if self.temperature <= 0:
            fail("temperature", f"must be > 0 (RL needs sampling), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            fail("top_p", f"must be in (0, 1], got {self.top_p}")


@dataclass
class EngineConfig:
    """SGLang generator servers.

    Several engines are balanced by the client (`generator/balancer.py`: least outstanding requests,
    retry on another engine), not by SGLang's router: weight pushes, pause/continue for in-flight updates,
    restarts and failure counts are per engine, so the orchestrator addresses each engine directly anyway.
    """

    kind: Literal["sglang"] = "sglang"
    num_engines: int = 1
    tp: int = 1
    """Tensor-parallel size of one SGLang engine (GPUs per engine)."""
    fp32_lm_head: bool = True
    """Start SGLang with its fp32 LM-head flag (docs/recipe.md §3)."""
    mem_fraction: float = 0.85
    dtype: Literal["bfloat16", "float32", "auto"] = "bfloat16"
    device: Literal["cuda", "cpu"] = "cuda"
    extra_args: list[str] = field(default_factory=list)
    """Extra `sglang.launch_server` flags, passed through verbatim."""
    ready_timeout_s: float | None = None
    """How long an engine may take from launch to ready (reading the checkpoint, compiling kernels) before the
    run fails naming it. null: 600 s plus 6 s per GB of the checkpoint's safetensors (a cold Scout engine reads
    218 GB: ~30 min)."""

    def __post_init__(self) -> None:
        if self.tp < 1:
            fail("tp", f"must be >= 1, got {self.tp}")
        if self.ready_timeout_s is not None and not self.ready_timeout_s > 0:
            fail(
                "ready_timeout_s", f"must be > 0 seconds (null: sized from the checkpoint), got {self.ready_timeout_s}"
            )
        if self.num_engines < 1:
            fail("num_engines", f"must be >= 1, got {self.num_engines}")
        if not 0 < self.mem_fraction <= 1:
            fail("mem_fraction", f"must be in (0, 1], got {self.mem_fraction}")


@dataclass
class ToolsConfig:
    """Tools a policy may call while it reasons (rollout/tools.py, rollout/trajectory.py).

    A call is the chat-template tool-call format Qwen and Hermes use: `call_start`, a JSON object
    {"name": ..., "arguments": {...}}, `call_end`. The engine stops at `call_end`, which must therefore be one
    token of the policy's tokenizer; the tool's output comes back inside `response_template`, masked out of the
    loss. Every limit is per trajectory unless it says per call.
    """

    enabled: list[str] = field(default_factory=list)
    """The tools a dataset row may declare (names in rollout/tools.py TOOLS); empty: no row uses tools."""
    call_start: str = "<tool_call>"
    call_end: str = "</tool_call>"
    response_template: str = "\n<tool_response>\n{output}\n</tool_response>\n"
    """How a call's result is shown to the policy; `{output}` is the tool's text."""
    max_calls: int = 4
    """Calls a trajectory may make; the next one ends it (finish "length", counted as a limit hit)."""
    call_time_s: float = 5.0
    """Wall and CPU time of one call (a call past it is killed and answered with a timeout)."""
    trajectory_time_s: float = 20.0
    """Tool time one trajectory may spend; a call that could take it past this is not run and ends it."""
    max_output_bytes: int = 1024
    """Bytes of one call's output shown to the policy; the rest is cut with a visible marker."""
    max_environment_tokens: int = 1024
    """Tool-response tokens one trajectory may receive (they are outside the thinking budget, so bounded here);
    a response past it is cut, and a call once it is spent ends the trajectory."""
    memory_mb: int = 512
    """Memory of one call's sandbox."""

    def __post_init__(self) -> None:
        for name in ("call_start", "call_end"):
            if not getattr(self, name):
                fail(name, "must be a non-empty marker")
        if "{output}" not in self.response_template:
            fail("response_template", f"must contain {{output}}, got {self.response_template!r}")
        if len(set(self.enabled)) != len(self.enabled):
            fail("enabled", f"names a tool twice: {self.enabled}")
        for name in ("max_calls", "max_output_bytes", "max_environment_tokens"):
            if getattr(self, name) < 1:
                fail(name, f"must be >= 1, got {getattr(self, name)}")
        if self.memory_mb < 16:
            fail("memory_mb", f"must be >= 16, got {self.memory_mb}")
        for name in ("call_time_s", "trajectory_time_s"):
            if not getattr(self, name) > 0:
                fail(name, f"must be > 0 seconds, got {getattr(self, name)}")
        if self.trajectory_time_s < self.call_time_s:
            fail("trajectory_time_s", f"must be >= call_time_s={self.call_time_s}, got {self.trajectory_time_s}")


PHRASE_TOKEN_ALLOWANCE = 64
"""Tokens the interruption phrase may take in the engines' context (the default phrase is ~20 in Llama-3's and in
the tiny models' tokenizers)."""


@dataclass
class RolloutConfig:
    """Generation: engines, the asynchronous pipeline, batch shape and length budgets."""

    engine: EngineConfig = field(default_factory=EngineConfig)
    mode: Literal["pipeline", "ppo_off_policy"] = "pipeline"
    """pipeline = PipelineRL-k (in-flight weight updates); ppo_off_policy = PPO-off-policy-k."""
    k: int = 8
    """Max policy versions between generation and use (pipeline), or minibatches per sync (off-policy)."""
    staleness: Literal["wait", "drop"] = "wait"
    """How k is kept: wait = the trainer waits for groups that would otherwise grow more than k versions
    old (docs/recipe.md §4, the paper's rule: nothing is dropped); drop = groups over k are dropped and counted
    (`train/stale_dropped`), which drops the longest completions most often."""
    prompts_per_step: int = 48
    generations_per_prompt: int = 16
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    max_prompt_tokens: int = 2048
    answer_tokens: int = 2048
    """Budget after the end of thinking (after interruption, up to this many tokens more)."""
    interruption: InterruptionConfig = field(default_factory=InterruptionConfig)
    weight_sync: Literal["distributed", "disk"] = "distributed"
    """Trainer -> engines transport: a process group (NCCL/gloo) or safetensors files (the fallback)."""
    sync_bucket_mb: int = 512
    sync_timeout_s: float = 300.0
    """Bound on every step of a weight push (each HTTP call, each bucket's broadcast, the group's
    rendezvous): an engine that has not answered by then (hung, stopped) fails the push, is restarted and
    caught up. Must cover loading one bucket on the slowest engine."""
    max_retries: int = 3
    """Retries of a request whose engine failed, on another engine or after restart."""
    tools: ToolsConfig = field(default_factory=ToolsConfig)
    """Tools the policy may call while it reasons, for rows that declare them (multi-turn trajectories)."""

    def __post_init__(self) -> None:
        if self.k < 1:
            fail("k", f"must be >= 1, got {self.k}")
        if self.sync_timeout_s <= 0:
            fail("sync_timeout_s", f"must be > 0, got {self.sync_timeout_s}")
        if self.prompts_per_step < 1:
            fail("prompts_per_step", f"must be >= 1, got {self.prompts_per_step}")
        for name in ("answer_tokens", "max_prompt_tokens", "sync_bucket_mb"):
            if getattr(self, name) < 1:
                fail(name, f"must be >= 1, got {getattr(self, name)}")
        if self.generations_per_prompt < 2:
            fail(
                "generations_per_prompt",
                f"must be >= 2 (advantages compare within a group), got {self.generations_per_prompt}",
            )

    @property
    def completions_per_step(self) -> int:
        return self.prompts_per_step * self.generations_per_prompt

    @property
    def max_completion_tokens(self) -> int:
        return self.interruption.max_thinking_tokens + self.answer_tokens

    @property
    def environment_tokens(self) -> int:
        """Tool-response tokens one trajectory can hold beyond its policy's budgets (0 without tools)."""
        return self.tools.max_environment_tokens if self.tools.enabled else 0

    @property
    def context_length(self) -> int:
        """Tokens one sequence can reach: prompt, thinking, the interruption phrase (at most
        `PHRASE_TOKEN_ALLOWANCE`, checked against the tokenizer at start), answer and, with tools, their responses.
        The engines are started with it (SGLang's --context-length: it sizes each request's row of its
        request-to-token table from it)."""
        phrase = PHRASE_TOKEN_ALLOWANCE if self.interruption.enabled else 0
        return self.max_prompt_tokens + self.max_completion_tokens + phrase + self.environment_tokens

    def check_phrase(self, phrase_tokens: int) -> None:
        if self.interruption.enabled and phrase_tokens > PHRASE_TOKEN_ALLOWANCE:
            fail(
                "rollout.interruption.phrase",
                f"{phrase_tokens} tokens with this tokenizer; at most {PHRASE_TOKEN_ALLOWANCE} fit the engines'"
                " context (rollout.context_length)",
            )

    @property
    def batches_in_flight(self) -> int:
        """Batches of `prompts_per_step` groups generating or buffered at most: k (a round of frozen weights) for
        ppo_off_policy, min(2, k) for pipeline. A pipeline group started at version v is due at v + k, so with at
        most min(2, k) batches in flight at most one batch of groups is ever due at once (rollout/pipeline.py)."""
        return self.k if self.mode == "ppo_off_policy" else min(2, self.k)

    @property
    def groups_in_flight(self) -> int:
        """The pipeline's capacity: groups generating or buffered at most (the engines' peak load, plan.py)."""
        return self.batches_in_flight * self.prompts_per_step
