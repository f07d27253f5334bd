"""The rollout record: what generation produces and the trainer consumes.

Producer: the rollout workers (rollout/pipeline.py) fill one `Completion` per sampled sequence from the
engine's answer, then the reward functions set `reward`. Consumer: the trainer (trainer/step.py) turns
a list of `Group`s into packed token tensors. Nothing else travels between them, so keep it small: a new
feature adds a field here only when the trainer needs it per token or per sequence.

Per-token lists (`tokens`, `gen_logprobs`, `versions`, `loss_mask`) all have the completion's length;
prompt tokens carry none of them (they are never trained on). The one record over prompt and completion is
an MoE run's `routed_experts` (routing replay): the experts the generator chose for every token it ran.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import numpy as np

FinishReason = Literal["stop", "length", "interrupted", "abort"]
"""stop: EOS or stop string; length: hit the answer budget (truncated); interrupted: thinking budget
reached, the end-of-thinking phrase injected, then stopped normally; abort: the engine gave up."""


@dataclass(frozen=True)
class RoutingShape:
    """What a routing record of the model looks like: [tokens, layers, top-k] expert ids in [0, experts)."""

    layers: int
    topk: int
    experts: int

    @property
    def dtype(self) -> type[np.integer]:
        """The compact id type: one byte per choice up to 256 experts (Scout 16, Qwen3-30B-A3B 128)."""
        return np.uint8 if self.experts <= 256 else np.int16

    def bytes_per_token(self) -> int:
        return self.layers * self.topk * np.dtype(self.dtype).itemsize

    def check(self, record: np.ndarray, rows: int, what: str) -> None:
        """Raise ValueError naming `what` unless `record` is [rows, layers, topk] with ids in range."""
        expected = (rows, self.layers, self.topk)
        if record.shape != expected:
            raise ValueError(
                f"{what}: routing record of shape {list(record.shape)}, expected [tokens={rows}, "
                f"layers={self.layers}, top-k={self.topk}]"
            )
        if record.size and (int(record.min()) < 0 or int(record.max()) >= self.experts):
            raise ValueError(
                f"{what}: routing record holds expert ids in [{int(record.min())}, {int(record.max())}], "
                f"the model has {self.experts} experts"
            )

    def check_captured(self, records: list[np.ndarray], what: str) -> None:
        """Raise ValueError naming `what` when every id of `records` is 0: SGLang's capture buffer as it started.

        SGLang records the routed experts only on its standard top-k path; the MoE runners that route inside their
        fused kernel (`--moe-runner-backend flashinfer_trtllm`, `flashinfer_mxfp4`, `triton_kernel`, and `auto`
        where it picks one, as for Qwen3-MoE on Blackwell) never write the buffer, so every record stays 0 and
        passes the shape and range checks. Replayed, such records would send every token to expert 0. They are
        refused rather than skipped: a run asked to replay that silently does not is another experiment, and the
        engine's flag is the fix. At top-k > 1 one such record decides it (a top-k picks k distinct experts, never
        expert 0 k times); at top-1 it takes a batch of them (a router choosing expert 0 for every token at every
        layer of a whole batch has collapsed, and replaying it teaches nothing either)."""
        if any(record.any() for record in records) or not any(record.size for record in records):
            return
        raise ValueError(
            f"{what}: every routing record is expert 0 at every layer: SGLang did not capture the routed experts "
            "(its fused-kernel MoE runners flashinfer_trtllm, "
            "flashinfer_mxfp4 and triton_kernel, or `auto` picking one, route inside the kernel and leave the "
            "records at 0), and replaying them would send every token to expert 0. Run the engines with a runner "
            "that records them (rollout.engine.extra_args=[--moe-runner-backend,triton]) or set "
            "algo.routing_replay=none"
        )


@dataclass
class Completion:
    prompt_id: str
    task: str
    prompt_tokens: list[int]
    tokens: list[int]
    """Completion token ids, injected interruption tokens included."""
    gen_logprobs: list[float]
    """The generator's log-prob of each completion token (fp32; 0.0 for injected tokens)."""
    versions: list[int]
    """Policy version that produced each token (the version at injection time for injected tokens)."""
    loss_mask: list[bool]
    """False for tokens that must not be trained on (injected by interruption control)."""
    finish_reason: FinishReason = "stop"
    reward: float = 0.0
    reward_info: dict[str, str] = field(default_factory=dict)
    """Why the reward is what it is (e.g. {"failure": "timeout"}); counted in metrics, not trained on."""
    routed_experts: np.ndarray | None = None
    """MoE runs with `algo.routing_replay`: the experts the generator chose at every layer for every token it ran
    forward (the prompt and all completion tokens but the last), [len(prompt_tokens) + len(tokens) - 1, layers,
    top-k], compact ids (RoutingShape.dtype)."""

    def __post_init__(self) -> None:
        n = len(self.tokens)
        if self.routed_experts is not None and len(self.routed_experts) != len(self.prompt_tokens) + n - 1:
            raise ValueError(
                f"completion of prompt {self.prompt_id}: routing record of {len(self.routed_experts)} tokens for "
                f"{len(self.prompt_tokens)} prompt + {n} completion tokens (expected all but the last)"
            )
        if not (len(self.gen_logprobs) == len(self.versions) == len(self.loss_mask) == n):
            raise ValueError(
                f"completion of prompt {self.prompt_id}: per-token lists differ in length (tokens {n}, "
                f"gen_logprobs {len(self.gen_logprobs)}, versions {len(self.versions)}, "
                f"loss_mask {len(self.loss_mask)})"
            )

    @property
    def truncated(self) -> bool:
        return self.finish_reason == "length"

    @property
    def oldest_version(self) -> int:
        return min(self.versions) if self.versions else 0


@dataclass
class Group:
    """The G completions sampled for one prompt."""

    prompt_id: str
    task: str
    completions: list[Completion]

    @property
    def rewards(self) -> list[float]:
        return [c.reward for c in self.completions]

    @property
    def oldest_version(self) -> int:
        return min(c.oldest_version for c in self.completions)


def random_groups(
    seed: int,
    prompts: int,
    group: int,
    vocab: int,
    prompt_len: tuple[int, int],
    completion_len: tuple[int, int],
    gen_logprob: float = -6.0,
    masked_index: int | None = None,
) -> list[Group]:
    """Groups of random token ids (5 <= id < `vocab`) for tests, benchmarks and the GPU smoke check: a prompt length
    per group and a completion length per sample drawn from [low, high), rewards +1/-1 alternating (every group with
    more than one sample has both signs: non-zero advantages), generator log-probs `gen_logprob` + U(0, 0.1), and
    token `masked_index` of each completion out of the loss (an injected token)."""
    import random

    rng = random.Random(seed)
    groups = []
    for p in range(prompts):
        prompt = [rng.randrange(5, vocab) for _ in range(rng.randrange(*prompt_len))]
        completions = []
        for g in range(group):
            n = rng.randrange(*completion_len)
            completions.append(
                Completion(
                    prompt_id=str(p),
                    task="math",
                    prompt_tokens=prompt,
                    tokens=[rng.randrange(5, vocab) for _ in range(n)],
                    gen_logprobs=[gen_logprob + 0.1 * rng.random() for _ in range(n)],
                    versions=[0] * n,
                    loss_mask=[i != masked_index for i in range(n)],
                    reward=float((p + g) % 2 * 2 - 1),
                )
            )
        groups.append(Group(str(p), "math", completions))
    return groups
