"""The ScaleRL driver: `megatron-rl train --recipe scalerl --model llama3_8b [overrides]`.

The loop (docs/recipe.md §4, docs/run_flow.md) reads as the algorithm:

    every eval.every_steps (and eval.downstream.every_steps): start the evaluations of the engines' policy
                                                 (on the engines while the trainer takes the step below)
    groups  <- pipeline.next_batch(version)      G completions per prompt, rewarded, filtered, <= k stale
    metrics <- trainers.train_step(groups)       one optimizer step on all trainer ranks; version += 1
    push weights when the pipeline says so       in flight (pipeline) or after k steps (ppo_off_policy); a push
                                                 may wait one step for running evaluations where the pipeline's
                                                 staleness rule allows it (`may_hold`)
    log one row (metrics JSONL + wandb + console), checkpoint every N steps and on SIGTERM/SIGUSR1

`setup` builds the run's parts (inputs, Ray, trainer ranks, engines, weight-sync group, resume, the sampling
session, pipeline, evaluations, logger); `_loop` is the loop above. Generation never waits for the trainer in
`pipeline` mode: the rollout producer runs on this event loop while the trainer ranks (Ray actors) train and sync.
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
import signal
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ray

from megatron_rl.config import ConfigError, RunConfig, save_config
from megatron_rl.data.datasets import Splits
from megatron_rl.data.sampler import CurriculumSampler
from megatron_rl.metrics import ComputeClock, MetricsLogger, end_wandb, start_wandb
from megatron_rl.orchestration.actors import TrainerDied, TrainerGroup
from megatron_rl.orchestration.engines import EngineGroup, LocalLaunch, local_engines
from megatron_rl.orchestration.evaluations import Evaluations
from megatron_rl.orchestration.inputs import prepare_inputs, sampling_session
from megatron_rl.orchestration.placement import check_cpu_slots
from megatron_rl.orchestration.ray_head import start_ray
from megatron_rl.orchestration.reaper import Reaper
from megatron_rl.orchestration.resume import check_resume, fork_source
from megatron_rl.orchestration.run_dir import check_writable, last_checkpoint, out_of_space
from megatron_rl.orchestration.stop import StopFlag
from megatron_rl.rewards.workers import RewardWorkers
from megatron_rl.trainer.checkpoint import latest_checkpoint, record_starting_model

if TYPE_CHECKING:  # torch: imported while Ray starts (prepare_inputs), not at the CLI's start
    from megatron_rl.rollout.pipeline import RolloutPipeline


class StartupTimeline:
    """When each part of the start-up was done, in seconds from the driver's launch (its process's start, so the
    CLI's own imports count): one line on the console when the loop starts, which names the part that held it."""

    def __init__(self) -> None:
        import psutil

        self.launched = psutil.Process().create_time()
        self.marks: dict[str, float] = {}

    def mark(self, part: str, ago: float = 0.0) -> None:
        """`part` done now, or `ago` seconds before now."""
        self.marks[part] = time.time() - ago - self.launched

    async def timed(self, awaitable: Awaitable[Any], part: str) -> Any:
        outcome = await awaitable
        self.mark(part)
        return outcome

    def line(self) -> str:
        """The parts in the order they were done (a part marked `ago` goes where it happened)."""
        done = sorted(self.marks.items(), key=lambda item: item[1])
        parts = ", ".join(f"{part} {seconds:.1f}" for part, seconds in done)
        return f"start-up {time.time() - self.launched:.1f} s from launch ({parts})"


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
    evaluations: Evaluations
    clock: ComputeClock
    logger: MetricsLogger
    step: int
    regenerated: int
    """Groups that were buffered or in flight at the checkpoint resumed from (their prompts are drawn again)."""
    fingerprints: dict[str, str] = dataclasses.field(default_factory=dict)
    """The training data's fingerprints (`Splits.fingerprints`), recorded in every checkpoint."""
    saved: int | None = None
    """The step of the last checkpoint this start wrote."""
    empty_batches: int = 0
    empty_streak: int = 0

    async def train(self, groups: list[Any]) -> dict[str, Any]:
        """One optimizer step on `groups`; none when every group was zero-variance (logged, counted)."""
        row = await self.trainers.call("train_step", groups) if groups else {}
        self.empty_batches += not groups
        self.empty_streak = 0 if groups else self.empty_streak + 1
        return {**row, "train/empty_batches": float(self.empty_batches)}

    @property
    def out_of_batches(self) -> bool:
        """`algo.max_empty_batches` batches in a row had nothing to train on."""
        limit = self.run.algo.max_empty_batches
        return bool(limit) and self.empty_streak >= limit

    def checkpoint_due(self, step: int) -> bool:
        return step % self.run.checkpoint.every_steps == 0 or bool(self.stop) or step == self.run.total_steps

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
                f"({last_checkpoint(self.run_dir)}); free space or move output_dir, then run the same command to "
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
        raise StartStopped(stop.signal, last_checkpoint(Path(run.output_dir) / run.name)) from None
    try:
        step = await _loop(parts)
    except TrainerDied as exc:
        raise RunStopped(
            f"{exc}. The run stops; {last_checkpoint(parts.run_dir)}: run the same command to resume."
        ) from exc
    except EmptyBatches as exc:
        raise RunStopped(f"{exc}; {last_checkpoint(parts.run_dir)}") from exc
    finally:
        await parts.close()
    if parts.stop:
        if parts.saved == step:
            what = f"checkpoint saved at step {step}"
        else:
            what = f"nothing saved by this start; {last_checkpoint(parts.run_dir)}"
        print(f"stopped by {parts.stop.signal} at step {step}: {what}; resume with the same command", flush=True)
    else:
        parts.evaluations.fit_curves()
    return parts.run_dir


async def _loop(p: Parts) -> int:
    """The training loop (module docstring); returns the last step."""
    run, step, evaluations = p.run, p.step, p.evaluations
    p.engines.reset_usage()  # the generators' idle share over the loop, not the start-up
    p.pipeline.start()
    try:
        while step < run.total_steps and not p.stop:
            started = time.perf_counter()
            if evaluations.due(step):  # the policy of `step`, evaluated while the trainer steps
                evaluations.start(step)
            groups, stats = await p.pipeline.next_batch(step)
            row = {**stats.as_metrics(), **await p.train(groups)}
            if p.out_of_batches:
                await evaluations.settle(row, p.log)
                p.log(step, row)
                raise EmptyBatches(step, p.empty_streak, stats.as_metrics())
            step = await p.trainers.call("version")
            row.update({"time/step_s": time.perf_counter() - started, "train/regenerated_groups": p.regenerated})
            if evaluations.running and not evaluations.held and p.pipeline.may_hold(step) and not _boundary(p, step):
                # The engines keep the evaluated policy one step longer: the trainer takes its next step on
                # groups already buffered instead of waiting for the evaluation to end.
                p.pipeline.hold()
                evaluations.hold(step, row)
                continue
            await evaluations.settle(row, p.log)
            if p.pipeline.push_due(step):
                row.update(await p.engines.push_weights(p.trainers, step))
                p.pipeline.pushed(step)
            row["time/step_s"] = time.perf_counter() - started
            p.log(step, row)
            if p.checkpoint_due(step):
                await p.save(step)
    except BaseException:
        await evaluations.cancel()
        raise
    if step >= run.total_steps and not p.stop:
        p.log(step, await evaluations.run_due(step, final=True))
    return step


def _boundary(p: Parts, step: int) -> bool:
    """A step whose push never waits: it checkpoints, stops, ends the run or starts evaluations itself."""
    return p.checkpoint_due(step) or step >= p.run.total_steps or p.evaluations.due(step)


async def setup(run: RunConfig, stop: StopFlag) -> Parts:
    """Everything before the first step: data, the starting policy, Ray, trainer ranks and engines, the
    weight-sync group, the checkpoint resumed from, the pipeline and the logger. Whatever can refuse the start
    (output directory, data, sandbox, starting model, budgets) is checked before the run's config, metrics or
    checkpoints are written, so a refused start leaves them as they were."""
    timeline = StartupTimeline()
    run_dir = Path(run.output_dir) / run.name
    check_writable(run_dir)
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
        timeline.mark("Ray")
        stop.install()  # over the handler Ray's core worker installed
        inputs = await prepared
        timeline.mark("inputs")
        splits = inputs.splits
    except BaseException:
        prepared.cancel()
        if launch is not None:
            launch.close()
        raise
    run_dir.mkdir(parents=True, exist_ok=True)
    save_config(run, run_dir / "config.yaml")
    record_starting_model(run_dir, inputs.policy)
    check_cpu_slots(run, ray.cluster_resources().get("CPU", 0.0), local_engines=launch is not None)
    config = dataclasses.asdict(run)
    wandb_run = _in_daemon_thread(start_wandb, run.logging, run_dir, run.name, config)
    # The trainer's placement is reserved first (the node plan packs trainer ranks first); its ranks build their
    # models while the engines start, the two longest parts of start-up, side by side.
    trainers = TrainerGroup(run, config, wait=False)
    try:
        engines = EngineGroup(run, inputs.policy, run_dir, servers=launch.servers if launch is not None else None)
    except BaseException:
        if launch is not None:
            launch.close()
        _drop(wandb_run)
        raise
    rewards: RewardWorkers | None = None
    try:
        await asyncio.gather(
            timeline.timed(_engines_started(engines, run, inputs.policy), "engines"),
            timeline.timed(trainers.ready(), "trainer"),
        )
        if launch is not None and launch.servers:
            timeline.mark("engines launched", ago=time.monotonic() - min(s.started_at for s in launch.servers))

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
            await trainers.call("load_hf", str(inputs.policy))
        timeline.mark("weights")
        step = await trainers.call("version")
        await engines.connect_weight_sync(trainers)
        if checkpoint is not None or forked is not None:
            await engines.push_weights(trainers, step)
        timeline.mark("weight sync")

        # The reward workers' start (their imports, ~1 s of CPU) comes now, not beside the engines' and trainer's on
        # the start-up's busy cores: the first rewards are needed at the end of the first evaluation's generation.
        rewards = RewardWorkers(run.rewards, processes=run.rewards.processes)
        seed = run.seed + step
        session = sampling_session(run, inputs.encoding, engines.generate, rewards)
        pipeline = RolloutPipeline(session, run.algo, sampler, seed=seed, version=step)
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
        evaluations = Evaluations(run, run_dir, session, splits.val, inputs.downstream, clock, logger.path)
        print(timeline.line(), flush=True)
        return Parts(
            run, run_dir, splits, stop, trainers, engines, rewards, sampler, pipeline, evaluations, clock, logger,
            step, regenerated, splits.fingerprints(),
        )  # fmt: skip
    except BaseException:
        if rewards is not None:
            rewards.close()
        if launch is not None:
            launch.close()
        _drop(wandb_run)
        raise


async def _engines_started(engines: EngineGroup, run: RunConfig, policy: Path) -> None:
    """The engines' start. The driver checks the starting model's config.json and files without torch, not its
    tensors' shapes: an engine loading one whose config.json matches but a tensor is misshapen dies on a bare assertion
    in SGLang's loader. A failed start is then explained by the full check (torch imported only now), which names every
    tensor that differs; a start that failed for another reason keeps its own error."""
    try:
        await engines.start()
    except Exception as exc:
        from megatron_rl.convert.hf_import import verify_hf_checkpoint

        try:
            verify_hf_checkpoint(run.model, policy)
        except ValueError as mismatch:
            raise ConfigError(f"starting model: {mismatch}") from exc
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
