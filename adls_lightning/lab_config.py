"""The labs' config files (MASE's ``.toml``, or YAML / JSON) read as the arguments of one pass.

``quant.config=lab.toml``, ``prune.config=lab.toml`` and ``compress.quant=lab.toml`` all come through
:func:`load_lab_config`: a mapping is taken as it is, a file is parsed by its suffix, and a whole MASE config file
gives its ``[passes.<pass>]`` table, and chop's ``"NA"`` is read as None. What the arguments mean is up to the pass (``adls_lightning.quant.mase`` for
quantization, ``adls_lightning/callbacks/pruning.py`` for pruning).
"""

from __future__ import annotations

import copy
import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from adls_lightning.errors import ConfigError

log = logging.getLogger(__name__)


def load_lab_config(source: Any, pass_name: str, key: str) -> dict[str, Any]:
    """A lab config as a plain dict: a mapping, or the path of a ``.toml`` / ``.yaml`` / ``.json`` file.

    A whole MASE config (``model``, ``dataset``, ``[passes.<pass_name>]``...) gives its ``passes.<pass_name>``
    table; its other keys are ignored with a one-line note (the run's own ``model=``, ``data=`` apply).

    Raises:
        ConfigError: a missing or unreadable file, or no ``passes.<pass_name>`` table in a whole config.
    """
    return load_lab_config_at(source, pass_name, key)[0]


def load_lab_config_at(source: Any, pass_name: str, key: str) -> tuple[dict[str, Any], str]:
    """:func:`load_lab_config`, plus the key its entries are named under in messages (``lab.toml:passes.quantize``
    for a file)."""
    where = key
    if isinstance(source, (str, os.PathLike)):
        where = str(source)
        source = _read_file(Path(source), key)
    data = OmegaConf.to_container(source, resolve=True) if isinstance(source, DictConfig) else source
    if not isinstance(data, Mapping):
        raise ConfigError(f"{key}={data!r}: expected a mapping or the path of a .toml/.yaml/.json lab config")
    if "passes" in data:
        passes = data["passes"]
        if not isinstance(passes, Mapping) or pass_name not in passes:
            raise ConfigError(
                f"{where}.passes: has no '{pass_name}' table (a MASE config's [passes.{pass_name}])"
            )
        ignored = [k for k in data if k != "passes"] + [f"passes.{p}" for p in passes if p != pass_name]
        if ignored:
            log.info("%s: ignored %s (this run's own settings apply)", where, ", ".join(ignored))
        data, where = passes[pass_name], f"{where}:passes.{pass_name}"
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where}={data!r}: expected a table of the pass's arguments")
    if not data and where != key:
        # an empty file would otherwise run as if the pass were on (a "QAT" run with nothing quantized)
        raise ConfigError(f"{where}: empty; a lab config file must give the {pass_name} pass's arguments")
    return _na_as_none(copy.deepcopy(dict(data))), where


#: chop's TOML spelling of None (TOML has no null): ``name = "NA"`` leaves a layer alone, a statistic "NA" is
#: measured, ``binary_training = "NA"`` is off.
CHOP_NONE = "NA"


def _na_as_none(value: Any) -> Any:
    """``value`` with every ``"NA"`` read as None, as chop reads it, in nested tables and arrays alike."""
    if isinstance(value, dict):
        return {k: _na_as_none(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_na_as_none(v) for v in value]
    return None if value == CHOP_NONE else value


def _read_file(path: Path, key: str) -> Any:
    try:
        import tomllib  # Python >= 3.11
    except ModuleNotFoundError:  # pragma: no cover - Python 3.10
        import tomli as tomllib  # type: ignore[no-redef]
    readers = {".toml": tomllib.loads, ".json": json.loads}
    if not path.is_file():
        raise ConfigError(
            f"{key}={path}: no such file (give a .toml, .yaml or .json lab config, or a mapping)"
        )
    try:
        text = path.read_text()
        if path.suffix in (".yaml", ".yml"):
            return OmegaConf.to_container(OmegaConf.create(text), resolve=True)
        if path.suffix not in readers:
            raise ConfigError(f"{key}={path}: unknown file type (use .toml, .yaml or .json)")
        return readers[path.suffix](text)
    except (OSError, ValueError) as err:  # TOMLDecodeError and JSONDecodeError are ValueErrors
        raise ConfigError(f"{key}={path}: cannot be read ({str(err).splitlines()[0]})") from None
