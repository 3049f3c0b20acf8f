"""Up-front validation of a composed run config, so bad input fails before any training starts."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A user-facing configuration error; its message names the offending key and what would be valid."""


def require_positive_int(key: str, value: Any, *, allow_none: bool = False) -> None:
    """Raise ConfigError unless ``value`` is a positive int (or None when ``allow_none``)."""
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        valid = "a positive integer" + (" or null" if allow_none else "")
        raise ConfigError(f"{key}={value!r}: must be {valid}")


def require_fraction(key: str, value: Any, *, low: float = 0.0, high: float = 1.0) -> None:
    """Raise ConfigError unless ``low <= value < high``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value < high:
        raise ConfigError(f"{key}={value!r}: must be a number in [{low}, {high})")


def _get(cfg: Mapping, dotted: str, default: Any = None) -> Any:
    node: Any = cfg
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return default
        node = node[part]
    return node


def validate_run_config(cfg: Mapping) -> None:
    """Check the keys of a composed ``train.yaml`` config that Hydra's struct mode cannot check (values, paths).

    Unknown keys are already rejected by Hydra (``Key 'x' is not in struct``); this checks values.

    Raises:
        ConfigError: naming the first offending key.
    """
    data = cfg.get("data") or {}
    require_positive_int("data.max_length", data.get("max_length"))
    require_positive_int("data.batch_size", data.get("batch_size"))
    for key in ("train_size", "val_size", "test_size"):
        require_positive_int(f"data.{key}", data.get(key), allow_none=key != "val_size")
    data_dir = data.get("data_dir")
    if data_dir not in (None, "auto") and not Path(str(data_dir)).is_dir():
        raise ConfigError(
            f"data.data_dir={data_dir}: no such directory (give a folder holding train/test files, "
            "'auto' to use $ADLS_IMDB_DIR or ../shared/data/imdb, or null for the Hugging Face hub)"
        )
    trainer = cfg.get("trainer") or {}
    require_positive_int("trainer.max_epochs", trainer.get("max_epochs"))
    lora = _get(cfg, "model.lora")
    if lora:
        require_positive_int("model.lora.r", lora.get("r"))
        require_fraction("model.lora.lora_dropout", lora.get("lora_dropout", 0.0))
    optimizer = _get(cfg, "model.optimizer") or {}
    lr = optimizer.get("lr")
    if lr is not None and (isinstance(lr, bool) or not isinstance(lr, (int, float)) or lr <= 0):
        raise ConfigError(f"model.optimizer.lr={lr!r}: must be a positive number")
    require_fraction("model.warmup_ratio", _get(cfg, "model.warmup_ratio", 0.0))
    init_ckpt = cfg.get("init_ckpt")
    if init_ckpt is not None and not Path(str(init_ckpt)).is_file():
        raise ConfigError(f"init_ckpt={init_ckpt}: no such checkpoint file (give a .ckpt path or null)")
    ckpt = cfg.get("ckpt_path")
    if ckpt not in (None, "last", "best") and not Path(str(ckpt)).is_file():
        raise ConfigError(f"ckpt_path={ckpt}: no such checkpoint file (give a .ckpt path, 'last', or null)")
