"""Synthetic tasks that need no download: the CPU run's data and the tests'.

`linear_code`: "Write a Python function f(x) that returns 3 * x + 4." (call-based tests) or the same as a
stdin/stdout program, for math+code runs on CPU.

`arithmetic`: "What is 37 + 45?" with answer "82". Its worked solution, used by the supervised warm-up
that gives the CPU run a non-zero starting pass rate, adds the columns right to left:

    <think>7+5=12 3+4+1=8</think>\\boxed{82}

Rows are generated deterministically from a seed, so train/validation splits are reproducible.
"""

from __future__ import annotations

import random
from collections.abc import Callable

Row = dict[str, object]


def arithmetic_rows(seed: int = 0, max_operand: int = 99) -> list[Row]:
    """Every a + b with 0 <= a, b <= max_operand, shuffled by `seed`."""
    rows: list[Row] = [
        {"id": f"add-{a}-{b}", "prompt": f"What is {a} + {b}?", "answer": str(a + b)}
        for a in range(max_operand + 1)
        for b in range(max_operand + 1)
    ]
    random.Random(seed).shuffle(rows)
    return rows


def arithmetic_solution(prompt: str) -> str:
    """The worked solution of an arithmetic prompt: column additions with carries, then the boxed sum."""
    a_text, b_text = prompt.removeprefix("What is ").removesuffix("?").split(" + ")
    a, b = int(a_text), int(b_text)
    steps, carry = [], 0
    for column in range(len(str(max(a, b)))):
        da, db = a // 10**column % 10, b // 10**column % 10
        total = da + db + carry
        steps.append(f"{da}+{db}{'+1' if carry else ''}={total}")
        carry = total // 10
    if carry:
        steps.append("0+0+1=1")
    return f"<think>{' '.join(steps)}</think>\\boxed{{{a + b}}}"


def linear_code_rows(seed: int = 0, max_coefficient: int = 9) -> list[Row]:
    """Code problems "f(x) = a*x + b", half call-based (a function) and half stdin/stdout (a program)."""
    rows: list[Row] = []
    for a in range(1, max_coefficient + 1):
        for b in range(0, max_coefficient + 1):
            xs = [0, 1, 2, 7, 13]
            rows.append(
                {
                    "id": f"linfn-{a}-{b}",
                    "prompt": f"Write a Python function f(x) that returns {a} * x + {b}.",
                    "tests": {"fn_name": "f", "inputs": [[x] for x in xs], "outputs": [a * x + b for x in xs]},
                }
            )
            rows.append(
                {
                    "id": f"linio-{a}-{b}",
                    "prompt": f"Write a Python program that reads an integer n and prints {a} * n + {b}.",
                    "tests": {"inputs": [f"{x}\n" for x in xs], "outputs": [f"{a * x + b}\n" for x in xs]},
                }
            )
    random.Random(seed).shuffle(rows)
    return rows


def linear_code_solution(prompt: str) -> str:
    """The reference solution of a `linear_code_rows` prompt, in the completion format."""
    words = prompt.rstrip(".").split()
    a, b = int(words[-5]), int(words[-1])  # "... returns|prints A * x|n + B"
    if "function" in prompt:
        program = f"def f(x):\n    return {a} * x + {b}"
    else:
        program = f"n = int(input())\nprint({a} * n + {b})"
    return f"<think>{a}*x+{b}</think>```python\n{program}\n```"


SYNTHETIC_TASKS: dict[str, Callable[[int], list[Row]]] = {
    "arithmetic": arithmetic_rows,
    "linear_code": linear_code_rows,
}

SOLUTIONS: dict[str, Callable[[str], str]] = {
    "arithmetic": arithmetic_solution,
    "linear_code": linear_code_solution,
}
"""Worked solutions per synthetic task, for the supervised warm-up."""
