"""The data and rewards sections: datasets and their mix, the code sandbox, the reward workers."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from megatron_rl.config.errors import fail


@dataclass
class DatasetConfig:
    """One training source: a local jsonl/parquet file, a `datasets` hub name, or `synthetic:<task>`."""

    source: str = "synthetic:arithmetic"
    task: Literal["math", "code"] = "math"
    weight: float = 1.0
    """Mixing weight among the datasets of a multi-task run."""
    split: str = "train"
    subset: str | None = None
    """The `datasets` configuration name (e.g. DeepCoder's 'lcbv5'); hub sources only."""
    limit: int | None = None
    """Use only the first N rows (ours; for smoke runs)."""
    val_prompts: int | None = None
    """Held-out prompts of this dataset; null: `data.val_prompts`."""
    tools: list[str] = field(default_factory=list)
    """Tools every row of this dataset may call (names of rollout.tools.enabled), besides a row's own `tools`."""

    def __post_init__(self) -> None:
        if self.weight <= 0:
            fail("weight", f"must be > 0, got {self.weight}")
        if self.val_prompts is not None and self.val_prompts < 0:
            fail("val_prompts", f"must be >= 0, got {self.val_prompts}")

    @property
    def key(self) -> str:
        """How the run names this source (sampler weights, metrics, split seeds): `source[:subset]`."""
        return self.source if self.subset is None else f"{self.source}:{self.subset}"


@dataclass
class DataConfig:
    datasets: list[DatasetConfig] = field(default_factory=lambda: [DatasetConfig()])
    val_prompts: int = 1000
    """Prompts held out for validation, drawn deterministically from `seed` (paper: 1,000)."""
    seed: int = 0
    chat_template: bool = True
    """Wrap prompts with the tokenizer's chat template."""
    system_prompt: str | None = None
    bad_rows: Literal["error", "skip"] = "error"
    """A malformed dataset row stops the run (error) or is skipped and counted (skip)."""

    def __post_init__(self) -> None:
        if not self.datasets:
            fail("datasets", "at least one dataset is required")
        if self.val_prompts < 0:
            fail("val_prompts", f"must be >= 0, got {self.val_prompts}")


@dataclass
class SandboxConfig:
    """Isolation limits for running model-written programs (rewards/sandbox.py)."""

    wall_time_s: float = 10.0
    cpu_time_s: float = 10.0
    memory_mb: int = 1024
    max_processes: int = 16
    max_output_bytes: int = 1 << 20
    workers: int = 4
    allow_unisolated: bool = False
    """Development switch: run code without isolation when bubblewrap is missing (loudly logged)."""

    def __post_init__(self) -> None:
        for name in ("wall_time_s", "cpu_time_s"):
            if getattr(self, name) < 0:
                fail(name, f"must be >= 0 seconds, got {getattr(self, name)}")
        for name, least in (("memory_mb", 16), ("max_processes", 1), ("max_output_bytes", 1), ("workers", 1)):
            if getattr(self, name) < least:
                fail(name, f"must be >= {least}, got {getattr(self, name)}")


@dataclass
class RewardsConfig:
    correct: float = 1.0
    incorrect: float = -1.0
    """Reward of a wrong (or unparseable, or failed) completion; the paper uses +1 / -1."""
    math_timeout_s: float = 5.0
    code_partial_credit: bool = False
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
    processes: int = 2
    """Reward worker processes on the driver's node (each scores one completion at a time; a code reward's
    sandboxes run inside its worker, `sandbox.workers` at a time)."""

    def __post_init__(self) -> None:
        if self.processes < 1:
            fail("processes", f"must be >= 1, got {self.processes}")
