"""Synthetic tasks that need no download: the CPU run's data and the tests'.

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


SYNTHETIC_TASKS: dict[str, Callable[[int], list[Row]]] = {
    "arithmetic": arithmetic_rows,
}
