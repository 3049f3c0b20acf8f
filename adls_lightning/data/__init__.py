"""Data: tasks as data (:mod:`.tasks`), one module per source (:mod:`.folder` files or a hub data set,
:mod:`.glue` GLUE's TSVs or ``nyu-mll/glue``) and the LightningDataModules over them (:mod:`.datamodule`);
:mod:`.sources` reads a single run's local files in the pre-flight check with the data modules' own functions.

The data modules are imported on first use (``adls_lightning.data.IMDbDataModule``), so importing the package for
its task table (the config resolver) stays light.
"""

from __future__ import annotations

import importlib
from typing import Any

from adls_lightning.data.tasks import GLUE_TASKS, Task  # noqa: F401  (registers the config resolver)

_LAZY = {
    "TextDataModule": "datamodule",
    "FolderDataModule": "datamodule",
    "IMDbDataModule": "datamodule",
    "GlueDataModule": "datamodule",
    "ResumableLoader": "datamodule",
    "stratified_subset": "datamodule",
    "default_data_dir": "folder",
    "find_split_files": "folder",
    "load_raw_splits": "folder",
    "read_data_file": "folder",
    "check_rows": "folder",
    "load_glue": "glue",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
