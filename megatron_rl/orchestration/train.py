"""The ScaleRL driver: `megatron-rl train --recipe scalerl --model llama3_8b [overrides]`.

The loop (SCALERL.md §4) reads as the algorithm:

    every eval.every_steps:  validation mean@k on the held-out prompts (+ live scaling-curve fit)
    groups  <- pipeline.next_batch(version)      G completions per prompt, rewarded, filtered, <= k stale
    metrics <- trainers.train_step(groups)       one optimizer step on all trainer ranks; version += 1
    push weights to the engines                  in flight (pipeline) or after k steps (ppo_off_policy)
    log one row (metrics JSONL + wandb + console), checkpoint every N steps and on SIGTERM/SIGUSR1

Generation never waits for the trainer in `pipeline` mode: the rollout producer runs on this event loop
while the trainer ranks (Ray actors) train and sync. Everything the run needs to continue after a
kill — trainer state, sampler and curriculum state, step, compute clock — is in the checkpoint; the
prompts of groups that were buffered or in flight are drawn again first on resume (counted in
`train/regenerated_groups`), and metrics rows logged after the checkpoint are dropped, so a run killed at
any point (SIGKILL included) and started again with the same command trains and logs every step once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import signal
import time
from pathlib import Path
from typing import Any

from megatron_rl.config import RunConfig, save_config
from megatron_rl.data.datasets import Splits, load_splits

POLICY_CACHE = Path.home() / ".cache" / "megatron_rl"


def prepare_policy(run: RunConfig, splits: Splits, cache: Path = POLICY_CACHE) -> Path:
    """The Hugging Face directory RL starts from: `model.hf_path`, or a tiny model built here and warmed up
    on the synthetic task's worked solutions (`trainer.warm_start_steps`)."""
    from megatron_rl.data.synthetic import SOLUTIONS
    from megatron_rl.data.tiny import build_tiny_model
    from megatron_rl.orchestration.warmstart import WarmupTask, warm_start

    if run.model.hf_path:
        path = Path(run.model.hf_path)
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"model.hf_path: {path} has no config.json")
        return path
    base = build_tiny_model(cache / f"{run.model.name}-seed{run.seed}", run.model, seed=run.seed)
    if run.trainer.warm_start_steps == 0:
        return base
    tasks = []
    for i, dataset in enumerate(run.data.datasets):
        name = dataset.source.removeprefix("synthetic:")
        if not dataset.source.startswith("synthetic:") or name not in SOLUTIONS:
            raise ValueError(
                f"trainer.warm_start_steps: the warm-up needs synthetic tasks with worked solutions "
                f"({sorted(SOLUTIONS)}); data.datasets[{i}].source is {dataset.source!r}"
            )
        tasks.append(WarmupTask(splits.train[dataset.key], SOLUTIONS[name], dataset.weight))
    names = "+".join(d.source.removeprefix("synthetic:") for d in run.data.datasets[1:])
    out = cache / f"{run.model.name}-seed{run.seed}-warm{run.trainer.warm_start_steps}{'-' + names if names else ''}"
    slip = run.trainer.warm_start_slip
    return warm_start(base, out, tasks, steps=run.trainer.warm_start_steps, seed=run.seed, slip=slip)


def _report_data(splits: Splits) -> None:
    """One line per dataset (training prompts, malformed rows skipped) and the validation prompts per task."""
    for key, stats in splits.stats.items():
        line = f"data: {key}: {len(splits.train[key])} training prompts"
        if stats.skipped:
            line += f", {stats.skipped} of {stats.rows} rows skipped (data.bad_rows=skip); first: {stats.errors[0]}"
        print(line, flush=True)
    print("data: validation " + ", ".join(f"{task} {len(p)}" for task, p in splits.val.items()), flush=True)


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


class StopFlag:
    """Set by SIGTERM / SIGUSR1 (Slurm's pre-timeout signal): checkpoint at the end of this step and exit.

    `ray.init` installs Ray's own SIGTERM handler in the driver (it ends the process at once), so `install`
    runs again once Ray is up."""

    def __init__(self, enabled: bool) -> None:
        self.signal: str | None = None
        self.enabled = enabled
        self.install()

    def install(self) -> None:
        if self.enabled:
            for sig in (signal.SIGTERM, signal.SIGUSR1):
                signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        self.signal = signal.Signals(signum).name

    def __bool__(self) -> bool:
        return self.signal is not None


def train(run: RunConfig) -> Path:
    """Run (or resume) a ScaleRL training run; returns the run directory. If this process is killed, even
    with SIGKILL, the processes it started are ended too (orchestration/reaper.py)."""
    import ray

    from megatron_rl.orchestration.reaper import Reaper

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


async def _train(run: RunConfig) -> Path:
    import ray
    from transformers import AutoTokenizer

    from megatron_rl.algo.filters import NoPositiveResampling
    from megatron_rl.data.sampler import CurriculumSampler
    from megatron_rl.metrics import ComputeClock, MetricsLogger, read_metrics
    from megatron_rl.orchestration.actors import TrainerDied, TrainerGroup
    from megatron_rl.orchestration.engines import EngineGroup
    from megatron_rl.rewards.workers import RewardWorkers
    from megatron_rl.rollout.interruption import InterruptionTokens
    from megatron_rl.rollout.pipeline import PromptEncoder, RolloutPipeline, validate
    from megatron_rl.trainer.checkpoint import latest_checkpoint

    run_dir = Path(run.output_dir) / run.name
    run_dir.mkdir(parents=True, exist_ok=True)
    save_config(run, run_dir / "config.yaml")
    stop = StopFlag(run.checkpoint.save_on_signal)

    splits = load_splits(run.data)
    _report_data(splits)
    if any(d.task == "code" for d in run.data.datasets):
        from megatron_rl.rewards.sandbox import get_sandbox

        get_sandbox(run.rewards.sandbox)  # no isolation for model-written code: stop now, not at the first reward
    policy = prepare_policy(run, splits)
    tokenizer = AutoTokenizer.from_pretrained(policy)
    encoder = PromptEncoder(tokenizer, run.data.system_prompt, run.data.chat_template)
    phrase = run.rollout.interruption.phrase
    tokens = InterruptionTokens(
        end_of_thinking=tokenizer.convert_tokens_to_ids(run.rollout.interruption.end_of_thinking),
        eos=tokenizer.eos_token_id,
        phrase=list(
            tokenizer(phrase if phrase.startswith(" ") else " " + phrase, add_special_tokens=False)["input_ids"]
        ),
    )
    run.check_row_budget(len(tokens.phrase))  # the longest row fits a micro-batch: stop now, not in a collective

    if not ray.is_initialized():
        # Off a cluster, always a fresh local instance ("local"): address=None would join any Ray head already
        # running on this machine (another run's, another user's) and fail on its auth token.
        address = "auto" if _ray_cluster() else "local"
        ray.init(address=address, include_dashboard=False, log_to_driver=True)
    stop.install()  # over Ray's handler
    trainers = TrainerGroup(run, dataclasses.asdict(run))
    engines = EngineGroup(run, policy, run_dir)
    await engines.start()

    sampler = CurriculumSampler(
        splits.train,
        {d.key: d.weight for d in run.data.datasets},
        run.seed,
        NoPositiveResampling(run.algo.no_positive_resampling),
    )
    checkpoint = latest_checkpoint(run_dir / "checkpoints") if run.checkpoint.resume == "auto" else None
    start_hours, regenerated = 0.0, 0
    if checkpoint is not None:
        state = await trainers.call("load", str(checkpoint))
        sampler.load_state_dict(state["sampler"])
        start_hours, regenerated = state["device_hours"], state.get("in_flight_groups", 0)
        print(f"resumed from {checkpoint} at step {state['step']}", flush=True)
    else:
        await trainers.call("load_hf", str(policy))
    step = await trainers.call("version")
    await engines.connect_weight_sync(trainers)
    if checkpoint is not None:
        await engines.push_weights(trainers, step)

    rewards = RewardWorkers(run.rewards, processes=run.rewards.processes)
    pipeline = RolloutPipeline(
        run.rollout, run.algo, sampler, rewards, engines.generate, encoder, tokens, seed=run.seed + step
    )
    pipeline.version = step
    devices = run.parallel.trainer_devices + (run.compute.generator_devices or engines.devices)
    clock = ComputeClock(devices, start_hours)
    header = {"name": run.name, "recipe": run.recipe, "model": run.model.name, "seed": run.seed}
    header.update(device_kind=run.compute.device_kind, devices=devices)
    header["data"] = {key: {"rows": st.rows, "skipped_rows": st.skipped} for key, st in splits.stats.items()}
    logger = MetricsLogger(run.logging, run_dir, header, dataclasses.asdict(run), resume_step=step)

    async def validation() -> dict[str, float]:
        result = await validate(
            splits.val,
            run.eval.samples_per_prompt,
            engines.generate,
            encoder,
            run.rollout,
            tokens,
            rewards,
            lambda: pipeline.version,
            seed=run.seed,
        )
        if run.logging.live_scaling_fit:
            rows = read_metrics(logger.path)
            fit_start = run.logging.scaling_fit_start
            result.update(_live_fit(rows, result, clock.device_hours, fit_start))
            if len(splits.val) > 1:
                for task in splits.val:
                    metric = f"val/pass_rate/{task}"
                    prediction = _live_fit(rows, result, clock.device_hours, fit_start, metric)
                    result.update({k.replace("scaling/", f"scaling/{task}/"): v for k, v in prediction.items()})
        return result

    if engines.balancer is not None:
        engines.balancer.reset_usage()  # generator idle share over the loop, not the start-up
    pipeline.start()
    validated, empty_batches, empty_streak = -1, 0, 0
    try:
        while step < run.total_steps and not stop:
            started = time.perf_counter()
            row: dict[str, Any] = {}
            if step % run.eval.every_steps == 0 and validated != step:
                row.update(await validation())
                validated = step
            groups, stats = await pipeline.next_batch(step)
            row.update(stats.as_metrics())
            if groups:
                row.update(await trainers.call("train_step", groups))
                empty_streak = 0
            else:  # every group was zero-variance: no optimizer step this round (logged, counted)
                empty_batches, empty_streak = empty_batches + 1, empty_streak + 1
            row["train/empty_batches"] = float(empty_batches)
            if run.algo.max_empty_batches and empty_streak >= run.algo.max_empty_batches:
                logger.log(step, {**row, "device_hours": clock.device_hours})
                raise EmptyBatches(step, empty_streak, stats.as_metrics())
            step = await trainers.call("version")
            if run.rollout.mode == "pipeline" or step % run.rollout.k == 0:
                row.update(await engines.push_weights(trainers, step))
                pipeline.version = step
                if run.rollout.mode == "ppo_off_policy":
                    pipeline.release_round()
            row.update({"time/step_s": time.perf_counter() - started, "train/regenerated_groups": regenerated})
            row.update(engines.metrics())
            row.update(rewards.metrics())
            row["device_hours"] = clock.device_hours
            logger.log(step, row)
            if step % run.checkpoint.every_steps == 0 or stop or step == run.total_steps:
                await _save(trainers, run, run_dir, step, sampler, clock, pipeline)
        if step >= run.total_steps and not stop:
            final = await validation()
            logger.log(step, {**final, "device_hours": clock.device_hours})
    except TrainerDied as exc:
        last = latest_checkpoint(run_dir / "checkpoints")
        where = f"the last complete checkpoint is {last}" if last else "no checkpoint was written yet"
        raise RunStopped(f"{exc}. The run stops; {where}: run the same command to resume.") from exc
    except EmptyBatches as exc:
        last = latest_checkpoint(run_dir / "checkpoints")
        where = f"the last complete checkpoint is {last}" if last else "no checkpoint was written yet"
        raise RunStopped(f"{exc}; {where}") from exc
    finally:
        await pipeline.close()
        rewards.close()
        logger.close()
        await engines.stop()
        trainers.shutdown()
    if stop:
        print(f"stopped by {stop.signal} at step {step}; checkpoint saved, resume with the same command", flush=True)
    else:
        _final_fit(logger.path, run_dir, set(splits.val), run.logging.scaling_fit_start)
    return run_dir


async def _save(
    trainers: Any, run: RunConfig, run_dir: Path, step: int, sampler: Any, clock: Any, pipeline: Any
) -> None:
    state = {
        "step": step,
        "sampler": sampler.state_dict(),
        "device_hours": clock.device_hours,
        "in_flight_groups": len(pipeline.buffer) + len(pipeline.tasks),
    }
    await trainers.call("save", str(run_dir / "checkpoints"), state, run.checkpoint.keep_last)


def _ray_cluster() -> bool:
    import os

    return bool(os.environ.get("RAY_ADDRESS"))


def _live_fit(
    rows: list[dict[str, Any]],
    latest: dict[str, float],
    device_hours: float,
    fit_start: float,
    metric: str = "val/pass_rate",
) -> dict[str, float]:
    """Predicted asymptote A (with its interval) from the validation points so far (scaling toolkit)."""
    from megatron_rl.scaling import live_prediction

    points = [r for r in rows if r.get(metric) is not None]
    points.append({"step": -1, "device_hours": device_hours, **latest})
    return live_prediction(points, fit_start=fit_start, metric=metric)


def _final_fit(metrics_path: Path, run_dir: Path, tasks: set[str], fit_start: float) -> None:
    """Print the fitted compute-performance curve of this run and write its plot."""
    from megatron_rl.scaling.cli import main as fit_main

    common = [str(metrics_path), "--fit-start", str(fit_start)]
    fit_main([*common, "--plot", str(run_dir / "scaling_curve.png")])
    if len(tasks) > 1:  # multi-task: one curve per task as well (SCALERL.md: math and code fitted separately)
        fit_main([*common, "--metric", "val/pass_rate/*", "--plot", str(run_dir / "scaling_curve_tasks.png")])
