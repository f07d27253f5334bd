"""The judge's `numpy` where the sandbox's Python has none: the comparisons test programs make with it.

EvalPlus's HumanEval+ and MBPP+ test programs import numpy for `np.allclose`, `np.testing.assert_allclose` and
`isinstance(x, np.ndarray)` checks; values from the solution are builtin types (rewards/values.py), so no array
ever reaches them. This module gives those names numpy's documented semantics on numbers and nested lists and
tuples: `allclose(a, b, rtol=1e-05, atol=1e-08)` is all |a - b| <= atol + rtol * |b| with NaN unequal (unless
equal_nan), a scalar broadcast against a sequence; `testing.assert_allclose(actual, desired, rtol=1e-07, atol=0)`
the same with NaN equal, raising AssertionError; shapes must match. Anything else of numpy is missing (a test
that needs it fails with AttributeError). The judge installs it only when `import numpy` finds nothing.
"""

import math
import types

__all__ = ["allclose", "isclose", "ndarray", "float64", "float32", "int64", "testing", "inf", "nan", "pi"]

inf, nan, pi = math.inf, math.nan, math.pi


class ndarray:  # noqa: N801 (numpy's names)
    """Nothing is an instance: values from the solution are builtin types."""


class float64(float):  # noqa: N801
    pass


class float32(float):  # noqa: N801
    pass


class int64(int):  # noqa: N801
    pass


def _flat(x) -> list:
    if isinstance(x, list | tuple):
        return [item for element in x for item in _flat(element)]
    if isinstance(x, bool | int | float):
        return [x]
    raise TypeError(f"numpy comparisons of {type(x).__name__} are not supported")


def _shape(x) -> tuple:
    if isinstance(x, list | tuple):
        inner = {_shape(element) for element in x}
        if len(inner) > 1:
            raise ValueError("inhomogeneous shape")
        return (len(x), *(inner.pop() if inner else ()))
    return ()


def _pairs(a, b) -> list:
    shape_a, shape_b = _shape(a), _shape(b)
    flat_a, flat_b = _flat(a), _flat(b)
    if shape_a == shape_b:
        return list(zip(flat_a, flat_b, strict=False))
    if shape_a == ():
        return [(flat_a[0], y) for y in flat_b]
    if shape_b == ():
        return [(x, flat_b[0]) for x in flat_a]
    raise ValueError(f"operands could not be broadcast together with shapes {shape_a} {shape_b}")


def _close(x, y, rtol: float, atol: float, equal_nan: bool) -> bool:
    x, y = float(x), float(y)
    if math.isnan(x) or math.isnan(y):
        return equal_nan and math.isnan(x) and math.isnan(y)
    if math.isinf(x) or math.isinf(y):
        return x == y
    return abs(x - y) <= atol + rtol * abs(y)


def isclose(a, b, rtol=1e-05, atol=1e-08, equal_nan=False):
    results = [_close(x, y, rtol, atol, equal_nan) for x, y in _pairs(a, b)]
    return results[0] if _shape(a) == () and _shape(b) == () else results


def allclose(a, b, rtol=1e-05, atol=1e-08, equal_nan=False) -> bool:
    return all(_close(x, y, rtol, atol, equal_nan) for x, y in _pairs(a, b))


def _assert_allclose(actual, desired, rtol=1e-07, atol=0, equal_nan=True, err_msg="", verbose=True) -> None:
    if _shape(actual) != _shape(desired) and _shape(actual) != () and _shape(desired) != ():
        raise AssertionError(f"shapes differ: {_shape(actual)} {_shape(desired)} {err_msg}")
    if not all(_close(x, y, rtol, atol, equal_nan) for x, y in _pairs(actual, desired)):
        raise AssertionError(f"not close to rtol={rtol}, atol={atol} {err_msg}")


testing = types.ModuleType("numpy.testing")
testing.assert_allclose = _assert_allclose
