"""Where the default run's start-up CPU and its memory go, process by process.

    python benchmarks/bench_processes.py [--steps 200] [--json processes.json] [overrides ...]

Runs `megatron-rl train --recipe scalerl-cpu` (as shipped unless overridden; the warm-up should be cached, run the
command once before) and samples every process of the run (the launched driver and all its descendants: Ray's
head, the trainer actors, SGLang's server and its children, the reward workers) every `--sample-s`.
Prints one row per role (processes of one kind summed):

- born: seconds from launch to the role's first process start;
- CPU to loop: CPU seconds (user + system) the role used from launch to the loop's start, the moment the run
  clock starts before the step-0 validation (as `bench_vs_trl.py` measures start-up): on a machine with few cores,
  start-up is bounded below by the sum of this column over the cores;
- CPU total: CPU seconds over the whole run;
- PSS at peak: the role's proportional set size at the sample where the sum over all processes peaked (shared
  pages split between the processes sharing them: the column sums to the physical memory the run held);
- private at peak: of that, the pages no other process maps (Private_Clean + Private_Dirty: what ending the role's
  processes would free; the rest of its PSS is its share of libraries and files other processes map too);
- own peak: the role's largest PSS over the run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import psutil

ROLES = [  # (substring of the command line, role), first match wins
    ("megatron_rl.orchestration.reaper", "reaper (driver's watcher)"),
    ("gcs_server", "Ray GCS"),
    ("raylet/raylet", "Ray raylet"),
    ("ray_agent_stand_in.py", "Ray dashboard agent (stand-in)"),
    ("dashboard/dashboard.py", "Ray dashboard (minimal)"),
    ("DashboardAgent", "Ray dashboard agent"),
    ("dashboard/agent.py", "Ray dashboard agent"),
    ("RuntimeEnvAgent", "Ray runtime-env agent"),
    ("runtime_env/agent", "Ray runtime-env agent"),
    ("log_monitor.py", "Ray log monitor"),
    ("autoscaler/_private/monitor.py", "Ray autoscaler monitor"),
    ("ray::TrainerWorker", "trainer rank"),
    ("ray::EngineHost", "engine host (Ray actor)"),
    ("ray::IDLE", "Ray idle worker"),
    ("workers/default_worker.py", "Ray worker (starting)"),
    ("sglang.launch_server", "SGLang server (HTTP, tokenizer manager)"),
    ("sglang::scheduler", "SGLang scheduler"),
    ("sglang::detokenizer", "SGLang detokenizer"),
    ("resource_tracker", "multiprocessing resource tracker"),
    ("multiprocessing.spawn", "reward worker"),
    ("wandb", "wandb service"),
    ("megatron-rl train", "driver"),
]


def role(command: str) -> str:
    return next((name for part, name in ROLES if part in command), command[:60] or "?")


def pss(pid: int) -> tuple[int, int]:
    """Proportional set size and private memory in bytes ((0, 0) when the process is gone or unreadable)."""
    fields: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                name, _, value = line.partition(":")
                if name in ("Pss", "Private_Clean", "Private_Dirty"):
                    fields[name] = int(value.split()[0]) * 1024
    except OSError:
        return 0, 0
    return fields.get("Pss", 0), fields.get("Private_Clean", 0) + fields.get("Private_Dirty", 0)


def sample_run(command: list[str], env: dict[str, str], log: Path, sample_s: float) -> dict[str, Any]:
    """Run `command`, sampling its process tree; per process: role, birth, CPU time series, PSS series."""
    launched = time.time()
    lines: list[tuple[float, str]] = []
    procs: dict[int, dict[str, Any]] = {}
    totals: list[tuple[float, int, dict[int, tuple[int, int]]]] = []
    with log.open("w") as out:
        process = psutil.Popen(command, stdout=-1, stderr=-2, env=env, text=True)

        def read() -> None:
            for line in process.stdout:
                lines.append((time.time() - launched, line))
                out.write(line)

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        while process.poll() is None:
            now = time.time() - launched
            try:
                tree = [process, *process.children(recursive=True)]
            except psutil.NoSuchProcess:
                break
            sizes: dict[int, tuple[int, int]] = {}
            for proc in tree:
                try:
                    with proc.oneshot():
                        cpu = proc.cpu_times()
                        command = " ".join(proc.cmdline())  # Ray's workers and SGLang's children rename themselves
                        entry = procs.setdefault(proc.pid, {"born": proc.create_time() - launched})
                except psutil.Error:  # ended between the listing and the read
                    continue
                entry["command"], entry["role"] = command, role(command)
                entry.setdefault("cpu", []).append((now, cpu.user + cpu.system))
                sizes[proc.pid] = pss(proc.pid)
                entry["peak"] = max(entry.get("peak", 0), sizes[proc.pid][0])
            totals.append((now, sum(size for size, _ in sizes.values()), sizes))
            time.sleep(sample_s)
        reader.join()
    if process.returncode != 0:
        tail = "".join(line for _, line in lines[-30:])
        raise RuntimeError(f"{' '.join(command[:4])} ... exited with {process.returncode}; log {log}:\n{tail}")
    return {"lines": lines, "procs": procs, "totals": totals, "wall_s": time.time() - launched}


def loop_start(lines: list[tuple[float, str]], metrics: Path) -> float:
    """Seconds from launch to the run clock's start: the step-1 line's time less the step's device-hours."""
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    devices = rows[0]["run"]["devices"]
    first_line = next(t for t, line in lines if line.startswith("step     1 "))
    first_row = next(r for r in rows[1:] if r.get("step") == 1 and "time/step_s" in r)
    return first_line - first_row["device_hours"] * 3600.0 / devices


def cpu_at(series: list[tuple[float, float]], t: float) -> float:
    """CPU seconds by time `t`: the last sample at or before it (0 when the process was not seen yet)."""
    before = [cpu for when, cpu in series if when <= t]
    return before[-1] if before else 0.0


def table(run: dict[str, Any], start: float) -> list[dict[str, Any]]:
    _, _, peak_sizes = max(run["totals"], key=lambda total: total[1])
    by_role: dict[str, dict[str, Any]] = defaultdict(
        lambda: (
            {"processes": 0, "born": float("inf"), "cpu_loop": 0.0, "cpu": 0.0}
            | {"pss_at_peak": 0, "private_at_peak": 0, "peak": 0}
        )
    )
    for pid, entry in run["procs"].items():
        row = by_role[entry["role"]]
        row["processes"] += 1
        row["born"] = min(row["born"], entry["born"])
        row["cpu_loop"] += cpu_at(entry["cpu"], start)
        row["cpu"] += entry["cpu"][-1][1]
        size, private = peak_sizes.get(pid, (0, 0))
        row["pss_at_peak"] += size
        row["private_at_peak"] += private
        row["peak"] = max(row["peak"], entry["peak"])
    rows = [{"role": name, **row} for name, row in by_role.items()]
    rows.sort(key=lambda r: -r["cpu_loop"])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default="scalerl-cpu")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--output-dir", type=Path, default=Path("runs/bench_processes"))
    parser.add_argument("--sample-s", type=float, default=0.5)
    parser.add_argument("--json", type=Path)
    parser.add_argument("overrides", nargs="*", help="recipe overrides (as for megatron-rl train)")
    args = parser.parse_args()

    shutil.rmtree(args.output_dir, ignore_errors=True)
    args.output_dir.mkdir(parents=True)
    cli = Path(sys.executable).with_name("megatron-rl")
    overrides = [f"output_dir={args.output_dir}", "name=run", f"total_steps={args.steps}", *args.overrides]
    command = [str(cli), "train", "--recipe", args.recipe, *overrides]
    # The command as the README gives it: no OMP_NUM_THREADS (each process of the run sets its own threads).
    env = {**{k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}, "WANDB_MODE": "offline"}
    run = sample_run(command, env, args.output_dir / "run.log", args.sample_s)
    start = loop_start(run["lines"], args.output_dir / "run" / "metrics.jsonl")
    rows = table(run, start)
    peak_t, peak_total, _ = max(run["totals"], key=lambda total: total[1])
    before = [line.split("|")[0].strip() for t, line in run["lines"] if t <= peak_t and line.startswith("step ")]
    median = sorted(total for _, total, _ in run["totals"])[len(run["totals"]) // 2]

    print(
        f"{args.recipe}, {args.steps} steps: loop start {start:.1f} s after launch, run {run['wall_s']:.0f} s, "
        f"peak PSS {peak_total / 1e9:.2f} GB at {peak_t:.0f} s (after {before[-1] if before else 'no step line'})"
        f" over {sum(r['processes'] for r in rows)} processes; median over the samples {median / 1e9:.2f} GB"
    )
    print("| role | processes | born | CPU to loop | CPU total | PSS at peak | private at peak | own peak |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['role']} | {r['processes']} | {r['born']:.1f} s | {r['cpu_loop']:.1f} s | {r['cpu']:.1f} s | "
            f"{r['pss_at_peak'] / 1e6:.0f} MB | {r['private_at_peak'] / 1e6:.0f} MB | {r['peak'] / 1e6:.0f} MB |"
        )
    cpu_loop, cpu = sum(r["cpu_loop"] for r in rows), sum(r["cpu"] for r in rows)
    count = sum(r["processes"] for r in rows)
    private = sum(r["private_at_peak"] for r in rows) / 1e6
    print(f"| all | {count} | | {cpu_loop:.1f} s | {cpu:.1f} s | {peak_total / 1e6:.0f} MB | {private:.0f} MB | |")
    if args.json:
        result = {"loop_start_s": start, "wall_s": run["wall_s"], "peak_pss": peak_total, "peak_at_s": peak_t}
        result["pss_over_time"] = [(round(t, 1), total) for t, total, _ in run["totals"]]
        args.json.write_text(json.dumps({**result, "roles": rows}, indent=1))


if __name__ == "__main__":
    main()
