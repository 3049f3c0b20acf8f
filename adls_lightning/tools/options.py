"""The one command-line parser of the project's tools (:mod:`adls_lightning.tools`: ``adls-table``,
``python -m adls_lightning.graph``, ``soup``, ``quant.sensitivity``, ``reports.sweep``, ``reports.study``, ``adls-export``,
``adls-evaluate``, ``adls-predict``, ``adls-budget``): ``key=value`` options, Hydra overrides of
``conf/train.yaml`` passed on, and the output checks.

Every tool answers ``--help`` / ``-h`` with its usage (its module docstring) and exit code 0, refuses an unknown
key in one line naming the valid ones (a tool that also takes Hydra overrides of ``conf/train.yaml`` passes other
keys on, for Hydra to refuse), and refuses an output path no file can be written to before any work starts.
Imports only the ground floor (no torch), so ``--help`` and a refusal answer at once.
"""

from __future__ import annotations

import difflib
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from adls_lightning.configs import CONF_DIR
from adls_lightning.errors import ConfigError, did_you_mean
from adls_lightning.overrides import merge_overrides as merge_overrides
from adls_lightning.overrides import override_key as override_key
from adls_lightning.runs.folder import check_writable as check_writable

HELP_FLAGS = ("--help", "-h")
FLAGS = {"true": True, "false": False}


class HelpRequested(Exception):  # noqa: N818 - not an error: the tool prints its usage and exits 0
    """``--help`` / ``-h`` on a tool's command line (raised by :func:`split_options`; :func:`run_tool` prints
    the usage)."""


def split_options(
    argv: Sequence[str],
    defaults: Mapping[str, str | None],
    example: str,
    *,
    overrides: bool = True,
    positional: str | None = None,
) -> tuple[dict[str, Any], list[str]]:
    """A ``python -m`` tool's command line: its own ``key=value`` options (``defaults`` names them) and, when
    ``overrides``, the Hydra overrides of the run's config (every other ``key=value``); ``example`` shows a valid
    command line in errors.

    ``positional`` names the bare arguments the tool takes (``options[positional]``: their list); without it a
    token without ``=`` is refused.

    Raises:
        HelpRequested: ``--help`` or ``-h`` among the tokens.
        ConfigError: a token without ``=`` (and no ``positional``), or (without ``overrides``) an unknown key,
            naming the valid keys.
    """
    if any(token in HELP_FLAGS for token in argv):
        raise HelpRequested()
    options: dict[str, Any] = dict(defaults)
    extra: list[str] = []
    bare: list[str] = []
    for token in argv:
        key, sep, value = token.partition("=")
        if not sep and positional is not None and not token.startswith("-"):
            bare.append(token)
        elif not sep or not key:
            raise ConfigError(f"{token!r}: expected key=value, e.g. {example}")
        elif key in defaults:
            options[key] = value
        elif overrides:
            extra.append(token)
        else:
            raise ConfigError(f"{key}: unknown option (valid: {', '.join(defaults)}; usage: {example})")
    if positional is not None:
        options[positional] = bare
    return options, extra


#: the config folder of ``conf/train.yaml`` (and ``search.yaml``): its groups and top-level keys are what an
#: override may set
#: the root configs a run's overrides compose with (a search trial's run composes search.yaml)
ROOT_CONFIGS = ("train.yaml", "search.yaml")


def config_top_keys(conf_dir: Path = CONF_DIR) -> set[str]:
    """Every top-level key an override of the run's config may set without ``+``: the config groups (the
    folders), ``hydra``, and the keys of the root configs and of every ``@package _global_`` option (a preset
    such as ``search/preset=cpu`` or ``method=...`` sets keys at the top). Read as YAML, no Hydra: milliseconds."""
    import yaml

    keys = {"hydra"} | {p.name for p in conf_dir.iterdir() if p.is_dir()}
    for path in conf_dir.rglob("*.yaml"):
        text = path.read_text()
        if path.parent == conf_dir and path.name not in ROOT_CONFIGS:
            continue  # another command's root (graph.yaml)
        if path.parent != conf_dir and "@package _global_" not in text.split("\n", 1)[0]:
            continue
        try:
            node = yaml.safe_load(text)
        except yaml.YAMLError:  # Hydra refuses it when it composes, naming the file
            continue
        if isinstance(node, dict):
            keys.update(str(k) for k in node if k != "defaults")
    return keys


def check_override_keys(overrides: Sequence[str], options: Sequence[str]) -> None:
    """Refuse an override whose top-level key neither this command nor the run's config has: a misspelt option
    (``latncy=0.5``) reaches here as an override, and is named before any option is checked (an option's own
    check would name the option it misses instead). ``+key=...`` adds a key and is Hydra's to check.

    Raises:
        ConfigError: naming the key, the command's options and the config's.
    """
    known: set[str] | None = None
    for token in overrides:
        if token.startswith(("+", "~")):
            continue
        key = override_key(token)
        known = config_top_keys() if known is None else known
        top = key.split("@")[0].split(".")[0]  # model@pkg=x: a group placed elsewhere
        if top not in known:
            close = difflib.get_close_matches(top, [*options, *sorted(known)], n=3)
            raise ConfigError(
                f"{key}: unknown key{did_you_mean(close)}; valid: this command's options ({', '.join(options)}) "
                f"or a key of conf/train.yaml (model=..., data.*, quant.*; a new key: +{key}=...)"
            )


def flag_option(options: Mapping[str, Any], key: str) -> bool:
    """A ``python -m`` tool's ``key=true|false`` option (any case); ConfigError naming ``key`` otherwise."""
    value = str(options[key]).lower()
    if value not in FLAGS:
        raise ConfigError(f"{key}={options[key]}: must be true or false")
    return FLAGS[value]


def run_tool(body: Callable[[], Any], usage: str | None) -> int:
    """A tool's ``main``: ``body()`` with ``--help`` answered by ``usage`` (exit code 0) and a refusal as one
    ``error:`` line on stderr (exit code 2). Returns ``body``'s exit code (0 when it returns None)."""
    try:
        code = body()
    except HelpRequested:
        print((usage or "").strip())
        return 0
    except ConfigError as error:
        print(f"error: {' '.join(str(error).split())}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # the reader stopped early (`adls-table ... | head`): what it read is all it wanted. Python's own advice:
        # point stdout at devnull so the interpreter's final flush does not raise again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    return 0 if code is None else int(code)


# -- the reports' commands (adls_lightning.tools.report, adls_lightning.tools.study_report)


def report_arguments(
    argv: Sequence[str], positional: str | None, keys: Sequence[str], usage: str
) -> dict[str, str]:
    """``key=value`` arguments and, when ``positional`` names it, one bare argument: the tools' one parser
    (:func:`split_options`), with ``out`` (and the bare argument) required.

    Raises:
        HelpRequested: ``--help`` / ``-h``.
        ConfigError: an unknown key, a second bare argument, or a missing required key (``out`` always).
    """
    options, _ = split_options(argv, dict.fromkeys(keys), usage, overrides=False, positional=positional)
    args = {key: value for key, value in options.items() if key in keys and value is not None}
    if positional is not None:
        bare = options[positional]
        if len(bare) > 1:
            raise ConfigError(f"{bare[1]}: unexpected argument ({usage})")
        if bare:
            args[positional] = bare[0]
    required = [positional] if positional else []
    for key in [*required, "out"]:
        if not args.get(key):
            raise ConfigError(f"{key}: missing ({usage})")
    return args


def check_out_dir(out: str, command: str | None = None) -> Path:
    """The report's folder: creatable and writable (nothing is written before the report is ready) and, for
    ``command``'s page, new, empty or that command's own earlier page
    (:func:`adls_lightning.reports.page.check_page_folder`).

    Raises:
        ConfigError: naming ``out=``.
    """
    from adls_lightning.runs.folder import check_output_dir

    path = Path(out).expanduser().absolute()
    check_output_dir(path, {}, "out", earlier_run=False)
    if command is not None:
        from adls_lightning.reports.page import check_page_folder

        check_page_folder(path, command)
    return path


def report_main(func: Any, usage: str | None = None) -> None:
    """Run ``func(sys.argv[1:])`` with ``--help`` answered by ``usage`` (exit code 0) and a refusal as one line and
    exit code 2."""

    def report() -> None:
        print(f"Report written to {func(sys.argv[1:])}")

    sys.exit(run_tool(report, usage))
