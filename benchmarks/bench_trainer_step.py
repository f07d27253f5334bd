"""The CPU recipe's trainer step alone, by row size: seconds per optimizer step and peak memory.

    OMP_NUM_THREADS=1 python benchmarks/bench_trainer_step.py [--tokens 512 1024 2048 4096 8192] [--steps 10]

Each row size runs in a fresh process: the `scalerl-cpu` trainer (megatron-core on gloo, one thread, the recipe's
model, fp32, CISPO) with `trainer.micro_batch_tokens` set to it, fed one batch shaped like the run's: 16 prompts x
8 completions of random tokens, prompts of 12-23 tokens and completions of 10-43 (the run's mean is ~27), packed
into rows of at most that many tokens (~10,000 tokens per step). Two warm-up steps, then `--steps` timed
`train_step` calls. Reported: the median step, the rows per step, and the process's peak resident set (VmHWM).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time


def child(tokens: int, steps: int) -> dict:
    import torch

    from megatron_rl.config import load_config
    from megatron_rl.rollout.types import random_groups
    from megatron_rl.trainer.step import Trainer, sequences_from_groups

    torch.set_num_threads(1)
    run = load_config("scalerl-cpu", None, [f"trainer.micro_batch_tokens={tokens}"])
    trainer = Trainer(run)
    batch = random_groups(0, 16, 8, run.model.vocab_size, (12, 24), (10, 44))
    rows = len(trainer._micro_batches(sequences_from_groups(batch, run)))
    times = []
    for i in range(steps + 2):
        started = time.perf_counter()
        trainer.train_step(batch)
        if i >= 2:
            times.append(time.perf_counter() - started)
    with open("/proc/self/status") as f:
        peak_kib = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    return {"tokens": tokens, "rows": rows, "step_s": statistics.median(times), "peak_mib": peak_kib / 1024}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.steps)))
        return
    print("| row tokens | rows per step | median step | peak RSS |")
    print("|---:|---:|---:|---:|")
    for tokens in args.tokens:
        command = [sys.executable, __file__, "--child", str(tokens), "--steps", str(args.steps)]
        out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
        result = json.loads(out.strip().splitlines()[-1])
        row = f"| {tokens:,} | {result['rows']} | {result['step_s']:.3f} s | {result['peak_mib']:.0f} MiB |"
        print(row, flush=True)


if __name__ == "__main__":
    main()
