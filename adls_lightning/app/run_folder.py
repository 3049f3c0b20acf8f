"""A run's folder: Hydra's run record, written by the task once the run's checks passed."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from omegaconf import OmegaConf

from adls_lightning.atomic_files import atomic_write_bytes

RUN_RECORD_DIR = ".hydra"


def write_run_record(output_dir: str | os.PathLike, cfg: Any) -> None:
    """Write Hydra's run record (``.hydra/config.yaml``, ``hydra.yaml``, ``overrides.yaml``) of ``cfg``.

    Hydra would write it before the task starts (replacing an earlier run's record even when the run is then
    refused), so ``conf/hydra/default.yaml`` turns that off and the task calls this once its checks passed.
    """
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
