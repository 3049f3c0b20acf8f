"""The command lines of ``scripts/*.py`` and ``benchmarks/*.py``: every option checked when it is parsed, before any
work starts (a benchmark or a figure script may run for hours), and a refusal in one line.

:class:`Parser` is argparse with its refusal as one ``error: ...`` line on stderr and exit status 2 (argparse's own
prints the usage block first); the ``type=`` converters below refuse a value that would fail later (a zero thread
count, a sparsity of 1.5, a ``16y256`` token shape), and :func:`check_output_file` an output no file can be written
to. Imports only the ground floor (no torch): a refusal answers in about a second.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import NoReturn

from adls_lightning.errors import ConfigError
from adls_lightning.runs.folder import check_writable


class Parser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose refusals are one line, ``error: <what> (see <prog> --help)``, exit
    status 2; the description is shown raw (the scripts' docstrings are laid out by hand)."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        print(f"error: {' '.join(message.split())} (see {self.prog} --help)", file=sys.stderr)
        sys.exit(2)


def _number(text: str, kind: Callable[[str], float], what: str, ok: Callable[[float], bool]) -> float:
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: must be {what}") from None
    if not ok(value):
        raise argparse.ArgumentTypeError(f"{text}: must be {what}")
    return value


def positive_int(text: str) -> int:
    """A count that must be at least 1 (threads, rounds, repeats, sizes)."""
    return int(_number(text, int, "a positive integer", lambda v: v >= 1))


def non_negative_int(text: str) -> int:
    """A count where 0 means none (e.g. rows of an accuracy check that 0 skips)."""
    return int(_number(text, int, "an integer >= 0", lambda v: v >= 0))


def positive_float(text: str) -> float:
    """A positive finite number (seconds, GHz)."""
    return _number(text, float, "a positive number", lambda v: 0 < v < float("inf"))


def fraction(text: str) -> float:
    """A share in [0, 1) (a sparsity, a dropout probability): 1 would remove everything."""
    return _number(text, float, "a number in [0, 1)", lambda v: 0 <= v < 1)


def unit_fraction(text: str) -> float:
    """A share in [0, 1] (a fraction of heads or neurons to prune)."""
    return _number(text, float, "a number in [0, 1]", lambda v: 0 <= v <= 1)


def batch_by_length(text: str) -> tuple[int, int]:
    """``"16x256"`` -> (16, 256): batch x sequence length, both positive."""
    parts = text.lower().split("x")
    try:
        batch, length = (int(part) for part in parts)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: must be BATCHxLENGTH, e.g. 16x256") from None
    if batch < 1 or length < 1:
        raise argparse.ArgumentTypeError(f"{text}: batch and length must be at least 1, e.g. 16x256")
    return batch, length


def existing_file(text: str) -> Path:
    """An input file that must be there (a checkpoint): refused when parsed, not when the work reaches it."""
    path = Path(text)
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"{text}: no such file")
    return path


def existing_folder(text: str) -> Path:
    """An input folder that must be there (a data set, earlier runs)."""
    path = Path(text)
    if not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: no such folder")
    return path


def check_output_file(path: Path, option: str, suffixes: Sequence[str] | None = None) -> None:
    """Refuse an output file that cannot be written, before anything is read or written: a suffix not in
    ``suffixes``, a folder, a read-only file, a path no file can be created at.

    Raises:
        ConfigError: ``OPTION=PATH: ...``.
    """
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"{option}={path}: is a folder; give a file path")
    if suffixes is not None and path.suffix.lower() not in suffixes:
        raise ConfigError(f"{option}={path}: must end in one of {', '.join(suffixes)}")
    if path.exists() and not os.access(path, os.W_OK):
        raise ConfigError(f"{option}={path}: the file is not writable; give a path you can write to")
    check_writable(path, option, file=True)


def check_outputs(
    parser: Parser,
    figures: Mapping[str, Path | None] | None = None,
    files: Mapping[str, Path | None] | None = None,
) -> None:
    """:func:`check_output_file` for each ``{option: path}`` given (None: not asked for), figures with
    :data:`FIGURE_SUFFIXES`; a refusal through ``parser``."""
    for outputs, suffixes in ((figures or {}, FIGURE_SUFFIXES), (files or {}, None)):
        for option, path in outputs.items():
            if path is not None:
                try:
                    check_output_file(path, option, suffixes)
                except ConfigError as error:
                    parser.error(str(error))


#: What matplotlib writes without extra packages: the figure options' valid suffixes.
FIGURE_SUFFIXES = (".png", ".svg", ".pdf")
