"""What context parallelism and optimizer offload cost per train step on this machine, at the tiny size.

    python benchmarks/bench_long_context.py [--tokens 4096] [--steps 3] [--adam-params 50000000]

Every variant runs the real trainer (megatron-core, gloo) in fresh processes on one packed row of `--tokens`
tokens (one group of two completions sharing a 64-token prompt), a scaled-down Llama (4 layers, hidden 512, fp32),
the machine's cores split evenly over the ranks. Reported per variant: the median wall time of `--steps` train
steps after a warm-up step, and rank 0's peak resident memory during them above what it held before.

    cp1        1 rank, the row whole
    cp2        2 ranks of context parallel: each holds half of every sequence, keys and values all-gathered
    dp2        2 ranks of data parallel on two such rows (the same work per rank as cp1: what CP replaces)
    offload    1 rank, the whole Adam state in host memory (megatron's HybridDeviceOptimizer)
    offload50  1 rank, half of it

Then torch's CPU AdamW over `--adam-params` fp32 parameters (fused, the kernel megatron's offload uses): the host
part of an offloaded optimizer step per parameter, to scale to a GPU node's share (benchmarks/README.md).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PROMPT = 64
VARIANTS = {
    "cp1": (1, []),
    "cp2": (2, ["parallel.cp=2"]),
    "dp2": (2, []),
    "offload": (1, ["trainer.optimizer.cpu_offload=true"]),
    "offload50": (1, ["trainer.optimizer.cpu_offload=true", "trainer.optimizer.offload_fraction=0.5"]),
}


def _status_kib(field: str) -> int:
    return int(re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.MULTILINE).group(1))


def _batch(tokens: int, vocab: int, seed: int, groups: int = 1) -> list:
    import random

    from megatron_rl.rollout.types import Completion, Group

    rng = random.Random(seed)
    out = []
    for g in range(groups):
        prompt = [rng.randrange(5, vocab) for _ in range(PROMPT)]
        completions = []
        for c, length in enumerate((tokens // 2 - PROMPT, tokens - tokens // 2 - PROMPT)):
            completions.append(
                Completion(
                    prompt_id=str(g), task="math", prompt_tokens=prompt,
                    tokens=[rng.randrange(5, vocab) for _ in range(length)],
                    gen_logprobs=[-9.0 + 0.1 * rng.random() for _ in range(length)],
                    versions=[0] * length, loss_mask=[True] * length, reward=1.0 if c == 0 else -1.0,
                )
            )  # fmt: skip
        out.append(Group(str(g), "math", completions))
    return out


def _child(args: argparse.Namespace) -> None:
    import gc

    import torch
    import torch.distributed as dist

    from megatron_rl.config import load_config
    from megatron_rl.trainer.step import Trainer

    world, overrides = VARIANTS[args.child]
    torch.set_num_threads(max(1, args.threads // world))
    overrides = [
        "model.num_layers=4", "model.hidden_size=512", "model.ffn_hidden_size=1408", "model.num_attention_heads=8",
        "model.num_query_groups=8", "model.vocab_size=8192", f"model.max_position_embeddings={max(args.tokens, 4096)}",
        "trainer.params_dtype=fp32", f"trainer.micro_batch_tokens={args.tokens}", f"rollout.max_prompt_tokens={PROMPT}",
        "rollout.answer_tokens=64", "rollout.interruption.min_thinking_tokens=1",
        f"rollout.interruption.max_thinking_tokens={args.tokens - PROMPT - 64 - 4}",
        "trainer.optimizer.warmup_steps=0", f"parallel.trainer_devices={world}", *overrides,
    ]  # fmt: skip
    trainer = Trainer(load_config("scalerl-cpu", "cpu_demo", overrides))
    rows = 2 if args.child == "dp2" else 1  # data parallel: one row per rank
    trainer.train_step(_batch(args.tokens, 8192, seed=1, groups=rows))
    batch = _batch(args.tokens, 8192, seed=0, groups=rows)
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    baseline = _status_kib("VmRSS")
    seconds = []
    for _ in range(args.steps):
        dist.barrier()
        start = time.perf_counter()
        trainer.train_step(batch)
        seconds.append(time.perf_counter() - start)
    if dist.get_rank() == 0:
        peak = (_status_kib("VmHWM") - baseline) / 1024
        print(json.dumps({"seconds": statistics.median(seconds), "peak_mib": peak}), flush=True)


def _measure(args: argparse.Namespace, variant: str) -> dict:
    from megatron_rl.trainer.distributed import free_port

    world = VARIANTS[variant][0]
    port = free_port()
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        env.update(OMP_NUM_THREADS=str(max(1, args.threads // world)), PYTHONWARNINGS="ignore")
        command = [sys.executable, __file__, "--child", variant, "--tokens", str(args.tokens)]
        command += ["--steps", str(args.steps), "--threads", str(args.threads)]
        procs.append(subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outputs = [p.communicate() for p in procs]
    for p, (_, err) in zip(procs, outputs, strict=True):
        if p.returncode:
            raise RuntimeError(f"{variant}: exit {p.returncode}: {err.strip().splitlines()[-3:]}")
    line = next(line for line in outputs[0][0].splitlines() if line.startswith("{"))
    return json.loads(line)


def _adam(params: int, threads: int) -> float:
    """Seconds per step of torch's fused CPU AdamW over `params` fp32 parameters (after one warm-up step)."""
    import torch

    torch.set_num_threads(threads)
    weight = torch.nn.Parameter(torch.randn(params))
    weight.grad = torch.randn(params)
    optimizer = torch.optim.AdamW([weight], lr=1e-4, betas=(0.9, 0.95), eps=1e-15, weight_decay=0.01, fused=True)
    optimizer.step()
    times = []
    for _ in range(3):
        start = time.perf_counter()
        optimizer.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--adam-params", type=int, default=50_000_000)
    parser.add_argument("--child", choices=list(VARIANTS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args)
        return
    from tqdm import tqdm

    results = {}
    for variant in tqdm(args.variants, desc="variants"):
        results[variant] = _measure(args, variant)
    print(f"\nrow of {args.tokens} tokens, {args.threads} threads in all, load {os.getloadavg()[0]:.1f}")
    print(f"{'variant':<11}{'ranks':>6}{'s/step':>9}{'rank-0 peak MiB':>17}")
    for variant, result in results.items():
        print(f"{variant:<11}{VARIANTS[variant][0]:>6}{result['seconds']:>9.2f}{result['peak_mib']:>17,.0f}")
    seconds = _adam(args.adam_params, args.threads)
    print(f"\ntorch fused CPU AdamW, {args.adam_params / 1e6:.0f}M fp32 parameters, {args.threads} threads: "
          f"{seconds:.3f} s/step = {args.adam_params / seconds / 1e6:.0f}M parameters/s")  # fmt: skip


if __name__ == "__main__":
    main()
