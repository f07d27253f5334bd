"""The CPU run with and without the Python tool, side by side: does the policy learn to call it, and do the held-out
large sums rise beyond the tool-less run's?

    python benchmarks/bench_tools.py                         # 200 steps each, as the recipes ship
    python benchmarks/bench_tools.py --steps 100 --out runs/bench_tools

Each system is one `megatron-rl train` of its recipe as shipped (`scalerl-cpu`, `scalerl-cpu-tools`), run one after
the other. The table reads each run's metrics.jsonl: validation (256 prompts x 4) and the held-out sums >= 180
(`synthetic_large`, 190 problems x 2; offered the tool in the tool run) at the first and last evaluations, the best
held-out value, and for the tool run the share of training trajectories that called the tool and the pass rates of
those that did and did not, over the first and the last 10 steps; steps per minute of the training steps
(`time/step_s`: start-up, warm-up and evaluations left out).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

SYSTEMS = {"tool-less": "scalerl-cpu", "python tool": "scalerl-cpu-tools"}


def run(out: Path, recipe: str, steps: int) -> dict[str, str]:
    cmd = [sys.executable, "-m", "megatron_rl.cli", "train", "--recipe", recipe]
    cmd += [f"output_dir={out}", f"name={recipe}", f"total_steps={steps}", "logging.wandb=disabled"]
    done = subprocess.run(cmd, env=dict(os.environ, PYTHONWARNINGS="ignore"), capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(done.stdout[-3000:] + done.stderr[-3000:])
    rows = [json.loads(line) for line in (out / recipe / "metrics.jsonl").read_text().splitlines()[1:]]
    steps_ = [r for r in rows if "train/loss" in r]
    val = [r["val/pass_rate"] for r in rows if "val/pass_rate" in r]
    large = [r["downstream/synthetic_large/mean@2"] for r in rows if "downstream/synthetic_large/mean@2" in r]

    def window(key: str, part: list[dict]) -> str:
        values = [r[key] for r in part if key in r]
        return f"{sum(values) / len(values):.2f}" if values else "-"

    first, last = steps_[:10], steps_[-10:]
    return {
        "validation": f"{val[0]:.3f} -> {val[-1]:.3f}",
        "held-out large sums": f"{large[0]:.3f} -> {large[-1]:.3f} (best {max(large):.3f})",
        "calling share": f"{window('tools/calling_share', first)} -> {window('tools/calling_share', last)}",
        "pass with / without calls": (
            f"{window('tools/pass_rate_with_calls', first)} / {window('tools/pass_rate_without_calls', first)} -> "
            f"{window('tools/pass_rate_with_calls', last)} / {window('tools/pass_rate_without_calls', last)}"
        ),
        "steps/min": f"{60 * len(steps_) / sum(r['time/step_s'] for r in steps_):.1f}",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--out", type=Path, default=Path("runs/bench_tools"))
    args = parser.parse_args()
    results = {system: run(args.out, recipe, args.steps) for system, recipe in SYSTEMS.items()}
    columns = list(next(iter(results.values())))
    print("| system | " + " | ".join(columns) + " |")
    print("|---|" + "---|" * len(columns))
    for system, row in results.items():
        print(f"| {system} | " + " | ".join(row[c] for c in columns) + " |")


if __name__ == "__main__":
    main()
