"""Building configs from plain data (YAML, overrides), with type checks that name the field."""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from typing import Any, Literal, get_args, get_origin

from megatron_rl.config.errors import ConfigError, fail


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(value: Any, tp: Any, name: str) -> Any:
    """Check `value` against the annotation `tp`, converting where YAML/CLI text is ambiguous."""
    origin = get_origin(tp)
    if origin is typing.Union or origin is types.UnionType:
        options = get_args(tp)
        if value is None:
            if type(None) in options:
                return None
            fail(name, "must not be null")
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _coerce(value, option, name)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(errors[0])
    if origin is Literal:
        allowed = list(get_args(tp))
        if value not in allowed:
            fail(name, f"{value!r} is not one of {allowed}")
        return value
    if origin is list:
        (item_tp,) = get_args(tp)
        if not isinstance(value, list):
            fail(name, f"expected a list, got {value!r}")
        return [_coerce(item, item_tp, f"{name}[{i}]") for i, item in enumerate(value)]
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if isinstance(value, str) and hasattr(tp, "from_str"):  # a shorthand, e.g. a benchmark's name
            try:
                return tp.from_str(value)
            except ConfigError as exc:
                raise ConfigError(f"{name}.{exc}") from None
        if not isinstance(value, dict):
            fail(name, f"expected a mapping of {tp.__name__} fields, got {value!r}")
        return build(tp, value, prefix=name)
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        fail(name, f"expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            fail(name, f"expected an integer, got {value!r}")
        try:
            return int(value)
        except ValueError:
            fail(name, f"expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, bool):
            fail(name, f"expected a number, got {value!r}")
        try:
            number = float(value)  # YAML 1.1 reads "1e-6" as a string; accept it as a number here
        except (TypeError, ValueError):
            fail(name, f"expected a number, got {value!r}")
        if not math.isfinite(number):
            fail(name, f"expected a finite number, got {value!r}")
        return number
    if tp is str:
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            fail(name, f"expected a string, got {value!r}")
        return str(value)
    raise TypeError(f"unsupported annotation {tp!r} for {name}")  # a bug in this module, not user input


def build(cls: type, data: dict[str, Any], prefix: str = "") -> Any:
    """Build dataclass `cls` from a nested dict; unknown keys and bad values raise ConfigError."""
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    dotted = (prefix + ".") if prefix else ""
    unknown = sorted(set(data) - known)
    if unknown:
        fail(f"{dotted}{unknown[0]}", f"unknown field of {cls.__name__}; known fields: {sorted(known)}")
    kwargs = {key: _coerce(value, hints[key], f"{dotted}{key}") for key, value in data.items()}
    try:
        return cls(**kwargs)
    except ConfigError as exc:
        message = str(exc)
        # Field names raised inside __post_init__ are relative; make them dotted from the root.
        if prefix and not message.startswith(dotted):
            message = dotted + message
        raise ConfigError(message) from None


def to_dict(config: Any) -> dict[str, Any]:
    return dataclasses.asdict(config)
