"""Code rewards a policy cannot forge: every attempt to make the harness report success without computing the
right values scores as a failure, in the real bubblewrap sandboxes, while HumanEval-style tests of canonical
solutions (loops, tolerances, `is None`, tuples, sets, dicts, `not`) still pass and wrong solutions still fail.

The attacks are those an RL policy optimising against the reward could find: writing the harness's report
itself (on every open descriptor, through /proc/self/fd, through the harness's frames), exiting early after a
fabricated report, rewriting the harness's globals, `json` or the builtins, returning objects whose `==` (or
truth, or `!=`) always answers as the test wants, and reading the expected values from the sandbox's files;
against judged tests also shadowing the builtins and prompt helpers the test relies on, defining `pytest`,
returning NaN to a tolerance check, raising where the test catches, and attacking the channel between the
judge's process and the solution's (values too large or too deep, replies out of turn or from threads, handles
forged or used later, a solution that never answers).
"""

from __future__ import annotations

import dataclasses

import pytest

from megatron_rl.config import RewardsConfig, SandboxConfig
from megatron_rl.data.assert_tests import UnsupportedTest, check_judged
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
            "import math\nassert math.isclose(truncate_number(123.456), 0.456, abs_tol=1e-6)",
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


def test_the_solutions_process_never_sees_the_statements_or_their_expected_values():
    program = """
import json, os
def f(x):
    # Everything this process can read: its files and its own memory. None holds a statement or 21 * x.
    seen = "".join(open(os.path.join("/sandbox", n)).read() for n in os.listdir("/sandbox"))
    import gc
    seen += repr([o for o in gc.get_objects() if isinstance(o, (str, dict))][:20000])
    statement = "f(2) " + "== " + str(6 * 7)  # not in this program's own text
    return 0 if statement in seen else 21 * x
"""
    assert code_reward(_fenced(program), ASSERTS, CFG).passed


def test_only_text_that_is_not_python_is_refused():
    check_judged({"asserts": ["def check(candidate):\n    assert candidate(1) == 2\ncheck(f)", "import os"]})
    with pytest.raises(UnsupportedTest, match=r"asserts\[1\] is not Python"):
        check_judged({"asserts": ["assert f(1) == 2", "assert f(1 =="]})


# Judged tests attacked where the test leans on something other than the solution's values.
JUDGED = {
    "name-bound-expected": (
        {"asserts": ["expected = 21 * 2", "assert f(2) == expected"]},
        "expected = 0\nimport builtins\nbuiltins.expected = 0\ndef f(x):\n    return 0\n",
    ),
    "loop-pairs-visible": (
        {"asserts": ["for x, want in [(1, 21), (2, 42), (3, 63)]:\n    assert f(x) == want"]},
        """
import sys, gc
def f(x):
    frame = sys._getframe()
    while frame is not None:  # look for the test's `want` in any frame, as an old harness exposed it
        if "want" in frame.f_locals:
            return frame.f_locals["want"]
        frame = frame.f_back
    ints = [o for o in gc.get_objects() if isinstance(o, tuple) and len(o) == 2 and o[0] == x]
    return ints[0][1] if ints else 0
""",
    ),
    "helper-of-the-prompt-shadowed": (
        {
            "asserts": ["assert abs(poly([-2, 1], find_zero([-2, 1]))) < 1e-6"],
            "setup": "def poly(xs, x):\n    return sum(c * x ** i for i, c in enumerate(xs))\n",
            "entry_point": "find_zero",
        },
        "def poly(xs, x):\n    return 0\ndef find_zero(xs):\n    return 0.0\n",
    ),
    "encode-helper-shadowed": (
        {
            "asserts": ["assert decode_shift(encode_shift('abc')) == 'abc'"],
            "setup": "def encode_shift(s):\n    return ''.join(chr((ord(c) - 92) % 26 + 97) for c in s)\n",
        },
        "def encode_shift(s):\n    return s\ndef decode_shift(s):\n    return s\n",
    ),
    "builtins-shadowed": (
        {"asserts": ["assert f(2) == sum([21, 21])", "assert f(1) == pow(21, 1)"]},
        "import builtins\nbuiltins.sum = builtins.pow = lambda *a: 0\nsum = pow = lambda *a: 0\n"
        "def f(x):\n    return 0\n",
    ),
    "pytest-defined-by-the-solution": (
        {"asserts": ["assert f(1) == pytest.approx(21)"], "setup": "import pytest"},
        """
import sys, types
class Always:
    def __eq__(self, other): return True
fake = types.ModuleType("pytest")
fake.approx = lambda *a, **k: Always()
sys.modules["pytest"] = fake
pytest = fake
def f(x):
    return 0
""",
    ),
    "raising-where-truth-is-checked": (
        {"asserts": ["assert not f(0)", "assert f(1)"]},
        "def f(x):\n    raise ValueError('no')\n",
    ),
    "nan-through-a-tolerance": (
        {"asserts": ["assert not abs(f(1) - 21.0) > 1e-6", "assert not abs(f(2) - 42.0) > 1e-6"]},
        "def f(x):\n    return float('nan')\n",
    ),
    "exit-inside-an-expected-exception": (
        {
            "asserts": [
                "try:\n    f(-1)\nexcept Exception:\n    pass\nelse:\n    raise AssertionError",
                "assert f(1) == 21",
            ]
        },
        "import os\ndef f(x):\n    if x < 0:\n        raise SystemExit(0)\n    return 0\n",
    ),
    "process-exit-inside-an-expected-exception": (
        {"asserts": ["try:\n    f(-1)\nexcept BaseException:\n    pass"]},
        "import os\ndef f(x):\n    os._exit(0)\n",
    ),
    "argument-mutated-after-return": (
        {"asserts": ["xs = [1, 2, 3]\nassert f(xs) == 6\nassert xs == [1, 2, 3]"]},
        """
import threading, time
def f(xs):
    def later():
        time.sleep(0.05)
        xs[:] = [6]
    threading.Thread(target=later).start()
    xs[:] = [6]
    return 6
""",
    ),
    # The channel between the judge's process and the solution's.
    "oversized-value": (ASSERTS, "def f(x):\n    return 'x' * (10 ** 7)\n"),
    "deeply-nested-value": (
        ASSERTS,
        "def f(x):\n    v = []\n    for _ in range(100000):\n        v = [v]\n    return v\n",
    ),
    "endless-generator": (ASSERTS, "def f(x):\n    while True:\n        yield 21 * x\n"),
    "forged-handle-and-encoder": (
        ASSERTS,
        """
import values
values.encode = lambda value, limits, handle=None: {"t": "handle", "v": 0, "type": "int", "callable": False}
class Truthy:
    def __bool__(self): return True
def f(x):
    return Truthy()
""",
    ),
    "handle-used-after-the-call": (
        {"asserts": ["box = make()\nassert box.value() == 21", "assert box.value() == 42"]},
        "class Box:\n    n = 21\n    def value(self):\n        Box.n = 0\n        return Box.n\n"
        "def make():\n    return Box()\n",
    ),
    "replies-from-threads": (
        ASSERTS,
        """
import os, threading
def spam():
    while True:
        try:
            os.write(3, b'{"id": 1, "ok": true, "value": 21}\\n')
        except OSError:
            pass
for _ in range(2):
    threading.Thread(target=spam, daemon=True).start()
def f(x):
    return 0
""",
    ),
    "replies-written-ahead": (
        ASSERTS,
        """
import os
for n in range(1, 6):
    for fd in range(1, 8):
        try:
            os.write(fd, b'{"id": %d, "ok": true, "value": %d}\\n' % (n, 21 * n))
            os.write(fd, b'{"unit": %d, "outcome": null}\\n{"done": true}\\n' % (n - 1))
        except OSError:
            pass
def f(x):
    return 0
""",
    ),
}


@pytest.mark.parametrize("attack", list(JUDGED))
def test_every_attack_on_a_judged_test_scores_as_a_failure(attack):
    tests, program = JUDGED[attack]
    result = code_reward(_fenced(program), tests, CFG)
    assert (result.reward, result.passed) == (CFG.incorrect, False), (attack, result)


def test_a_solution_that_never_answers_times_out():
    quick = RewardsConfig(sandbox=dataclasses.replace(CFG.sandbox, wall_time_s=2.0))
    for program in ("import time\ndef f(x):\n    time.sleep(60)\n", "def f(x):\n    while True:\n        pass\n"):
        result = code_reward(_fenced(program), ASSERTS, quick)
        assert (result.passed, result.failure) == (False, "timeout"), program
