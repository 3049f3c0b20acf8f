"""A run's local data files, read and checked before torch or Lightning is imported; and what a recorded run read.

The pre-flight check (:mod:`adls_lightning.app.preflight`) calls :func:`check_local_data` on a single run's
composed ``data`` node. For the project's data modules reading a local folder, the splits are read with the
functions the data module calls when the run builds it (:func:`~adls_lightning.data.folder.load_folder`,
:func:`~adls_lightning.data.glue.load_glue`): a bad file is refused in seconds instead of after the model
libraries have loaded, and a good one is read once, since both keep what they read in this process's cache.
A hub data set is not fetched here: a download is the run's, with its log lines.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from adls_lightning.data.folder import (
    AUTO,
    IMDB_HUB_NAME,
    IMDB_LABEL_NAMES,
    IMDB_LABELS,
    find_split_files,
    folder_data_dir,
    imdb_data_dir,
    load_folder,
    local_identity,
    resolve_data_dir,
)
from adls_lightning.data.glue import HUB_NAME as GLUE_HUB_NAME
from adls_lightning.data.glue import glue_files, load_glue
from adls_lightning.data.settings import check_val_size

# Where the project's data modules are importable from (the package re-exports them from .datamodule).
DATA_MODULE_PACKAGES = ("adls_lightning.data", "adls_lightning.data.datamodule")
# A value left out on the command line: the run's build reports it in Hydra's words.
MISSING = "???"
# How :func:`data_identity` starts: local files by their content, or a hub data set by its name.
LOCAL_DATA = "sha256:"
HUB_DATA = "hub:"
# The content digest of files already hashed by this process, by their path, size and modification time.
_DIGESTS: dict[str, str] = {}


def check_local_data(data: Mapping[str, Any]) -> None:
    """Read and check the splits that ``data`` (a resolved ``data`` node) names in a local folder, as the data
    module will: the files (parsed whole, columns, texts), the labels and their names, the main metric,
    ``data.val_size`` against the training rows. Another ``_target_``, a hub source or a missing ``data_dir`` is
    left to the run.

    Raises:
        ConfigError: the data module's own message (the key, the file and the row).
    """
    package, _, name = str(data.get("_target_", "")).rpartition(".")
    if package not in DATA_MODULE_PACKAGES or data.get("data_dir") == MISSING:
        return
    if name == "GlueDataModule":
        folder = resolve_data_dir(data.get("data_dir"))
        if folder is None or "task" not in data:
            return
        raw = load_glue(folder, data["task"])[0]
    elif name in ("IMDbDataModule", "FolderDataModule"):
        if name == "IMDbDataModule":  # its defaults: the data module's signature
            folder = resolve_data_dir(imdb_data_dir(data.get("data_dir", AUTO)))
            labels = data.get("labels", IMDB_LABELS)
            label_names = data.get("label_names", IMDB_LABEL_NAMES)
        else:
            folder = folder_data_dir(data.get("data_dir"), data.get("hub_name"))
            labels = data.get("labels")
            label_names = data.get("label_names")
        if folder is None:
            return
        labels = None if labels is None else list(labels)
        raw = load_folder(
            folder,
            data.get("hub_name"),
            labels,
            data.get("main_metric"),
            label_names,
            metrics=data.get("metrics"),
        )[0]
    else:
        return
    if "val_size" in data:
        check_val_size(data["val_size"], len(raw["train"]))


def data_read(data: Mapping[str, Any]) -> str:
    """What a run whose recorded ``data`` node this is read: its local folder, else its hub data set; a GLUE
    run's task first (``rte from DIR``). The tables' provenance (``adls-table``'s footer).

    ``data.data_dir=auto`` (IMDb's default) is resolved as a run would resolve it here and now, and says so: the
    record holds ``auto``, not what the run found.
    """
    data_dir = data.get("data_dir")
    auto = data_dir == AUTO
    if auto:
        data_dir = imdb_data_dir(AUTO)
    hub = GLUE_HUB_NAME if data.get("task") else data.get("hub_name")
    where = str(data_dir or hub or data.get("_target_") or "unknown")
    if auto:
        where += f" (data.data_dir={AUTO}, as found here)"
    return f"{data['task']} from {where}" if data.get("task") else where


def data_identity(data: Mapping[str, Any]) -> str | None:
    """What a resolved ``data`` node reads, the same wherever the same data are read from: its local files by
    content (``sha256:<digest> of train.parquet, test.parquet``), whatever folder holds them (another checkout,
    ``$ADLS_IMDB_DIR``, a worker machine's copy); or its hub data set (``hub:stanfordnlp/imdb``). IMDb's
    ``data.data_dir=auto`` is resolved as the run resolves it (:func:`~adls_lightning.data.folder.imdb_data_dir`).
    None for a data module of another kind (its ``data_dir`` is all that is known of it). A search's study records
    this as its ``data.data_dir`` (:mod:`adls_lightning.search.identity`).

    Raises:
        ConfigError: the folder or one of its split files is missing (the run's own message).
    """
    package, _, name = str(data.get("_target_", "")).rpartition(".")
    if package not in DATA_MODULE_PACKAGES or data.get("data_dir") == MISSING:
        return None
    if name == "GlueDataModule":
        if "task" not in data:
            return None
        folder = resolve_data_dir(data.get("data_dir"))
        if folder is None:
            return HUB_DATA + GLUE_HUB_NAME
        files = glue_files(folder, data["task"])
    elif name in ("IMDbDataModule", "FolderDataModule"):
        if name == "IMDbDataModule":  # its defaults: the data module's signature
            folder = resolve_data_dir(imdb_data_dir(data.get("data_dir", AUTO)))
            hub = data.get("hub_name", IMDB_HUB_NAME)
        else:
            folder = folder_data_dir(data.get("data_dir"), data.get("hub_name"))
            hub = data.get("hub_name")
        if folder is None:
            return f"{HUB_DATA}{hub}"
        files = find_split_files(folder)
    else:
        return None
    names = {split: path.relative_to(folder).as_posix() for split, path in files.items()}
    digest = hashlib.sha256()
    for split in sorted(files):
        digest.update(f"{split}:{names[split]}:{_file_digest(files[split])}\n".encode())
    return f"{LOCAL_DATA}{digest.hexdigest()[:16]} of {', '.join(names.values())}"


def is_data_identity(value: object) -> bool:
    """Whether ``value`` is a :func:`data_identity` (not a folder, ``auto`` or null as a config gives it)."""
    return isinstance(value, str) and value.startswith((LOCAL_DATA, HUB_DATA))


def _file_digest(path: Path) -> str:
    key = local_identity({"file": path})  # unchanged path, size and mtime: the content hashed before
    if key not in _DIGESTS:
        with path.open("rb") as handle:
            _DIGESTS[key] = hashlib.file_digest(handle, "sha256").hexdigest()
    return _DIGESTS[key]
