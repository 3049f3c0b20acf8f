"""The ground floor: the user-facing :class:`ConfigError` and the value checks every module raises it from.

Imports nothing of the project, so any module may use it (library, callbacks, application) without a circle.
"""

from __future__ import annotations

import contextlib
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


@contextlib.contextmanager
def refusing_in_one_line() -> typing.Iterator[None]:
    """A command line's checks before Hydra runs: a ConfigError, or Hydra's or OmegaConf's own error while
    composing, becomes :func:`exit_with`'s one line (its newlines joined), exit code 2."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    try:
        yield
    except ConfigError as err:
        exit_with(str(err))
    except (HydraException, OmegaConfBaseException) as err:
        exit_with(str(err).replace("\n", "; "))


def informational_flags(args: Any) -> bool:
    """Whether Hydra's parsed command line asks only for information (``--help``, ``--cfg``, ``--info``...):
    those go straight to Hydra, unchecked."""
    return any((args.help, args.hydra_help, args.cfg, args.info, args.shell_completion))
