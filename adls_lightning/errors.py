"""The ground floor: the user-facing :class:`ConfigError` and the value checks every module raises it from.

Imports nothing of the project, so any module may use it (library, callbacks, application) without a circle.
"""

from __future__ import annotations

import contextlib
import difflib
import math
import re
import sys
import typing
from typing import Any

from adls_lightning.configs import group_presets


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
    composing, becomes :func:`exit_with`'s one line (Hydra's through :func:`composition_error_line`), exit code 2."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    try:
        yield
    except ConfigError as err:
        exit_with(str(err))
    except (HydraException, OmegaConfBaseException) as err:
        exit_with(composition_error_line(err))


def composition_error_line(err: BaseException) -> str:
    """Hydra's or OmegaConf's error while composing a command line's config, as one refusal line.

    An unknown preset (``experiment=cpux``) names the group's presets and the closest ones; an unknown key
    (``data.max_lenght=64``) the closest key at its level, or, with none close, the keys there and Hydra's ``+``
    spelling (a new key is legitimate in a dict such as ``callbacks``). Any other error: Hydra's lines joined, without
    its config search path.
    """
    from hydra.errors import MissingConfigException

    if isinstance(err, MissingConfigException) and err.missing_cfg_file and err.options is not None:
        return _unknown_preset_line(err.missing_cfg_file, err.options)
    unknown_key = re.match(r"Could not override '([^']+)'\.\nTo append to your config use (\S.*)", str(err))
    if unknown_key:
        return _unknown_key_line(unknown_key.group(1), unknown_key.group(2), err.__cause__)
    message = str(err).split("\nConfig search path:")[0]  # Hydra's sources, the same for every command
    return "; ".join(line.strip() for line in message.splitlines() if line.strip())


def did_you_mean(closest: typing.Sequence[str]) -> str:
    """`` (did you mean a, b or c?)``, or nothing when nothing is close."""
    if not closest:
        return ""
    *others, last = closest
    return f" (did you mean {', '.join(others) + ' or ' if others else ''}{last}?)"


def _unknown_preset_line(missing_cfg_file: str, options: typing.Sequence[str]) -> str:
    # Hydra's "In '<config>'" names the config whose defaults list holds the group, also when the command line
    # chose the preset: not said here, where it would point away from the command line
    group, _, name = missing_cfg_file.rpartition("/")
    # a leading underscore marks a body the presets share (conf/quant/_base.yaml), not one to select
    presets = [option for option in options if not option.startswith("_")]
    if not presets:
        return f"{group}={name}: no such preset; {group} has none"
    closest = difflib.get_close_matches(name, presets)
    return f"{group}={name}: no such preset; valid: {', '.join(presets)}{did_you_mean(closest)}"


def _unknown_key_line(key: str, append: str, cause: BaseException | None) -> str:
    # OmegaConf's error names the first missing part of the key and the node it is missing from
    node = getattr(cause, "parent_node", None)
    missing, full_key = getattr(cause, "key", None), getattr(cause, "full_key", None)
    group, _, rest_of_key = key.partition(".")
    if rest_of_key and (node is None or not list(node)) and (presets := group_presets(group)):
        # a key of a config group left empty (compile=none, quant=none): it has keys once a preset is chosen
        return (
            f"{key}: no {group}= preset is chosen, so {group} has no keys; choose one first "
            f"(valid: {', '.join(f'{group}={p}' for p in presets)}), then set {key}"
        )
    if node is None or not isinstance(missing, str) or not isinstance(full_key, str):
        return f"{key}: no such key (a new key is added with {append})"
    level = full_key[: -len(missing)] if full_key.endswith(missing) else ""
    rest = key[len(full_key) :] if key.startswith(full_key) else ""
    keys = [str(k) for k in node] if hasattr(node, "keys") else []
    closest = difflib.get_close_matches(missing, keys)
    if closest:
        return f"{key}: no such key" + did_you_mean([f"{level}{match}{rest}" for match in closest])
    if not keys:
        return f"{key}: no such key (a new key is added with {append})"
    where = level.rstrip(".") or "the config"
    return f"{key}: no such key; {where} has {', '.join(keys)} (a new key is added with {append})"


def informational_flags(args: Any) -> bool:
    """Whether Hydra's parsed command line asks only for information (``--help``, ``--cfg``, ``--info``...):
    those go straight to Hydra, unchecked."""
    return any((args.help, args.hydra_help, args.cfg, args.info, args.shell_completion))
