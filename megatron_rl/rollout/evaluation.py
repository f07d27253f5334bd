"""Evaluation on the engines: validation (mean@k on held-out training prompts) and downstream benchmarks
(mean@n and pass@k on AIME, MATH-500, LiveCodeBench, ...), sampled and scored as training samples are.

Both sample each prompt n times through the run's sampling session (rollout/session.py: the rollout's budgets,
interruption included, and the run's reward workers), as training groups are. The draws are seeded per prompt from
`seed`, so the same checkpoint evaluated twice with the same seed sends the same requests.

Metrics of a benchmark with N problems, n samples each and c_i passes on problem i:

    mean@n   = (1/N) sum_i c_i / n                          (the paper's mean@16 on validation)
    pass@k   = (1/N) sum_i [1 - C(n - c_i, k) / C(n, k)]    the unbiased estimator of Chen et al. (2021), k <= n
    *_se     = sd_i(per-problem value) / sqrt(N)            the standard error over problems (N - 1 in sd)

pass@1 equals mean@n. Keys logged: `downstream/<bench>/mean@<n>`, `downstream/<bench>/pass@<k>` (k = 1, 2,
4, ... up to n, and n), each with `_se`, `downstream/<bench>/problems` (evaluated) and
`downstream/<bench>/skipped_long` (left out: prompt longer than rollout.max_prompt_tokens). A benchmark with no
problem left to evaluate has no mean@n or pass@k: its row carries only the counts, its table row reads `n/a`, and
results.json holds null, never a 0.000 that reads as a measured failure.
"""

from __future__ import annotations

import asyncio
import math
import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from megatron_rl.config import RolloutConfig, SamplingConfig
from megatron_rl.data.datasets import Prompt
from megatron_rl.rollout.session import SamplingSession


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one problem with c correct of n samples: 1 - C(n-c, k) / C(n, k), computed as a
    product so that large n does not overflow (Chen et al. 2021, Codex paper, Fig. 3)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    miss = 1.0
    for i in range(n - c + 1, n + 1):
        miss *= 1.0 - k / i
    return 1.0 - miss


def ks_for(n: int) -> list[int]:
    """The k of pass@k reported for n samples: 1, 2, 4, ... up to n, and n."""
    ks, k = [], 1
    while k <= n:
        ks.append(k)
        k *= 2
    return ks if ks[-1] == n else [*ks, n]


def mean_and_se(values: Sequence[float]) -> tuple[float, float]:
    """The mean and its standard error (sample sd with N - 1, over sqrt(N)); se 0 for a single value."""
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return mean, 0.0
    var = sum((v - mean) ** 2 for v in values) / (n - 1)
    return mean, math.sqrt(var / n)


@dataclass
class BenchmarkResult:
    """One benchmark evaluated: per-problem pass counts and what the field reports from them."""

    name: str
    samples: int
    """n per problem."""
    passed: dict[str, int]
    """problem id -> correct samples (of n)."""
    mean: float | None = None
    """mean@n; None when no problem was evaluated (n/a, not a pass rate of 0)."""
    mean_se: float | None = None
    pass_at: dict[int, tuple[float, float]] = field(default_factory=dict)
    """k -> (pass@k, its standard error); empty when no problem was evaluated."""
    truncated: float | None = None
    """Share of completions cut by the answer budget (finish reason 'length'); None without completions."""
    skipped_long: int = 0
    """Problems whose prompt is longer than rollout.max_prompt_tokens: not sampled, not counted."""

    @classmethod
    def of(cls, name: str, samples: int, passed: dict[str, int], truncated: float | None, skipped_long: int = 0):
        result = cls(name, samples, passed, skipped_long=skipped_long)
        counts = list(passed.values())
        if counts:
            result.truncated = truncated
            result.mean, result.mean_se = mean_and_se([c / samples for c in counts])
            for k in ks_for(samples):
                result.pass_at[k] = mean_and_se([pass_at_k(samples, c, k) for c in counts])
        return result

    @property
    def problems(self) -> int:
        """Problems evaluated (those skipped as too long not counted)."""
        return len(self.passed)

    def metrics(self, prefix: str = "downstream") -> dict[str, float]:
        """The row's keys; without an evaluated problem only the counts (a missing value, not a 0 pass rate)."""
        base = f"{prefix}/{self.name}"
        out = {f"{base}/problems": float(self.problems), f"{base}/skipped_long": float(self.skipped_long)}
        if self.mean is None or self.mean_se is None:
            return out
        out[f"{base}/mean@{self.samples}"], out[f"{base}/mean@{self.samples}_se"] = self.mean, self.mean_se
        for k, (value, se) in self.pass_at.items():
            out[f"{base}/pass@{k}"], out[f"{base}/pass@{k}_se"] = value, se
        if self.truncated is not None:
            out[f"{base}/truncation_rate"] = self.truncated
        return out

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["pass_at"] = {str(k): {"value": v, "se": se} for k, (v, se) in self.pass_at.items()}
        out["problems"] = self.problems
        return out


@dataclass
class Sampled:
    """Per prompt id: the pass of each of its samples; the completions' finish reasons; prompts too long."""

    passed: dict[str, list[bool]]
    finishes: list[str]
    skipped_long: int
    versions: set[int]
    """The policy versions that generated the completions' tokens (one, unless weights changed meanwhile)."""


async def sample_and_score(
    prompts: list[Prompt], samples: int, session: SamplingSession, rng: random.Random
) -> Sampled:
    """`samples` completions of every prompt, each scored by the session's reward workers, all requests in flight
    at once (the engines batch them). `rng` draws one seed per sample of every prompt, also of a prompt skipped as
    too long, so a prompt's draws do not depend on the others'."""

    async def one(prompt: Prompt, prompt_ids: list[int], sample_rng: random.Random) -> tuple[str, bool, str, set[int]]:
        sample = await session.sample(prompt, prompt_ids, sample_rng)
        return prompt.id, sample.result.passed, sample.generated.finish_reason, set(sample.generated.versions)

    jobs, skipped = [], 0
    for prompt in prompts:
        ids = session.encode(prompt)
        seeds = [rng.random() for _ in range(samples)]
        if not session.fits(ids):
            skipped += 1
            continue
        jobs += [one(prompt, ids, random.Random(s)) for s in seeds]
    passed: dict[str, list[bool]] = {}
    finishes: list[str] = []
    versions: set[int] = set()
    for prompt_id, ok, finish, used in await asyncio.gather(*jobs):
        passed.setdefault(prompt_id, []).append(ok)
        finishes.append(finish)
        versions |= used
    return Sampled(passed, finishes, skipped, versions)


async def validate(
    prompts: dict[str, list[Prompt]], samples: int, session: SamplingSession, seed: int
) -> dict[str, float]:
    """mean@k pass rate per task and overall (`val/pass_rate`, `val/pass_rate/<task>`), and how many policy
    versions generated the completions (`val/policy_versions`: 1, unless the weights changed meanwhile)."""
    rng = random.Random(seed)
    results: dict[str, list[bool]] = {}
    skipped, versions = 0, set[int]()
    for task, task_prompts in prompts.items():
        sampled = await sample_and_score(task_prompts, samples, session, rng)
        results[task] = [ok for passes in sampled.passed.values() for ok in passes]
        skipped += sampled.skipped_long
        versions |= sampled.versions
    metrics = {f"val/pass_rate/{task}": sum(r) / max(len(r), 1) for task, r in results.items()}
    every = [p for r in results.values() for p in r]
    metrics["val/pass_rate"] = sum(every) / max(len(every), 1)
    metrics["val/long_prompts_skipped"] = float(skipped)
    metrics["val/policy_versions"] = float(len(versions))
    return metrics


async def evaluate_benchmarks(
    sets: dict[str, list[Prompt]], samples: int, session: SamplingSession, seed: int
) -> dict[str, BenchmarkResult]:
    """Every benchmark's problems sampled `samples` times and scored; one result per benchmark. All benchmarks'
    requests are in flight together; each benchmark's draws come from its own seed."""
    names = list(sets)
    runs = [sample_and_score(sets[name], samples, session, random.Random(f"{seed}:{name}")) for name in names]
    results = {}
    for name, sampled in zip(names, await asyncio.gather(*runs), strict=True):
        counts = {pid: sum(passes) for pid, passes in sampled.passed.items()}
        finishes = sampled.finishes
        truncated = sum(f == "length" for f in finishes) / len(finishes) if finishes else None
        results[name] = BenchmarkResult.of(name, samples, counts, truncated, sampled.skipped_long)
    return results


def sampling_record(cfg: RolloutConfig, sampling: SamplingConfig, samples: int) -> dict[str, Any]:
    """The settings an eval result was sampled with, recorded beside every result."""
    control = cfg.interruption
    record: dict[str, Any] = {
        "samples_per_problem": samples,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k,
        "answer_tokens": cfg.answer_tokens,
        "max_prompt_tokens": cfg.max_prompt_tokens,
        "interruption": control.enabled,
    }
    if control.enabled:
        record["thinking_tokens"] = [control.min_thinking_tokens, control.max_thinking_tokens]
        record["interruption_phrase"] = control.phrase
    else:
        record["max_completion_tokens"] = cfg.max_completion_tokens
    return record


def format_table(results: dict[str, BenchmarkResult], title: str | None = None) -> str:
    """A plain table: one row per benchmark, problems evaluated and skipped as too long, mean@n and pass@k with
    their standard errors (`n/a` for a benchmark with no problem evaluated)."""
    if not results:
        return "(no benchmarks)"
    ks = sorted({k for r in results.values() for k in r.pass_at})
    head = ["benchmark", "problems", "skipped", "n", "mean@n", *(f"pass@{k}" for k in ks if k > 1), "trunc"]
    rows = [head]
    for r in results.values():
        row = [r.name, str(r.problems), str(r.skipped_long), str(r.samples)]
        if r.mean is None or r.mean_se is None:
            rows.append([*row, "n/a", *("n/a" for k in ks if k > 1), "n/a"])
            continue
        row.append(f"{r.mean:.3f} ± {r.mean_se:.3f}")
        for k in ks:
            if k > 1:
                value = r.pass_at.get(k)
                row.append(f"{value[0]:.3f} ± {value[1]:.3f}" if value else "")
        row.append(f"{r.truncated:.1%}" if r.truncated is not None else "n/a")
        rows.append(row)
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(([title] if title else []) + lines)
