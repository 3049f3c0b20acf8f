"""A report's ``out=`` folder: new, empty, or an earlier output of the same command (redrawn in place); anything
else (another command's output, a user's files) is refused before anything is read or written.

Shared by ``adls-table`` (:mod:`.table`) and the two HTML reports (:mod:`.page`: ``reports.sweep``,
``reports.study``); imports neither torch nor Hydra.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from pathlib import Path

from adls_lightning.errors import ConfigError


def check_report_folder(
    out: Path, command: str, files: Collection[str], written_by_command: Callable[[Path], bool] | None = None
) -> None:
    """Refuse ``out`` unless it is not there, empty, or holds only ``files`` that ``command`` wrote before.

    ``written_by_command(out)`` tells an earlier output of ``command`` from one of another command that writes the
    same file names (both HTML reports write ``index.html``); without it the names alone decide.

    Raises:
        ConfigError: ``out=FOLDER: holds ...``, naming what is in the way and what is valid.
    """
    try:
        names = sorted(p.name for p in out.iterdir())
    except (FileNotFoundError, NotADirectoryError):  # a file in the way is check_writable's refusal
        return
    if not names:
        return
    others = [name for name in names if name not in files]
    if not others and (written_by_command is None or written_by_command(out)):
        return
    found = ", ".join(others[:3]) + (f" and {len(others) - 3} more" if len(others) > 3 else "")
    what = found if others else f"{', '.join(names)} not written by {command}"
    raise ConfigError(
        f"out={out}: holds {what}; valid: a new or empty folder, or one holding an earlier {command} output "
        f"({', '.join(files)}), which is redrawn"
    )
