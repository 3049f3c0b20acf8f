"""The data modules' loader settings, checked without importing torch.

The data module checks them when it is built; the pre-flight check calls the same function on the composed
config, so a bad value is refused in about a second instead of after the model libraries have loaded.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from adls_lightning.errors import ConfigError, require_positive_int

POSITIVE = ("max_length", "batch_size", "val_size")
POSITIVE_OR_NULL = ("train_size", "test_size", "pad_to_multiple_of")
TRUNCATION_SIDES = ("left", "right")


def check_loader_settings(settings: Mapping[str, Any]) -> None:
    """Check the ``data.*`` loader settings present in ``settings`` (absent ones keep their valid defaults).

    Raises:
        ConfigError: naming the first offending ``data.<key>``.
    """
    for name in POSITIVE:
        if name in settings:
            require_positive_int(f"data.{name}", settings[name])
    for name in POSITIVE_OR_NULL:
        if name in settings:
            require_positive_int(f"data.{name}", settings[name], allow_none=True)
    swap = settings.get("swap_pairs", False)
    if not isinstance(swap, bool):
        raise ConfigError(f"data.swap_pairs={swap!r}: must be true or false")
    side = settings.get("truncation_side", "right")
    if side not in TRUNCATION_SIDES:
        raise ConfigError(f"data.truncation_side={side!r}: must be 'left' or 'right'")


def check_val_size(val_size: int, train_rows: int) -> None:
    """Validation is carved out of train: ``data.val_size`` must leave training rows.

    Raises:
        ConfigError: ``val_size`` is as large as the training split.
    """
    if val_size >= train_rows:
        raise ConfigError(f"data.val_size={val_size}: larger than or equal to the {train_rows} training rows")
