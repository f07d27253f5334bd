"""Programs per second through the code sandbox's pool (rewards/sandbox.py), and code rewards per second.

    OMP_NUM_THREADS=1 python benchmarks/bench_sandbox.py [--programs 200] [--workers 1 2 4 8] [--json out.json]

Workloads: `print(1)` (pure sandbox overhead: bwrap, namespaces, interpreter start), a stdin/stdout
solution of the synthetic linear task, and a program that burns ~50 ms of CPU; each also without the
per-sandbox cgroup where one is used (root), to show its cost. Baseline: the same
programs run by the same interpreter (`python3 -I -c`) as plain subprocesses on a thread pool of the same
width, without isolation or limits.
Last, `code_reward` on synthetic `linear_code` completions (half stdin/stdout with 5 runs each, half
call-based with one run each), in completions per second.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import subprocess
import time

from megatron_rl.config import RewardsConfig, SandboxConfig
from megatron_rl.data.synthetic import linear_code_rows, linear_code_solution
from megatron_rl.rewards import sandbox as sandbox_module
from megatron_rl.rewards.code import code_reward
from megatron_rl.rewards.sandbox import Sandbox, sandbox_python

PROGRAMS = {
    "print(1)": ("print(1)", b""),
    "stdin solution": ("n = int(input())\nprint(3 * n + 4)", b"13\n"),
    "~50 ms CPU": ("s = 0\nfor i in range(1_500_000):\n    s += i\nprint(s)", b""),
}


def sandbox_rate(workers: int, program: str, stdin: bytes, count: int, cgroups: bool = True) -> float:
    sandbox_module.USE_CGROUPS = cgroups
    box = Sandbox(SandboxConfig(workers=workers, wall_time_s=60.0))
    try:
        box.run(program, stdin)  # warm the page cache
        start = time.perf_counter()
        results = box.map([(program, stdin)] * count)
        elapsed = time.perf_counter() - start
    finally:
        box.close()
        sandbox_module.USE_CGROUPS = True
    assert all(r.status == "ok" for r in results), {r.status for r in results}
    return count / elapsed


def bare_rate(workers: int, program: str, stdin: bytes, count: int) -> float:
    def one(_: int) -> int:
        return subprocess.run([python, "-I", "-c", program], input=stdin, capture_output=True).returncode

    python = sandbox_python()[0]

    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        start = time.perf_counter()
        codes = list(pool.map(one, range(count)))
        elapsed = time.perf_counter() - start
    assert codes == [0] * count
    return count / elapsed


def reward_rate(workers: int, count: int) -> float:
    cfg = RewardsConfig(sandbox=SandboxConfig(workers=workers, wall_time_s=60.0))
    rows = linear_code_rows()[:count]
    code_reward(linear_code_solution(rows[0]["prompt"]), rows[0]["tests"], cfg)  # start the pool
    start = time.perf_counter()
    passed = [code_reward(linear_code_solution(row["prompt"]), row["tests"], cfg).passed for row in rows]
    elapsed = time.perf_counter() - start
    assert all(passed)
    return count / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--programs", type=int, default=200)
    parser.add_argument("--completions", type=int, default=60)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    table: dict[str, dict[int, float]] = {}
    for name, (program, stdin) in PROGRAMS.items():
        table[f"sandbox: {name}"] = {w: sandbox_rate(w, program, stdin, args.programs) for w in args.workers}
        if sandbox_module._cgroups() is not None:
            table[f"sandbox without cgroup: {name}"] = {
                w: sandbox_rate(w, program, stdin, args.programs, cgroups=False) for w in args.workers
            }
        table[f"bare python: {name}"] = {w: bare_rate(w, program, stdin, args.programs) for w in args.workers}
    table["code_reward (completions/s)"] = {w: reward_rate(w, args.completions) for w in args.workers}

    print("| workload | " + " | ".join(f"{w} workers" for w in args.workers) + " |")
    print("|---|" + "---:|" * len(args.workers))
    for name, rates in table.items():
        print(f"| {name} | " + " | ".join(f"{rates[w]:.1f}" for w in args.workers) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(table, f, indent=2)


if __name__ == "__main__":
    main()
