"""Atomic file writes without torch: a temporary file beside the target, renamed over it.

``os.replace`` is atomic, whereas moving a file in from ``$TMPDIR`` on another file system is a copy that a kill
can cut short. Kept apart from :mod:`adls_lightning.files.lightning_io` (Lightning's checkpoint and CSV writers built on
these) so that what writes only JSON or bytes - the study sweeper, run folders, HTML reports - imports neither
torch nor Lightning: a search process loads them only when a trial runs in it.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

TMP_SUFFIX = ".tmp"


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def remove_stale_tmp(path: str | os.PathLike) -> None:
    """Delete temporary files an earlier, killed write of ``path`` left beside it."""
    path = Path(path)
    for stale in path.parent.glob(f".{path.name}.*{TMP_SUFFIX}"):
        stale.unlink(missing_ok=True)


def atomic_write(path: str | os.PathLike, write: Callable[[Path], None]) -> None:
    """Let ``write`` fill a temporary file in ``path``'s folder, then ``os.replace`` it over ``path``.

    The file gets the mode a plain ``open(path, "w")`` would give (0666 less the umask), not mkstemp's 0600.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_tmp(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=TMP_SUFFIX)
    os.close(fd)
    try:
        write(Path(tmp))
        with open(tmp, "rb+") as handle:
            os.fsync(handle.fileno())
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically (:func:`atomic_write`)."""
    atomic_write(path, lambda tmp: tmp.write_bytes(data))


def atomic_write_json(path: str | os.PathLike, obj: Any) -> None:
    """Serialise ``obj`` as indented JSON and write it atomically."""
    atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())
