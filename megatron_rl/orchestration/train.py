"""The ScaleRL driver: `megatron-rl train --recipe scalerl --model llama3_8b [overrides]`.

The loop (docs/recipe.md §4, docs/run_flow.md) reads as the algorithm:

    every eval.every_steps:  validation mean@k on the held-out prompts (+ live scaling-curve fit)
    every eval.downstream.every_steps: mean@n and pass@k on the downstream benchmarks (AIME, MATH-500, ...)
                                                 (on the engines while the trainer takes the step below)
    groups  <- pipeline.next_batch(version)      G completions per prompt, rewarded, filtered, <= k stale
    metrics <- trainers.train_step(groups)       one optimizer step on all trainer ranks; version += 1
    push weights when the pipeline says so       in flight (pipeline) or after k steps (ppo_off_policy); in
                                                 pipeline mode a push may wait one step for running evaluations
    log one row (metrics JSONL + wandb + console), checkpoint every N steps and on SIGTERM/SIGUSR1

`setup` builds the run's parts (data, starting policy, Ray, trainer ranks, engines, weight-sync group,
resume, pipeline, logger); `_loop` is the loop above. Generation never waits for the trainer in `pipeline`
mode: the rollout producer runs on this event loop while the trainer ranks (Ray actors) train and sync.
Everything the run needs to continue after a kill — trainer state, sampler and curriculum state, step,
compute clock — is in the checkpoint; the prompts of groups that were buffered or in flight are drawn
again first on resume (counted in `train/regenerated_groups`), and metrics rows logged after the checkpoint
are dropped, so a run killed at any point (SIGKILL included) and started again with the same command trains
and logs every step once.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import shutil
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ray

from megatron_rl.config import ConfigError, RunConfig, save_config
from megatron_rl.data.benchmarks import BenchmarkSet, load_benchmark
from megatron_rl.data.datasets import Splits, load_splits
from megatron_rl.data.sampler import CurriculumSampler
from megatron_rl.metrics import ComputeClock, MetricsLogger, end_wandb, read_metrics, start_wandb
from megatron_rl.orchestration.actors import TrainerDied, TrainerGroup
from megatron_rl.orchestration.engines import EngineGroup, LocalLaunch, local_engines
from megatron_rl.orchestration.placement import check_cpu_slots, cpu_processes, local_ray_cpus
from megatron_rl.orchestration.reaper import Reaper
from megatron_rl.orchestration.resume import check_data, check_resume, fork_source
from megatron_rl.rewards.workers import RewardWorkers
from megatron_rl.rollout.evaluation import (
    BenchmarkResult,
    evaluate_benchmarks,
    format_table,
    sampling_record,
    validate,
    with_sampling,
)
from megatron_rl.rollout.interruption import InterruptionTokens
from megatron_rl.trainer.checkpoint import latest_checkpoint, record_starting_model

if TYPE_CHECKING:  # torch: imported while Ray starts (prepare_inputs), not at the CLI's start
    from megatron_rl.rollout.pipeline import PromptEncoder, RolloutPipeline


class RunStopped(RuntimeError):
    """The run cannot go on (a trainer rank died); the message says why and where it can resume from."""


class EmptyBatches(Exception):
    """`algo.max_empty_batches` batches in a row left nothing to train on."""

    def __init__(self, step: int, streak: int, stats: dict[str, float]) -> None:
        passed = stats.get("train/pass_rate")
        rate = f"pass rate {passed:.2f}" if passed is not None else "no pass rate"
        super().__init__(
            f"{streak} batches in a row after step {step} had no group with differing rewards ({rate} in the "
            "last): every group was filtered as zero-variance, so no step was taken. The policy has collapsed "
            "or the data is all too hard or too easy; raise algo.max_empty_batches (0: never stop) to go on"
        )


class StartStopped(Exception):
    """A stop signal came while the run was starting: the start was abandoned, nothing trained or saved."""

    def __init__(self, signal_name: str, where: str) -> None:
        self.signum = int(signal.Signals[signal_name])
        super().__init__(
            f"stopped by {signal_name} during start-up, before the first step: nothing was trained or saved by this "
            f"start ({where}); run the same command to start again"
        )


class StopFlag:
    """Set by SIGTERM / SIGUSR1 (Slurm's pre-timeout signal): checkpoint at the end of this step and exit. During
    start-up there is nothing to checkpoint and a start takes minutes (engines loading weights): the signal cancels
    the start (`cancels`), which shuts down what it started.

    `ray.init` installs Ray's own SIGTERM handler in the driver (it ends the process at once, wherever it is), so
    `start_ray` keeps this one while Ray starts, and `install` runs again once Ray is up (Ray's core worker adds a
    handler that prints a stack dump)."""

    def __init__(self, enabled: bool) -> None:
        self.signal: str | None = None
        self.enabled = enabled
        self._start: asyncio.Future[Any] | None = None
        self.install()

    def install(self) -> None:
        if self.enabled:
            for sig in (signal.SIGTERM, signal.SIGUSR1):
                signal.signal(sig, self._handle)

    def cancels(self, start: asyncio.Future[Any]) -> None:
        """Until `start` is done, a signal cancels it (one that came already does so now)."""
        self._start = start
        if self.signal is not None:
            start.cancel()

    def _handle(self, signum: int, frame: Any) -> None:
        self.signal = signal.Signals(signum).name
        if self._start is not None and not self._start.done():
            # As asyncio's own Ctrl-C handling: the cancellation lands at the start's next await, and the loop is
            # woken in case it sleeps in select().
            self._start.cancel()
            self._start.get_loop().call_soon_threadsafe(lambda: None)

    def __bool__(self) -> bool:
        return self.signal is not None


def train(run: RunConfig) -> Path:
    """Run (or resume) a ScaleRL training run; returns the run directory. If this process is killed, even
    with SIGKILL, the processes it started are ended too (orchestration/reaper.py)."""
    reaper = Reaper.start()
    started_ray = not ray.is_initialized()
    try:
        return asyncio.run(_train(run))
    finally:
        if started_ray and ray.is_initialized():
            ray.shutdown()  # here, under the watcher's guard, not at interpreter exit
        stragglers = reaper.stop(leftovers_grace_s=10.0)
        if stragglers:
            print(f"ended {len(stragglers)} processes of the run still running after its shutdown:", flush=True)
            for line in stragglers:
                print(f"  {line}", flush=True)


@dataclass
class Parts:
    """A started run: everything the loop drives, and what it resumes from."""

    run: RunConfig
    run_dir: Path
    splits: Splits
    stop: StopFlag
    trainers: TrainerGroup
    engines: EngineGroup
    rewards: RewardWorkers
    sampler: CurriculumSampler
    pipeline: RolloutPipeline
    encoder: PromptEncoder
    tokens: InterruptionTokens
    clock: ComputeClock
    logger: MetricsLogger
    step: int
    regenerated: int
    """Groups that were buffered or in flight at the checkpoint resumed from (their prompts are drawn again)."""
    downstream: dict[str, BenchmarkSet]
    """The downstream benchmarks (eval.downstream), loaded before the start."""
    fingerprints: dict[str, str] = dataclasses.field(default_factory=dict)
    """The training data's fingerprints (`Splits.fingerprints`), recorded in every checkpoint."""
    saved: int | None = None
    """The step of the last checkpoint this start wrote."""

    async def validate(self) -> dict[str, float]:
        """mean@k on the held-out prompts, per task and overall, with the live prediction of A."""
        run, pipeline = self.run, self.pipeline
        result = await validate(
            self.splits.val,
            run.eval.samples_per_prompt,
            self.engines.generate,
            self.encoder,
            run.rollout,
            self.tokens,
            self.rewards,
            lambda: pipeline.version,
            seed=run.seed,
        )
        if run.logging.live_scaling_fit:
            rows, hours, fit_start = (
                read_metrics(self.logger.path),
                self.clock.device_hours,
                run.logging.scaling_fit_start,
            )
            tasks = list(self.splits.val) if len(self.splits.val) > 1 else []
            for task in [None, *tasks]:  # overall, then per task (`scaling/<task>/A`, ...) on multi-task runs
                metric = f"val/pass_rate/{task}" if task else "val/pass_rate"
                prediction = _live_fit(rows, result, hours, fit_start, metric)
                result.update(
                    {k.replace("scaling/", f"scaling/{task}/") if task else k: v for k, v in prediction.items()}
                )
        return result

    async def evaluate_downstream(self, step: int) -> dict[str, float]:
        """mean@n and pass@k on every downstream benchmark, on the run's engines while generation for training
        goes on; each result is also appended, with the sampling settings, to the run's downstream.jsonl."""
        run = self.run
        config = run.eval.downstream
        sampling = config.sampling(run.rollout.sampling)
        pipeline = self.pipeline
        results = await evaluate_benchmarks(
            {name: bench.prompts for name, bench in self.downstream.items()},
            config.samples_per_prompt,
            with_sampling(self.engines.generate, sampling),
            self.encoder,
            run.rollout,
            self.tokens,
            self.rewards,
            lambda: pipeline.version,
            seed=run.seed,
        )
        settings = sampling_record(run.rollout, sampling, config.samples_per_prompt)
        sources = {name: bench.source for name, bench in self.downstream.items()}
        record_downstream(self.run_dir / "downstream.jsonl", step, results, settings, sources)
        print(format_table(results, f"downstream at step {step}:"), flush=True)
        return {key: value for result in results.values() for key, value in result.metrics().items()}

    def log(self, step: int, row: dict[str, Any]) -> None:
        row.update(self.engines.metrics())
        row.update(self.rewards.metrics())
        row["device_hours"] = self.clock.device_hours
        self.logger.log(step, row)

    async def save(self, step: int) -> None:
        state = {
            "step": step,
            "sampler": self.sampler.state_dict(),
            "device_hours": self.clock.device_hours,
            "in_flight_groups": len(self.pipeline.buffer) + len(self.pipeline.tasks),
            "data_fingerprints": self.fingerprints,
        }
        root = self.run_dir / "checkpoints"
        try:
            await self.trainers.call("save", str(root), state, self.run.checkpoint.keep_last)
        except Exception as exc:
            full = out_of_space(root, exc)
            if full is None:
                raise
            raise RunStopped(
                f"the checkpoint of step {step} could not be written: {full}. Nothing before it is lost "
                f"({_last_checkpoint(self.run_dir)}); free space or move output_dir, then run the same command to "
                "resume"
            ) from exc
        self.saved = step

    async def close(self) -> None:
        await self.pipeline.close()
        self.rewards.close()
        self.logger.close()
        await self.engines.stop()
        self.trainers.shutdown()


async def _train(run: RunConfig) -> Path:
    stop = StopFlag(run.checkpoint.save_on_signal)
    starting = asyncio.ensure_future(setup(run, stop))
    stop.cancels(starting)
    try:
        parts = await starting
    except asyncio.CancelledError:
        if stop.signal is None:  # not ours: Ctrl-C (asyncio cancels the run) or a shutdown
            raise
        raise StartStopped(stop.signal, _last_checkpoint(Path(run.output_dir) / run.name)) from None
    try:
        step = await _loop(parts)
    except TrainerDied as exc:
        where = _last_checkpoint(parts.run_dir)
        raise RunStopped(f"{exc}. The run stops; {where}: run the same command to resume.") from exc
    except EmptyBatches as exc:
        raise RunStopped(f"{exc}; {_last_checkpoint(parts.run_dir)}") from exc
    finally:
        await parts.close()
    if parts.stop:
        if parts.saved == step:
            what = f"checkpoint saved at step {step}"
        else:
            what = f"nothing saved by this start; {_last_checkpoint(parts.run_dir)}"
        print(f"stopped by {parts.stop.signal} at step {step}: {what}; resume with the same command", flush=True)
    else:
        downstream = [f"downstream/{name}/mean@{run.eval.downstream.samples_per_prompt}" for name in parts.downstream]
        logged = {key for row in read_metrics(parts.logger.path) for key in row}
        downstream = [key for key in downstream if key in logged]  # a benchmark whose problems were all too long: n/a
        _final_fit(parts.logger.path, parts.run_dir, set(parts.splits.val), run.logging.scaling_fit_start, downstream)
    return parts.run_dir


async def _loop(p: Parts) -> int:
    """The training loop (module docstring); returns the last step."""
    run, step, validated, empty_batches, empty_streak = p.run, p.step, -1, 0, 0
    evaluations: asyncio.Future[dict[str, Any]] | None = None
    held: list[tuple[int, dict[str, Any]]] = []
    """Rows of finished steps waiting for the evaluations to end (logged in order, the first with their results)."""
    p.engines.reset_usage()  # the generators' idle share over the loop, not the start-up
    p.pipeline.start()
    try:
        while step < run.total_steps and not p.stop:
            started = time.perf_counter()
            row: dict[str, Any] = {}
            if validated != step and _due(p, step, final=False):  # the policy of `step`, while the trainer steps
                evaluations = asyncio.ensure_future(_evaluations(p, step, final=False))
                validated = step
            groups, stats = await p.pipeline.next_batch(step)
            row.update(stats.as_metrics())
            if groups:
                row.update(await p.trainers.call("train_step", groups))
                empty_streak = 0
            else:  # every group was zero-variance: no optimizer step this round (logged, counted)
                empty_batches, empty_streak = empty_batches + 1, empty_streak + 1
            row["train/empty_batches"] = float(empty_batches)
            if run.algo.max_empty_batches and empty_streak >= run.algo.max_empty_batches:
                await _log_held(p, evaluations, held, row)
                p.log(step, row)
                raise EmptyBatches(step, empty_streak, stats.as_metrics())
            step = await p.trainers.call("version")
            if evaluations is not None and not held and _may_defer(p, evaluations, step):
                # The engines keep the evaluated policy one step longer: the trainer takes its next step on
                # groups already buffered instead of waiting, and no group starts until the push, so none is
                # trained on more than k versions after it started.
                row.update({"time/step_s": time.perf_counter() - started, "train/regenerated_groups": p.regenerated})
                p.pipeline.hold()
                held.append((step, row))
                continue
            await _log_held(p, evaluations, held, row)
            evaluations, held = None, []
            if p.pipeline.push_due(step):
                row.update(await p.engines.push_weights(p.trainers, step))
                p.pipeline.pushed(step)
            row.update({"time/step_s": time.perf_counter() - started, "train/regenerated_groups": p.regenerated})
            p.log(step, row)
            if step % run.checkpoint.every_steps == 0 or p.stop or step == run.total_steps:
                await p.save(step)
    except BaseException:
        if evaluations is not None and not evaluations.done():
            evaluations.cancel()
            await asyncio.gather(evaluations, return_exceptions=True)
        raise
    if step >= run.total_steps and not p.stop:
        p.log(step, await _evaluations(p, step, final=True))
    return step


async def _log_held(
    p: Parts, evaluations: asyncio.Future[dict[str, Any]] | None, held: list[tuple[int, dict[str, Any]]], row: dict
) -> None:
    """The evaluations' results into the first row after their start (a held one, else `row`); the held rows
    logged, with the readings of now (their `device_hours` after the evaluations, as a row that waited for them)."""
    if evaluations is not None:
        (held[0][1] if held else row).update(await evaluations)
    for step, waited in held:
        p.log(step, waited)


def _may_defer(p: Parts, evaluations: asyncio.Future[dict[str, Any]], version: int) -> bool:
    """Whether the push of `version` may wait one step for evaluations still running (once per evaluation):
    PipelineRL only (its engines change weights in flight, so the wait only makes the next batch a version
    staler), with the engines one version behind and k >= 2, and not at a step that checkpoints, stops, ends or
    starts evaluations."""
    run = p.run
    return (
        not evaluations.done()
        and run.rollout.mode == "pipeline"
        and run.rollout.k >= 2
        and version - p.pipeline.version == 1
        and version < run.total_steps
        and version % run.checkpoint.every_steps != 0
        and not p.stop
        and not _due(p, version, final=False)
    )


def _due(p: Parts, step: int, final: bool) -> bool:
    """Whether any evaluation is due at `step` (all of them at the end)."""
    run = p.run
    downstream = bool(p.downstream) and (final or step % run.eval.downstream.every_steps == 0)
    return final or step % run.eval.every_steps == 0 or downstream


async def _evaluations(p: Parts, step: int, final: bool) -> dict[str, Any]:
    """The evaluations due at `step` (all of them at the end), validation and downstream side by side on the
    engines (generation for training keeps its share of them meanwhile)."""
    run = p.run
    jobs = []
    if final or step % run.eval.every_steps == 0:
        jobs.append(p.validate())
    if p.downstream and (final or step % run.eval.downstream.every_steps == 0):
        jobs.append(p.evaluate_downstream(step))
    row: dict[str, Any] = {}
    for result in await asyncio.gather(*jobs):
        row.update(result)
    return row


def record_downstream(
    path: Path, step: int, results: dict[str, BenchmarkResult], sampling: dict[str, Any], sources: dict[str, str]
) -> None:
    """Append one JSON line: the step, the sampling settings, and each benchmark's result (per-problem passes
    included, so pass@k at another k can be computed later)."""
    import json

    entry = {"step": step, "sampling": sampling, "sources": sources}
    entry["results"] = {name: result.as_dict() for name, result in results.items()}
    with path.open("a") as f:
        f.write(json.dumps(entry) + "\n")


async def setup(run: RunConfig, stop: StopFlag) -> Parts:
    """Everything before the first step: data, the starting policy, Ray, trainer ranks and engines, the
    weight-sync group, the checkpoint resumed from, the pipeline and the logger. Whatever can refuse the start
    (output directory, data, sandbox, starting model, budgets) is checked before the run's config, metrics or
    checkpoints are written, so a refused start leaves them as they were."""
    run_dir = Path(run.output_dir) / run.name
    _check_writable(run_dir)
    # The checkpoint to resume from, verified against its manifest before anything starts, and the config it was saved
    # under compared with this one (orchestration/resume.py): another experiment is refused here, before Ray starts.
    checkpoint = latest_checkpoint(run_dir / "checkpoints") if run.checkpoint.resume == "auto" else None
    change = check_resume(run, checkpoint) if checkpoint is not None else None
    forked = fork_source(run) if checkpoint is None and run.checkpoint.fork_from else None
    if forked is not None:
        check_resume(run, forked, fork=True)
    # Ray's local head takes seconds to start (its processes' imports): it starts while a worker thread reads
    # the data, finds the starting policy and loads its tokenizer. A start those checks refuse shuts Ray down.
    # CPU engines on this machine start from that thread too, as soon as the starting policy is checked
    # (engines.LocalLaunch); a start refused after that stops them (their log stays in the run's logs/).
    launch = LocalLaunch(run, run_dir) if local_engines(run) else None
    prepared = _in_daemon_thread(prepare_inputs, run, launch, checkpoint)
    try:
        start_ray(run)
        stop.install()  # over the handler Ray's core worker installed
        splits, downstream, policy, encoder, tokens = await prepared
    except BaseException:
        prepared.cancel()
        if launch is not None:
            launch.close()
        raise
    run_dir.mkdir(parents=True, exist_ok=True)
    save_config(run, run_dir / "config.yaml")
    record_starting_model(run_dir, policy)
    check_cpu_slots(run, ray.cluster_resources().get("CPU", 0.0), local_engines=launch is not None)
    config = dataclasses.asdict(run)
    wandb_run = _in_daemon_thread(start_wandb, run.logging, run_dir, run.name, config)
    # The trainer's placement is reserved first (the node plan packs trainer ranks first); its ranks build their
    # models while the engines start, the two longest parts of start-up, side by side.
    trainers = TrainerGroup(run, config, wait=False)
    try:
        engines = EngineGroup(run, policy, run_dir, servers=launch.servers if launch is not None else None)
    except BaseException:
        if launch is not None:
            launch.close()
        _drop(wandb_run)
        raise
    rewards: RewardWorkers | None = None
    try:
        await asyncio.gather(engines.start(), trainers.ready())

        from megatron_rl.algo.filters import NoPositiveResampling
        from megatron_rl.rollout.pipeline import RolloutPipeline

        no_positive = NoPositiveResampling(run.algo.no_positive_resampling)
        sampler = CurriculumSampler(splits.train, {d.key: d.weight for d in run.data.datasets}, run.seed, no_positive)
        start_hours, regenerated = 0.0, 0
        if checkpoint is not None:
            state = await trainers.call("load", str(checkpoint))
            sampler.load_state_dict(state["sampler"])
            start_hours, regenerated = state["device_hours"], state.get("in_flight_groups", 0)
            print(f"resumed from {checkpoint} at step {state['step']}", flush=True)
        elif forked is not None:
            await trainers.call("fork", str(forked))
            print(f"forked from {forked}: its weights, with a fresh optimizer, data order and step count", flush=True)
        else:
            await trainers.call("load_hf", str(policy))
        step = await trainers.call("version")
        await engines.connect_weight_sync(trainers)
        if checkpoint is not None or forked is not None:
            await engines.push_weights(trainers, step)

        # The reward workers' start (their imports, ~1 s of CPU) comes now, not beside the engines' and trainer's on
        # the start-up's busy cores: the first rewards are needed at the end of the first evaluation's generation.
        rewards = RewardWorkers(run.rewards, processes=run.rewards.processes)
        seed = run.seed + step
        pipeline = RolloutPipeline(
            run.rollout, run.algo, sampler, rewards, engines.generate, encoder, tokens, seed=seed, version=step
        )
        devices = run.parallel.trainer_devices + (run.compute.generator_devices or engines.devices)
        clock = ComputeClock(devices, start_hours)
        header = {"name": run.name, "recipe": run.recipe, "model": run.model.name, "seed": run.seed}
        header.update(device_kind=run.compute.device_kind, devices=devices)
        header["data"] = {key: {"rows": st.rows, "skipped_rows": st.skipped} for key, st in splits.stats.items()}
        if forked is not None:
            header["forked_from"] = str(forked)
        logger = MetricsLogger(run.logging, run_dir, header, config, resume_step=step, wandb_run=await wandb_run)
        if change is not None:  # applied: this start runs with the new settings from the resumed step on
            print(f"config changed at step {change.step}: {change.describe()}", flush=True)
            logger.mark({**change.record(), "device_hours": start_hours})
        return Parts(
            run, run_dir, splits, stop, trainers, engines, rewards, sampler, pipeline, encoder, tokens, clock, logger,
            step, regenerated, downstream, splits.fingerprints(),
        )  # fmt: skip
    except BaseException:
        if rewards is not None:
            rewards.close()
        if launch is not None:
            launch.close()
        _drop(wandb_run)
        raise


def _drop(wandb_run: asyncio.Future[Any]) -> None:
    """The wandb run of a start that failed: finished if it started, else never handed over."""
    if wandb_run.done() and not wandb_run.cancelled() and wandb_run.exception() is None:
        end_wandb(wandb_run.result())
    else:
        wandb_run.cancel()


def _in_daemon_thread(fn: Callable[..., Any], *args: Any) -> asyncio.Future[Any]:
    """`fn(*args)` in a daemon thread, as a future of this event loop. Not `asyncio.to_thread`: the loop's executor
    is joined when the loop ends, so Ctrl-C during a first run's warm-up (a minute) would wait for it to finish."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[Any] = loop.create_future()

    def settle(outcome: Any, failed: bool) -> None:
        if future.done():  # cancelled: the start failed or was interrupted meanwhile
            return
        if failed:
            future.set_exception(outcome)
        else:
            future.set_result(outcome)

    def work() -> None:
        try:
            outcome, failed = fn(*args), False
        except BaseException as exc:
            outcome, failed = exc, True
        with contextlib.suppress(RuntimeError):  # the loop already closed: nobody waits for the outcome
            loop.call_soon_threadsafe(settle, outcome, failed)

    threading.Thread(target=work, name=getattr(fn, "__name__", "setup"), daemon=True).start()
    return future


def prepare_inputs(
    run: RunConfig, launch: LocalLaunch | None = None, resumed: Path | None = None
) -> tuple[Splits, dict[str, BenchmarkSet], Path, PromptEncoder, InterruptionTokens]:
    """What the run reads before anything starts, each source checked: the data (unchanged since the checkpoint
    `resumed`, when resuming), the downstream benchmarks, the sandbox (code tasks), the starting policy (warm-started
    on first use) and its tokenizer with the budgets it implies; then `launch` starts the local engines' servers from
    that policy."""
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
    from megatron_rl.rollout.pipeline import PromptEncoder

    tokenizer = load_tokenizer(policy)
    encoder = PromptEncoder(tokenizer, run.data.system_prompt, run.data.chat_template)
    tokens = interruption_tokens(run, tokenizer)
    run.check_row_budget(len(tokens.phrase))  # the longest row fits a micro-batch: stop now, not in a collective
    run.rollout.check_phrase(len(tokens.phrase))  # and the engines' context
    return splits, downstream, policy, encoder, tokens


def start_ray(run: RunConfig) -> None:
    """Join the allocation's Ray (RAY_ADDRESS, set by the Slurm script) or start a fresh local instance."""
    if ray.is_initialized():
        return
    # Off a cluster, always a fresh local instance ("local"): address=None would join any Ray head already
    # running on this machine (another run's, another user's) and fail on its auth token.
    if os.environ.get("RAY_ADDRESS"):
        with _keeping_sigterm(run.checkpoint.save_on_signal):
            ray.init(address="auto", include_dashboard=False)
    else:
        cores = os.cpu_count() or 1
        slots, processes = local_ray_cpus(run, cores), cpu_processes(run)
        if processes > cores:
            print(f"ray: {processes} processes on {cores} cores (trainer ranks and CPU engines share them)", flush=True)
        with _one_machine_head(), _keeping_sigterm(run.checkpoint.save_on_signal):
            ray.init(address="local", include_dashboard=False, num_cpus=slots)


@contextlib.contextmanager
def _keeping_sigterm(keep: bool) -> Any:
    """`ray.init` first replaces the driver's SIGTERM handler with `sys.exit(15)`, raised wherever the driver is:
    in the middle of Ray's own start, it leaves a half-started head to the reaper and the process to die in
    interpreter shutdown. A run that handles SIGTERM itself (StopFlag) keeps its handler while Ray starts."""
    if not keep:
        yield
        return
    import ray._private.utils as utils

    set_handler = utils.set_sigterm_handler
    utils.set_sigterm_handler = lambda handler: None
    try:
        yield
    finally:
        utils.set_sigterm_handler = set_handler


@contextlib.contextmanager
def _one_machine_head() -> Any:
    """A local Ray head without the processes a one-machine run never uses: the autoscaler's monitor (one
    machine's Ray has no nodes to add or remove; 55 MB of memory) and the API server (`dashboard.py`, behind Ray's
    jobs, state API and dashboard, none of which a run calls; ~1 s of CPU on the start-up's busy cores and ~100 MB).
    `ray.init` exposes no switch for either: `ray start --head` has one for the monitor (`--no-monitor`, the field
    `RayParams.no_monitor` it sets), which the head `ray.init` starts is given, and the node's `start_api_server`
    does nothing while it starts. The dashboard agent starts minimal (`--minimal`, as with Ray's minimal install:
    no metrics export or HTTP server, which only the dashboard reads): `ray.init` decides that by importing the
    dashboard's optional dependencies (aiohttp, grpc, prometheus, opencensus; ~0.25 CPU-s, and Ray's start 0.5 s
    later, measured alternating), which it is told are absent. Ray's log monitor (actors' output on this console),
    raylet and agents still start; a head started by `ray start` (a Slurm allocation) is joined as it is."""
    import ray._private.node as node
    import ray._private.parameter as parameter
    import ray._private.utils as utils

    base, start_api_server = parameter.RayParams, node.Node.start_api_server
    dependency_error = utils.get_dashboard_dependency_error

    class HeadParams(base):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.no_monitor = True

    parameter.RayParams = HeadParams
    node.Node.start_api_server = lambda self, **kwargs: None
    utils.get_dashboard_dependency_error = lambda: ImportError("a one-machine run starts no dashboard")
    try:
        yield
    finally:
        parameter.RayParams, node.Node.start_api_server = base, start_api_server
        utils.get_dashboard_dependency_error = dependency_error


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


def _check_writable(run_dir: Path) -> None:
    """The run directory exists and is writable, or can be created (its nearest existing ancestor is writable)."""
    existing = run_dir
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        what = "is not a directory" if not existing.is_dir() else "is not writable"
        raise ConfigError(f"output_dir: {existing} {what}, so the run directory {run_dir} cannot be written")


def out_of_space(path: Path, exc: BaseException) -> str | None:
    """Why a write under `path` failed when the file system is full, else None. The error a save raises in a trainer
    rank rarely says so (torch's checkpoint writer wraps the OSError, Ray wraps that again), so the file system is
    asked too: full when it has less free space than the newest checkpoint takes (what the save needed), or none."""
    text = f"{exc!r} {exc}"
    mount = path if path.exists() else path.parent
    usage = shutil.disk_usage(mount)
    newest = max((p for p in path.glob("step_*") if p.is_dir()), default=None) if path.exists() else None
    needed = sum(f.stat().st_size for f in newest.rglob("*") if f.is_file()) if newest is not None else 0
    if "No space left on device" in text or "Errno 28" in text or usage.free < max(needed, 1 << 20):
        size = lambda n: f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"  # noqa: E731
        return f"no space left on device ({size(usage.free)} free of {size(usage.total)} at {mount})"
    return None


def _last_checkpoint(run_dir: Path) -> str:
    last = latest_checkpoint(run_dir / "checkpoints")
    return f"the last complete checkpoint is {last}" if last else "no checkpoint was written yet"


def interruption_tokens(run: RunConfig, tokenizer: Any) -> InterruptionTokens:
    """The token ids length control needs: `</think>`, EOS, and the interruption phrase as it is appended.

    With interruption on, the end-of-thinking marker must be one token of the policy's vocabulary (a thinking
    model's special token): a tokenizer without it (Llama-3.1's, say) answers the unknown token's id or None,
    and interruption would then never see a thinking part end."""
    phrase, marker = run.rollout.interruption.phrase, run.rollout.interruption.end_of_thinking
    end = tokenizer.convert_tokens_to_ids(marker)
    if run.rollout.interruption.enabled and (end is None or tokenizer.convert_ids_to_tokens(end) != marker):
        raise ConfigError(
            f"rollout.interruption.end_of_thinking: {marker!r} is not a token of the starting model's tokenizer: "
            "start from a thinking model (or add it as a special token), set the field to the model's own "
            "end-of-thinking token, or turn interruption off (rollout.interruption.enabled=false)"
        )
    return InterruptionTokens(
        end_of_thinking=end,
        eos=tokenizer.eos_token_id,
        phrase=list(
            tokenizer(phrase if phrase.startswith(" ") else " " + phrase, add_special_tokens=False)["input_ids"]
        ),
    )


def _report_data(splits: Splits) -> None:
    """One line per dataset (training prompts, malformed rows skipped) and the validation prompts per task."""
    for key, stats in splits.stats.items():
        line = f"data: {key}: {len(splits.train[key])} training prompts"
        if stats.skipped:
            line += f", {stats.skipped} of {stats.rows} rows skipped (data.bad_rows=skip); first: {stats.errors[0]}"
        print(line, flush=True)
    print("data: validation " + ", ".join(f"{task} {len(p)}" for task, p in splits.val.items()), flush=True)


def _live_fit(
    rows: list[dict[str, Any]], latest: dict[str, float], device_hours: float, fit_start: float, metric: str
) -> dict[str, float]:
    """Predicted asymptote A (with its interval) from the validation points so far (scaling toolkit)."""
    from megatron_rl.scaling import live_prediction  # SciPy: imported at the first fit, not at start-up

    points = [r for r in rows if r.get(metric) is not None]
    points.append({"step": -1, "device_hours": device_hours, **latest})
    return live_prediction(points, fit_start=fit_start, metric=metric)


def _final_fit(metrics_path: Path, run_dir: Path, tasks: set[str], fit_start: float, downstream: list[str]) -> None:
    """Print the fitted compute-performance curve of this run and write its plot; with downstream benchmarks,
    also their curves beside the validation curve (the paper's validation vs AIME figure)."""
    from megatron_rl.scaling.cli import main as fit_main

    common = [str(metrics_path), "--fit-start", str(fit_start)]
    fit_main([*common, "--plot", str(run_dir / "scaling_curve.png")])
    if len(tasks) > 1:  # multi-task: one curve per task as well (docs/recipe.md §7: math and code fitted apart)
        fit_main([*common, "--metric", "val/pass_rate/*", "--plot", str(run_dir / "scaling_curve_tasks.png")])
    if downstream:
        metrics = ",".join(["val/pass_rate", *downstream])
        fit_main([*common, "--metric", metrics, "--plot", str(run_dir / "scaling_curve_downstream.png")])
