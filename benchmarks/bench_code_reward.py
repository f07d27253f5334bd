"""Throughput of the code reward per test format: completions scored per second, one at a time and with
several scored concurrently (as the reward workers do), half of them correct.

    OMP_NUM_THREADS=1 python benchmarks/bench_code_reward.py [--completions 40] [--concurrency 1 4]

Formats: stdin/stdout (3 cases: three sandbox runs), call-based (3 cases, one run), an assert list (4 asserts,
one judged run: the judge's process and the solution's side by side), and a HumanEval-style `check(candidate)`
with its prompt as setup (judged; `--skip-humaneval` for code that cannot run it). The judged formats cost two
sandboxes and a relayed call per value; the table in benchmarks/README.md says how much against the one-process
harness that judged assert lists before.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import time

from megatron_rl.config import RewardsConfig
from megatron_rl.rewards.code import code_reward

FORMATS = {
    "stdin/stdout (3 cases)": (
        {"inputs": ["5\n", "0\n", "-2\n"], "outputs": ["19\n", "4\n", "-2\n"]},
        "n = int(input())\nprint(3 * n + 4)",
        "n = int(input())\nprint(3 * n + 5)",
    ),
    "call-based (3 cases)": (
        {"fn_name": "f", "inputs": [[5], [0], [-2]], "outputs": [19, 4, -2]},
        "def f(x):\n    return 3 * x + 4",
        "def f(x):\n    return 3 * x + 5",
    ),
    "assert list (4 asserts)": (
        {"asserts": ["assert f(5) == 19", "assert f(0) == 4", "assert f(-2) == -2", "assert f(1)"]},
        "def f(x):\n    return 3 * x + 4",
        "def f(x):\n    return 3 * x + 5",
    ),
    "HumanEval check(candidate) (4 asserts)": (
        {
            "asserts": [
                "\nMETADATA = {}\n\ndef check(candidate):\n    assert candidate(5) == 19\n"
                "    assert candidate(0) == 4\n    assert candidate(-2) == -2\n    assert candidate(1)\n\ncheck(f)\n"
            ],
            "setup": 'def f(x: int) -> int:\n    """3x + 4."""\n',
            "entry_point": "f",
        },
        "def f(x):\n    return 3 * x + 4",
        "def f(x):\n    return 3 * x + 5",
    ),
}


def rate(tests: dict, right: str, wrong: str, count: int, concurrency: int) -> tuple[float, int]:
    cfg = RewardsConfig()
    completions = [f"```python\n{right if i % 2 == 0 else wrong}\n```" for i in range(count)]
    code_reward(completions[0], tests, cfg)  # start the pool and warm the page cache
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(lambda text: code_reward(text, tests, cfg), completions))
    elapsed = time.perf_counter() - start
    misscored = sum(result.passed != (i % 2 == 0) for i, result in enumerate(results))
    return count / elapsed, misscored


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--completions", type=int, default=40)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--skip-humaneval", action="store_true")
    args = parser.parse_args()
    table = {}
    for name, (tests, right, wrong) in FORMATS.items():
        if args.skip_humaneval and name.startswith("HumanEval"):
            continue
        table[name] = {c: rate(tests, right, wrong, args.completions, c) for c in args.concurrency}
        cells = "  ".join(f"{c}: {r:.1f}/s (misscored {m})" for c, (r, m) in table[name].items())
        print(f"{name:42s} {cells}", flush=True)
    print(json.dumps({name: {c: round(r, 2) for c, (r, _) in row.items()} for name, row in table.items()}))


if __name__ == "__main__":
    main()
