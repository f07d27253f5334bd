"""Values across a sandbox boundary: tagged JSON that encodes and decodes plain data only.

    line = dumps(encode([1, (2, 3)], Limits()))      # '[1, {"t": "tuple", "v": [2, 3]}]'
    decode(loads(line), Limits())                      -> [1, (2, 3)]

Used on every side of the code reward: the solution's process encodes what its functions return, the judge's
process (rewards/judge_runtime.py) encodes the arguments it passes and decodes the returns, the host decodes a
call-based harness's returns. Decoding builds builtin types and a few standard-library values only (int of any
size, float, complex, str, bytes, bytearray, bool, None, list, tuple, set, frozenset, dict, range, Fraction,
Decimal): never an object with code of the sender's, never by unpickling or eval. Anything else the sender
holds crosses as a handle (a number the receiver can only send back) or, where no handles are taken, as an
`Opaque` value that refuses every use.

Limits (`Limits`): nesting depth, the number of items and the characters of text in one value. A value over
them raises `ValueLimit` on the sending side, and a received value over them is refused the same way (a sender
that rewrote its encoder gains nothing). Iterators (generators, `map`, `zip`, ...) are materialised by the
sender within the same limits; an infinite one is over them.

This file runs inside the sandboxes as it is (shipped next to the runtimes), so it imports the standard library
only.
"""

from __future__ import annotations

import decimal
import fractions
import json
import math
import types
from typing import Any

SMALL_INT = 1 << 53
"""Integers at least this large cross as text: JSON readers elsewhere round them to doubles."""


class Limits:
    """How big one value may be: nesting `depth`, `items` (containers and scalars) and `chars` of text."""

    __slots__ = ("depth", "items", "chars")

    def __init__(self, depth: int = 64, items: int = 200_000, chars: int = 4_000_000) -> None:
        self.depth, self.items, self.chars = depth, items, chars


class ValueLimit(ValueError):
    """A value that cannot cross: nested too deep, too many items, too much text, or malformed."""


class Opaque:
    """A value that is not plain data (where no handles are taken). Any use but identity raises TypeError (truth,
    equality, order, hashing, length, iteration), so a check that needs it fails: an object cannot pass `== 9` or
    a truth test by being unusual."""

    __slots__ = ("type_name",)
    __hash__ = None  # type: ignore[assignment]

    def __init__(self, type_name: str) -> None:
        self.type_name = type_name

    def _refuse(self, *args: Any) -> Any:
        raise TypeError(f"a {self.type_name} value is not plain data")

    __bool__ = __eq__ = __ne__ = __lt__ = __le__ = __gt__ = __ge__ = __len__ = __iter__ = _refuse  # type: ignore

    def __repr__(self) -> str:
        return f"<{self.type_name}>"


class _Budget:
    __slots__ = ("limits", "items", "chars", "nan")

    def __init__(self, limits: Limits) -> None:
        self.limits, self.items, self.chars, self.nan = limits, 0, 0, None

    def take(self, depth: int, chars: int = 0) -> None:
        self.items += 1
        self.chars += chars
        if depth > self.limits.depth:
            raise ValueLimit(f"value nested deeper than {self.limits.depth}")
        if self.items > self.limits.items:
            raise ValueLimit(f"value of more than {self.limits.items} items")
        if self.chars > self.limits.chars:
            raise ValueLimit(f"value of more than {self.limits.chars} characters")


_ITERATOR_TYPES = (
    types.GeneratorType, map, filter, zip, enumerate, reversed, type(iter([])), type(iter(())), type(iter("")),
    type(iter(range(0))), type(iter({})), type(iter(set())), type({}.keys()), type({}.values()), type({}.items()),
)  # fmt: skip


def encode(value: Any, limits: Limits, handle: Any = None) -> Any:
    """`value` as JSON-ready tagged data. Objects that are not plain data go through `handle(obj)` (which returns
    the tagged handle to send), or raise ValueLimit when it is None. Subclasses of builtin types are sent as their
    builtin value, read through the base type's own slots (a subclass's methods never run)."""
    return _encode(value, _Budget(limits), 0, handle)


def _encode(value: Any, budget: _Budget, depth: int, handle: Any) -> Any:
    kind = type(value)
    if value is None or kind is bool:
        budget.take(depth)
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        number = int.__index__(value)
        budget.take(depth, 0 if -SMALL_INT < number < SMALL_INT else number.bit_length() // 4)
        return number if -SMALL_INT < number < SMALL_INT else {"t": "int", "v": format(number, "x")}
    if isinstance(value, float):
        number = float.__float__(value)
        budget.take(depth)
        return number if math.isfinite(number) else {"t": "float", "v": repr(number)}
    if isinstance(value, str):
        text = str.__str__(value)
        budget.take(depth, len(text))
        return text
    if isinstance(value, list | tuple | set | frozenset):
        base = next(b for b in (list, tuple, frozenset, set) if isinstance(value, b))
        budget.take(depth)
        items = [_encode(v, budget, depth + 1, handle) for v in base.__iter__(value)]
        return items if base is list else {"t": base.__name__, "v": items}
    if isinstance(value, dict):
        budget.take(depth)
        pairs = [[_encode(k, budget, depth + 1, handle), _encode(v, budget, depth + 1, handle)]
                 for k, v in dict.items(value)]  # fmt: skip
        return {"t": "dict", "v": pairs}
    if isinstance(value, bytes | bytearray):
        data = bytes(value)
        budget.take(depth, 2 * len(data))
        return {"t": "bytes" if isinstance(value, bytes) else "bytearray", "v": data.hex()}
    if kind is complex:
        budget.take(depth)
        return {"t": "complex", "v": [repr(value.real), repr(value.imag)]}
    if kind is range:
        budget.take(depth)
        return {
            "t": "range",
            "v": [_encode(n, budget, depth + 1, handle) for n in (value.start, value.stop, value.step)],
        }
    if kind is fractions.Fraction:
        budget.take(depth)
        return {"t": "fraction", "v": [_encode(value.numerator, budget, depth + 1, handle),
                                       _encode(value.denominator, budget, depth + 1, handle)]}  # fmt: skip
    if kind is decimal.Decimal:
        text = str(value)
        budget.take(depth, len(text))
        return {"t": "decimal", "v": text}
    if isinstance(value, _ITERATOR_TYPES):
        # Materialised here, item by item under the limits: an infinite generator runs into them.
        budget.take(depth)
        items = []
        for item in value:
            items.append(_encode(item, budget, depth + 1, handle))
        return {"t": "iter", "v": items}
    if handle is None:
        raise ValueLimit(f"a {kind.__name__} value is not plain data")
    budget.take(depth)
    return handle(value)


def decode(data: Any, limits: Limits, handle: Any = None, nan: Any = None) -> Any:
    """Tagged data as plain values; `handle(tagged)` builds what a handle stands for (None: `Opaque`); a NaN
    decodes to `nan()` when a factory is given (the judge's NaN that refuses comparisons, rewards/judge_runtime.py).

    Raises ValueLimit for data over the limits or malformed. Never runs code of the sender's."""
    budget = _Budget(limits)
    budget.nan = nan
    return _decode(data, budget, 0, handle)


def _decode(data: Any, budget: _Budget, depth: int, handle: Any) -> Any:
    kind = type(data)
    if data is None or kind in (bool, int, float):
        budget.take(depth)
        return data
    if kind is str:
        budget.take(depth, len(data))
        return data
    if kind is list:
        budget.take(depth)
        return [_decode(item, budget, depth + 1, handle) for item in data]
    if kind is not dict or type(data.get("t")) is not str:
        raise ValueLimit(f"malformed value of type {kind.__name__}")
    tag, value = data["t"], data.get("v")
    budget.take(depth, len(value) if type(value) is str else 0)
    try:
        return _decode_tagged(tag, value, data, budget, depth, handle)
    except (TypeError, ValueError, ArithmeticError, KeyError) as exc:  # ValueLimit is a ValueError too
        if isinstance(exc, ValueLimit):
            raise
        raise ValueLimit(f"malformed {tag} value: {exc}"[:200]) from None


def _decode_tagged(tag: str, value: Any, data: dict, budget: _Budget, depth: int, handle: Any) -> Any:
    def items() -> list[Any]:
        if type(value) is not list:
            raise TypeError("not a list")
        return [_decode(item, budget, depth + 1, handle) for item in value]

    if tag == "int":
        if type(value) is not str or len(value) > budget.limits.chars:
            raise TypeError("not hex text")
        return int(value, 16)
    if tag == "float":
        number = float(value)
        if math.isfinite(number):
            raise TypeError("a finite float sent as text")
        return budget.nan() if math.isnan(number) and budget.nan is not None else number
    if tag in ("tuple", "iter"):
        return tuple(items()) if tag == "tuple" else iter(items())
    if tag in ("set", "frozenset"):
        return (set if tag == "set" else frozenset)(items())  # unhashable items raise TypeError: malformed
    if tag == "dict":
        if type(value) is not list or not all(type(pair) is list and len(pair) == 2 for pair in value):
            raise TypeError("not a list of pairs")
        return {_decode(k, budget, depth + 1, handle): _decode(v, budget, depth + 1, handle) for k, v in value}
    if tag in ("bytes", "bytearray"):
        return (bytes if tag == "bytes" else bytearray).fromhex(value)
    if tag == "complex":
        real, imag = value
        return complex(float(real), float(imag))
    if tag == "range":
        start, stop, step = items()
        return range(start, stop, step)
    if tag == "fraction":
        numerator, denominator = items()
        if type(numerator) is not int or type(denominator) is not int:
            raise TypeError("not integers")
        return fractions.Fraction(numerator, denominator)
    if tag == "decimal":
        if type(value) is not str:
            raise TypeError("not text")
        return decimal.Decimal(value)
    if tag == "handle":
        if type(value) is not int or type(data.get("type")) is not str:
            raise TypeError("malformed handle")
        return Opaque(data["type"][:80]) if handle is None else handle(data)
    raise ValueLimit(f"unknown value tag {tag[:40]!r}")


def dumps(data: Any) -> str:
    """One line of JSON (no NaN literals: non-finite floats are tagged by `encode`)."""
    return json.dumps(data, separators=(",", ":"), allow_nan=False)


def loads(line: str | bytes) -> Any:
    """Parse one line; deep nesting or bad JSON raises ValueLimit."""
    try:
        return json.loads(line, parse_constant=_no_constant)
    except (ValueError, RecursionError) as exc:
        raise ValueLimit(f"not a JSON value: {type(exc).__name__}") from None


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} literal")  # non-finite floats cross tagged, so a NaN is always seen as one
