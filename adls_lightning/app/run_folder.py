"""A run's folder: Hydra's run record, written by the task once the run's checks passed; the folder of a run
refused inside the task removed again when the refusal left nothing of value in it."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from omegaconf import OmegaConf

from adls_lightning.files.atomic import atomic_write_bytes

RUN_RECORD_DIR = ".hydra"
# What write_run_record writes into RUN_RECORD_DIR.
RUN_RECORD_FILES = ("config.yaml", "hydra.yaml", "overrides.yaml")


def write_run_record(output_dir: str | os.PathLike, cfg: Any) -> None:
    """Write Hydra's run record (``.hydra/config.yaml``, ``hydra.yaml``, ``overrides.yaml``) of ``cfg``.

    Hydra would write it before the task starts (replacing an earlier run's record even when the run is then
    refused), so ``conf/hydra/default.yaml`` turns that off and the task calls this once its checks passed.
    """
    if not HydraConfig.initialized():
        return
    hydra_cfg = HydraConfig.instance().cfg  # the `hydra` node alone, as Hydra records it
    record = Path(output_dir) / RUN_RECORD_DIR
    nodes = (
        OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"]),
        hydra_cfg,
        hydra_cfg.hydra.overrides.task,
    )
    files = dict(zip(RUN_RECORD_FILES, nodes))
    for name, node in files.items():
        atomic_write_bytes(record / name, OmegaConf.to_yaml(node).encode())


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
