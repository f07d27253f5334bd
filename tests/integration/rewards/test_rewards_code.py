"""Code reward: program extraction, both shipped test formats (plus asserts), failure reasons, partial credit."""

import dataclasses

import pytest

from megatron_rl.config import RewardsConfig, SandboxConfig
from megatron_rl.data.datasets import Prompt
from megatron_rl.data.synthetic import linear_code_rows, linear_code_solution
from megatron_rl.rewards import REWARDS, score
from megatron_rl.rewards.code import FAILURES, code_reward, extract_program, normalise_output
from megatron_rl.rewards.sandbox import isolation_problem

CFG = RewardsConfig(sandbox=SandboxConfig(wall_time_s=20.0, cpu_time_s=2.0, memory_mb=256, max_output_bytes=1 << 16))
PARTIAL = dataclasses.replace(CFG, code_partial_credit=True)

needs_isolation = pytest.mark.skipif(
    isolation_problem(CFG.sandbox) is not None, reason=f"no isolation here: {isolation_problem(CFG.sandbox)}"
)

STDIO = {"inputs": ["5\n", "0\n", "-2\n"], "outputs": ["19\n", "4\n", "-2\n"]}  # 3 * n + 4
CALL = {"fn_name": "f", "inputs": [[5], [0], [-2]], "outputs": [19, 4, -2]}


def fenced(program: str, thinking: str = "<think>let me see</think>") -> str:
    return f"{thinking}Here it is:\n```python\n{program}\n```\n"


def test_extract_program_takes_the_last_block_after_thinking():
    completion = "<think>```python\nprint('draft')\n```</think>first\n```\nprint(1)\n```\nfinal\n```py\nprint(2)\n```"
    assert extract_program(completion) == "print(2)\n"
    assert extract_program("<think>```python\nprint(1)\n```") is None  # thinking never closed
    assert extract_program("no code here") is None
    assert extract_program("```python\nprint(1)") is None  # unclosed fence
    assert extract_program("```python\n\n```") is None


def test_normalise_output():
    assert normalise_output("  1   2 \n3\t4\n\n") == normalise_output("1 2\n3 4")
    assert normalise_output("1 2\n3 4") != normalise_output("1 2 3 4")
    assert normalise_output("1\n\n2") != normalise_output("1\n2")


@needs_isolation
@pytest.mark.parametrize("tests", [STDIO, CALL], ids=["stdio", "call"])
def test_correct_passes_and_wrong_fails(tests):
    if "fn_name" in tests:
        right, wrong = "def f(x):\n    return 3 * x + 4", "def f(x):\n    return 3 * x + 5"
    else:
        right, wrong = "n = int(input())\nprint(3 * n + 4)", "n = int(input())\nprint(3 * n + 5)"
    assert code_reward(fenced(right), tests, CFG) == code_reward(fenced(right), tests, CFG)
    good = code_reward(fenced(right), tests, CFG)
    bad = code_reward(fenced(wrong), tests, CFG)
    assert (good.reward, good.passed, good.failure) == (1.0, True, None)
    assert (bad.reward, bad.passed, bad.failure) == (-1.0, False, "wrong_answer")


@needs_isolation
def test_synthetic_linear_code_tasks_through_the_registry():
    rows = linear_code_rows()
    picked = [
        next(r for r in rows if r["id"].startswith("linfn")),
        next(r for r in rows if r["id"].startswith("linio")),
    ]
    for row in picked:
        prompt = Prompt(id=row["id"], task="code", prompt=row["prompt"], tests=row["tests"])
        solution = linear_code_solution(row["prompt"])
        assert score(solution, prompt, CFG).passed, row["id"]
        broken = solution.replace("* x", "* x * x").replace("* n", "* n * n")
        assert score(broken, prompt, CFG).failure == "wrong_answer", row["id"]
    assert "code" in REWARDS


@needs_isolation
def test_assert_based_tests():
    tests = {"asserts": ["assert f(1) == 2", "assert f(10) == 11"]}
    assert code_reward(fenced("def f(x):\n    return x + 1"), tests, CFG).passed
    result = code_reward(fenced("def f(x):\n    return 2"), tests, CFG)
    assert (result.passed, result.failure) == (False, "wrong_answer")


@needs_isolation
def test_call_based_dataset_quirks():
    # LeetCode-style class, TACO-style wrapped outputs, tuples; LiveCodeBench's JSON-lines case list.
    tests = {"fn_name": "twoSum", "inputs": [[[2, 7, 11], 9], [[3, 3], 6]], "outputs": [[0, 1], [[0, 1]]]}
    program = "class Solution:\n    def twoSum(self, nums, target):\n        return (0, 1)"
    assert code_reward(fenced(program), tests, CFG).passed
    lcb = [
        {"input": "[2, 7, 11]\n9", "output": "[0, 1]", "testtype": "functional", "metadata": {"func_name": "twoSum"}}
    ]
    assert code_reward(fenced(program), lcb, CFG).passed
    # A `__main__` block reading stdin is not run for call-based tests.
    program = "def f(x):\n    return 3 * x + 4\nif __name__ == '__main__':\n    print(f(int(input())))"
    assert code_reward(fenced(program), CALL, CFG).passed


@needs_isolation
def test_expected_values_are_compared_as_the_values_they_are():
    returns_text, returns_number = "def f(x):\n    return '21'", "def f(x):\n    return 21"
    # TACO/APPS store values: the expected string "21" is a string, not JSON text for the number 21.
    taco = {"fn_name": "f", "inputs": [[1]], "outputs": ["21"]}
    assert code_reward(fenced(returns_text), taco, CFG).passed
    assert code_reward(fenced(returns_number), taco, CFG).failure == "wrong_answer"
    # LiveCodeBench stores JSON text: '"21"' is the string, '21' the number.
    for output, right, wrong in [('"21"', returns_text, returns_number), ("21", returns_number, returns_text)]:
        lcb = [{"input": "1", "output": output, "testtype": "functional", "metadata": {"func_name": "f"}}]
        assert code_reward(fenced(right), lcb, CFG).passed, output
        assert code_reward(fenced(wrong), lcb, CFG).failure == "wrong_answer", output


@needs_isolation
def test_deepcoder_case_lists():
    stdio = [{"input": "1 2\n", "output": "3\n"}, {"input": "5 5\n", "output": "10"}]
    adder = "a, b = map(int, input().split())\nprint(a + b)"
    assert code_reward(fenced(adder), stdio, CFG).passed
    functional = [
        {"input": "[1, 2]\n3", "output": "[1, 2, 3]", "testtype": "functional", "metadata": {"func_name": "push"}}
    ]
    assert code_reward(fenced("def push(xs, x):\n    return xs + [x]"), functional, CFG).passed
    assert code_reward(fenced("def push(xs, x):\n    return xs"), functional, CFG).failure == "wrong_answer"
    with pytest.raises(ValueError, match="func_name"):
        code_reward(fenced("print(1)"), [{"input": "1", "output": "1", "testtype": "functional"}], CFG)


@needs_isolation
@pytest.mark.parametrize(
    ("program", "tests", "failure"),
    [
        ("def f(x) return x", CALL, "compile_error"),
        ("n = int(input(\nprint(n)", STDIO, "compile_error"),
        ("def f(x):\n    return 1 / 0", CALL, "crash"),
        ("raise SystemExit(2)", STDIO, "crash"),
        ("def g(x):\n    return x", CALL, "crash"),  # no function f
        ("import os\nos._exit(0)", CALL, "crash"),  # ends before reporting any result
        ("def f(x):\n    while True:\n        pass", CALL, "timeout"),
        ("while True:\n    pass", STDIO, "timeout"),
        ("def f(x):\n    return bytearray(10 ** 12)", CALL, "memory"),
        ("x = bytearray(10 ** 12)", STDIO, "memory"),
        ("while True:\n    print('y' * 1000)", STDIO, "output_limit"),
    ],
)
def test_failure_reasons(program, tests, failure):
    result = code_reward(fenced(program), tests, CFG)
    assert (result.reward, result.passed, result.failure) == (-1.0, False, failure)
    assert failure in FAILURES


def test_no_code_is_a_failure_without_running_anything():
    result = code_reward("<think>hmm</think> the answer is 19", STDIO, CFG)
    assert (result.reward, result.passed, result.failure) == (-1.0, False, "no_code")


@needs_isolation
def test_partial_credit():
    half_right = "def f(x):\n    return 3 * x + 4 if x >= 0 else 0"  # 2 of 3 cases
    result = code_reward(fenced(half_right), CALL, PARTIAL)
    assert result.reward == pytest.approx(-1.0 + 2.0 * 2 / 3)
    assert (result.passed, result.failure) == (False, "wrong_answer")
    stdio_half = "n = int(input())\nprint(3 * n + 4 if n >= 0 else 0)"
    assert code_reward(fenced(stdio_half), STDIO, PARTIAL).reward == pytest.approx(-1.0 + 2.0 * 2 / 3)
    assert code_reward(fenced(stdio_half), STDIO, CFG).reward == -1.0


@pytest.mark.parametrize(
    "tests",
    [{}, {"inputs": ["1"], "outputs": []}, {"inputs": [], "outputs": []}, {"asserts": []}, {"fn_name": "f"}],
)
def test_malformed_tests_are_rejected(tests):
    with pytest.raises(ValueError, match="code tests"):
        code_reward(fenced("print(1)"), tests, CFG)
