"""The evaluation section: validation and the downstream benchmarks."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from megatron_rl.config.errors import fail
from megatron_rl.config.rollout import SamplingConfig

DOWNSTREAM_BENCHMARKS = ("aime24", "aime25", "math500", "livecodebench", "synthetic_large")
"""The downstream benchmarks data/benchmarks.py loads."""


def _iso_date(name: str, value: str | None) -> None:
    if value is None:
        return
    import datetime

    try:
        datetime.date.fromisoformat(value)
    except ValueError:
        fail(name, f"expected a date YYYY-MM-DD, got {value!r}")


@dataclass
class BenchmarkConfig:
    """One downstream benchmark (data/benchmarks.py). In a list, `NAME` stands for {name: NAME} and
    `NAME=PATH` for {name: NAME, source: PATH}."""

    name: str = "aime24"
    """One of aime24, aime25, math500, livecodebench, synthetic_large (the CPU run's held-out sums >= 180)."""
    source: str | None = None
    """A local .jsonl/.parquet file in the published schema (LiveCodeBench: also a downloaded copy of its
    dataset repository), or another hub name; default: the benchmark's own hub name."""
    split: str | None = None
    """The hub split; default: the benchmark's (train for the AIME sets, test for MATH-500)."""
    limit: int | None = None
    """At most this many problems (the first ones, in file order)."""
    version: str = "release_v5"
    """LiveCodeBench: release_vN (all problems up to release N), vN (release N's alone) or release_latest."""
    start_date: str | None = "2024-08-01"
    """LiveCodeBench: keep problems whose contest date is on or after this (a model's cut-off)."""
    end_date: str | None = "2025-02-01"
    """LiveCodeBench: ... and on or before this (2024-08-01 .. 2025-02-01: the window DeepSeek-R1 reports)."""
    tools: list[str] = field(default_factory=list)
    """Tools the policy may call on every problem (names of rollout.tools.enabled), as a training dataset's."""

    @classmethod
    def from_str(cls, text: str) -> BenchmarkConfig:
        name, _, source = text.partition("=")
        return cls(name=name.strip(), source=source.strip() or None)

    def __post_init__(self) -> None:
        if self.name not in DOWNSTREAM_BENCHMARKS:
            fail("name", f"unknown benchmark {self.name!r}; known: {list(DOWNSTREAM_BENCHMARKS)}")
        if self.limit is not None and self.limit < 1:
            fail("limit", f"must be >= 1, got {self.limit}")
        _iso_date("start_date", self.start_date)
        _iso_date("end_date", self.end_date)
        if self.start_date and self.end_date and self.start_date > self.end_date:
            fail("end_date", f"{self.end_date} is before start_date {self.start_date}")


@dataclass
class DownstreamConfig:
    """Downstream benchmarks evaluated on the run's own engines (docs/recipe.md §8): at step 0 (the starting
    model), every `every_steps` and at the end; `megatron-rl eval` evaluates any checkpoint the same way."""

    benchmarks: list[BenchmarkConfig] = field(default_factory=list)
    """E.g. [aime24, math500, livecodebench] or [{name: math500, source: /data/math500.jsonl}]; empty: off."""
    every_steps: int = 100
    samples_per_prompt: int = 16
    """n samples per problem: mean@n, and the unbiased pass@k for k = 1, 2, 4, ... up to n."""
    temperature: float | None = None
    """Default: the rollout's sampling (the policy RL trains); the budgets are always the rollout's."""
    top_p: float | None = None

    def __post_init__(self) -> None:
        if self.every_steps < 1:
            fail("every_steps", f"must be >= 1, got {self.every_steps}")
        if self.samples_per_prompt < 1:
            fail("samples_per_prompt", f"must be >= 1, got {self.samples_per_prompt}")
        if self.temperature is not None and self.temperature <= 0:
            fail("temperature", f"must be > 0, got {self.temperature}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            fail("top_p", f"must be in (0, 1], got {self.top_p}")
        names = [b.name for b in self.benchmarks]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            fail("benchmarks", f"{repeated} listed twice (results are logged per benchmark name)")

    def sampling(self, rollout: SamplingConfig) -> SamplingConfig:
        """The eval's sampling: the rollout's, with this config's temperature and top-p where set."""
        return dataclasses.replace(
            rollout,
            temperature=rollout.temperature if self.temperature is None else self.temperature,
            top_p=rollout.top_p if self.top_p is None else self.top_p,
        )


@dataclass
class EvalConfig:
    every_steps: int = 100
    """Validation every N optimizer steps, and at step 0 (R0 of the scaling law)."""
    samples_per_prompt: int = 16
    """mean@k: the paper's mean@16, sampled as training samples (`rollout.sampling`: same engines, temperature
    and top-p), so the validation pass rate measures the policy that RL trains."""
    downstream: DownstreamConfig = field(default_factory=DownstreamConfig)

    def __post_init__(self) -> None:
        if self.every_steps < 1:
            fail("every_steps", f"must be >= 1, got {self.every_steps}")
        if self.samples_per_prompt < 1:
            fail("samples_per_prompt", f"must be >= 1, got {self.samples_per_prompt}")
