"""PipelineRL-8 against the synchronous loop: generator idle share and time to a target validation pass rate.

    OMP_NUM_THREADS=1 python benchmarks/bench_loop.py [--steps 80] [--eval-every 10] [--target 0.4] [--json out.json]
    python benchmarks/bench_loop.py --report-only              # re-read the runs of an earlier call

Two real `megatron-rl train` runs of the `scalerl-cpu` recipe, one after the other, same seed, model, task,
batch and validation set; only the loop differs:

- PipelineRL-8 (`rollout.mode=pipeline rollout.k=8`): generation never stops, weights are pushed in flight
  after every step, a batch may be up to 8 versions stale.
- synchronous (`rollout.mode=ppo_off_policy rollout.k=1`): generate one batch with frozen weights, train on
  it, sync, repeat; the engine has nothing to do while the trainer steps.

`--loops default` runs the recipe as shipped (PipelineRL-2), e.g. for the default run's steps per minute,
median step, generated tokens per second (training completions only: their tokens over the steps without a
validation) and time to a target pass rate.

Intermediate checkpoints are off (`checkpoint.every_steps` = the step count; the last step still saves) and
wandb is disabled: the benchmark reads each run's metrics JSONL. The warm-started policy is built (or taken
from the cache) first, outside the timed runs, and both runs start from one private copy of it
(`model.hf_path`). Times come from each row's `device_hours` (devices x wall time since the run's loop
began; the header says how many devices), so they exclude process, Ray and engine start-up, which the
`process s` column includes together with the final curve fit. Generator idle share is taken between the
first and the last training row (steps 2..N) from the balancer's cumulative busy seconds
(`rollout/generator_busy_s`: an engine is busy while it has a request outstanding); the balancer's own
cumulative share, which also counts the idle engine during start-up, is in the JSON. Validation runs on
the same engine and is part of both runs' step times. Engine failures and retries are the balancer's
counts over the whole run (`rollout/engine_failures`, `rollout/engine_retries`); nothing is injected, so
anything but 0 means a request failed on a healthy engine.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from megatron_rl.config import load_config
from megatron_rl.metrics import read_metrics

RECIPE = "scalerl-cpu"
LOOPS: dict[str, list[str]] = {
    "default": [],  # the recipe as shipped (scalerl-cpu: PipelineRL-2)
    "PipelineRL-8": ["rollout.mode=pipeline", "rollout.k=8"],
    "synchronous": ["rollout.mode=ppo_off_policy", "rollout.k=1"],
    # in flight but at most one version stale: what fresher batches buy per step against steps per minute
    "PipelineRL-1": ["rollout.mode=pipeline", "rollout.k=1"],
    # the staleness rule where it binds: k = 2 keeps at most two batches in flight
    "PipelineRL-2-wait": ["rollout.mode=pipeline", "rollout.k=2", "rollout.staleness=wait"],
    "PipelineRL-2-drop": ["rollout.mode=pipeline", "rollout.k=2", "rollout.staleness=drop"],
}
DEFAULT_LOOPS = ["PipelineRL-8", "synchronous"]


def run_name(loop: str) -> str:
    return "loop-" + loop.lower().replace("-", "")


def common_overrides(args: argparse.Namespace) -> list[str]:
    return [
        f"output_dir={args.output_dir}",
        f"seed={args.seed}",
        f"total_steps={args.steps}",
        f"eval.every_steps={args.eval_every}",
        f"checkpoint.every_steps={args.steps}",
        "checkpoint.resume=never",
        "logging.wandb=disabled",
    ]


def freeze_policy(overrides: list[str], output_dir: Path) -> Path:
    """Build (or find) the cached warm-started policy and copy it into `output_dir`: both runs start from
    this copy (`model.hf_path`), so neither pays for the warm-up and another job rewriting the shared
    cache meanwhile cannot give them different starting weights."""
    from megatron_rl.data.datasets import load_splits
    from megatron_rl.orchestration.warmstart import prepare_policy

    run = load_config(RECIPE, None, overrides)
    cached = prepare_policy(run, load_splits(run.data))
    policy = output_dir / "policy"
    shutil.rmtree(policy, ignore_errors=True)
    shutil.copytree(cached, policy)
    print(f"policy: {cached} -> {policy}", flush=True)
    return policy


def train(loop: str, overrides: list[str], output_dir: Path) -> tuple[float, float]:
    """One `megatron-rl train` run in a fresh run directory; returns its process wall time in seconds and
    the machine's mean 1-minute load average meanwhile (other jobs on a shared machine show up there)."""
    name = run_name(loop)
    shutil.rmtree(output_dir / name, ignore_errors=True)
    output_dir.mkdir(parents=True, exist_ok=True)
    log = output_dir / f"{name}.log"
    cli = Path(sys.executable).with_name("megatron-rl")
    command = [str(cli), "train", "--recipe", RECIPE, f"name={name}", *overrides, *LOOPS[loop]]
    env = {**os.environ, "WANDB_MODE": "offline"}
    env.setdefault("OMP_NUM_THREADS", "1")
    print(f"{loop}: {' '.join(command)}  (log: {log})", flush=True)
    start, loads = time.perf_counter(), []
    with log.open("w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
        while True:
            try:
                code = process.wait(timeout=10.0)
                break
            except subprocess.TimeoutExpired:
                loads.append(os.getloadavg()[0])
    seconds = time.perf_counter() - start
    if code != 0:
        tail = "\n".join(log.read_text().splitlines()[-30:])
        raise RuntimeError(f"{loop}: megatron-rl train exited with {code}; last lines of {log}:\n{tail}")
    load = sum(loads) / max(len(loads), 1)
    print(f"{loop}: done in {seconds:.0f} s, mean load average {load:.1f}", flush=True)
    return seconds, load


def summarize(metrics_path: Path) -> dict[str, Any]:
    """Loop timing, generator idle share, staleness and the validation curve of one run's metrics file."""
    header = json.loads(metrics_path.read_text().splitlines()[0])["run"]
    rows = read_metrics(metrics_path)
    devices = header["devices"]
    train_rows = [r for r in rows if "time/step_s" in r]
    first, last = train_rows[0], train_rows[-1]

    def wall_s(row: dict[str, Any]) -> float:
        return row["device_hours"] * 3600.0 / devices

    # A validation inside the loop runs before that iteration's step and is logged with the step after it;
    # the final validation (no step time) is logged at the last step. `version` = steps the policy had;
    # a validation's time is its row's, i.e. after the step that followed it (the same for both loops).
    curve = [
        {
            "version": r["step"] - 1 if "time/step_s" in r else r["step"],
            "pass_rate": r["val/pass_rate"],
            "wall_s": wall_s(r),
            "device_hours": r["device_hours"],
        }
        for r in rows
        if r.get("val/pass_rate") is not None
    ]
    span_s = wall_s(last) - wall_s(first)
    config = yaml.safe_load((metrics_path.parent / "config.yaml").read_text())
    n_engines = int(config["rollout"]["engine"]["num_engines"])
    busy = last["rollout/generator_busy_s"] - first["rollout/generator_busy_s"]
    step_times = [r["time/step_s"] for r in train_rows]
    # a validation's time lies in its row and, when the trainer took the next step while the engines validated, in
    # the next row too: neither counts as a step without one
    validated = {r["step"] for r in train_rows if r.get("val/pass_rate") is not None}
    plain = [r for r in train_rows if r["step"] not in validated and r["step"] - 1 not in validated]
    no_eval = [r["time/step_s"] for r in plain]
    # tokens the engine generated for training (validation's are not in the rows); per completion: its length
    group = int(config["rollout"]["generations_per_prompt"])
    generated = [r["train/sampled_groups"] * group * r["train/response_length"] for r in plain]
    staleness = [r["train/staleness_mean"] for r in train_rows]
    return {
        "steps": last["step"],
        "devices": devices,
        "engines": n_engines,
        "loop_s": wall_s(last),
        "steps_per_min": len(train_rows) / wall_s(last) * 60.0,
        "step_s_mean": sum(step_times) / len(step_times),
        "step_s_mean_no_eval": sum(no_eval) / max(len(no_eval), 1),
        "step_s_median_no_eval": statistics.median(no_eval) if no_eval else float("nan"),
        "generated_tokens_per_s": sum(generated) / max(sum(no_eval), 1e-9),
        "generator_idle_share": 1.0 - busy / (span_s * n_engines),
        "generator_idle_share_cumulative": last["rollout/generator_idle_share"],
        "staleness_mean": sum(staleness) / len(staleness),
        "staleness_max": max(r["train/staleness_max"] for r in train_rows),
        "stale_dropped": sum(r["train/stale_dropped"] for r in train_rows),
        "stale_wait_s": sum(r.get("train/stale_wait_s", 0.0) for r in train_rows),
        "response_length": sum(r["train/response_length"] for r in train_rows) / len(train_rows),
        # The balancer's counters are cumulative over the run (one driver process: resume is off), so the
        # run's total is the largest value logged.
        "engine_failures": max(r.get("rollout/engine_failures", 0.0) for r in rows),
        "engine_retries": max(r.get("rollout/engine_retries", 0.0) for r in rows),
        "validation": curve,
    }


def reach(curve: list[dict[str, Any]], target: float) -> dict[str, Any] | None:
    """The first validation at or above `target`, or None."""
    return next((point for point in curve if point["pass_rate"] >= target), None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=80, help="optimizer steps per run (the recipe's 80)")
    parser.add_argument("--eval-every", type=int, default=10, help="validation every N steps (and at 0 and the end)")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--target", type=float, help="target val/pass_rate (default: mean starting rate + 0.05)")
    parser.add_argument("--output-dir", type=Path, default=Path("runs/bench_loop"))
    parser.add_argument("--reverse", action="store_true", help="run the loops in reverse order")
    parser.add_argument("--report-only", action="store_true", help="do not train; read the runs already there")
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--loops", nargs="+", choices=list(LOOPS), default=DEFAULT_LOOPS, help="loops to run, in order")
    args = parser.parse_args()
    loops = args.loops

    overrides = common_overrides(args)
    process: dict[str, tuple[float, float] | None] = dict.fromkeys(loops)
    if not args.report_only:
        overrides.append(f"model.hf_path={freeze_policy(overrides, args.output_dir).resolve()}")
        for loop in reversed(loops) if args.reverse else loops:
            process[loop] = train(loop, overrides, args.output_dir)
    results = {loop: summarize(args.output_dir / run_name(loop) / "metrics.jsonl") for loop in loops}
    starts = [r["validation"][0]["pass_rate"] for r in results.values()]
    target = args.target if args.target is not None else round(sum(starts) / len(starts) + 0.05, 3)
    for loop, result in results.items():
        result["process_s"], result["load_avg"] = process[loop] or (None, None)
        result["target"] = target
        result["reached"] = reach(result["validation"], target)

    def reached(result: dict[str, Any]) -> str:
        point = result["reached"]
        if point is None:
            return "not reached"
        return f"{point['wall_s']:.0f} s / {point['device_hours']:.4f} (step {point['version']})"

    columns: list[tuple[str, Any]] = [
        (
            "process s (load avg)",
            lambda r: "-" if r["process_s"] is None else f"{r['process_s']:.0f} ({r['load_avg']:.1f})",
        ),
        ("loop s", lambda r: f"{r['loop_s']:.0f}"),
        ("steps/min", lambda r: f"{r['steps_per_min']:.2f}"),
        ("mean step s (w/o eval)", lambda r: f"{r['step_s_mean']:.2f} ({r['step_s_mean_no_eval']:.2f})"),
        ("median step s w/o eval", lambda r: f"{r['step_s_median_no_eval']:.2f}"),
        ("generated tokens/s", lambda r: f"{r['generated_tokens_per_s']:.0f}"),
        ("generator idle", lambda r: f"{r['generator_idle_share']:.1%}"),
        (
            "val start -> end",
            lambda r: f"{r['validation'][0]['pass_rate']:.3f} -> {r['validation'][-1]['pass_rate']:.3f}",
        ),
        (f"to val >= {target:.3f}: s / device-h", reached),
        ("staleness mean (max)", lambda r: f"{r['staleness_mean']:.2f} ({r['staleness_max']:.0f})"),
        ("stale dropped", lambda r: f"{r['stale_dropped']:.0f}"),
        ("trained length", lambda r: f"{r['response_length']:.1f}"),
        ("waited for due groups s", lambda r: f"{r['stale_wait_s']:.1f}"),
        ("engine failures / retries", lambda r: f"{r['engine_failures']:.0f} / {r['engine_retries']:.0f}"),
    ]
    print(f"\n{args.steps} steps each, validation every {args.eval_every}; target val/pass_rate {target:.3f}\n")
    print("| loop | " + " | ".join(name for name, _ in columns) + " |")
    print("|---|" + "---:|" * len(columns))
    for loop, result in results.items():
        print(f"| {loop} | " + " | ".join(cell(result) for _, cell in columns) + " |")
    print("\nvalidation curves (policy version: pass rate @ loop s):")
    for loop, result in results.items():
        points = ", ".join(f"{p['version']}: {p['pass_rate']:.3f} @ {p['wall_s']:.0f}" for p in result["validation"])
        print(f"  {loop}: {points}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"target": target, "runs": results}, f, indent=2)


if __name__ == "__main__":
    main()
