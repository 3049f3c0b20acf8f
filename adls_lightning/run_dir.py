"""A run's folder: the file that marks an earlier run, and the check that a folder can take a new run (or a report).

Shared by the application's pre-flight and the report commands; imports only the ground floor.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from pathlib import Path

from adls_lightning.errors import ConfigError

# What marks a folder as holding an earlier run (besides its checkpoints/ folder).
METRICS_FILE = "metrics.json"


def cannot_create_in(folder: Path) -> str | None:
    """Why no folder can be created in ``folder`` (None: one can). Tried, not guessed: ``os.access`` says yes to
    root under ``/proc`` and knows nothing of a read-only mount; an empty probe folder is made and removed at once.
    """
    try:
        probe = tempfile.mkdtemp(prefix=".adls-probe-", dir=folder)
    except OSError as err:
        return err.strerror or type(err).__name__
    os.rmdir(probe)
    return None


def check_output_dir(
    output_dir: Path, cfg: Mapping, key: str = "hydra.run.dir", *, earlier_run: bool = True
) -> None:
    """Refuse a run folder that is not a writable folder, or (``earlier_run``) that holds an earlier run a fresh
    run would replace. A search's sweep folder may hold its earlier trials: re-running resumes the study.

    Raises:
        ConfigError: naming ``key``; an earlier run is refused unless resuming (``ckpt_path``) or ``overwrite``.
    """
    existing = next((p for p in (output_dir, *output_dir.parents) if p.exists()), None)
    if existing is not None and not existing.is_dir():
        raise ConfigError(f"{key}={output_dir}: {existing} is a file, not a folder (give a folder path)")
    if existing is not None and not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"{key}={output_dir}: {existing} is not writable (give a folder you can write to)")
    if existing is not None and (why := cannot_create_in(existing)):
        raise ConfigError(
            f"{key}={output_dir}: cannot create folders in {existing} ({why}); give a folder you can write to"
        )
    if not earlier_run or cfg.get("ckpt_path") or cfg.get("overwrite"):
        return
    earlier = [p for p in (output_dir / METRICS_FILE, output_dir / "checkpoints") if p.exists()]
    if earlier:
        raise ConfigError(
            f"{key}={output_dir}: holds an earlier run ({earlier[0].name}); choose another hydra.run.dir, "
            "resume it with ckpt_path=last, or pass overwrite=true"
        )


def check_writable(path: Path, key: str = "out", *, file: bool = False) -> None:
    """Refuse an output path nothing can be written to: one under a regular file, or in a folder where no file
    or folder can be created (``/proc``, a read-only mount, no permission). ``file``: ``path`` is the file to
    write (its folder is checked), else the folder to create or fill. Tried, not guessed
    (:func:`~adls_lightning.run_dir.cannot_create_in`); nothing is left behind.

    Raises:
        ConfigError: ``KEY=PATH: ...`` naming the part of the path in the way.
    """
    path = Path(path).expanduser().absolute()
    folder = path.parent if file else path
    existing = next((p for p in (folder, *folder.parents) if p.exists()), None)
    if existing is None:
        return
    if not existing.is_dir():
        raise ConfigError(f"{key}={path}: {existing} is a file, not a folder (give a path you can write to)")
    if why := cannot_create_in(existing):
        raise ConfigError(f"{key}={path}: cannot write in {existing} ({why}); give a path you can write to")
