"""Judged code tests: a test program run as written, in a judge process apart from the solution's.

    {"asserts": ["assert f(3) == 9", "for n in range(3):\\n    assert f(n) == n * n"],
     "setup": "import math",            # optional: the dataset's code the test relies on (prompt helpers, imports)
     "entry_point": "f"}                # optional: the solution's function, also bound as `candidate`

Each entry of `asserts` is one unit of Python, any statements at all (HumanEval's `def check(candidate)` followed
by `check(f)`, MBPP's asserts, try/except, `with pytest.raises(...)`, a LeetCode design-class sequence); the
units run in order in one namespace, after `setup`, and each passes or fails on its own (partial credit counts
units). rewards/judge.py runs them in the judge's sandboxed process with the solution's names as proxies to the
solution's process (rewards/judge_runtime.py says what crosses and how), so a test is refused at load only when
it is not Python.

The published forms (HumanEval's `test` + `entry_point`, MBPP's `test_list` + `test_setup_code`, EvalPlus's
inputs) are converted to this one by data/code_sets.py.
"""

from __future__ import annotations

from typing import Any


class UnsupportedTest(ValueError):
    """A judged test that cannot be run: not Python, or a field of the wrong type."""


def check_judged(tests: dict[str, Any]) -> None:
    """Raise UnsupportedTest (a ValueError) naming the unit or field that is wrong."""
    units = tests["asserts"]
    if not isinstance(units, list) or not units:
        raise UnsupportedTest("code tests: 'asserts' must be a non-empty list of statements")
    if not all(isinstance(unit, str) for unit in units):
        raise UnsupportedTest("code tests: 'asserts' must be statements as strings")
    for field in ("setup", "entry_point"):
        if tests.get(field) is not None and not isinstance(tests[field], str):
            raise UnsupportedTest(f"code tests: '{field}' must be a string, got {type(tests[field]).__name__}")
    entry = tests.get("entry_point")
    if entry is not None and not entry.isidentifier():
        raise UnsupportedTest(f"code tests: 'entry_point' must be a Python name, got {entry!r}")
    for where, source in [("setup", tests.get("setup") or "")] + [(f"asserts[{i}]", u) for i, u in enumerate(units)]:
        try:
            compile(source, f"<{where}>", "exec")
        except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
            raise UnsupportedTest(f"code tests: {where} is not Python: {exc}") from None
