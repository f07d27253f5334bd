"""SGLang on CPU, standalone, on the default run's request shape: the throughput the loop's generator is held to.

    OMP_NUM_THREADS=1 python benchmarks/bench_engine.py [--prompts 256] [--variants default skip-tokenizer-init]

One `SGLangServer` serving the warmed-up `cpu_demo` policy of the default run (`scalerl-cpu`), fed by the
project's own client (`SGLangClient.generate`, called once per completion as the loop calls it: the calls made
in one turn of the event loop go out as batched `/generate` requests of up to 64):
prompts from the run's training split, encoded as the run encodes them, `generations_per_prompt` samples
each at temperature 1, up to `--tokens` new tokens (ignore_eos, so every variant generates the same count),
with `--concurrency` requests outstanding (the loop keeps about two batches of groups in flight: 2 x 16 x 8).
Variants differ only in SGLang's server flags:

- default: the flags `SGLangServer` passes on CPU;
- skip-tokenizer-init: `--skip-tokenizer-init` (the loop sends and reads token ids only, so SGLang's
  tokenizer and detokenizer work is unused; `SGLangServer` passes it since);
- no-overlap: `--disable-overlap-schedule` (SGLang's overlap scheduler runs the forward in a thread of its own
  while the main thread processes the previous batch's results; on a CPU engine of one torch thread that
  overlap only pays where a core is free).

Prints one table: requests/s, generated tokens/s, wall seconds, and the CPU milliseconds per request of the
HTTP server process and of the engine's other processes (the scheduler and the detokenizer): on the loop's
2 cores the engine's CPU, not its wall time alone, is what the trainer competes with. Compare tokens/s with the
loop's `train/tokens` rate (benchmarks/README.md, "Default run"). A second table reads each process's memory
after the load (/proc/<pid>/smaps): PSS, private, and where the private pages are (the brk heap, anonymous
mappings, the largest of them: the scheduler's KV pool).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import random
import time
from pathlib import Path

import psutil

from megatron_rl.config import load_config
from megatron_rl.data.datasets import load_splits
from megatron_rl.generator.client import SGLangClient
from megatron_rl.generator.server import SGLangServer
from megatron_rl.orchestration.warmstart import prepare_policy
from megatron_rl.rollout.session import PromptEncoder

VARIANTS: dict[str, list[str]] = {
    "default": [],
    "skip-tokenizer-init": ["--skip-tokenizer-init"],
    "no-overlap": ["--disable-overlap-schedule"],
}


async def _load(url: str, prompts: list[list[int]], group: int, tokens: int, concurrency: int) -> tuple[float, int]:
    client = SGLangClient(url)
    gate = asyncio.Semaphore(concurrency)
    generated = 0

    async def one(ids: list[int]) -> None:
        nonlocal generated
        async with gate:
            out = await client.generate(ids, tokens, [], extra_params={"ignore_eos": True})
            generated += len(out.tokens)

    try:
        await asyncio.gather(*(one(p) for p in prompts[:8]))  # first requests: allocator and kernels warm
        generated = 0
        start = time.perf_counter()
        await asyncio.gather(*(one(p) for p in prompts for _ in range(group)))
        return time.perf_counter() - start, generated
    finally:
        await client.close()


def _cpu_seconds(pid: int) -> float:
    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


def _children_cpu_seconds(pid: int) -> float:
    """The server's own processes besides the HTTP one (the scheduler, the detokenizer)."""
    total = 0.0
    for child in psutil.Process(pid).children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess):
            times = child.cpu_times()
            total += times.user + times.system
    return total


def _smaps(pid: int) -> dict[str, float]:
    """MiB of one process: PSS, private (what ending it frees), and of the private: the brk heap, anonymous
    mappings, and the largest anonymous mapping (the scheduler's KV pool)."""
    out = {"pss": 0.0, "private": 0.0, "heap": 0.0, "anonymous": 0.0, "largest anonymous": 0.0}
    name, mapping_private = "", 0.0

    def close_mapping() -> None:
        if name == "[heap]":
            out["heap"] += mapping_private
        elif name == "":
            out["anonymous"] += mapping_private
            out["largest anonymous"] = max(out["largest anonymous"], mapping_private)

    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            parts = line.split()
            if "-" in parts[0] and not parts[0].endswith(":"):  # a mapping's header line
                close_mapping()
                name, mapping_private = (parts[5] if len(parts) > 5 else ""), 0.0
            elif parts[0] == "Pss:":
                out["pss"] += int(parts[1]) / 1024
            elif parts[0] in ("Private_Clean:", "Private_Dirty:"):
                out["private"] += int(parts[1]) / 1024
                mapping_private += int(parts[1]) / 1024
    close_mapping()
    return out


def _memory(pid: int) -> dict[str, dict[str, float]]:
    """The server's processes by role, as `_smaps` reads them."""
    roles = {}
    for process in [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]:
        with contextlib.suppress(psutil.NoSuchProcess, FileNotFoundError):
            title = " ".join(process.cmdline())
            role = next((r for r in ("scheduler", "detokenizer") if f"sglang::{r}" in title), "HTTP server")
            roles[role] = _smaps(process.pid)
    return roles


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=27, help="new tokens per request (the run's mean: ~27)")
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--work", default="/tmp/bench_engine")
    args = parser.parse_args()

    run = load_config("scalerl-cpu")
    splits = load_splits(run.data)
    policy = prepare_policy(run, splits)
    from transformers import AutoTokenizer

    encoder = PromptEncoder(AutoTokenizer.from_pretrained(policy), run.data.system_prompt, run.data.chat_template)
    train = [p for source in splits.train.values() for p in source]
    prompts = [encoder.encode(p) for p in random.Random(0).sample(train, args.prompts)]
    group = run.rollout.generations_per_prompt
    results = []
    for variant in args.variants:
        engine = dataclasses.replace(run.rollout.engine, extra_args=VARIANTS[variant])
        work = Path(args.work)
        work.mkdir(parents=True, exist_ok=True)
        server = SGLangServer(policy, engine, work / f"{variant}.log")
        server.start()
        try:
            asyncio.run(server.wait_ready(timeout_s=600))
            http_before, engine_before = _cpu_seconds(server.pid), _children_cpu_seconds(server.pid)
            seconds, generated = asyncio.run(_load(server.url, prompts, group, args.tokens, args.concurrency))
            http_cpu = _cpu_seconds(server.pid) - http_before
            engine_cpu = _children_cpu_seconds(server.pid) - engine_before
            memory = _memory(server.pid)
        finally:
            server.stop()
        requests = len(prompts) * group
        results.append(
            {
                "variant": variant,
                "requests": requests,
                "seconds": seconds,
                "requests_per_s": requests / seconds,
                "tokens_per_s": generated / seconds,
                "http_cpu_ms_per_request": 1000 * http_cpu / requests,
                "engine_cpu_ms_per_request": 1000 * engine_cpu / requests,
                "memory_mib": memory,
            }
        )
    print(f"\n{args.prompts} prompts x {group} samples, {args.tokens} new tokens each, {args.concurrency} in flight\n")
    print("| variant | requests/s | generated tokens/s | wall s | HTTP CPU ms / request | engine CPU ms / request |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in results:
        print(
            f"| {r['variant']} | {r['requests_per_s']:.0f} | {r['tokens_per_s']:.0f} | {r['seconds']:.1f} | "
            f"{r['http_cpu_ms_per_request']:.2f} | {r['engine_cpu_ms_per_request']:.2f} |"
        )
    print("\nMemory after the load, MiB: PSS / private (of the private: heap, anonymous, largest anonymous mapping)\n")
    print("| variant | process | PSS | private | heap | anonymous | largest anonymous |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for r in results:
        for role, m in r["memory_mib"].items():
            print(
                f"| {r['variant']} | {role} | {m['pss']:.0f} | {m['private']:.0f} | {m['heap']:.0f} | "
                f"{m['anonymous']:.0f} | {m['largest anonymous']:.0f} |"
            )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
