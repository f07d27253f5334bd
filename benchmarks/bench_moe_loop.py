"""The tiny Qwen3-MoE through the whole loop on CPU (EP 2 trainer, one SGLang engine), with and without rollout
routing replay: steps per minute and the generator/trainer mismatch.

    python benchmarks/bench_moe_loop.py                       # 8 steps per mode
    python benchmarks/bench_moe_loop.py --steps 16 --out runs/bench_moe

Each mode is one `megatron-rl train --recipe scalerl-cpu --model tiny_moe` run; the table reads its
metrics.jsonl: steps per minute of the training steps (start-up, warm-up and validation left out: the sum of
`time/step_s`), mean |log pi_train - log pi_gen| and the k3 KL estimate over all steps, the routing agreement
(mean and lowest layer), and engine failures.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

SMALL = [
    "data.val_prompts=16",
    "eval.every_steps=1000",
    "rollout.prompts_per_step=8",
    "rollout.generations_per_prompt=4",
    "logging.wandb=offline",
    "rollout.k=2",
]


def run(out: Path, mode: str, steps: int) -> dict[str, float]:
    name = f"moe_{mode}"
    cmd = [sys.executable, "-m", "megatron_rl.cli", "train", "--recipe", "scalerl-cpu", "--model", "tiny_moe"]
    cmd += [f"output_dir={out}", f"name={name}", f"total_steps={steps}", f"algo.routing_replay={mode}", *SMALL]
    started = time.perf_counter()
    done = subprocess.run(cmd, env=dict(os.environ, WANDB_MODE="offline"), capture_output=True, text=True)
    wall = time.perf_counter() - started
    if done.returncode:
        raise SystemExit(done.stdout[-3000:] + done.stderr[-3000:])
    rows = [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()[1:]]
    steps_ = [r for r in rows if "train/loss" in r]

    def mean(key: str) -> float:
        values = [r[key] for r in steps_ if key in r]
        return sum(values) / len(values) if values else float("nan")

    return {
        "steps_per_min": 60 * len(steps_) / sum(r["time/step_s"] for r in steps_),
        "wall_s": wall,
        "mismatch": mean("train/mismatch"),
        "kl": mean("train/mismatch_kl"),
        "agreement": mean("train/routing_agreement"),
        "agreement_min": min((r["train/routing_agreement_min"] for r in steps_), default=float("nan")),
        "failures": sum(r.get("rollout/engine_failures", 0) for r in steps_),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--out", type=Path, default=Path("runs/bench_moe"))
    args = parser.parse_args()
    print(f"{'replay':>8} {'steps/min':>10} {'wall s':>7} {'|dlogp|':>8} {'kl':>9} {'route':>7} {'min':>7} {'fail':>5}")
    for mode in ("measure", "rollout"):
        r = run(args.out, mode, args.steps)
        print(
            f"{mode:>8} {r['steps_per_min']:>10.1f} {r['wall_s']:>7.0f} {r['mismatch']:>8.4f} {r['kl']:>9.2e} "
            f"{r['agreement']:>7.2%} {r['agreement_min']:>7.2%} {r['failures']:>5.0f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
