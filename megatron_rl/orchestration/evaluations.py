"""A run's evaluations: validation (mean@k on the held-out prompts, with the live scaling-curve prediction) every
`eval.every_steps`, and the downstream benchmarks (mean@n and pass@k) every `eval.downstream.every_steps`; all of
them after the last step, and the fitted curves at the end.

An evaluation measures the policy the engines hold when it starts and runs on them beside generation for training,
while the trainer takes its next step. Its results go into the row of the first step that finishes after its start.
When the loop holds a push back for the evaluation to end (rollout/pipeline.py `may_hold`), the rows of the steps
finished meanwhile are held here and logged in order once it has (`settle`), so rows never go out of step order.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from megatron_rl.config import RunConfig
from megatron_rl.data.benchmarks import BenchmarkSet
from megatron_rl.data.datasets import Prompt
from megatron_rl.metrics import ComputeClock, read_metrics
from megatron_rl.rollout.evaluation import (
    BenchmarkResult,
    evaluate_benchmarks,
    format_table,
    sampling_record,
    validate,
)
from megatron_rl.rollout.session import SamplingSession

Row = dict[str, Any]


class Evaluations:
    """The evaluations of a run (module docstring): `due(step)`, `start(step)`, `running`, `hold` / `settle` for
    the rows that wait for them, and `run` for the ones after the last step."""

    def __init__(
        self,
        run: RunConfig,
        run_dir: Path,
        session: SamplingSession,
        validation: dict[str, list[Prompt]],
        downstream: dict[str, BenchmarkSet],
        clock: ComputeClock,
        metrics_path: Path,
    ) -> None:
        self.run, self.run_dir, self.session = run, run_dir, session
        self.validation, self.downstream = validation, downstream
        self.clock, self.metrics_path = clock, metrics_path
        self.pending: asyncio.Future[Row] | None = None
        self.held: list[tuple[int, Row]] = []
        """Rows of finished steps waiting for the pending evaluations (logged in order, the first with results)."""
        self._started = -1

    def due(self, step: int, final: bool = False) -> bool:
        """Whether any evaluation is due at `step` and not already started there (all of them at the end)."""
        return step != self._started and (final or self._validation_due(step) or self._downstream_due(step))

    def start(self, step: int) -> None:
        """The evaluations due at `step`, in the background."""
        self._started = step
        self.pending = asyncio.ensure_future(self.run_due(step))

    @property
    def running(self) -> bool:
        return self.pending is not None and not self.pending.done()

    def hold(self, step: int, row: Row) -> None:
        self.held.append((step, row))

    async def settle(self, row: Row, log: Callable[[int, Row], None]) -> None:
        """Wait for the pending evaluations; their results go into the first held row (else `row`), and the held
        rows are logged with the readings of now (their `device_hours` after the evaluations, as rows that waited
        for them)."""
        if self.pending is not None:
            (self.held[0][1] if self.held else row).update(await self.pending)
        for step, waited in self.held:
            log(step, waited)
        self.pending, self.held = None, []

    async def cancel(self) -> None:
        if self.pending is not None and not self.pending.done():
            self.pending.cancel()
            await asyncio.gather(self.pending, return_exceptions=True)

    async def run_due(self, step: int, final: bool = False) -> Row:
        """The evaluations due at `step` (all of them when `final`), validation and downstream side by side on the
        engines (generation for training keeps its share of them meanwhile)."""
        jobs = []
        if final or self._validation_due(step):
            jobs.append(self.validate())
        if final and self.downstream or self._downstream_due(step):
            jobs.append(self.evaluate_downstream(step))
        row: Row = {}
        for result in await asyncio.gather(*jobs):
            row.update(result)
        return row

    def _validation_due(self, step: int) -> bool:
        return step % self.run.eval.every_steps == 0

    def _downstream_due(self, step: int) -> bool:
        return bool(self.downstream) and step % self.run.eval.downstream.every_steps == 0

    async def validate(self) -> Row:
        """mean@k on the held-out prompts, per task and overall, with the live prediction of A."""
        run = self.run
        result = await validate(self.validation, run.eval.samples_per_prompt, self.session, seed=run.seed)
        if run.logging.live_scaling_fit:
            rows, hours = read_metrics(self.metrics_path), self.clock.device_hours
            tasks = list(self.validation) if len(self.validation) > 1 else []
            for task in [None, *tasks]:  # overall, then per task (`scaling/<task>/A`, ...) on multi-task runs
                metric = f"val/pass_rate/{task}" if task else "val/pass_rate"
                prediction = _live_fit(rows, result, hours, run.logging.scaling_fit_start, metric)
                result.update(
                    {k.replace("scaling/", f"scaling/{task}/") if task else k: v for k, v in prediction.items()}
                )
        return result

    async def evaluate_downstream(self, step: int) -> Row:
        """mean@n and pass@k on every downstream benchmark; each result is also appended, with the sampling
        settings, to the run's downstream.jsonl."""
        run, config = self.run, self.run.eval.downstream
        sampling = config.sampling(run.rollout.sampling)
        results = await evaluate_benchmarks(
            {name: bench.prompts for name, bench in self.downstream.items()},
            config.samples_per_prompt,
            self.session.with_sampling(sampling),
            seed=run.seed,
        )
        settings = sampling_record(run.rollout, sampling, config.samples_per_prompt)
        sources = {name: bench.source for name, bench in self.downstream.items()}
        record_downstream(self.run_dir / "downstream.jsonl", step, results, settings, sources)
        print(format_table(results, f"downstream at step {step}:"), flush=True)
        return {key: value for result in results.values() for key, value in result.metrics().items()}

    def fit_curves(self) -> None:
        """The run's fitted compute-performance curves, printed and plotted: validation, per task on multi-task
        runs (docs/recipe.md §7: math and code fitted apart), and the downstream benchmarks that have results beside
        it (the paper's validation vs AIME figure)."""
        from megatron_rl.scaling.cli import main as fit_main

        downstream = [
            f"downstream/{name}/mean@{self.run.eval.downstream.samples_per_prompt}" for name in self.downstream
        ]
        logged = {key for row in read_metrics(self.metrics_path) for key in row}
        downstream = [key for key in downstream if key in logged]  # a benchmark whose problems were all too long: n/a
        common = [str(self.metrics_path), "--fit-start", str(self.run.logging.scaling_fit_start)]
        fit_main([*common, "--plot", str(self.run_dir / "scaling_curve.png")])
        if len(self.validation) > 1:
            fit_main([*common, "--metric", "val/pass_rate/*", "--plot", str(self.run_dir / "scaling_curve_tasks.png")])
        if downstream:
            metrics = ",".join(["val/pass_rate", *downstream])
            fit_main([*common, "--metric", metrics, "--plot", str(self.run_dir / "scaling_curve_downstream.png")])


def record_downstream(
    path: Path, step: int, results: dict[str, BenchmarkResult], sampling: dict[str, Any], sources: dict[str, str]
) -> None:
    """Append one JSON line: the step, the sampling settings, and each benchmark's result (per-problem passes
    included, so pass@k at another k can be computed later)."""
    entry = {"step": step, "sampling": sampling, "sources": sources}
    entry["results"] = {name: result.as_dict() for name, result in results.items()}
    with path.open("a") as f:
        f.write(json.dumps(entry) + "\n")


def _live_fit(rows: list[Row], latest: dict[str, float], device_hours: float, fit_start: float, metric: str) -> Row:
    """Predicted asymptote A (with its interval) from the validation points so far (scaling toolkit)."""
    from megatron_rl.scaling import live_prediction  # numpy only: no scipy in the driver (~70 MiB it would hold)

    points = [r for r in rows if r.get(metric) is not None]
    points.append({"step": -1, "device_hours": device_hours, **latest})
    return live_prediction(points, fit_start=fit_start, metric=metric)
