"""The judge's `pytest`: the two helpers test programs use inside a test body, `raises` and `approx`.

Tests are run by the judge's process (rewards/judge_runtime.py), not by pytest, and the sandbox's Python has no
pytest; this module stands in for it there, so a solution can never define it. Semantics follow pytest's
documentation: `approx` compares numbers within max(rel * |expected|, abs) (defaults rel 1e-6, abs 1e-12; only
`abs` given: absolute only), element by element for sequences and dicts, NaN equal to nothing unless `nan_ok`;
`raises(E, match=...)` passes only on an exception of type E whose text matches. Anything else of pytest's
(fixtures, marks, parametrize) is not here: a test using it fails with AttributeError. Standard library only.
"""

import math
import re

__all__ = ["approx", "fail", "raises"]


class _Approx:
    def __init__(self, expected, rel=None, abs=None, nan_ok=False) -> None:
        self.expected, self.rel, self.abs, self.nan_ok = expected, rel, abs, nan_ok

    def __repr__(self) -> str:
        return f"approx({self.expected!r})"

    def __eq__(self, actual) -> bool:
        return _close(actual, self.expected, self)

    def __ne__(self, actual) -> bool:
        return not self.__eq__(actual)

    __hash__ = None


def _number(x) -> bool:
    return isinstance(x, int | float | complex) and not isinstance(x, bool)


def _close(actual, expected, how: _Approx) -> bool:
    if isinstance(expected, dict):
        if not isinstance(actual, dict) or set(actual) != set(expected):
            return False
        return all(_close(actual[k], expected[k], how) for k in expected)
    if isinstance(expected, list | tuple) and not isinstance(expected, str):
        if not isinstance(actual, list | tuple) or len(actual) != len(expected):
            return False
        return all(_close(a, e, how) for a, e in zip(actual, expected, strict=False))
    if not _number(expected):
        return actual == expected
    if not _number(actual):
        return False
    if isinstance(expected, float) and math.isnan(expected) or isinstance(actual, float) and math.isnan(actual):
        both_nan = isinstance(actual, float) and math.isnan(actual) and isinstance(expected, float)
        return how.nan_ok and both_nan and math.isnan(expected)
    if actual == expected:
        return True
    if isinstance(expected, float) and math.isinf(expected):
        return False
    absolute = 1e-12 if how.abs is None else how.abs
    if how.rel is None and how.abs is not None:
        tolerance = absolute
    else:
        tolerance = max((1e-6 if how.rel is None else how.rel) * abs(expected), absolute)
    return abs(actual - expected) <= tolerance


def approx(expected, rel=None, abs=None, nan_ok=False) -> _Approx:
    return _Approx(expected, rel, abs, nan_ok)


def fail(reason: str = "") -> None:
    raise AssertionError(reason)


class _Info:
    def __init__(self) -> None:
        self.type = self.value = None

    def match(self, pattern) -> bool:
        if re.search(pattern, str(self.value)) is None:
            raise AssertionError(f"exception text does not match {pattern!r}")
        return True


class _Raises:
    def __init__(self, expected, match=None) -> None:
        self.expected, self.pattern, self.info = expected, match, _Info()

    def __enter__(self) -> _Info:
        return self.info

    def __exit__(self, kind, value, traceback) -> bool:
        if kind is None:
            raise AssertionError(f"DID NOT RAISE {self.expected}")
        if not issubclass(kind, self.expected):
            return False  # not the expected exception: it propagates, as under pytest
        self.info.type, self.info.value = kind, value
        if self.pattern is not None:
            self.info.match(self.pattern)
        return True


def raises(expected, *args, match=None, **kwargs):
    if not args:
        return _Raises(expected, match)
    with _Raises(expected, match) as info:
        args[0](*args[1:], **kwargs)
    return info
