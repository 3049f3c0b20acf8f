"""A run's record: Hydra's ``.hydra/`` files (written by the task once the run's checks passed), the identity of the
data it read beside them, and ``metrics.json``; written here, and read back here for the tables and figures over
many runs."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import yaml
from omegaconf import OmegaConf

from adls_lightning.files.atomic import atomic_write_bytes, atomic_write_json

RUN_RECORD_DIR = ".hydra"
# A finished run's metrics (also what marks a folder as holding an earlier run).
METRICS_FILE = "metrics.json"
# The precision the run's trainer computed in, as Lightning names it (``trainer.precision=auto`` resolved, or the
# value given): the one text value of ``metrics.json`` beside its numbers; runs recorded before it lack it.
PRECISION_KEY = "trainer/precision"
# The data the run read, by content (adls_lightning.data.sources.data_identity, as a search's study records them):
# ``{"identity": "sha256:<digest> of train.parquet, test.parquet"}`` or ``"hub:<name>"``. The config names a folder,
# whose files may be replaced between two runs; runs recorded before it, or of another data module, lack it.
DATA_FILE = "data.json"
DATA_IDENTITY_KEY = "identity"
# What write_run_record writes into RUN_RECORD_DIR: Hydra's files, then the data's identity.
HYDRA_RECORD_FILES = ("config.yaml", "hydra.yaml", "overrides.yaml")
RUN_RECORD_FILES = (*HYDRA_RECORD_FILES, DATA_FILE)


def write_run_record(
    output_dir: str | os.PathLike, cfg: Any, hydra_cfg: Any, data_identity: str | None = None
) -> None:
    """Write Hydra's run record (``.hydra/config.yaml``, ``hydra.yaml``, ``overrides.yaml``) of ``cfg``;
    ``hydra_cfg`` is the ``hydra`` node alone, as Hydra records it (``HydraConfig.instance().cfg``: the
    application reads Hydra's runtime, not this module); and ``data_identity``, what the run reads
    (:data:`DATA_FILE`; None: not known, and an earlier run's file goes).

    Hydra would write it before the task starts (replacing an earlier run's record even when the run is then
    refused), so ``conf/hydra/default.yaml`` turns that off and the task calls this once its checks passed.
    """
    record = Path(output_dir) / RUN_RECORD_DIR
    nodes = (
        OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"]),
        hydra_cfg,
        hydra_cfg.hydra.overrides.task,
    )
    for name, node in zip(HYDRA_RECORD_FILES, nodes):
        atomic_write_bytes(record / name, OmegaConf.to_yaml(node).encode())
    if data_identity is None:
        (record / DATA_FILE).unlink(missing_ok=True)
    else:
        atomic_write_json(record / DATA_FILE, {DATA_IDENTITY_KEY: data_identity})


def iter_run_records(
    roots: Iterable[Path], metric: str
) -> Iterator[tuple[Path, dict[str, Any], dict[str, Any]]]:
    """``(run folder, metrics, config)`` per ``metrics.json`` under ``roots`` (recursively, sorted).

    Runs without ``metric`` are skipped with a note on stderr (e.g. a job that failed before testing); a run
    without a saved config gets ``{}``.

    Raises:
        ValueError: a ``metrics.json`` that is not a JSON object (a file cut by a killed job) or a saved config
            that is not a YAML mapping, naming the file: a figure drawn without that run would be silently wrong.
    """
    for root in roots:
        for metrics_file in sorted(Path(root).rglob(METRICS_FILE)):
            run_dir = metrics_file.parent
            metrics, config = read_run_record(run_dir)
            if metric not in metrics:
                print(f"skipping {run_dir}: no {metric} in metrics.json", file=sys.stderr)
                continue
            yield run_dir, metrics, config


def read_run_record(run_dir: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(metrics, config)`` of one run folder: its ``metrics.json`` and saved ``.hydra/config.yaml`` (``{}`` when
    it saved none).

    Raises:
        ValueError: as :func:`iter_run_records`, naming the file.
    """
    return _read_mapping(run_dir / METRICS_FILE, json.loads, "JSON"), read_run_config(run_dir)


def read_run_config(run_dir: Path) -> dict[str, Any]:
    """A run folder's saved ``.hydra/config.yaml`` (``{}`` when it saved none): also readable for a run that
    failed or has not finished, which has no ``metrics.json``.

    Raises:
        ValueError: naming the file, when it is not a YAML mapping.
    """
    config_file = run_dir / RUN_RECORD_DIR / "config.yaml"
    return _read_mapping(config_file, yaml.safe_load, "YAML") if config_file.is_file() else {}


def read_run_data(run_dir: Path) -> str | None:
    """The identity of the data a run read (:data:`DATA_FILE`), or None for a run that did not record it.

    Raises:
        ValueError: naming the file, when it is not a JSON object with a text ``identity``.
    """
    data_file = run_dir / RUN_RECORD_DIR / DATA_FILE
    if not data_file.is_file():
        return None
    identity = _read_mapping(data_file, json.loads, "JSON").get(DATA_IDENTITY_KEY)
    if not isinstance(identity, str):
        raise ValueError(f"{data_file}: no text {DATA_IDENTITY_KEY!r} (holds {identity!r})")
    return identity


def _read_mapping(path: Path, parse: Callable[[str], Any], kind: str) -> dict[str, Any]:
    try:
        value = parse(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError, yaml.YAMLError) as err:
        raise ValueError(f"{path}: not readable {kind} ({' '.join(str(err).split())})") from err
    if not isinstance(value, dict):
        raise ValueError(f"{path}: not a {kind} mapping of names to values (holds {type(value).__name__})")
    return value
