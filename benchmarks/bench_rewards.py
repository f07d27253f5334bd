"""Bursts of completions through the reward workers (rewards/workers.py) with the default config: wall time,
completions per second, and that nothing is timed out or scored wrongly by the burst itself.

    OMP_NUM_THREADS=1 python benchmarks/bench_rewards.py [--bursts 768 16000] [--code-share 0.125 0.0]
        [--processes 2] [--json out.json]

Burst 768 is one ScaleRL step (48 prompts x 16 completions) as the pipeline hands it over when a batch of
generations finishes together; burst 16,000 is a validation pass (1,000 prompts x 16). Completions are half
correct and half wrong: math on synthetic arithmetic and on symbolic answers (fractions, polynomials,
intervals) checked by Math-Verify, and a `--code-share` of synthetic `linear_code` programs (half call-based:
one sandbox run; half stdin/stdout: five runs) checked in the bubblewrap sandbox. Every completion's
expected verdict is known, so `misscored` counts any correct completion scored wrong or wrong one scored
right; `timeouts`, `crashes` and `hung` (workers killed past their deadline) should all be zero here.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from collections import Counter
from typing import Any

from megatron_rl.config import RewardsConfig
from megatron_rl.data.datasets import Prompt
from megatron_rl.data.synthetic import arithmetic_rows, arithmetic_solution, linear_code_rows, linear_code_solution
from megatron_rl.rewards.workers import RewardWorkers

# (reference answer, a correct final answer in another form, a wrong one)
SYMBOLIC = [
    ("\\frac{1}{2}", "0.5", "\\frac{1}{3}"),
    ("(x+1)^2", "x^2+2x+1", "x^2+1"),
    ("\\sqrt{8}", "2\\sqrt{2}", "3\\sqrt{2}"),
    ("[1, 3)", "[1,3)", "(1, 3]"),
    ("\\frac{\\pi}{4}", "\\pi/4", "\\pi/2"),
    ("3x^2 - 12", "3(x-2)(x+2)", "3(x-2)^2"),
]


def burst(size: int, code_share: float, seed: int = 0) -> list[tuple[str, Prompt, bool]]:
    """`size` (completion, prompt, should pass) triples, half of them correct."""
    rng = random.Random(seed)
    arithmetic: list[dict[str, Any]] = arithmetic_rows(seed)
    code: list[dict[str, Any]] = linear_code_rows(seed)
    jobs = []
    for i in range(size):
        correct = i % 2 == 0
        if rng.random() < code_share:
            row = code[i % len(code)]
            solution = linear_code_solution(row["prompt"])
            if not correct:
                solution = solution.replace("* x", "* x * x").replace("* n", "* n * n")
            prompt = Prompt(row["id"], "code", row["prompt"], tests=row["tests"])
        elif rng.random() < 0.25:
            answer, right, wrong = SYMBOLIC[i % len(SYMBOLIC)]
            solution = f"<think>working</think>The answer is $\\boxed{{{right if correct else wrong}}}$."
            prompt = Prompt(f"sym-{i % len(SYMBOLIC)}", "math", "Simplify.", answer)
        else:
            row = arithmetic[i % len(arithmetic)]
            solution = arithmetic_solution(row["prompt"])
            if not correct:
                solution = solution.replace(f"\\boxed{{{row['answer']}}}", f"\\boxed{{{int(row['answer']) + 1}}}")
            prompt = Prompt(row["id"], "math", row["prompt"], row["answer"])
        jobs.append((solution, prompt, correct))
    return jobs


def run_burst(size: int, code_share: float, processes: int) -> dict[str, float]:
    jobs = burst(size, code_share)
    workers = RewardWorkers(RewardsConfig(), processes=processes)

    async def score_all() -> tuple[list, float]:
        # Warm-up outside the clock: the workers start and import, each code path runs once.
        warm = [jobs[0]] + [job for job in jobs if job[1].task == "code"][:1]
        await asyncio.gather(*(workers.score(text, prompt) for text, prompt, _ in warm * processes))
        start = time.perf_counter()
        results = await asyncio.gather(*(workers.score(text, prompt) for text, prompt, _ in jobs))
        return results, time.perf_counter() - start

    try:
        results, elapsed = asyncio.run(score_all())
    finally:
        workers.close()
    failures = Counter(r.failure for r in results)
    return {
        "completions": size,
        "code share": sum(p.task == "code" for _, p, _ in jobs) / size,
        "workers": processes,
        "wall s": elapsed,
        "completions/s": size / elapsed,
        "timeouts": failures["timeout"],
        "crashes": failures["reward_crash"] + failures["reward_error"],
        "hung": getattr(workers, "hung_workers", float("nan")),
        "misscored": sum(
            r.passed != correct and r.failure != "timeout" for r, (_, _, correct) in zip(results, jobs, strict=True)
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bursts", type=int, nargs="+", default=[768, 16000])
    parser.add_argument("--code-share", type=float, nargs="+", default=[0.125, 0.125], help="one per burst")
    parser.add_argument("--processes", type=int, default=2, help="reward worker processes (the driver uses 2)")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    if len(args.code_share) != len(args.bursts):
        parser.error("--code-share takes one value per burst")
    rows = [run_burst(size, share, args.processes) for size, share in zip(args.bursts, args.code_share, strict=True)]
    columns = list(rows[0])
    print("| " + " | ".join(columns) + " |")
    print("|" + "---:|" * len(columns))
    for row in rows:
        cells = [
            f"{row[c]:.2f}" if c == "code share" else f"{row[c]:.1f}" if isinstance(row[c], float) else str(row[c])
            for c in columns
        ]
        print("| " + " | ".join(cells) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
