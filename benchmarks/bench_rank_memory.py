"""Where a CPU trainer rank's memory goes: its private memory after each stage of its life.

    OMP_NUM_THREADS=1 python benchmarks/bench_rank_memory.py [--steps 20]

One fresh process is the `scalerl-cpu` trainer (megatron-core on gloo, one thread, the recipe's model, fp32,
CISPO), built as a run's rank builds it and fed batches shaped like the run's (16 prompts x 8 completions, prompts
of 12-23 tokens, completions of 10-43 and longer by turns). Private memory is Private_Clean + Private_Dirty of
/proc/self/smaps_rollup: the pages only this process holds, what ending it frees (shared library pages are left
out). Stages: the interpreter; `import torch`; the trainer's modules (megatron-core through
`megatron_rl.trainer`); the trainer built (process groups, model, DDP buffers, distributed optimizer); after the
first step, and the largest value after any of `--steps` steps; then after glibc's `malloc_trim(0)`, which returns
the heap's free pages: what the steps' tensors left as free heap the allocator keeps. The median step is timed
without and (a second pass over the same batches) with a trim after every step: what returning that memory costs.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import time


def private_mib() -> int:
    fields = {}
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("Private_Clean", "Private_Dirty"):
                fields[key] = int(value.split()[0])
    return sum(fields.values()) // 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    stages = [("interpreter", private_mib())]
    import torch

    stages.append(("torch imported", private_mib()))
    torch.set_num_threads(1)
    import warnings

    warnings.filterwarnings("ignore")
    from megatron_rl.config import load_config
    from megatron_rl.rollout.types import random_groups
    from megatron_rl.trainer.step import Trainer

    stages.append(("trainer modules imported", private_mib()))
    run = load_config("scalerl-cpu", None, [])
    trainer = Trainer(run)
    stages.append(("trainer built", private_mib()))
    vocab = run.model.vocab_size
    batches = [random_groups(i, 16, 8, vocab, (12, 24), (10, 44 + (i % 5) * 4)) for i in range(args.steps)]
    libc = ctypes.CDLL("libc.so.6")

    def steps(trim: bool) -> tuple[float, list[int]]:
        times, after = [], []
        for batch in batches:
            started = time.perf_counter()
            trainer.train_step(batch)
            if trim:
                libc.malloc_trim(0)
            times.append(time.perf_counter() - started)
            after.append(private_mib())
        return statistics.median(times[2:]), after

    plain_s, after = steps(trim=False)
    stages += [("after step 1", after[0]), (f"largest after steps 1-{args.steps}", max(after))]
    libc.malloc_trim(0)
    stages.append(("after malloc_trim(0)", private_mib()))
    trimmed_s, after_trimmed = steps(trim=True)
    stages.append((f"largest after steps 1-{args.steps} trimmed each", max(after_trimmed)))
    print("| stage | private MiB | change |")
    print("|---|---:|---:|")
    previous = 0
    for name, value in stages:
        print(f"| {name} | {value} | {value - previous:+d} |")
        previous = value
    print(f"\nmedian step: {plain_s:.3f} s; with malloc_trim(0) after each: {trimmed_s:.3f} s")


if __name__ == "__main__":
    main()
