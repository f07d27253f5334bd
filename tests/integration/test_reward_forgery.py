"""Code rewards a policy cannot forge: every attempt to make the harness report success without computing the
right values scores as a failure, in the real bubblewrap sandbox, while HumanEval-style tests of canonical
solutions (loops, tolerances, `is None`, tuples, sets, dicts, `not`) still pass and wrong solutions still fail.

The attacks are those an RL policy optimising against the reward could find: writing the harness's report
itself (on every open descriptor, through /proc/self/fd, through the harness's frames), exiting early after a
fabricated report, rewriting the harness's globals, `json` or the builtins, returning objects whose `==` (or
truth, or `!=`) always answers as the test wants, and reading the expected values from the sandbox's files.
"""

from __future__ import annotations

import pytest

from megatron_rl.config import RewardsConfig, SandboxConfig
from megatron_rl.data.assert_tests import UnsupportedTest, plan_asserts
from megatron_rl.rewards.code import code_reward
from megatron_rl.rewards.sandbox import isolation_problem

CFG = RewardsConfig(sandbox=SandboxConfig(wall_time_s=20.0, cpu_time_s=2.0, memory_mb=256, max_output_bytes=1 << 16))

pytestmark = pytest.mark.skipif(
    isolation_problem(CFG.sandbox) is not None, reason=f"no isolation here: {isolation_problem(CFG.sandbox)}"
)

ASSERTS = {"asserts": ["assert f(1) == 21", "assert f(2) == 42", "assert f(3) != 0", "assert f(4)"]}
CALL = {"fn_name": "f", "inputs": [[1], [2], [3]], "outputs": [21, 42, 63]}
RIGHT = "def f(x):\n    return 21 * x\n"

FORGED_LINE = '{"ok": true, "value": 21}'
ATTACKS = {
    "every-descriptor": f"""
import os
for fd in range(0, 256):
    try:
        os.write(fd, b'{{"ok": true}}\\n' * 8 + b'{FORGED_LINE}\\n' * 8)
    except OSError:
        pass
def f(x):
    return 0
""",
    "proc-self-fd": f"""
import os
for name in os.listdir("/proc/self/fd"):
    try:
        with open(os.path.join("/proc/self/fd", name), "w") as out:
            out.write('{FORGED_LINE}\\n' * 8)
    except OSError:
        pass
def f(x):
    return 0
""",
    "early-exit-with-report": f"""
import os, sys
for fd in (1, 3, 4, 5, 6, 7):
    try:
        os.write(fd, b'{FORGED_LINE}\\n' * 8)
    except OSError:
        pass
os._exit(0)
""",
    "harness-frames": f"""
import sys
frame = sys._getframe()
while frame is not None:
    results = frame.f_locals.get("results")
    if results is not None:
        results.write('{FORGED_LINE}\\n' * 8)
        results.flush()
    frame = frame.f_back
def f(x):
    return 0
""",
    "rewritten-globals-json-builtins": """
import builtins, json, __main__
json.dumps = lambda *args, **kwargs: '{"ok": true, "value": 21}'
__main__.encode_value = lambda value, depth=0: 21
builtins.AssertionError = type("Never", (Exception,), {})
def f(x):
    return 0
""",
    "always-equal-object": """
class Anything:
    def __eq__(self, other): return True
    def __ne__(self, other): return True
    def __bool__(self): return True
    def __hash__(self): return 0
def f(x):
    return Anything()
""",
    "equal-int-subclass": """
class Liar(int):
    def __eq__(self, other): return True
    def __ne__(self, other): return False
    def __index__(self): return 21
    def __int__(self): return 21
def f(x):
    return Liar(0)
""",
    "read-expected-from-files": """
import os, re, json
numbers = []
for root, _, files in os.walk(os.path.dirname(os.path.abspath(__file__)) or "."):
    for name in files:
        try:
            numbers += [int(n) for n in re.findall(r"-?\\d+", open(os.path.join(root, name)).read())]
        except (OSError, UnicodeDecodeError):
            pass
seen = sorted(set(numbers))
def f(x):
    return max(seen) if seen else 0
""",
}


def _fenced(program: str) -> str:
    return f"<think>hmm</think>\n```python\n{program}\n```\n"


@pytest.mark.parametrize("attack", list(ATTACKS))
@pytest.mark.parametrize("tests", [ASSERTS, CALL], ids=["asserts", "call"])
def test_every_forgery_scores_as_a_failure(attack, tests):
    result = code_reward(_fenced(ATTACKS[attack]), tests, CFG)
    assert (result.reward, result.passed) == (CFG.incorrect, False), (attack, result)


@pytest.mark.parametrize("tests", [ASSERTS, CALL], ids=["asserts", "call"])
def test_the_right_program_passes_the_same_tests(tests):
    assert code_reward(_fenced(RIGHT), tests, CFG).passed


# HumanEval-style problems: each test in the forms HumanEval's `check(candidate)` uses, with the candidate named.
HUMANEVAL = {
    "has_close_elements": (
        """
def has_close_elements(numbers, threshold):
    return any(abs(a - b) < threshold for i, a in enumerate(numbers) for b in numbers[i + 1:])
""",
        """
def has_close_elements(numbers, threshold):
    return any(abs(a - b) <= threshold for i, a in enumerate(numbers) for b in numbers[i + 1:])
""",
        [
            "assert has_close_elements([1.0, 2.0, 3.9, 4.0, 5.0, 2.2], 0.3) == True",
            "assert has_close_elements([1.0, 2.0, 3.9, 4.0, 5.0, 2.2], 0.05) == False",
            "assert not has_close_elements([1.0, 2.0, 3.0], 1.0)",
            "assert has_close_elements([1.1, 2.2, 3.1, 4.1, 5.1], 1.0) == True",
        ],
    ),
    "truncate_number": (
        "def truncate_number(number):\n    return number % 1.0\n",
        "def truncate_number(number):\n    return round(number % 1.0, 1)\n",
        [
            "assert truncate_number(3.5) == 0.5",
            "assert abs(truncate_number(1.33) - 0.33) < 1e-6",
            "assert math.isclose(truncate_number(123.456), 0.456, abs_tol=1e-6)",
        ],
    ),
    "sum_product": (
        "def sum_product(numbers):\n    p = 1\n    for n in numbers:\n        p *= n\n    return sum(numbers), p\n",
        "def sum_product(numbers):\n    return [sum(numbers), 1]\n",
        [
            "assert sum_product([]) == (0, 1)",
            "assert sum_product([3, 5, 7]) == (3 + 5 + 7, 3 * 5 * 7)",
            "for n in range(1, 6):\n    assert sum_product(list(range(n))) == (n * (n - 1) // 2, 0)",
        ],
    ),
    "first_repeat": (
        """
def first_repeat(items):
    seen = set()
    for item in items:
        if item in seen:
            return item
        seen.add(item)
    return None
""",
        "def first_repeat(items):\n    return items[0] if items else None\n",
        [
            "assert first_repeat([1, 2, 3]) is None",
            "assert first_repeat(['a', 'b', 'a']) == 'a'",
            "result = first_repeat([5, 6, 6, 5])\nassert result == 6 and result in {5, 6}",
            "assert [first_repeat([i, i]) for i in range(3)] == [0, 1, 2]",
        ],
    ),
    "histogram": (
        """
def histogram(text):
    counts = {}
    for word in text.split():
        counts[word] = counts.get(word, 0) + 1
    top = max(counts.values(), default=0)
    return {w: c for w, c in counts.items() if c == top}, set(counts)
""",
        "def histogram(text):\n    return {}, set()\n",
        [
            "assert histogram('a b b a') == ({'a': 2, 'b': 2}, {'a', 'b'})",
            "assert histogram('') == ({}, set())",
            "assert len(histogram('r t g')[1]) == 3",
        ],
    ),
}


@pytest.mark.parametrize("problem", list(HUMANEVAL))
def test_humaneval_style_tests_pass_the_canonical_solution_and_fail_a_wrong_one(problem):
    right, wrong, asserts = HUMANEVAL[problem]
    good = code_reward(_fenced(right), {"asserts": asserts}, CFG)
    bad = code_reward(_fenced(wrong), {"asserts": asserts}, CFG)
    assert (good.reward, good.passed, good.failure) == (CFG.correct, True, None), problem
    assert (bad.reward, bad.passed, bad.failure) == (CFG.incorrect, False, "wrong_answer"), problem


def test_the_sandbox_never_sees_the_statements_or_their_expected_values():
    plan = plan_asserts(ASSERTS["asserts"] + ["for n in range(2):\n    assert f(n) == 21 * n"])
    assert [step.expr for step in plan.steps] == ["f(1)", "f(2)", "f(3)", "f(4)", "f(0)", "f(1)"]
    assert not any(str(value) in step.expr for step in plan.steps for value in (21, 42, 0.0) if value)


@pytest.mark.parametrize(
    ("statement", "construct"),
    [
        ("def check(candidate):\n    assert candidate(1) == 2", "FunctionDef"),
        ("import os\nassert f(1) == 2", "Import"),
        ("while True:\n    assert f(1)", "While"),
        ("assert {k: f(k) for k in range(2)} == {0: 0, 1: 21}", "DictComp"),
        ("for x in f(3):\n    assert x", "loop over solution values"),
    ],
)
def test_tests_that_could_only_be_judged_next_to_the_solution_are_refused_naming_the_construct(statement, construct):
    with pytest.raises(UnsupportedTest, match=construct):
        plan_asserts([statement])
