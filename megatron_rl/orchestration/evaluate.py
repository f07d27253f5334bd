"""`megatron-rl eval`: downstream benchmarks of any checkpoint, and of the model a run started from.

    megatron-rl eval --checkpoint runs/scalerl-cpu --start                 the run's latest checkpoint and its
                                                                            starting model, with the gain
    megatron-rl eval --checkpoint runs/x/checkpoints/step_200 --benchmarks aime24,math500 --samples 16
    megatron-rl eval --checkpoint /models/Qwen3-8B --recipe scalerl --benchmarks aime24 --json aime.json

--checkpoint takes a Hugging Face directory (config.json and its tokenizer), a run directory (its latest
checkpoint), or a checkpoint step directory; a megatron checkpoint is exported to Hugging Face first
(convert/hf_export.py), into the output directory. The engines are the run's (SGLang; on CPU here, on GPUs
with the run's engine layout), sampling and budgets are the run's rollout settings unless --temperature /
--top-p say otherwise, and every completion is scored by the run's rewards: the numbers are those that
`eval.downstream` logs during training. Inside a run, its resolved config.yaml is used (--recipe/--model
only for a bare Hugging Face directory); dotted overrides apply on top.

Prints a table per model (problems evaluated and skipped as longer than rollout.max_prompt_tokens, mean@n and
pass@k with standard errors, `n/a` where no problem was left; with --start also the gain, its standard error paired
over problems) and writes everything, with the sampling settings, to --json (default <out>/results.json; null
where the table says n/a).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_rl.config import (
    ConfigError,
    RunConfig,
    apply_overrides,
    build,
    load_config,
    load_resolved,
)
from megatron_rl.data.datasets import DatasetError
from megatron_rl.rollout.evaluation import BenchmarkResult, mean_and_se


class EvalError(RuntimeError):
    """What to evaluate cannot be evaluated as given; the message names the path and what is missing."""


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="megatron-rl eval",
        description="Downstream benchmarks (AIME, MATH-500, LiveCodeBench, ...) of a checkpoint.",
        epilog=__doc__.split("\n", 2)[2],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--checkpoint", required=True, help="HF directory, run directory or checkpoint step dir")
    parser.add_argument("--start", action="store_true", help="also evaluate the run's starting model: the gain")
    parser.add_argument(
        "--benchmarks", help="comma-separated: aime24,aime25,math500,livecodebench,synthetic_large (NAME=PATH: local)"
    )
    parser.add_argument("--samples", type=int, help="samples per problem, n (default eval.downstream's)")
    parser.add_argument("--temperature", type=float, help="default: the run's rollout.sampling")
    parser.add_argument("--top-p", type=float, help="default: the run's rollout.sampling")
    parser.add_argument("--limit", type=int, help="at most this many problems per benchmark")
    parser.add_argument("--seed", type=int, help="sampling seed (default: the run's)")
    parser.add_argument("--out", help="output directory (default: <run>/eval, or ./eval for an HF directory)")
    parser.add_argument("--json", help="results file (default: <out>/results.json)")
    parser.add_argument("--recipe", default="scalerl", help="for an HF directory outside a run: the run settings")
    parser.add_argument("--model", help="for an HF directory outside a run: the model config")
    parser.add_argument("overrides", nargs="*", metavar="section.field=value", help="dotted config overrides")
    return parser


@dataclass
class Target:
    label: str
    """'start' or 'checkpoint'."""
    path: Path
    """An HF directory, or a megatron checkpoint step directory to export first."""
    megatron: bool = False


def find_run_dir(path: Path) -> Path | None:
    """The run directory `path` is or is inside (a checkpoint step directory or the checkpoints root)."""
    for candidate in (path, path.parent, path.parent.parent):
        if (candidate / "config.yaml").is_file() and (candidate / "checkpoints").exists():
            return candidate
    return None


def resolve(args: argparse.Namespace) -> tuple[RunConfig, list[Target], Path]:
    """The run settings, what to evaluate, and the output directory."""
    from megatron_rl.trainer.checkpoint import latest_checkpoint, starting_model

    path = Path(args.checkpoint)
    if not path.exists():
        raise EvalError(f"--checkpoint {path}: no such directory")
    overrides = list(args.overrides)
    if args.benchmarks:
        names = [b.strip() for b in args.benchmarks.split(",") if b.strip()]
        overrides.append(f"eval.downstream.benchmarks=[{','.join(names)}]")
    for flag, field in (("samples", "samples_per_prompt"), ("temperature", "temperature"), ("top_p", "top_p")):
        if getattr(args, flag) is not None:
            overrides.append(f"eval.downstream.{field}={getattr(args, flag)}")
    if args.seed is not None:
        overrides.append(f"seed={args.seed}")
    overrides.append("algo.routing_replay=none")  # an evaluation needs no routing records
    run_dir = find_run_dir(path)
    if (path / "config.json").is_file():  # a Hugging Face directory
        run = load_config(args.recipe, args.model, overrides) if run_dir is None else _run_config(run_dir, overrides)
        targets = [Target("checkpoint", path)]
        if args.start:
            raise EvalError(
                f"--start: {path} is a Hugging Face directory, not a run's checkpoint; evaluate the starting model "
                "by giving its directory to --checkpoint"
            )
    else:
        if run_dir is None:
            raise EvalError(
                f"--checkpoint {path}: neither a Hugging Face directory (config.json) nor a run directory or "
                "checkpoint inside one (config.yaml beside checkpoints/)"
            )
        run = _run_config(run_dir, overrides)
        checkpoint = path if path.name.startswith("step_") else latest_checkpoint(run_dir / "checkpoints")
        targets = []
        if args.start:
            start = starting_model(run_dir / "checkpoints" / "latest")
            if start is None:
                raise EvalError(f"--start: {run_dir} does not record its starting model, or it is gone")
            targets.append(Target("start", start))
        if checkpoint is None:
            if not targets:
                raise EvalError(f"--checkpoint {path}: the run has no checkpoint yet (--start evaluates its start)")
        else:
            targets.append(Target("checkpoint", checkpoint, megatron=True))
    if args.limit is not None:
        benchmarks = [dataclasses.replace(b, limit=args.limit) for b in run.eval.downstream.benchmarks]
        run.eval.downstream.benchmarks = benchmarks
    if not run.eval.downstream.benchmarks:
        raise EvalError("no benchmarks: give --benchmarks (e.g. aime24,math500) or set eval.downstream.benchmarks")
    out = Path(args.out) if args.out else (run_dir / "eval" if run_dir else Path("eval"))
    return run, targets, out


def _run_config(run_dir: Path, overrides: list[str]) -> RunConfig:
    import yaml

    data = yaml.safe_load((run_dir / "config.yaml").read_text())
    if overrides:
        data = apply_overrides(data, overrides)
    return build(RunConfig, data) if overrides else load_resolved(run_dir / "config.yaml")  # type: ignore[no-any-return]


def check_tokenizer(hf_dir: Path) -> None:
    if not any((hf_dir / name).is_file() for name in TOKENIZER_FILES):
        raise EvalError(
            f"{hf_dir}: no tokenizer ({', '.join(TOKENIZER_FILES)} missing): copy the tokenizer files of the model "
            "it was trained from into it (a megatron checkpoint is exported with its run's starting-model tokenizer; "
            "`megatron-rl convert --to-hf CKPT --out DIR --hf-source BASE` names another)"
        )


def export(target: Target, out: Path) -> Path:
    """The HF directory of a target, exporting a megatron checkpoint into `out` (once per step)."""
    if not target.megatron:
        return target.path
    from megatron_rl.convert import export_hf

    hf_dir = out / f"hf_{target.path.name}"
    if (hf_dir / "config.json").is_file():
        return hf_dir
    print(f"eval: exporting {target.path} to {hf_dir}", flush=True)
    return Path(export_hf(target.path, hf_dir, progress=False))


async def evaluate_model(run: RunConfig, hf_dir: Path, out: Path, sets: dict[str, Any]) -> dict[str, BenchmarkResult]:
    """Start the run's engines on `hf_dir` (on CPU off a cluster: the driver's own processes, as a run's are),
    evaluate every benchmark through the run's sampling session, stop them."""
    from transformers import AutoTokenizer

    from megatron_rl.orchestration.engines import EngineGroup, LocalLaunch, local_engines
    from megatron_rl.orchestration.inputs import prompt_encoding, sampling_session
    from megatron_rl.rewards.workers import RewardWorkers
    from megatron_rl.rollout.evaluation import evaluate_benchmarks

    run.check_context(hf_dir)
    encoding = prompt_encoding(run, AutoTokenizer.from_pretrained(hf_dir))
    config = run.eval.downstream
    launch = LocalLaunch(run, out) if local_engines(run) else None
    rewards: RewardWorkers | None = None
    try:
        if launch is not None:
            launch.start(hf_dir)
        engines = EngineGroup(run, hf_dir, out, servers=launch.servers if launch is not None else None)
    except BaseException:
        if launch is not None:
            launch.close()
        raise
    try:
        rewards = RewardWorkers(run.rewards, processes=run.rewards.processes)
        await engines.start()
        session = sampling_session(run, encoding, engines.generate, rewards)
        return await evaluate_benchmarks(
            {name: bench.prompts for name, bench in sets.items()},
            config.samples_per_prompt,
            session.with_sampling(config.sampling(run.rollout.sampling)),
            seed=run.seed,
        )
    finally:
        if rewards is not None:
            rewards.close()
        await engines.stop()


def gain(start: BenchmarkResult, end: BenchmarkResult) -> tuple[float, float] | None:
    """mean@n of `end` minus `start`, with its standard error paired over the problems both evaluated; None (n/a)
    when they evaluated none in common (every problem skipped as too long)."""
    common = [pid for pid in end.passed if pid in start.passed]
    diffs = [(end.passed[pid] - start.passed[pid]) / end.samples for pid in common]
    return mean_and_se(diffs) if diffs else None


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        run, targets, out = resolve(args)
        from megatron_rl.orchestration.inputs import load_downstream

        sets = load_downstream(run)
        for target in targets:
            if not target.megatron:
                check_tokenizer(target.path)
        results = _run(run, targets, out, sets)
    except ConfigError as exc:
        print(f"megatron-rl eval: config error: {exc}", file=sys.stderr)
        return 2
    except DatasetError as exc:
        print(f"megatron-rl eval: data error: {exc}", file=sys.stderr)
        return 3
    except EvalError as exc:
        print(f"megatron-rl eval: {exc}", file=sys.stderr)
        return 2
    _report(run, targets, results, out, args.json)
    return 0


def _run(
    run: RunConfig, targets: list[Target], out: Path, sets: dict[str, Any]
) -> dict[str, tuple[Path, dict[str, BenchmarkResult]]]:
    import ray

    from megatron_rl.orchestration.ray_head import start_ray
    from megatron_rl.orchestration.reaper import Reaper

    out.mkdir(parents=True, exist_ok=True)
    reaper = Reaper.start()
    started_ray = not ray.is_initialized()
    try:
        start_ray(run, keep_sigterm=False)  # the allocation's Ray, or a fresh local head as `train` starts one
        results = {}
        for target in targets:
            hf_dir = export(target, out)
            check_tokenizer(hf_dir)
            print(f"eval: {target.label}: {hf_dir}", flush=True)
            results[target.label] = (hf_dir, asyncio.run(evaluate_model(run, hf_dir, out, sets)))
        return results
    finally:
        if started_ray and ray.is_initialized():
            ray.shutdown()
        reaper.stop(leftovers_grace_s=10.0)


def _report(
    run: RunConfig,
    targets: list[Target],
    results: dict[str, tuple[Path, dict[str, BenchmarkResult]]],
    out: Path,
    json_path: str | None,
) -> None:
    from megatron_rl.rollout.evaluation import format_table, sampling_record

    config = run.eval.downstream
    settings = sampling_record(run.rollout, config.sampling(run.rollout.sampling), config.samples_per_prompt)
    payload: dict[str, Any] = {"sampling": settings, "seed": run.seed, "models": {}}
    for target in targets:
        hf_dir, by_bench = results[target.label]
        print(format_table(by_bench, f"{target.label}: {target.path}"))
        print()
        payload["models"][target.label] = {
            "path": str(target.path),
            "hf_dir": str(hf_dir),
            "results": {name: r.as_dict() for name, r in by_bench.items()},
        }
    if "start" in results and "checkpoint" in results:
        payload["gain"] = {}
        print("gain (checkpoint - start), mean@n, standard error paired over problems:")
        for name, end in results["checkpoint"][1].items():
            paired = gain(results["start"][1][name], end)
            if paired is None:
                payload["gain"][name] = {"mean": None, "se": None}
                print(f"  {name}: n/a (no problem evaluated in both)")
                continue
            payload["gain"][name] = {"mean": paired[0], "se": paired[1]}
            print(f"  {name}: {paired[0]:+.3f} ± {paired[1]:.3f}")
    text = ", ".join(f"{k} {v}" for k, v in settings.items())
    print(f"sampling: {text}")
    path = Path(json_path) if json_path else out / "results.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2))
    print(f"wrote {path}")
