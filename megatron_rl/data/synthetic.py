"""Synthetic tasks that need no download: the CPU run's data and the tests'.

`linear_code`: "Write a Python function f(x) that returns 3 * x + 4." (call-based tests) or the same as a
stdin/stdout program, for math+code runs on CPU.

`arithmetic`: "What is 37 + 45?" with answer "82" (sums of 180 and more held out: `large_sum_rows`, the CPU
run's downstream benchmark). Its worked solution, used by the supervised warm-up
that gives the CPU run a non-zero starting pass rate, adds the columns right to left:

    <think>7+5=12 3+4+1=8</think>\\boxed{82}

With the Python tool (rollout/tools.py), a solution may instead run `print(37 + 45)` and box what it printed
(`arithmetic_program`); the warm-up teaches that call to a share of its solutions.

A worked solution can be written with deliberate slips (`slip`, the chance per step): a column sum off by
one (the carry and the boxed sum follow the slip), a coefficient off by one in a program. Warmed up on such
solutions, a policy knows the method and makes mistakes at a known rate, as a pretrained model does, and
RL's part is to remove them: the CPU run's rise then comes from what RL does, not from learning the task.

Rows are generated deterministically from a seed, so train/validation splits are reproducible.
"""

from __future__ import annotations

import random
from collections.abc import Callable

Row = dict[str, object]


HELD_OUT_SUM = 180
"""Additions whose sum is at least this are never training rows: they are the CPU demo's downstream set."""


def arithmetic_rows(seed: int = 0, max_operand: int = 99) -> list[Row]:
    """Every a + b with 0 <= a, b <= max_operand, shuffled by `seed`, except those with a + b >= HELD_OUT_SUM
    (`large_sum_rows`)."""
    rows: list[Row] = [
        {"id": f"add-{a}-{b}", "prompt": f"What is {a} + {b}?", "answer": str(a + b)}
        for a in range(max_operand + 1)
        for b in range(max_operand + 1)
        if a + b < HELD_OUT_SUM
    ]
    random.Random(seed).shuffle(rows)
    return rows


def large_sum_rows() -> list[Row]:
    """The 190 additions of two operands up to 99 whose sum is 180 or more: held out of `arithmetic_rows` (and so
    of the warm-up and validation), and harder (a three-digit sum from large digits in both columns), as a
    downstream benchmark is to a training distribution."""
    return [
        {"id": f"add-{a}-{b}", "problem": f"What is {a} + {b}?", "answer": str(a + b)}
        for a in range(100)
        for b in range(100)
        if a + b >= HELD_OUT_SUM
    ]


def arithmetic_solution(prompt: str, slip: float = 0.0, rng: random.Random | None = None) -> str:
    """The worked solution of an arithmetic prompt: column additions with carries, then the boxed sum. With
    `slip` > 0 each column sum is written one too high or too low with that chance, and the carry and the
    boxed sum follow what was written (a wrong answer reached consistently)."""
    a_text, b_text = prompt.removeprefix("What is ").removesuffix("?").split(" + ")
    a, b = int(a_text), int(b_text)
    steps, carry, answer = [], 0, 0
    for column in range(len(str(max(a, b)))):
        da, db = a // 10**column % 10, b // 10**column % 10
        total = da + db + carry
        if slip and rng is not None and rng.random() < slip:
            total = total + 1 if total == 0 or rng.random() < 0.5 else total - 1
        steps.append(f"{da}+{db}{'+1' if carry else ''}={total}")
        answer += total % 10 * 10**column
        carry = total // 10
    if carry:
        steps.append("0+0+1=1")
        answer += 10 ** len(steps[:-1])
    return f"<think>{' '.join(steps)}</think>\\boxed{{{answer}}}"


def arithmetic_program(prompt: str, slip: float = 0.0, rng: random.Random | None = None) -> tuple[str, str]:
    """The program a tool-using solution of an arithmetic prompt runs, and what it prints: `print(a + b)`. With
    `slip` > 0 an operand is copied one too high or too low with that chance (the output and the boxed answer
    follow the program: a wrong answer reached consistently, as with `arithmetic_solution`'s slips)."""
    a_text, b_text = prompt.removeprefix("What is ").removesuffix("?").split(" + ")
    a, b = int(a_text), int(b_text)
    if slip and rng is not None and rng.random() < slip:
        b = b + 1 if b == 0 or rng.random() < 0.5 else b - 1
    return f"print({a} + {b})", str(a + b)


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


def linear_code_solution(prompt: str, slip: float = 0.0, rng: random.Random | None = None) -> str:
    """The reference solution of a `linear_code_rows` prompt, in the completion format. With `slip` > 0 the
    constant term is written one too high with that chance."""
    words = prompt.rstrip(".").split()
    a, b = int(words[-5]), int(words[-1])  # "... returns|prints A * x|n + B"
    if slip and rng is not None and rng.random() < slip:
        b += 1
    if "function" in prompt:
        program = f"def f(x):\n    return {a} * x + {b}"
    else:
        program = f"n = int(input())\nprint({a} * n + {b})"
    return f"<think>{a}*x+{b}</think>```python\n{program}\n```"


SYNTHETIC_TASKS: dict[str, Callable[[int], list[Row]]] = {
    "arithmetic": arithmetic_rows,
    "linear_code": linear_code_rows,
}

Solution = Callable[..., str]
"""`solution(prompt, slip=0.0, rng=None) -> completion text`."""

SOLUTIONS: dict[str, Solution] = {
    "arithmetic": arithmetic_solution,
    "linear_code": linear_code_solution,
}
"""Worked solutions per synthetic task, for the supervised warm-up."""

Program = Callable[..., tuple[str, str]]
"""`program(prompt, slip=0.0, rng=None) -> (Python program, what it prints)`."""

PROGRAMS: dict[str, Program] = {"arithmetic": arithmetic_program}
"""Per synthetic task, the program a solution that calls the Python tool runs (the warm-up's tool solutions)."""
