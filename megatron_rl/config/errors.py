"""The one error a configuration raises: its message starts with the dotted field to change."""

from __future__ import annotations

import typing


class ConfigError(ValueError):
    """A configuration value is wrong. The message starts with the dotted field name."""


def fail(name: str, message: str) -> typing.NoReturn:
    raise ConfigError(f"{name}: {message}")
