"""Values across the sandbox boundary: tagged JSON that decodes to builtin types only.

The harness (rewards/code.py) encodes what a probe or a call returned with `ENCODE_SOURCE`, in the sandbox; the
host decodes it with `decode_value` into int, float, str, bytes, bool, None, list, tuple, set, frozenset and dict,
and anything else into `Opaque` (data/assert_tests.py), which refuses every use. A solution that rewrites the
encoder can only report other plain values, which the host then judges; no object of its own reaches the host.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from megatron_rl.data.assert_tests import Opaque


def decode_value(data: Any) -> Any:
    """A value the sandbox reported, as builtin plain data (never an object with the solution's methods)."""
    if data is None or type(data) in (bool, int, str):
        return data
    if type(data) is float:
        return data
    if type(data) is list:
        return [decode_value(item) for item in data]
    if type(data) is not dict or "t" not in data:
        return Opaque("malformed", repr(data)[:80])
    tag, value = data.get("t"), data.get("v")
    decoders: dict[str, Callable[[Any], Any]] = {
        "tuple": lambda v: tuple(decode_value(i) for i in v),
        "set": lambda v: {_hashable(decode_value(i)) for i in v},
        "frozenset": lambda v: frozenset(_hashable(decode_value(i)) for i in v),
        "dict": lambda v: {_hashable(decode_value(k)): decode_value(x) for k, x in v},
        "float": lambda v: float(v),
        "bytes": lambda v: bytes.fromhex(v),
        "complex": lambda v: complex(float(v[0]), float(v[1])),
    }
    try:
        if tag in decoders:
            return decoders[tag](value)
        if tag == "opaque":
            return Opaque(str(data.get("type", "?"))[:80], str(data.get("repr", ""))[:200])
    except (TypeError, ValueError, OverflowError):
        pass
    return Opaque("malformed", repr(data)[:80])


def _hashable(value: Any) -> Any:
    try:
        hash(value)
    except TypeError:
        return Opaque(type(value).__name__, repr(value)[:200])
    return value


# The sandbox's side, as source for the harness. Subclasses of the builtin types are reported by their builtin
# value (read through the base type's own slot, not the subclass's overridable methods).
ENCODE_SOURCE = r"""
def encode_value(value, depth=0):
    if depth > 64:
        raise ValueError("value nested deeper than 64")
    kind = type(value)
    if value is None or kind is bool:
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return int.__int__(value)
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, float):
        value = float.__float__(value)
        finite = value == value and value not in (float("inf"), float("-inf"))
        return value if finite else {"t": "float", "v": repr(value)}
    if isinstance(value, list):
        return [encode_value(v, depth + 1) for v in list.__iter__(value)]
    if isinstance(value, tuple):
        return {"t": "tuple", "v": [encode_value(v, depth + 1) for v in tuple.__iter__(value)]}
    if isinstance(value, (set, frozenset)):
        base = frozenset if isinstance(value, frozenset) else set
        return {"t": base.__name__, "v": [encode_value(v, depth + 1) for v in base.__iter__(value)]}
    if isinstance(value, dict):
        pairs = dict.items(value)
        return {"t": "dict", "v": [[encode_value(k, depth + 1), encode_value(v, depth + 1)] for k, v in pairs]}
    if isinstance(value, bytes):
        return {"t": "bytes", "v": bytes.hex(value)}
    if kind is complex:
        return {"t": "complex", "v": [repr(value.real), repr(value.imag)]}
    try:
        text = object.__repr__(value)
    except Exception:
        text = "?"
    return {"t": "opaque", "type": kind.__name__, "repr": text}
"""
