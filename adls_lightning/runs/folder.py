"""A run's folder: the file that marks an earlier run, the check that a folder can take a new run (or a report), and
the removal of the folder of a run refused inside the task when the refusal left nothing of value in it.

Shared by the application's pre-flight and the report commands; imports neither torch nor Hydra's runtime.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from adls_lightning.errors import ConfigError
from adls_lightning.runs.record import METRICS_FILE, RUN_RECORD_DIR, RUN_RECORD_FILES


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


#: The entries a run writes into its folder (besides its log, ``<task>.log``): its record, metrics, checkpoints and
#: the loggers' folders (``conf/logger``: ``save_dir`` is the run folder). ``overwrite=true`` replaces exactly these.
RUN_OUTPUTS = (RUN_RECORD_DIR, METRICS_FILE, "checkpoints", "csv", "wandb")


def earlier_run_outputs(folder: Path) -> list[Path]:
    """The entries of ``folder`` an earlier run wrote (:data:`RUN_OUTPUTS` and its ``.log`` files), in name order."""
    try:
        return sorted(
            p for p in folder.iterdir() if p.name in RUN_OUTPUTS or (p.suffix == ".log" and p.is_file())
        )
    except OSError:
        return []


def check_output_dir(
    output_dir: Path, cfg: Mapping, key: str = "hydra.run.dir", *, earlier_run: bool = True
) -> None:
    """Refuse a run folder that is not a writable folder, or (``earlier_run``) that holds an earlier run a fresh
    run would replace, or files no run wrote (an export, a study's folders: a run would mix into them). A search's
    sweep folder may hold its earlier trials: re-running resumes the study.

    ``overwrite=true`` lets a fresh run replace an earlier run's outputs (:func:`replace_earlier_run`), refused
    when the run reads a file among them (its ``init_ckpt``, say).

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
    if not earlier_run or cfg.get("ckpt_path"):
        return
    if cfg.get("overwrite"):
        _check_inputs_outside(earlier_run_outputs(output_dir), cfg, key, output_dir)
        return
    # what marks a folder as holding an earlier run: its metrics or its checkpoints
    earlier = [p for p in (output_dir / METRICS_FILE, output_dir / "checkpoints") if p.exists()]
    if earlier:
        raise ConfigError(
            f"{key}={output_dir}: holds an earlier run ({earlier[0].name}); choose another {key}, "
            "resume it with ckpt_path=last, or pass overwrite=true"
        )
    run_outputs = {p.name for p in earlier_run_outputs(output_dir)}
    # hidden files (a file manager's, an editor's) do not make a folder someone else's
    others = sorted(n for n in entries(output_dir) or () if n not in run_outputs and not n.startswith("."))
    if others:
        shown = ", ".join(others[:3]) + (f" and {len(others) - 3} more" if len(others) > 3 else "")
        raise ConfigError(
            f"{key}={output_dir}: holds files no run wrote ({shown}); choose a new or empty folder, "
            "or pass overwrite=true to write the run beside them"
        )


def _check_inputs_outside(outputs: list[Path], cfg: Mapping, key: str, output_dir: Path) -> None:
    """Refuse ``overwrite=true`` when a path the config names lies among the earlier run's outputs it removes."""
    # only an input file the run reads (an output location, like a checkpoint folder, is not one)
    named = path_named_among(config_strings(cfg), outputs, files_only=True, inside=True)
    if named is not None:
        name, value = named
        raise ConfigError(
            f"overwrite=true: {name}={value} is in the earlier run's outputs it would remove from {output_dir}; "
            f"copy it elsewhere first, or choose another {key}"
        )


def path_named_among(
    named: Iterable[tuple[str, str]], paths: Iterable[Path], files_only: bool, inside: bool
) -> tuple[str, str] | None:
    """The first ``(key, value)`` of ``named`` whose value is an existing path (a file only, with ``files_only``)
    that is one of ``paths`` (or lies inside one, with ``inside``): what ``overwrite=true`` would remove from under a
    run or an export that reads it. A string that names nothing (an interpolation, a hub name) is no such path."""
    targets = [p.resolve() for p in paths]
    if not targets:
        return None
    for key, value in named:
        try:
            path = Path(value).expanduser()
            if not (path.is_file() if files_only else path.exists()):
                continue
            path = path.resolve()
        except (
            OSError,
            RuntimeError,
            ValueError,
        ):  # a string that is no path (too long, a loop of links, a NUL)
            continue
        if any(path == t or (inside and t in path.parents) for t in targets):
            return key, value
    return None


def config_strings(node: object, key: str = "") -> list[tuple[str, str]]:
    """Every string leaf of a config as ``(dotted key, value)``."""
    if isinstance(node, Mapping):
        return [item for k, v in node.items() for item in config_strings(v, f"{key}.{k}" if key else str(k))]
    if isinstance(node, Sequence) and not isinstance(node, str):
        return [item for i, v in enumerate(node) for item in config_strings(v, f"{key}[{i}]")]
    return [(key, node)] if isinstance(node, str) else []


def replace_earlier_run(folder: Path) -> list[str]:
    """Remove an earlier run's outputs from ``folder`` (:func:`earlier_run_outputs`: what ``overwrite=true``
    replaces), leaving anything else in it. Returns the names removed."""
    removed = earlier_run_outputs(folder)
    for path in removed:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
    return [p.name for p in removed]


def check_writable(path: Path, key: str = "out", *, file: bool = False) -> None:
    """Refuse an output path nothing can be written to: one under a regular file, or in a folder where no file
    or folder can be created (``/proc``, a read-only mount, no permission). ``file``: ``path`` is the file to
    write (its folder is checked), else the folder to create or fill. Tried, not guessed
    (:func:`cannot_create_in`); nothing is left behind.

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


def made_by_this_process(folder: Path) -> bool:
    """``folder`` was created after this process started (Hydra made it for this run), by its birth time: its
    change time moves whenever an entry is added or removed (the pre-flight's probe folder, for one), so it tells
    nothing. False where the file system keeps no birth time."""
    import psutil  # read lazily: only a refused run asks

    born = birth_time(folder)
    try:
        return born is not None and born >= psutil.Process().create_time()
    except psutil.Error:
        return False


# statx(2): the mask bit of the birth time, its offset in struct statx, and the structure's size
_STATX_BTIME, _BTIME_OFFSET, _STATX_SIZE = 0x800, 80, 256


def birth_time(path: Path) -> float | None:
    """When ``path`` was created (seconds since the epoch), or None where the platform or file system does not say:
    ``st_birthtime`` (macOS, BSD), else Linux's ``statx`` through the C library."""
    try:
        info = path.stat()
    except OSError:
        return None
    if hasattr(info, "st_birthtime"):
        return info.st_birthtime
    if not sys.platform.startswith("linux"):
        return None
    import ctypes
    import struct

    try:
        statx = ctypes.CDLL(None, use_errno=True).statx
    except (OSError, AttributeError):  # a C library without statx (glibc before 2.28, musl before 1.2.5)
        return None
    buffer = ctypes.create_string_buffer(_STATX_SIZE)
    at_fdcwd = -100
    if statx(at_fdcwd, os.fsencode(path), 0, _STATX_BTIME, buffer) != 0:
        return None
    (mask,) = struct.unpack_from("I", buffer, 0)
    if not mask & _STATX_BTIME:
        return None
    seconds, nanoseconds = struct.unpack_from("qI", buffer, _BTIME_OFFSET)
    return seconds + nanoseconds / 1e9


def entries(folder: Path) -> set[str] | None:
    """The names in ``folder`` (None when it is not a folder)."""
    try:
        return {p.name for p in folder.iterdir()}
    except OSError:
        return None


def remove_unused_run_folder(folder: Path, at_start: set[str] | None) -> bool:
    """Remove the run folder of a refused run when it holds nothing of value: Hydra made it for this process (it
    was empty when the task started, and is no older than the process) and it holds at most the run record
    (:data:`RUN_RECORD_DIR`) and the run's log file. An earlier run's folder, or one with anything else in it
    (checkpoints, metrics, a user's file), is left as it is; so are the folders above it, unless Hydra made them
    for this run too and they are empty. Returns whether the folder is gone.
    """
    if at_start != set() or not made_by_this_process(folder):
        return False
    root = logging.getLogger()
    logs = {
        Path(h.baseFilename): h
        for h in root.handlers
        if isinstance(h, logging.FileHandler) and Path(h.baseFilename).parent == folder
    }
    record = folder / RUN_RECORD_DIR
    for path in folder.iterdir():
        if path == record and path.is_dir() and not path.is_symlink():
            if any(not f.is_file() or f.name not in RUN_RECORD_FILES for f in record.iterdir()):
                return False
        elif path not in logs or not path.is_file():
            return False
    for path, handler in logs.items():  # closed first: a later record would reopen the file in a gone folder
        root.removeHandler(handler)
        handler.close()
        path.unlink(missing_ok=True)
    if record.is_dir():
        for f in record.iterdir():
            f.unlink()
        record.rmdir()
    try:
        folder.rmdir()  # only ever an empty folder: a file written meanwhile keeps it
    except OSError:
        return False
    for (
        parent
    ) in folder.parents:  # and the folders above it that Hydra made for it (a first run's outputs/...)
        if not made_by_this_process(parent):
            break
        try:
            parent.rmdir()
        except OSError:  # not empty: another run's
            break
    return True
