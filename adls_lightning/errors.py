"""The ground floor: the user-facing :class:`ConfigError` and the value checks every module raises it from.

Imports nothing of the project, so any module may use it (library, callbacks, application) without a circle.
"""

from __future__ import annotations

import math
import sys
import typing
from typing import Any


class ConfigError(ValueError):
    """A user-facing configuration error; its message names the offending key and what would be valid."""


def require_positive_int(key: str, value: Any, *, allow_none: bool = False) -> None:
    """Raise ConfigError unless ``value`` is a positive int (or None when ``allow_none``)."""
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        valid = "a positive integer" + (" or null" if allow_none else "")
        raise ConfigError(f"{key}={value!r}: must be {valid}")


def require_positive_number(key: str, value: Any, *, allow_none: bool = False) -> None:
    """Raise ConfigError unless ``value`` is a positive finite number (or None when ``allow_none``)."""
    if value is None and allow_none:
        return
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value <= 0
    ):
        valid = "a positive finite number" + (" or null" if allow_none else "")
        raise ConfigError(f"{key}={value!r}: must be {valid}")


def require_fraction(key: str, value: Any, *, low: float = 0.0, high: float = 1.0) -> None:
    """Raise ConfigError unless ``low <= value < high``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value < high:
        raise ConfigError(f"{key}={value!r}: must be a number in [{low}, {high})")


def require_choice(key: str, value: Any, choices: typing.Sequence[str]) -> None:
    """Raise ConfigError unless ``value`` is one of ``choices``."""
    if value not in choices:
        raise ConfigError(f"{key}={value!r}: must be one of {', '.join(choices)}")


def exit_with(message: str) -> typing.NoReturn:
    """The one-line refusal: ``error: <message>`` on stderr, exit code 2."""
    print(f"error: {' '.join(message.split())}", file=sys.stderr)
    sys.exit(2)
