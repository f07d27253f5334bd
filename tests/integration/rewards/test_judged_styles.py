"""Test programs as datasets write them, run as written in the judge's process against the solution's (real
bubblewrap sandboxes): for each style a canonical solution passes and a wrong one fails.

The styles are those of HumanEval (`def check(candidate)` with METADATA and imports), MBPP (setup lines, assert
lists), pytest-style bodies (`pytest.raises`, `pytest.approx`), LeetCode design classes and in-place methods,
and the values they compare (generators, ranges, big integers, Fractions, floats computed in another order).
"""

from __future__ import annotations

import pytest

from megatron_rl.config import RewardsConfig, SandboxConfig
from megatron_rl.rewards.code import code_reward, outputs_match
from megatron_rl.rewards.sandbox import isolation_problem

CFG = RewardsConfig(sandbox=SandboxConfig(wall_time_s=20.0, cpu_time_s=2.0, memory_mb=256, max_output_bytes=1 << 16))

pytestmark = pytest.mark.skipif(
    isolation_problem(CFG.sandbox) is not None, reason=f"no isolation here: {isolation_problem(CFG.sandbox)}"
)

HUMANEVAL_TEST = """

METADATA = {"author": "jt", "dataset": "test"}


def check(candidate):
    import math
    assert candidate([1.0, 2.0, 3.9, 4.0, 5.0, 2.2], 0.3) == True
    assert candidate([1.0, 2.0, 3.9, 4.0, 5.0, 2.2], 0.05) == False
    assert math.isclose(float(candidate([1.0, 2.0], 1.5)), 1.0)
"""
HUMANEVAL_PROMPT = (
    "from typing import List\n\n\ndef has_close_elements(numbers: List[float], threshold: float) -> bool:\n"
    '    """Whether two numbers are closer than threshold."""\n'
)

# name -> (tests, right program, wrong program)
STYLES = {
    "humaneval-verbatim-check": (
        {
            "asserts": [HUMANEVAL_TEST + "\ncheck(has_close_elements)\n"],
            "setup": HUMANEVAL_PROMPT,
            "entry_point": "has_close_elements",
        },
        "def has_close_elements(numbers, threshold):\n"
        "    return any(abs(a - b) < threshold for i, a in enumerate(numbers) for b in numbers[i + 1:])\n",
        "def has_close_elements(numbers, threshold):\n"
        "    return any(abs(a - b) < threshold for a in numbers for b in numbers)\n",
    ),
    "humaneval-helper-from-prompt": (
        {
            "asserts": [
                "def check(candidate):\n    for s in ['abc', 'xyz', 'hello']:\n"
                "        assert candidate(encode_shift(s)) == s\n\ncheck(decode_shift)\n"
            ],
            "setup": "def encode_shift(s):\n    return ''.join(chr((ord(c) + 5 - 97) % 26 + 97) for c in s)\n\n"
            "def decode_shift(s):\n    '''Decode.'''\n",
            "entry_point": "decode_shift",
        },
        "def decode_shift(s):\n    return ''.join(chr((ord(c) - 5 - 97) % 26 + 97) for c in s)\n",
        "def decode_shift(s):\n    return ''.join(chr((ord(c) - 4 - 97) % 26 + 97) for c in s)\n",
    ),
    "mbpp-import-math-setup": (
        {
            "asserts": ["assert math.isclose(area(2), 12.566370614359172)", "assert area(0) == 0"],
            "setup": "import math",
        },
        "import math\ndef area(r):\n    return math.pi * r * r\n",
        "def area(r):\n    return 3.14 * r * r\n",
    ),
    "candidate-equals-f": (
        {"asserts": ["candidate = square\nassert candidate(3) == 9\nassert candidate(-2) == 4"]},
        "def square(x):\n    return x * x\n",
        "def square(x):\n    return x * 2\n",
    ),
    "for-pairs": (
        {"asserts": ["for a, b in [(1, 1), (2, 4), (5, 25)]:\n    assert square(a) == b"]},
        "def square(x):\n    return x * x\n",
        "def square(x):\n    return x + x\n",
    ),
    "for-zip": (
        {"asserts": ["for x in zip([1, 2, 3], [1, 4, 9]):\n    assert square(x[0]) == x[1]"]},
        "def square(x):\n    return x * x\n",
        "def square(x):\n    return abs(x) * 3 - 2\n",
    ),
    "tuple-unpacking": (
        {"asserts": ["q, r = divide(17, 5)\nassert (q, r) == (3, 2)\nassert q * 5 + r == 17"]},
        "def divide(a, b):\n    return a // b, a % b\n",
        "def divide(a, b):\n    return a // b, 0\n",
    ),
    "sorted-key-lambda": (
        {"asserts": ["assert sorted(words(), key=lambda w: (len(w), w)) == ['a', 'bb', 'ccc']"]},
        "def words():\n    return ['ccc', 'a', 'bb']\n",
        "def words():\n    return ['ccc', 'a', 'b']\n",
    ),
    "dict-comprehension": (
        {"asserts": ["assert {k: square(k) for k in range(4)} == {0: 0, 1: 1, 2: 4, 3: 9}"]},
        "def square(x):\n    return x * x\n",
        "def square(x):\n    return x\n",
    ),
    "try-except": (
        {
            "asserts": [
                "try:\n    parse('x')\nexcept ValueError:\n    pass\nelse:\n    raise AssertionError('no error')"
            ]
        },
        "def parse(s):\n    return int(s)\n",
        "def parse(s):\n    return 0\n",
    ),
    "pytest-raises": (
        {
            "asserts": ["with pytest.raises(ZeroDivisionError):\n    inverse(0)", "assert inverse(4) == 0.25"],
            "setup": "import pytest",
        },
        "def inverse(x):\n    return 1 / x\n",
        "def inverse(x):\n    return 1 / x if x else 0\n",
    ),
    "pytest-approx": (
        {"asserts": ["assert third(1) == pytest.approx(0.3333333)"], "setup": "import pytest"},
        "def third(x):\n    return x / 3\n",
        "def third(x):\n    return x / 3.1\n",
    ),
    "leetcode-design-class": (
        {
            "asserts": [
                "cache = LRUCache(2)\ncache.put(1, 1)\ncache.put(2, 2)\nassert cache.get(1) == 1\n"
                "cache.put(3, 3)\nassert cache.get(2) == -1\nassert cache.get(3) == 3"
            ]
        },
        """
from collections import OrderedDict
class LRUCache:
    def __init__(self, capacity):
        self.capacity, self.items = capacity, OrderedDict()
    def get(self, key):
        if key not in self.items:
            return -1
        self.items.move_to_end(key)
        return self.items[key]
    def put(self, key, value):
        self.items[key] = value
        self.items.move_to_end(key)
        if len(self.items) > self.capacity:
            self.items.popitem(last=False)
""",
        """
class LRUCache:
    def __init__(self, capacity):
        self.items = {}
    def get(self, key):
        return self.items.get(key, -1)
    def put(self, key, value):
        self.items[key] = value
""",
    ),
    "in-place-method": (
        {"asserts": ["nums = [3, 1, 2]\nSolution().sortColors(nums)\nassert nums == [1, 2, 3]"]},
        "class Solution:\n    def sortColors(self, nums):\n        nums.sort()\n",
        "class Solution:\n    def sortColors(self, nums):\n        nums = sorted(nums)\n",
    ),
    "in-place-nested": (
        {"asserts": ["m = [[1, 2], [3, 4]]\nrow = m[0]\nrotate(m)\nassert m == [[3, 1], [4, 2]] and row is m[0]"]},
        "def rotate(m):\n    n = len(m)\n    m[:] = [list(r) for r in zip(*m[::-1])]\n",
        "def rotate(m):\n    return [list(r) for r in zip(*m[::-1])]\n",
    ),
    "list-of-range": (
        {"asserts": ["assert list(evens(6)) == [0, 2, 4]"]},
        "def evens(n):\n    return range(0, n, 2)\n",
        "def evens(n):\n    return range(0, n)\n",
    ),
    "list-of-map": (
        {"asserts": ["assert list(doubled([1, 2])) == [2, 4]"]},
        "def doubled(xs):\n    return map(lambda x: 2 * x, xs)\n",
        "def doubled(xs):\n    return map(lambda x: x, xs)\n",
    ),
    "generator-result": (
        {"asserts": ["assert list(fib(5)) == [0, 1, 1, 2, 3]", "assert sum(fib(10)) == 88"]},
        "def fib(n):\n    a, b = 0, 1\n    for _ in range(n):\n        yield a\n        a, b = b, a + b\n",
        "def fib(n):\n    for i in range(n):\n        yield i\n",
    ),
    "big-integers": (
        {
            "asserts": [
                "assert factorial(30) == 265252859812191058636308480000000",
                "assert factorial(100) % 10**20 == 0",
            ]
        },
        "def factorial(n):\n    out = 1\n    for k in range(2, n + 1):\n        out *= k\n    return out\n",
        "def factorial(n):\n    return float(n) ** n\n",
    ),
    "fraction": (
        {"asserts": ["from fractions import Fraction\nassert harmonic(3) == Fraction(11, 6)"]},
        "from fractions import Fraction\ndef harmonic(n):\n    return sum(Fraction(1, k) for k in range(1, n + 1))\n",
        "def harmonic(n):\n    return sum(1 / k for k in range(1, n + 1))\n",
    ),
    "floats-in-another-order": (
        {"asserts": ["assert abs(total([0.1, 0.2, 0.3]) - 0.6) < 1e-9"]},
        "def total(xs):\n    return sum(reversed(xs))\n",
        "def total(xs):\n    return round(sum(xs), 1) + 0.01\n",
    ),
    "set-and-dict-results": (
        {"asserts": ["assert histogram('a b b') == ({'a': 1, 'b': 2}, {'a', 'b'})"]},
        "def histogram(t):\n    c = {}\n    for w in t.split():\n        c[w] = c.get(w, 0) + 1\n"
        "    return c, set(c)\n",
        "def histogram(t):\n    return {}, set()\n",
    ),
    "module-level-constant": (
        {"asserts": ["assert MOD == 10**9 + 7", "assert power(2, 10) == 1024"]},
        "MOD = 10**9 + 7\ndef power(a, b):\n    return pow(a, b, MOD)\n",
        "MOD = 10**9 + 9\ndef power(a, b):\n    return pow(a, b, MOD)\n",
    ),
    "linked-list-object": (
        {
            "asserts": [
                "def values(node):\n    out = []\n    while node is not None:\n        out.append(node.val)\n"
                "        node = node.next\n    return out\n\nassert values(build([1, 2, 3])) == [1, 2, 3]"
            ]
        },
        "class Node:\n    def __init__(self, val, next=None):\n        self.val, self.next = val, next\n"
        "def build(xs):\n    head = None\n    for x in reversed(xs):\n        head = Node(x, head)\n    return head\n",
        "class Node:\n    def __init__(self, val, next=None):\n        self.val, self.next = val, next\n"
        "def build(xs):\n    head = None\n    for x in xs:\n        head = Node(x, head)\n    return head\n",
    ),
    "keyword-arguments-and-str": (
        {"asserts": ["assert greet(name='Ann') == 'hi Ann'", "assert str(greet('Bo')).upper() == 'HI BO'"]},
        "def greet(name='x'):\n    return 'hi ' + name\n",
        "def greet(name='x'):\n    return 'hello ' + name\n",
    ),
    "evalplus-numpy-assertion": (
        {
            "asserts": [
                "import numpy as np\n\ndef assertion(out, exp, atol):\n    exact_match = out == exp\n"
                "    if atol == 0 and isinstance(exp, float):\n        atol = 1e-6\n"
                "    if not exact_match and atol != 0:\n        np.testing.assert_allclose(out, exp, atol=atol)\n"
                "    else:\n        assert exact_match\n\n"
                "inputs = [[1.0], [2.0]]\nresults = [0.5, 0.25]\n"
                "for i, (inp, exp) in enumerate(zip(inputs, results)):\n    assertion(half_inverse(*inp), exp, 0)\n"
            ]
        },
        "def half_inverse(x):\n    return 1 / (2 * x)\n",
        "def half_inverse(x):\n    return 1 / (2 * x + 0.01)\n",
    ),
}


@pytest.mark.parametrize("style", list(STYLES))
def test_each_style_passes_the_canonical_solution_and_fails_a_wrong_one(style):
    tests, right, wrong = STYLES[style]
    good = code_reward(f"<think>x</think>\n```python\n{right}\n```", tests, CFG)
    bad = code_reward(f"<think>x</think>\n```python\n{wrong}\n```", tests, CFG)
    assert (good.passed, good.failure) == (True, None), (style, good)
    assert (bad.passed, bad.reward) == (False, CFG.incorrect), (style, bad)


def test_call_based_int_keyed_dicts_and_floats_in_another_order():
    tests = {"fn_name": "f", "inputs": [[{"1": 2, "3": 4}], [[0.1, 0.2, 0.3]]], "outputs": [{"2": 1, "4": 3}, 0.6]}
    right = (
        "def f(x):\n    if isinstance(x, dict):\n        return {v: k for k, v in x.items()}\n    return sum(x[::-1])\n"
    )
    wrong = "def f(x):\n    if isinstance(x, dict):\n        return {v: k + 1 for k, v in x.items()}\n    return 0.61\n"
    assert code_reward(f"```python\n{right}\n```", tests, CFG).passed
    assert not code_reward(f"```python\n{wrong}\n```", tests, CFG).passed


def test_stdout_numbers_under_each_datasets_rule():
    assert outputs_match("0.3333333\n", "0.33333333333\n")  # APPS/TACO: np.allclose
    assert not outputs_match("0.3334\n", "0.33333333333\n")
    assert not outputs_match("100000000000000001\n", "100000000000000000\n")  # integers exactly
    assert outputs_match("1.50 2\n", "1.5 2\n", "decimal")  # LiveCodeBench: equal as decimals
    assert not outputs_match("0.3333333\n", "0.33333333333\n", "decimal")
    assert not outputs_match("1.50\n", "1.5\n", "lines")
    tests = {"inputs": ["3\n"], "outputs": ["0.333333333\n"]}
    assert code_reward("```python\nprint(1 / int(input()))\n```", tests, CFG).passed
    assert not code_reward("```python\nprint(0.3)\n```", tests, CFG).passed
