"""The loop's schedule around evaluations (orchestration/train.py `_loop`): in PipelineRL with k >= 2 the trainer
takes the step after an evaluation's start while the engines still evaluate, and the push waits for the
evaluation; everywhere else (PPO-off-policy, k = 1, a checkpoint step) the push follows the evaluation at once.

The trainer, engines, pipeline and logger are stand-ins that record what the loop asks of them, in order; the
evaluation ends when the trainer starts its next step or after 0.3 s, whichever comes first, so the order of
the records says whether the trainer went on during the evaluation. The loop with the real parts is
tests/integration/orchestration/test_loop.py.
"""

from __future__ import annotations

import asyncio
import contextlib
from types import SimpleNamespace
from typing import Any

import pytest

from megatron_rl.config import load_config
from megatron_rl.orchestration.evaluations import Evaluations
from megatron_rl.orchestration.train import Parts, _loop
from megatron_rl.rollout.pipeline import BatchStats, RolloutPipeline


class RecordedEvaluations(Evaluations):
    """The run's evaluations, their validation replaced by the recorder's."""

    def __init__(self, parts: Recorder) -> None:
        super().__init__(parts.run, None, None, {}, {}, None, None)  # type: ignore[arg-type]
        self.validate = parts.validate  # type: ignore[method-assign]


class Recorder:
    """The run's parts as `_loop` uses them, recording each call (the loop's own bookkeeping is Parts')."""

    train, out_of_batches, checkpoint_due = Parts.train, Parts.out_of_batches, Parts.checkpoint_due

    def __init__(self, overrides: list[str]) -> None:
        self.run = load_config("scalerl-cpu", None, ["eval.downstream.benchmarks=[]", *overrides])
        self.events: list[tuple[Any, ...]] = []
        self.rows: dict[int, dict[str, Any]] = {}
        self.version = 0
        self.engine_version = 0
        self.held = False
        self.evaluating: int | None = None
        self.moved = asyncio.Event()
        self.step, self.regenerated, self.downstream, self.batch_step = 0, 0, {}, 0
        self.stop = False
        self.empty_batches = self.empty_streak = 0
        self.evaluations = RecordedEvaluations(self)
        self.engines = SimpleNamespace(reset_usage=lambda: None, push_weights=self._push, metrics=dict)
        self.trainers = SimpleNamespace(call=self._call)
        self.pipeline = SimpleNamespace(
            start=lambda: None,
            next_batch=self._next_batch,
            push_due=lambda v: self.run.rollout.mode == "pipeline" or v % self.run.rollout.k == 0,
            pushed=self._pushed,
            hold=self._hold,
            cfg=self.run.rollout,
            may_hold=lambda v: RolloutPipeline.may_hold(self.pipeline, v),  # type: ignore[arg-type]
        )

    # the pipeline
    async def _next_batch(self, step: int) -> tuple[list[object], BatchStats]:
        self.events.append(("batch", step, "held" if self.held else "open"))
        self.batch_step = step
        return [object()], BatchStats()

    def _pushed(self, version: int) -> None:
        self.engine_version, self.held = version, False
        self.pipeline.version = version

    def _hold(self) -> None:
        self.held = True

    # the trainer and engines
    async def _call(self, name: str, *args: Any) -> Any:
        if name == "train_step":
            if self.evaluating is not None and self.batch_step > self.evaluating:
                self.moved.set()
            self.events.append(("train", self.version + 1))
            self.version += 1
            await asyncio.sleep(0.01)
            return {"train/loss": 0.0}
        assert name == "version"
        return self.version

    async def _push(self, trainers: Any, step: int) -> dict[str, float]:
        self.events.append(("push", step))
        return {"sync/seconds": 0.0}

    # the evaluations
    async def validate(self) -> dict[str, float]:
        self.evaluating, self.moved = self.batch_step, asyncio.Event()  # scheduled before that step's batch
        self.events.append(("eval", self.batch_step))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.moved.wait(), timeout=0.3)
        self.events.append(("evaluated", self.evaluating))
        self.evaluating = None
        return {"val/pass_rate": 0.5}

    # the logger and checkpoints
    def log(self, step: int, row: dict[str, Any]) -> None:
        assert step not in self.rows or "time/step_s" not in row, f"step {step} logged twice"
        self.rows.setdefault(step, {}).update(row)
        self.events.append(("log", step))

    async def save(self, step: int) -> None:
        self.events.append(("save", step))


def _run(overrides: list[str]) -> Recorder:
    parts = Recorder(overrides)
    parts.pipeline.version = 0
    asyncio.run(_loop(parts))  # type: ignore[arg-type]
    return parts


def _between(events: list[tuple[Any, ...]], first: tuple[Any, ...], last: tuple[Any, ...]) -> list[tuple[Any, ...]]:
    return events[events.index(first) + 1 : events.index(last)]


def test_pipelinerl_trains_the_next_step_while_the_engines_evaluate():
    parts = _run(["total_steps=7", "eval.every_steps=3", "checkpoint.every_steps=100", "rollout.k=2"])
    events = parts.events
    # step 3's evaluation runs while the trainer takes step 4 (as always) and step 5 (the batch of version 4);
    # the weights of version 4 are never pushed, those of 5 once the evaluation is over
    assert ("train", 5) in _between(events, ("eval", 3), ("evaluated", 3))
    assert ("push", 4) not in events and events.index(("evaluated", 3)) < events.index(("push", 5))
    # step 5's batch was drawn with generation held: no group started on weights two versions behind
    assert ("batch", 4, "held") in events and ("batch", 5, "open") in events
    # rows stay in step order, the evaluation of the policy of step 3 in the row of step 4, as without the wait
    logs = [e[1] for e in events if e[0] == "log"]
    assert logs == sorted(logs) and logs[:-1] == list(range(1, 8))
    assert "val/pass_rate" in parts.rows[4] and "val/pass_rate" not in parts.rows[5]
    assert all("time/step_s" in parts.rows[s] for s in range(1, 8))


@pytest.mark.parametrize(
    "overrides",
    [
        ["rollout.mode=ppo_off_policy", "rollout.k=2"],  # pushes after every k-th step only
        ["rollout.k=1"],  # on-policy but for the in-flight push: nothing to wait within
        ["checkpoint.every_steps=4", "rollout.k=2"],  # step 4 checkpoints: its row and push are not held
    ],
)
def test_the_push_follows_the_evaluation_at_once_where_waiting_is_not_allowed(overrides):
    parts = _run(["total_steps=7", "eval.every_steps=3", *overrides])
    events = parts.events
    assert ("train", 5) not in _between(events, ("eval", 3), ("evaluated", 3))
    assert ("batch", 4, "open") in events
    assert "val/pass_rate" in parts.rows[4]
