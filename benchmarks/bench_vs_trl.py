"""The default run against TRL's GRPOTrainer at its fastest settings, side by side: alternating runs on one machine.

    pip install trl==1.16.0 accelerate                  # the peer; not a dependency of megatron_rl
    python benchmarks/bench_vs_trl.py [--runs 3] [--steps 200] [--json vs_trl.json] [overrides ...]

Each round runs `megatron-rl train --recipe scalerl-cpu` as shipped (PipelineRL-2, validation of 256 prompts x 4
every 10 steps, downstream evaluation every 50, checkpoints every 20, one trainer thread and one SGLang engine
as the recipe runs them) and `benchmarks/bench_trl.py` (TRL 1.16 at the settings that file measured fastest: 2
threads, no gradient checkpointing, the same policy, prompts, reward, batch, optimizer, budgets and validation), in turn
stack first then TRL, then TRL first, and so on, so a machine slowing down over the hour hurts both alike.

What each run reports, measured the same way for both:

- start-up: from the process's launch to the start of its loop (the stack: the moment its run clock starts,
  before the step-0 validation; TRL: the first training step's start, before its step-0 validation), on a warm
  page cache: each timed run follows an untimed 2-step run of the same system (without it, the run after the
  other system's starts on files that run pushed out of a small page cache; `--cold` measures that);
- steps/min over the loop, every validation, checkpoint and evaluation included;
- wall seconds from the loop's start to the first validation at or above each target;
- peak memory: the largest sum over the run's processes (the launched process and all its descendants), as
  resident set size (RSS: shared library pages counted in every process, sampled every `--sample-s`) and as
  proportional set size (PSS: each shared page split between the processes sharing it, so the sum is the
  physical memory the run holds, what a laptop's memory monitor shows; sampled every `--pss-s`). A process's
  PSS is read by the kernel walking its page tables (/proc/PID/smaps_rollup, 5-20 ms of CPU for each of the
  stack's processes): read every 0.5 s, the sampler took 11-14 CPU-s of a 100 s run, ~6% of a 2-core machine,
  from the run it measured; every 2 s, 3.8 CPU-s, with the same peak (2.17-2.19 GB against 2.18 GB);
- for the stack, validation seconds per 1,000 completions (the time of a validation's step and of the next one,
  which the trainer may take while the engines validate, over two median steps without one) beside the training
  generation's (the engine's busy seconds per 1,000 training completions).

Prints one table row per run and the medians per system; `--json` keeps everything.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).parent))
from bench_loop import freeze_policy, reach, summarize  # noqa: E402

RECIPE = "scalerl-cpu"
TARGETS = (0.6, 0.7, 0.75, 0.8)


def measure(command: list[str], env: dict[str, str], log: Path, sample_s: float, pss_s: float) -> dict[str, Any]:
    """Run `command`; its wall time, the launch time, stdout lines with their times, and peak RSS/PSS sums (RSS
    every `sample_s` seconds, PSS every `pss_s`: the module docstring says why not as often)."""
    launched = time.time()
    lines: list[tuple[float, str]] = []
    peak: dict[str, Any] = {"rss": 0, "pss": 0, "processes": 0}
    with log.open("w") as out:
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)

        def read() -> None:
            assert process.stdout is not None
            for line in process.stdout:
                lines.append((time.time() - launched, line))
                out.write(line)

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        root = psutil.Process(process.pid)
        loads, pss_read = [], 0.0
        while process.poll() is None:
            rss = pss = count = 0
            try:
                tree = [root, *root.children(recursive=True)]
            except psutil.NoSuchProcess:
                break
            full = time.monotonic() - pss_read >= pss_s
            for proc in tree:
                try:
                    info = proc.memory_full_info() if full else proc.memory_info()
                except psutil.Error:  # ended between the listing and the read
                    continue
                rss, pss, count = rss + info.rss, pss + (info.pss if full else 0), count + 1
            if rss > peak["rss"]:
                peak.update(rss=rss, processes=count)
            if full:
                peak["pss"], pss_read = max(peak["pss"], pss), time.monotonic()
            loads.append(os.getloadavg()[0])
            time.sleep(sample_s)
        reader.join()
    if process.returncode != 0:
        tail = "".join(line for _, line in lines[-30:])
        raise RuntimeError(f"{' '.join(command[:4])} ... exited with {process.returncode}; log {log}:\n{tail}")
    return {
        "process_s": time.time() - launched,
        "lines": lines,
        "peak_rss_gb": peak["rss"] / 1e9,
        "peak_pss_gb": peak["pss"] / 1e9,
        "processes": peak["processes"],
        "load": statistics.mean(loads) if loads else float("nan"),
    }


WARM_UP_STEPS = 2
"""Steps of the untimed run of a system just before its timed one (`--cold`: none)."""


def stack_command(name: str, steps: int, args: argparse.Namespace, policy: Path) -> tuple[list[str], dict[str, str]]:
    cli = Path(sys.executable).with_name("megatron-rl")
    overrides = [
        f"output_dir={args.output_dir}",
        f"name={name}",
        f"model.hf_path={policy}",
        f"total_steps={steps}",
    ]
    command = [str(cli), "train", "--recipe", RECIPE, *overrides, "checkpoint.resume=never", *args.overrides]
    # The command as the README gives it: no OMP_NUM_THREADS (each process of the run sets its own threads).
    env = {**{k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}, "WANDB_MODE": "offline"}
    return command, env


def warm_up(system: str, args: argparse.Namespace, policy: Path) -> None:
    """A short untimed run of `system`, so that its timed run starts on a warm page cache: the files it reads at
    start-up (libraries, Python modules, the policy) are those the other system's run pushed out of a small cache."""
    if args.cold:
        return
    if system == "stack":
        command, env = stack_command("warm", WARM_UP_STEPS, args, policy)
    else:
        bench, out = Path(__file__).with_name("bench_trl.py"), args.output_dir / "warm_trl.json"
        command = [sys.executable, str(bench), "--steps", str(WARM_UP_STEPS), "--json", str(out), *args.overrides]
        env = dict(os.environ)
    with (args.output_dir / f"warm_{system}.log").open("w") as log:
        subprocess.run(command, env=env, stdout=log, stderr=subprocess.STDOUT, check=True)
    shutil.rmtree(args.output_dir / "warm", ignore_errors=True)


def run_stack(index: int, args: argparse.Namespace, policy: Path) -> dict[str, Any]:
    name = f"stack{index}"
    shutil.rmtree(args.output_dir / name, ignore_errors=True)
    command, env = stack_command(name, args.steps, args, policy)
    run = measure(command, env, args.output_dir / f"{name}.log", args.sample_s, args.pss_s)
    metrics = args.output_dir / name / "metrics.jsonl"
    summary = summarize(metrics)
    rows = [json.loads(line) for line in metrics.read_text().splitlines()[1:]]
    devices = summary["devices"]
    first_line = next(t for t, line in run["lines"] if line.startswith("step     1 "))
    first_row = next(r for r in rows if r.get("step") == 1 and "time/step_s" in r)
    loop_started = first_line - first_row["device_hours"] * 3600.0 / devices
    steps = [r for r in rows if "time/step_s" in r]
    by_step = {r["step"]: r for r in steps}

    def evaluated(row: dict[str, Any] | None) -> bool:
        if row is None:
            return False
        return row.get("val/pass_rate") is not None or any(k.startswith("downstream/") for k in row)

    # A validation's cost spreads over its row and the next (the trainer may take that step while the engines
    # validate): both over two median steps without one.
    plain = [r for r in steps if not evaluated(r) and not evaluated(by_step.get(r["step"] - 1))]
    median = statistics.median(r["time/step_s"] for r in plain)
    val_completions = args.val_prompts * args.val_samples
    val_s = [
        r["time/step_s"] + by_step[r["step"] + 1]["time/step_s"] - 2 * median
        for r in steps
        if r["step"] > 1
        and r.get("val/pass_rate") is not None
        and not any(k.startswith("downstream/") for k in r)
        and r["step"] + 1 in by_step
    ]
    group = args.generations_per_prompt
    busy, completions = 0.0, 0.0
    for before, after in zip(steps, steps[1:], strict=False):
        if after in plain and before in plain:
            busy += after["rollout/generator_busy_s"] - before["rollout/generator_busy_s"]
            completions += after["train/sampled_groups"] * group
    return {
        "system": "stack",
        "run": index,
        **{k: v for k, v in run.items() if k != "lines"},
        "startup_s": loop_started,
        "loop_s": summary["loop_s"],
        "steps": summary["steps"],
        "steps_per_min": summary["steps_per_min"],
        "median_step_s": median,
        "val_s_per_1k": statistics.mean(val_s) / val_completions * 1000 if val_s else float("nan"),
        "train_gen_s_per_1k": busy / completions * 1000 if completions else float("nan"),
        "curve": [
            {"step": p["version"], "pass_rate": p["pass_rate"], "wall_s": p["wall_s"]} for p in summary["validation"]
        ],
    }


def run_trl(index: int, args: argparse.Namespace) -> dict[str, Any]:
    out = args.output_dir / f"trl{index}.json"
    bench = Path(__file__).with_name("bench_trl.py")
    command = [sys.executable, str(bench), "--steps", str(args.steps), "--json", str(out), *args.overrides]
    run = measure(command, dict(os.environ), args.output_dir / f"trl{index}.log", args.sample_s, args.pss_s)
    result = json.loads(out.read_text())
    return {
        "system": "TRL",
        "run": index,
        **{k: v for k, v in run.items() if k != "lines"},
        "startup_s": result["startup_s"],
        "loop_s": result["loop_s"],
        "steps": result["steps"],
        "steps_per_min": result["steps"] / result["loop_s"] * 60.0,
        "settings": result["settings"],
        "curve": result["curve"],
    }


def row(result: dict[str, Any], targets: tuple[float, ...]) -> str:
    def reached(target: float) -> str:
        point = reach(result["curve"], target)
        return f"{point['wall_s']:.0f} s" if point else "-"

    at = {p["step"]: p["pass_rate"] for p in result["curve"]}
    cells = [
        result["system"],
        str(result["run"]),
        f"{result['load']:.1f}",
        f"{result['startup_s']:.1f} s",
        f"{result['steps_per_min']:.1f}",
        *[f"{at[s]:.3f}" if s in at else "" for s in (0, 100, 200)],
        *[reached(t) for t in targets],
        f"{result['peak_pss_gb']:.2f} ({result['peak_rss_gb']:.2f}) GB, {result['processes']}",
    ]
    if result["system"] == "stack":
        cells.append(f"{result['val_s_per_1k']:.2f} / {result['train_gen_s_per_1k']:.2f}")
    return "| " + " | ".join(cells) + " |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3, help="runs of each system (default 3)")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--output-dir", type=Path, default=Path("runs/bench_vs_trl"))
    parser.add_argument("--sample-s", type=float, default=0.5, help="RSS sampling period (default 0.5 s)")
    parser.add_argument("--pss-s", type=float, default=2.0, help="PSS sampling period (default 2 s)")
    parser.add_argument("--json", type=Path)
    parser.add_argument(
        "--cold", action="store_true", help="no untimed warm-up run before each timed one (start-up on a cold cache)"
    )
    parser.add_argument("overrides", nargs="*", help="recipe overrides for both (as for megatron-rl train)")
    args = parser.parse_args()

    from megatron_rl.config import load_config

    run = load_config(RECIPE, None, args.overrides)
    args.val_prompts, args.val_samples = run.data.val_prompts, run.eval.samples_per_prompt
    args.generations_per_prompt = run.rollout.generations_per_prompt
    args.output_dir.mkdir(parents=True, exist_ok=True)
    policy = freeze_policy(args.overrides, args.output_dir)
    results = []
    for index in range(args.runs):
        order = ("stack", "TRL") if index % 2 == 0 else ("TRL", "stack")
        for system in order:
            warm_up(system, args, policy)
            result = run_stack(index + 1, args, policy) if system == "stack" else run_trl(index + 1, args)
            results.append(result)
            print(row(result, TARGETS), flush=True)
            if args.json:
                args.json.write_text(json.dumps(results, indent=1))
    header = ["system", "run", "load", "start-up", "steps/min", "@0", "@100", "@200"]
    header += [f"to {t}" for t in TARGETS] + ["peak PSS (RSS), processes", "val / train gen s per 1k"]
    print("\n| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for result in results:
        print(row(result, TARGETS))
    for system in ("stack", "TRL"):
        mine = [r for r in results if r["system"] == system]
        print(
            f"{system}: median {statistics.median(r['steps_per_min'] for r in mine):.1f} steps/min, start-up "
            f"{statistics.median(r['startup_s'] for r in mine):.1f} s, peak PSS "
            f"{statistics.median(r['peak_pss_gb'] for r in mine):.2f} GB"
        )


if __name__ == "__main__":
    main()
