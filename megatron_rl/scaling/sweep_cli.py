"""`megatron-rl sweep SWEEP.yaml [--dir DIR] [--check] [--retry-failed]`: the command over scaling/sweep.py (the file
format, the loop, the stopping rule), launchers.py (local processes or Slurm jobs) and sweep_report.py (the report).

Exit status: 0 the sweep ended (every run finished, stopped, crashed or stalled: the report says which); 2 a bad
sweep file or a state file of another sweep; 128 + the signal's number when the sweep was interrupted (its runs
were stopped gracefully: run the same command to resume).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from megatron_rl.config import ConfigError
from megatron_rl.scaling.launchers import build_launcher
from megatron_rl.scaling.sweep import Interrupted, SweepError, load_sweep, run_sweep
from megatron_rl.scaling.sweep_report import write_report


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="megatron-rl sweep",
        description="Launch a grid of training runs, fit each live, stop the ones that will lose (docs/sweeps.md).",
    )
    p.add_argument("sweep", metavar="SWEEP.yaml", help="the sweep file")
    p.add_argument("--dir", default=None, help="the sweep directory (default: runs/<sweep file's name>)")
    p.add_argument("--check", action="store_true", help="validate the sweep file and list its runs; launch nothing")
    p.add_argument("--retry-failed", action="store_true", help="on resume, launch crashed and stalled runs again")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        sweep = load_sweep(args.sweep)
    except ConfigError as exc:
        print(f"megatron-rl sweep: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    directory = Path(args.dir) if args.dir else Path("runs") / sweep.name
    print(f"sweep {sweep.path}: {len(sweep.runs)} runs, launcher {sweep.launcher} (parallel {sweep.parallel}), rule "
          f"{sweep.stopping.rule}; directory {directory}", flush=True)  # fmt: skip
    for run in sweep.runs:
        model = f" --model {run.model}" if run.model else ""
        print(f"  {run.name}: --recipe {run.recipe}{model} {' '.join(run.overrides)} ({run.total_steps} steps)")
    if args.check:
        return 0
    try:
        runs = run_sweep(sweep, directory, build_launcher(sweep), args.retry_failed)
    except SweepError as exc:
        print(f"megatron-rl sweep: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    except Interrupted as exc:
        return 128 + exc.signum
    for line in write_report(sweep, directory, runs):
        print(line, flush=True)
    return 0
