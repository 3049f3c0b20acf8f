"""Atomic file writes, so a killed run never leaves a half-written file that looks whole, nor loses the last good one.

Every write goes to a temporary file beside its target (same folder, so the same file system) and is renamed over
it: ``os.replace`` is atomic, whereas moving a file in from ``$TMPDIR`` on another file system is a copy that a
kill can cut short. Lightning's own checkpoint writer stages in ``$TMPDIR`` (fsspec's local transaction), hence
:class:`AtomicCheckpointIO`.
"""

from __future__ import annotations

import io
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO

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


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` via a temporary file in the same folder and ``os.replace``.

    The file gets the mode a plain ``open(path, "w")`` would give (0666 less the umask), not mkstemp's 0600.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_tmp(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=TMP_SUFFIX)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_json(path: str | os.PathLike, obj: Any) -> None:
    """Serialise ``obj`` as indented JSON and write it atomically."""
    atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning's checkpoint writer, writing beside the target and renaming (whatever file system $TMPDIR is on).

    A kill during a save leaves the previous ``last.ckpt`` whole; the next save removes the stale temporary file.
    """

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: str | os.PathLike, storage_options=None
    ) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint takes no storage_options")
        buffer = io.BytesIO()
        torch.save(checkpoint, buffer)
        atomic_write_bytes(path, buffer.getvalue())


RUN_RECORD_DIR = ".hydra"


def write_run_record(output_dir: str | os.PathLike, cfg: Any) -> None:
    """Write Hydra's run record (``.hydra/config.yaml``, ``hydra.yaml``, ``overrides.yaml``) of ``cfg``.

    Hydra would write it before the task starts (replacing an earlier run's record even when the run is then
    refused), so ``conf/hydra/default.yaml`` turns that off and the task calls this once its checks passed.
    """
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf

    if not HydraConfig.initialized():
        return
    hydra_cfg = HydraConfig.instance().cfg  # the `hydra` node alone, as Hydra records it
    record = Path(output_dir) / RUN_RECORD_DIR
    files = {
        "config.yaml": OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"]),
        "hydra.yaml": hydra_cfg,
        "overrides.yaml": hydra_cfg.hydra.overrides.task,
    }
    for name, node in files.items():
        atomic_write_bytes(record / name, OmegaConf.to_yaml(node).encode())
