"""The rollout pipeline: prompts -> groups of G completions with rewards -> a bounded buffer -> batches.

One producer serves both asynchronous modes of docs/recipe.md §4; they differ only in when generation may
start a new group:

- `pipeline` (PipelineRL-k): generation never stops. Groups are started whenever fewer than
  2 x prompts_per_step are buffered or in flight; weights change under running sequences (the engine
  records each token's policy version). The one pause: while the loop holds a push back for a step
  (`hold`, the engines finishing an evaluation of the weights they have) no group starts.
- `ppo_off_policy` (PPO-off-policy-k): generation runs in rounds of k x prompts_per_step groups with
  frozen weights; the next round starts only after the trainer has taken k steps and synced
  (`release_round`).

The pipeline also owns the push cadence: `push_due(version)` says when the trainer's weights go to the
engines (after every step in `pipeline` mode, after every k-th in `ppo_off_policy`), and `pushed(version)`
records that the engines hold them.

Staleness is enforced here alone: `next_batch` decides which finished groups a batch takes, and `may_hold`
when the loop may hold a push back for a step without any group ending up more than k versions old. By default
(`rollout.staleness: wait`, the paper's rule, docs/recipe.md §4) the trainer waits: a group started k or more
versions ago is *due* and the batch is not complete without it, however long its completions take; the other slots
are filled first come, first served. Nothing is dropped, so the long completions (the last to finish) are trained on as
often as they are sampled. This is always feasible: in pipeline mode at most min(2, k) x prompts_per_step
groups are generating or buffered, so at most prompts_per_step of them can be due at once. With
`staleness: drop` a group whose oldest token is more than k versions behind is dropped and counted
instead (`train/stale_dropped`), which biases the batch towards short completions.

Truncated completions (answer budget hit) are left out of their group by default (`algo.truncated:
exclude`, counted in `train/truncated_excluded`): the group's advantages are computed over the others.
Zero-variance groups (fewer than two completions left, or all rewards equal) are dropped without refill
(the effective batch shrinks, as in the paper) and counted; every finished group, filtered or not, updates
the no-positive-resampling history with all its completions.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from dataclasses import dataclass, field

from megatron_rl.algo.filters import has_reward_variance
from megatron_rl.algo.length_penalty import overlong_penalty
from megatron_rl.config import AlgoConfig
from megatron_rl.data.datasets import Prompt
from megatron_rl.data.sampler import CurriculumSampler
from megatron_rl.rollout.session import SamplingSession
from megatron_rl.rollout.trajectory import ToolStats
from megatron_rl.rollout.types import Completion, Group

log = logging.getLogger(__name__)


@dataclass
class SampledGroup:
    group: Group
    """Every completion sampled for the prompt (the batch statistics count them all)."""
    train: Group | None
    """What is trained on: the completions not excluded; None when the zero-variance filter dropped it."""
    passed: list[bool]
    failures: list[str]
    start_version: int = 0
    """The policy version when the group was started: it is due `rollout.k` versions later."""
    prompt: Prompt | None = None
    """The prompt as the sampler gave it (reported back to it once the group is taken)."""
    tools: list[ToolStats] = field(default_factory=list)
    """Each trajectory's tool use (a prompt with tools), in completion order."""

    @property
    def kept(self) -> bool:
        return self.train is not None


@dataclass
class BatchStats:
    sampled_groups: int = 0
    effective_groups: int = 0
    stale_dropped: int = 0
    completions: int = 0
    truncated: int = 0
    truncated_excluded: int = 0
    waited_s: float = 0.0
    """Seconds the batch waited for due groups while other finished groups were ready."""
    interrupted: int = 0
    aborted: int = 0
    reward_sum: float = 0.0
    passed: int = 0
    response_tokens: int = 0
    staleness: list[int] = field(default_factory=list)
    failures: dict[str, int] = field(default_factory=dict)
    long_prompts_skipped: int = 0
    """Cumulative: prompts over `max_prompt_tokens`, skipped."""
    by_task: dict[str, list[float]] = field(default_factory=dict)
    """Per task: [completions, reward sum, passed]."""
    tools: list[tuple[ToolStats, bool]] = field(default_factory=list)
    """Each trajectory of a prompt with tools: its tool use and whether it passed."""

    def as_metrics(self) -> dict[str, float]:
        n = max(self.completions, 1)
        metrics = {
            "train/reward": self.reward_sum / n,
            "train/pass_rate": self.passed / n,
            "train/truncation_rate": self.truncated / n,
            "train/interruption_rate": self.interrupted / n,
            "train/aborted": float(self.aborted),
            "train/response_length": self.response_tokens / n,
            "train/sampled_groups": float(self.sampled_groups),
            "train/effective_groups": float(self.effective_groups),
            "train/stale_dropped": float(self.stale_dropped),
            "train/truncated_excluded": float(self.truncated_excluded),
            "train/stale_wait_s": self.waited_s,
            "train/staleness_mean": sum(self.staleness) / max(len(self.staleness), 1),
            "train/staleness_max": float(max(self.staleness, default=0)),
            "train/long_prompts_skipped": float(self.long_prompts_skipped),
        }
        metrics.update({f"train/failures/{k}": float(v) for k, v in sorted(self.failures.items())})
        if self.tools:
            metrics.update(tool_metrics(self.tools))
        for task, (count, reward, passed) in sorted(self.by_task.items()):
            metrics[f"train/reward/{task}"] = reward / count
            metrics[f"train/pass_rate/{task}"] = passed / count
        return metrics


class RolloutPipeline:
    def __init__(
        self, session: SamplingSession, algo: AlgoConfig, sampler: CurriculumSampler, seed: int, version: int = 0
    ) -> None:
        self.session, self.cfg, self.algo, self.sampler = session, session.rollout, algo, sampler
        self.version = version
        self.rng = random.Random(seed)
        self.capacity = self.cfg.groups_in_flight  # at most one batch is ever due at once: the wait rule completes
        self.buffer: list[SampledGroup] = []
        """Finished groups, in the order they finished."""
        self.generating: dict[int, int] = {}
        """Groups still generating, by the policy version they were started at."""
        self.finished = asyncio.Event()
        self.slots = asyncio.Semaphore(self.capacity)
        self.round_open = asyncio.Event()
        self.round_open.set()
        self.round_started = 0
        self.tasks: set[asyncio.Task] = set()
        self.producer: asyncio.Task | None = None
        self.errors: list[BaseException] = []
        self.long_prompts = 0
        """Prompts skipped for being longer than `max_prompt_tokens` (cumulative)."""

    @property
    def version(self) -> int:
        """The policy version the engines hold (the trainer's step count at the last push)."""
        return self.session.version.current

    @version.setter
    def version(self, version: int) -> None:
        self.session.version.current = version

    # ---------------------------------------------------------------------------------------------
    # Producer

    def start(self) -> None:
        self.producer = asyncio.create_task(self._produce())

    async def _produce(self) -> None:
        while True:
            await self.slots.acquire()  # released when the trainer takes the group
            await self.round_open.wait()  # PipelineRL: closed while a push waits (`hold`)
            if self.cfg.mode == "ppo_off_policy":
                self.round_started += 1
                if self.round_started == self.cfg.k * self.cfg.prompts_per_step:
                    self.round_open.clear()  # frozen weights: wait for k steps and a sync
            prompt = self.sampler.next_prompt()
            task = asyncio.create_task(self._group(prompt))
            self.tasks.add(task)
            task.add_done_callback(self._finished)

    def _finished(self, task: asyncio.Task) -> None:
        self.tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self.errors.append(task.exception())

    def push_due(self, trainer_version: int) -> bool:
        """Whether the engines get the trainer's weights now that it holds `trainer_version`: after every step
        (PipelineRL, in flight), or at the end of a round of k steps on frozen weights (PPO-off-policy)."""
        return self.cfg.mode == "pipeline" or trainer_version % self.cfg.k == 0

    def pushed(self, version: int) -> None:
        """The engines hold `version` now: new groups start from it, and PPO-off-policy's next round opens."""
        self.version = version
        if self.cfg.mode == "ppo_off_policy":
            self.release_round()
        else:
            self.round_open.set()

    def may_hold(self, trainer_version: int) -> bool:
        """Whether the push of `trainer_version` may wait one step (the engines finishing an evaluation of the
        weights they hold) without a group being trained on more than k versions after it started: PipelineRL only
        (its engines change weights in flight anyway; PPO-off-policy pushes once per round), with k >= 2 and the
        engines one version behind. While held no group starts (`hold`), so the oldest group a held batch can take
        started at the engines' version, k - 1 versions behind the next."""
        return self.cfg.mode == "pipeline" and self.cfg.k >= 2 and trainer_version - self.version == 1

    def hold(self) -> None:
        """PipelineRL: the trainer takes one step without a push (the engines keep their weights while they
        evaluate them). No group starts until the next push: a group started now, on weights already one version
        behind, could be trained on more than k versions later."""
        assert self.cfg.mode == "pipeline", "ppo_off_policy pushes after every k-th step only"
        self.round_open.clear()

    def release_round(self) -> None:
        """PPO-off-policy: the trainer synced after k steps; generate the next round."""
        self.round_started = 0
        self.round_open.set()

    async def _group(self, prompt: Prompt) -> None:
        prompt_ids = self.session.encode(prompt)
        if not self.session.fits(prompt_ids):
            self._skip_long(prompt, len(prompt_ids))
            return
        start = self.version
        self.generating[start] = self.generating.get(start, 0) + 1
        try:
            seeds = [self.rng.random() for _ in range(self.cfg.generations_per_prompt)]
            completions = await asyncio.gather(*(self._completion(prompt, prompt_ids, s) for s in seeds))
            tools = [t for _, _, _, t in completions if t is not None]
            group = Group(prompt.id, prompt.task, [c for c, _, _, _ in completions])
            passed = [p for _, p, _, _ in completions]
            failures = [f for _, _, f, _ in completions if f]
            self.sampler.no_positive.update(prompt.id, passed)
            trained = self._trained_part(group)
            self.buffer.append(SampledGroup(group, trained, passed, failures, start, prompt, tools))
        finally:
            self.generating[start] -= 1
            if not self.generating[start]:
                del self.generating[start]
            self.finished.set()

    def _trained_part(self, group: Group) -> Group | None:
        """The completions trained on (truncated ones excluded unless `algo.truncated: keep`), or None when the
        zero-variance filter drops the group."""
        completions = group.completions
        if self.algo.truncated == "exclude":
            completions = [c for c in completions if not c.truncated]
        if self.algo.zero_variance_filter:
            if len(completions) < 2 or not has_reward_variance([c.reward for c in completions]):
                return None
        elif not completions:
            return None
        return Group(group.prompt_id, group.task, completions)

    def _skip_long(self, prompt: Prompt, length: int) -> None:
        """A prompt over `max_prompt_tokens` is skipped and counted; the producer draws another in its place."""
        if not self.long_prompts:
            log.warning(
                "prompt %s has %d tokens, over rollout.max_prompt_tokens=%d: skipped (counted in "
                "train/long_prompts_skipped; later ones are not logged)",
                prompt.id,
                length,
                self.cfg.max_prompt_tokens,
            )
        self.long_prompts += 1
        self.sampler.done(prompt)
        self._refill_round()
        self.slots.release()

    def _refill_round(self) -> None:
        """PPO-off-policy: a group that will not be trained on (too long, too stale) is replaced within its
        round, which still needs k x prompts_per_step groups; without this the last batch would never fill."""
        if self.cfg.mode == "ppo_off_policy":
            self.round_started -= 1
            self.round_open.set()

    async def _completion(
        self, prompt: Prompt, prompt_ids: list[int], seed: float
    ) -> tuple[Completion, bool, str, ToolStats | None]:
        sample = await self.session.sample(prompt, prompt_ids, random.Random(seed))
        out, result = sample.generated, sample.result
        reward = result.reward
        if self.algo.length_penalty.enabled and result.passed:  # the paper's Eq. 9: correct traces only
            lp = self.algo.length_penalty
            reward += overlong_penalty(len(out.tokens), lp.max_length, lp.cache_length)
        completion = Completion(
            prompt_id=prompt.id,
            task=prompt.task,
            prompt_tokens=prompt_ids,
            tokens=out.tokens,
            gen_logprobs=out.logprobs,
            versions=out.versions,
            loss_mask=out.loss_mask,
            finish_reason=out.finish_reason,
            reward=reward,
            reward_info={"failure": result.failure} if result.failure else {},
            routed_experts=out.routing,
        )
        return completion, result.passed, result.failure or "", sample.tools

    # ---------------------------------------------------------------------------------------------
    # Consumer

    async def next_batch(self, trainer_version: int) -> tuple[list[Group], BatchStats]:
        """prompts_per_step sampled groups no more than k versions old; the zero-variance ones dropped."""
        stats = BatchStats()
        groups: list[Group] = []
        due_version = trainer_version - self.cfg.k  # groups started at or before it are due in this batch
        while stats.sampled_groups < self.cfg.prompts_per_step:
            self._raise_producer_errors()
            self.finished.clear()
            room = self.cfg.prompts_per_step - stats.sampled_groups
            sampled = self._take(due_version, room)
            if sampled is None:
                waiting_for_due = bool(self.buffer)
                started = time.perf_counter()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.finished.wait(), timeout=1.0)
                if waiting_for_due:
                    stats.waited_s += time.perf_counter() - started
                continue
            self.slots.release()
            if sampled.prompt is not None:
                self.sampler.done(sampled.prompt)
            staleness = trainer_version - sampled.group.oldest_version
            if self.cfg.staleness == "drop" and staleness > self.cfg.k:
                stats.stale_dropped += 1
                self._refill_round()
                continue
            if staleness > self.cfg.k:
                log.warning(
                    "group of prompt %s is %d versions old (k=%d)", sampled.group.prompt_id, staleness, self.cfg.k
                )
            stats.sampled_groups += 1
            stats.staleness.append(staleness)
            for completion in sampled.group.completions:
                stats.completions += 1
                stats.truncated += completion.finish_reason == "length"
                stats.interrupted += completion.finish_reason == "interrupted"
                stats.aborted += completion.finish_reason == "abort"
                stats.reward_sum += completion.reward
                stats.response_tokens += len(completion.tokens)
            if self.algo.truncated == "exclude":
                stats.truncated_excluded += sum(c.truncated for c in sampled.group.completions)
            stats.passed += sum(sampled.passed)
            task = stats.by_task.setdefault(sampled.group.task, [0.0, 0.0, 0.0])
            task[0] += len(sampled.group.completions)
            task[1] += sum(c.reward for c in sampled.group.completions)
            task[2] += sum(sampled.passed)
            for failure in sampled.failures:
                stats.failures[failure] = stats.failures.get(failure, 0) + 1
            stats.tools += zip(sampled.tools, sampled.passed, strict=False)  # a group's trajectories all have tools
            if sampled.train is not None:
                groups.append(sampled.train)
        stats.effective_groups = len(groups)
        stats.long_prompts_skipped = self.long_prompts
        return groups, stats

    def _take(self, due_version: int, room: int) -> SampledGroup | None:
        """The next finished group for a batch with `room` slots left, or None to wait.

        wait: due groups first; another group only while the slots left exceed the due groups still
        generating (they must fit in this batch). drop: first come, first served."""
        if not self.buffer:
            return None
        if self.cfg.staleness == "drop":
            return self.buffer.pop(0)
        for i, sampled in enumerate(self.buffer):
            if sampled.start_version <= due_version:
                return self.buffer.pop(i)
        due_generating = sum(n for version, n in self.generating.items() if version <= due_version)
        return self.buffer.pop(0) if room > due_generating else None

    def _raise_producer_errors(self) -> None:
        if self.producer is not None and self.producer.done() and not self.producer.cancelled():
            self.producer.result()
        if self.errors:
            raise RuntimeError("a rollout group failed") from self.errors[0]

    async def close(self) -> None:
        tasks = [t for t in [self.producer, *self.tasks] if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def tool_metrics(trajectories: list[tuple[ToolStats, bool]]) -> dict[str, float]:
    """A batch's tool use: calls, errors, timeouts, malformed calls, cut responses and limit hits (summed), the
    share of trajectories that called a tool, turns, calls and environment tokens per trajectory, and the pass rate
    of the trajectories that called a tool and of those that did not (each left out when the batch had none)."""
    n = len(trajectories)
    used = [ok for stats, ok in trajectories if stats.used_tools]
    unused = [ok for stats, ok in trajectories if not stats.used_tools]
    total = lambda name: float(sum(getattr(stats, name) for stats, _ in trajectories))  # noqa: E731
    metrics = {
        "tools/trajectories": float(n),
        "tools/calls": total("calls"),
        "tools/errors": total("errors"),
        "tools/timeouts": total("timeouts"),
        "tools/malformed": total("malformed"),
        "tools/truncated": total("truncated"),
        "tools/limit_hits": total("limit_hits"),
        "tools/calling_share": len(used) / n,
        "tools/calls_per_trajectory": total("calls") / n,
        "tools/turns_per_trajectory": total("turns") / n,
        "tools/environment_tokens": total("environment_tokens") / n,
    }
    if used:
        metrics["tools/pass_rate_with_calls"] = sum(used) / len(used)
    if unused:
        metrics["tools/pass_rate_without_calls"] = sum(unused) / len(unused)
    return metrics
