"""`megatron-rl`: the command line.

    megatron-rl recipes                              list the recipes and what each changes
    megatron-rl check --recipe R [--model M] [k=v]   resolve and validate a run config, print the plan
    megatron-rl plan --recipe R [--model M] [--allocation NxG] [k=v]
                                                     memory per trainer GPU and engine (refuses what won't fit)
                                                     and GPU-hours per step; --sweep KEY=V1,V2 --budget H: steps
                                                     of each at equal compute; --calibrate RUN: vs a real run
    megatron-rl node-check --recipe R [--model M] [--gpus N] [k=v]
                                                     this GPU node's driver and GPUs against the run
    megatron-rl train --recipe R [--model M] [k=v]   run (or resume) a ScaleRL training run
                      [--fork RUN]                   a new run from the weights of RUN's latest checkpoint
    megatron-rl fit RUNS.jsonl ... [options]         fit / predict / compare scaling curves
    megatron-rl sweep SWEEP.yaml [--dir DIR]         a grid of runs, fitted live, losers stopped (docs/sweeps.md)
    megatron-rl eval --checkpoint DIR [--start] [--benchmarks aime24,math500,...]
                                                     downstream benchmarks of a checkpoint (and its start)
    megatron-rl convert --from-hf | --to-hf ...      Hugging Face <-> Megatron checkpoints

Each subcommand imports what it needs when it runs, so `--help` and config checks stay fast and never
import torch, Megatron, SGLang or Ray.
"""

from __future__ import annotations

import argparse
import errno
import importlib
import os
import shlex
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from megatron_rl.config import ConfigError, list_model_configs, list_recipes, load_config, load_recipe_dict


def _add_run_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--recipe", default="scalerl", help=f"recipe name or YAML path; one of {list_recipes()}")
    parser.add_argument("--model", default=None, help=f"model config name or YAML path; one of {list_model_configs()}")
    parser.add_argument("overrides", nargs="*", metavar="section.field=value", help="dotted config overrides")


def _cmd_recipes(args: argparse.Namespace) -> int:
    import yaml

    from megatron_rl.config import RECIPES_DIR

    for name in list_recipes():
        text = (RECIPES_DIR / f"{name}.yaml").read_text()
        description = " ".join(str(yaml.safe_load(text).get("description", "")).split())
        print(f"{name:15s} {description}")
    return 0


def _cmd_check(args: argparse.Namespace) -> int:
    config = load_config(args.recipe, args.model, args.overrides)
    load_recipe_dict(args.recipe)  # surface recipe-file errors before printing anything
    p, r = config.parallel, config.rollout
    print(
        f"recipe {config.recipe}, model {config.model.name} ({config.model.family}"
        f"{', MoE ' + str(config.model.moe.num_experts) + ' experts' if config.model.is_moe else ', dense'})"
    )
    print(
        f"trainer: {p.trainer_devices} devices = TP {p.tp} x {f'CP {p.cp} x ' if p.cp > 1 else ''}PP {p.pp} "
        f"x DP {p.dp} (EP {p.ep}); "
        f"loss {config.algo.loss}, aggregation {config.algo.aggregation}, advantages {config.algo.advantage_norm}"
    )
    print(
        f"generators: {r.engine.num_engines} x SGLang TP {r.engine.tp}; {r.mode} k={r.k}; batch "
        f"{r.prompts_per_step} prompts x {r.generations_per_prompt} = {r.completions_per_step} completions"
    )
    if args.allocation:
        check_memory(config, check_allocation(config, args.allocation))
    if config.model.hf_path:
        check_checkpoint(config)
    config.check_starting_model()
    config.check_engine_attention()
    if args.write:
        from megatron_rl.config import save_config

        path = config.run_dir / "config.yaml"
        save_config(config, path)
        print(f"wrote {path}")
    return 0


def check_checkpoint(config: Any) -> None:
    """The starting model (`model.hf_path`) against the model config, before anything starts: architecture, the
    dimensions the config fixes, and every weight file and tensor shape from the safetensors headers (torch is
    imported here, for the model family's tensor names; nothing is loaded)."""
    from megatron_rl.convert.hf_import import verify_hf_checkpoint

    try:
        index = verify_hf_checkpoint(config.model, config.model.hf_path)
    except ValueError as exc:
        raise ConfigError(f"model.hf_path: {exc}") from None
    print(
        f"starting model: {config.model.hf_path}: {len(index.names)} tensors in {len(index.files)} file(s), "
        f"{index.nbytes / 1e9:.2f} GB, matching {config.model.name}"
    )


def check_allocation(config: Any, allocation: str) -> int | None:
    """Fail before anything starts when the recipe's GPU split does not fit `NODESxGPUS_PER_NODE`, or when the
    allocation holds whole nodes the run leaves idle (a Slurm job should not reserve GPUs nobody uses).

    Nodes are counted as Ray places the run (orchestration/placement.py): the trainer's ranks fill nodes in
    rank order, each engine sits inside one node, engines may use what the trainer's last node leaves. Returns the
    GPUs per node of a GPU run (the plan counts host memory per node with them), None for a CPU run."""
    try:
        nodes, per_node = (int(x) for x in allocation.lower().split("x"))
    except ValueError:
        raise ConfigError(f"--allocation: expected NODESxGPUS_PER_NODE (e.g. 10x8), got {allocation!r}") from None
    if nodes < 1:
        raise ConfigError(f"--allocation {allocation}: {nodes} nodes; an allocation has at least 1 node")
    engine, parallel = config.rollout.engine, config.parallel
    if engine.device == "cpu" and config.compute.device_kind == "cpu_core":
        print(f"allocation: {nodes} node(s); CPU run (trainer ranks and engines on cores)")
        return None
    if per_node < 1:
        raise ConfigError(
            f"--allocation {allocation}: {per_node} GPUs per node; this GPU run needs at least 1 (Slurm: "
            "sbatch --gpus-per-node=N sets SLURM_GPUS_ON_NODE; slurm/bootstrap.sh also reads GPUS_PER_NODE)"
        )
    from megatron_rl.orchestration.placement import node_plan

    try:
        plan = node_plan(config, nodes, per_node, where="allocation")
    except ValueError as exc:
        raise ConfigError(f"allocation: {exc}") from None
    trainer, generators, total = plan.trainer_gpus, plan.generator_gpus, nodes * per_node
    if plan.nodes < nodes:
        raise ConfigError(
            f"allocation: {nodes} x {per_node} = {total} GPUs is larger than the run needs: {trainer} trainer + "
            f"{generators} generator GPUs fit {plan.nodes} node(s) of {per_node}, so {nodes - plan.nodes} node(s) "
            f"({(nodes - plan.nodes) * per_node} GPUs) would sit idle; allocate {plan.nodes} node(s) or give the run "
            "the GPUs (parallel.trainer_devices, rollout.engine.num_engines)"
        )
    print(
        f"allocation: {nodes} x {per_node} GPUs = {total}: {trainer} train (TP {parallel.tp} x "
        f"{f'CP {parallel.cp} x ' if parallel.cp > 1 else ''}PP {parallel.pp} x DP {parallel.dp}, EP {parallel.ep}) "
        f"+ {generators} generate ({plan.engines} x TP {engine.tp}), {total - trainer - generators} idle"
    )
    return per_node


def check_memory(config: Any, gpus_per_node: int | None = None) -> None:
    """The memory plan of a GPU run (megatron_rl/plan.py): print it, refuse one that does not fit; then the trainer
    built as a GPU node builds it (Transformer Engine's spec, the node's kernel switches: `gpu_build_check`).
    `gpus_per_node`: the allocation's, for the host memory of a node's trainer ranks (default 8)."""
    if config.compute.device_kind != "gpu":
        return
    from megatron_rl.plan import format_plan, gpu_build_check, make_plan

    plan = make_plan(config, gpus_per_node=gpus_per_node)
    print(format_plan(plan))
    if not plan.fits:
        raise ConfigError("memory plan: " + "; ".join(plan.problems))
    build = gpu_build_check(config, plan)
    print(f"GPU build: {build.summary}")
    if build.problems:
        raise ConfigError("GPU build: " + "; ".join(build.problems))


def _cmd_plan(args: argparse.Namespace) -> int:
    if args.calibrate:
        return _calibrate(args)
    config = load_config(args.recipe, args.model, args.overrides)
    gpus_per_node = check_allocation(config, args.allocation) if args.allocation else None
    if config.compute.device_kind != "gpu":
        print(
            f"memory plan: {config.recipe} runs on CPU cores (compute.device_kind={config.compute.device_kind}); "
            "the plan sizes GPU memory and GPU-hours, so there is nothing to plan. Plan a GPU recipe, e.g. "
            "--recipe scalerl"
        )
        return 0
    if args.sweep:
        return _sweep(args)
    check_memory(config, gpus_per_node)
    from megatron_rl.scaling.cost import format_cost, step_cost

    print(format_cost(step_cost(config, args.gpu, response_tokens=args.response_tokens)))
    return 0


def _sweep(args: argparse.Namespace) -> int:
    """Each value of one config key at equal compute: its cost per step, the steps the budget buys, the command."""
    from megatron_rl.scaling.cost import step_cost, steps_at

    key, sep, values = args.sweep.partition("=")
    choices = [v for v in values.split(",") if v]
    if not sep or not choices:
        raise ConfigError(f"--sweep: expected KEY=V1,V2,... (e.g. rollout.prompts_per_step=24,48), got {args.sweep!r}")
    if args.budget is None or args.budget <= 0:
        raise ConfigError("--sweep needs --budget GPU_HOURS > 0: the compute each configuration gets")
    rows = []
    for value in choices:
        config = load_config(args.recipe, args.model, [*args.overrides, f"{key}={value}"])
        cost = step_cost(config, args.gpu, response_tokens=args.response_tokens)
        steps = steps_at(args.budget, cost)
        command = ["megatron-rl", "train", "--recipe", args.recipe, *(["--model", args.model] if args.model else [])]
        command += [*args.overrides, f"{key}={value}", f"total_steps={steps}", f"name={config.name}-{value}"]
        rows.append((value, cost, steps, shlex.join(command)))
    print(f"sweep of {key} at {args.budget:,.0f} GPU-hours each ({args.gpu}; cost model, --calibrate RUN checks it)")
    for value, cost, steps, _ in rows:
        per_step = f"{cost.gpu_hours_per_step:,.3f} GPU-hours/step ({cost.step_s:,.0f} s on {cost.gpus} GPUs"
        print(f"  {key}={value}: {per_step}, {cost.bound}-bound) -> {steps:,} steps")
    print("commands:")
    for *_, command in rows:
        print(f"  {command}")
    return 0


def _calibrate(args: argparse.Namespace) -> int:
    """The cost model against a run's own measured GPU-hours per step."""
    from pathlib import Path

    from megatron_rl.config import load_resolved
    from megatron_rl.scaling.cost import calibrate, format_calibration

    run_dir = Path(args.calibrate)
    if not (run_dir / "config.yaml").is_file() or not (run_dir / "metrics.jsonl").is_file():
        raise ConfigError(f"--calibrate {run_dir}: a run directory needs config.yaml and metrics.jsonl")
    config = load_resolved(run_dir / "config.yaml")
    if config.compute.device_kind != "gpu":
        raise ConfigError(
            f"--calibrate {run_dir}: a {config.compute.device_kind} run; the cost model has figures for GPUs only "
            "(its device-hours are core-hours)"
        )
    print(format_calibration(calibrate(config, run_dir / "metrics.jsonl", args.gpu)))
    return 0


def _cmd_node_check(args: argparse.Namespace) -> int:
    config = load_config(args.recipe, args.model, args.overrides)
    from megatron_rl.orchestration.node_check import check_node

    print(check_node(config, args.gpus), flush=True)
    return 0


EXIT_CODES = {"config": 2, "data": 3, "filesystem": 4, "sandbox": 5, "checkpoint": 6, "stopped": 1}
"""How `megatron-rl train` ends when it refuses or stops, one line on stderr each: `megatron-rl: <kind> error: ...`.
A stop signal during start-up ends it with 128 + the signal's number (143 for SIGTERM), as a shell reports a
process that signal ended, after one line `megatron-rl: stopped by SIGTERM during start-up ...`."""


def _cmd_train(args: argparse.Namespace) -> int:
    fork = [f"checkpoint.fork_from={args.fork}"] if args.fork else []
    config = load_config(args.recipe, args.model, [*args.overrides, *fork])
    config.check_starting_model()
    from megatron_rl.data.datasets import DatasetError
    from megatron_rl.orchestration.train import RunStopped, StartStopped, train
    from megatron_rl.rewards.sandbox import SandboxUnavailable
    from megatron_rl.trainer.checkpoint import CheckpointError

    refusals: list[tuple[type[BaseException], str]] = [
        (DatasetError, "data"),
        (SandboxUnavailable, "sandbox"),
        (CheckpointError, "checkpoint"),
        (RunStopped, "stopped"),
    ]
    try:
        run_dir = train(config)
    except StartStopped as exc:
        print(f"megatron-rl: {_one_line(exc)}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        # Everything the start launched is shut down, but the thread that prepares its inputs may still be in
        # torch (a first run's warm-up): at interpreter shutdown a daemon thread in torch code aborts the process.
        os._exit(128 + exc.signum)
    except tuple(kind for kind, _ in refusals) as exc:
        name = next(label for kind, label in refusals if isinstance(exc, kind))
        prefix = "" if name == "stopped" else f"{name} error: "
        print(f"megatron-rl: {prefix}{_one_line(exc)}", file=sys.stderr)
        return EXIT_CODES[name]
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        where = f" writing {exc.filename or Path(config.output_dir) / config.name}"
        print(
            f"megatron-rl: filesystem error: {os.strerror(exc.errno)}{where}; free space or move output_dir, then run "
            "the same command to resume from the last complete checkpoint",
            file=sys.stderr,
        )
        return EXIT_CODES["filesystem"]
    print(f"run directory: {run_dir}")
    return 0


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())


def _delegate(module: str) -> Callable[[list[str]], int]:
    """A subcommand whose parser lives with its package (`module.main(argv) -> int`)."""

    def run(argv: list[str]) -> int:
        return int(importlib.import_module(module).main(argv) or 0)

    return run


DELEGATED: dict[str, tuple[str, str]] = {
    "fit": ("megatron_rl.scaling.cli", "fit, predict and compare sigmoidal compute-performance curves"),
    "sweep": ("megatron_rl.scaling.sweep_cli", "launch a grid of runs, fit each live, stop the ones that will lose"),
    "convert": ("megatron_rl.convert.cli", "convert checkpoints between Hugging Face and Megatron"),
    "eval": ("megatron_rl.orchestration.evaluate", "downstream benchmarks (AIME, MATH-500, ...) of a checkpoint"),
}


def _available(module: str) -> bool:
    """Whether `module` (a megatron_rl submodule) is installed, looked up as a file: `find_spec` would import its
    parent packages, whose `__init__` imports torch and SciPy (~2 s on every command, `train` included)."""
    path = Path(__file__).parent.joinpath(*module.split(".")[1:])
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megatron-rl", description="ScaleRL on Megatron-Core and SGLang.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    sub.add_parser("recipes", help="list the recipes").set_defaults(func=_cmd_recipes)
    check = sub.add_parser("check", help="resolve and validate a run config and print the plan")
    _add_run_args(check)
    check.add_argument("--write", action="store_true", help="write the resolved config into the run directory")
    check.add_argument("--allocation", help="NODESxGPUS_PER_NODE: check the GPU split fits (Slurm launch)")
    check.set_defaults(func=_cmd_check)
    plan = sub.add_parser("plan", help="memory per trainer GPU and engine against the device; refuse what won't fit")
    _add_run_args(plan)
    plan.add_argument("--allocation", help="NODESxGPUS_PER_NODE: also check the GPU split against it")
    plan.add_argument("--gpu", default="h100", choices=("h100", "h200", "a100", "b200"), help="for the cost per step")
    plan.add_argument("--response-tokens", type=float, help="expected tokens per completion (default: from budgets)")
    plan.add_argument("--sweep", metavar="KEY=V1,V2", help="cost and steps of each value at equal compute (--budget)")
    plan.add_argument("--budget", type=float, metavar="GPU_HOURS", help="compute per configuration of a --sweep")
    plan.add_argument("--calibrate", metavar="RUN_DIR", help="the cost model against a run's measured cost per step")
    plan.set_defaults(func=_cmd_plan)
    node = sub.add_parser("node-check", help="this GPU node's driver and GPUs against the run (Slurm bootstrap)")
    _add_run_args(node)
    node.add_argument("--gpus", type=int, help="GPUs the allocation gives each node")
    node.set_defaults(func=_cmd_node_check)
    run = sub.add_parser("train", help="run (or resume) a ScaleRL training run")
    _add_run_args(run)
    run.add_argument(
        "--fork",
        default=None,
        metavar="RUN",
        help="start this new run (name=...) from the latest checkpoint's weights of RUN (a run directory or a "
        "checkpoint): fresh optimizer, data order and step count; the model must be the same",
    )
    run.set_defaults(func=_cmd_train)
    for name, (module, help_text) in DELEGATED.items():
        if _available(module):
            sub.add_parser(name, help=help_text, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in DELEGATED and _available(DELEGATED[argv[0]][0]):
        return _delegate(DELEGATED[argv[0]][0])(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ConfigError as exc:
        print(f"megatron-rl: config error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
