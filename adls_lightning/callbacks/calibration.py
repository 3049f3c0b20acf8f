"""Calibration batches for the callbacks that learn from training data before they act (quantization ranges,
SmoothQuant, GPTQ; one-shot pruning): the ``<group>.calibration`` setting and the forward they run."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, TypedDict

import lightning as L

from adls_lightning.data.inputs import model_inputs
from adls_lightning.errors import ConfigError
from adls_lightning.typed_settings import section


class CalibrationSettings(TypedDict, total=False):
    """``<group>.calibration`` as a config gives it."""

    batches: int


def calibration_batches(calibration: CalibrationSettings | Mapping[str, Any] | None, key: str) -> int:
    """``N`` of a ``{batches: N}`` setting named ``key`` (``quant.calibration``); 0 when unset.

    Raises:
        ConfigError: an unknown key or a count that is not an integer >= 0.
    """
    calibration = section(calibration, key) or {}
    unknown = sorted(set(calibration) - {"batches"})
    if unknown:
        raise ConfigError(f"{key}.{unknown[0]}: unknown key; valid: batches")
    batches = calibration.get("batches", 0)
    if isinstance(batches, bool) or not isinstance(batches, int) or batches < 0:
        raise ConfigError(f"{key}.batches={batches!r}: must be an integer >= 0 (0 = no calibration)")
    return batches


def model_forward(pl_module: L.LightningModule) -> Callable[[Mapping[str, Any]], Any]:
    """``forward(batch)``: one training batch through ``pl_module`` on its device (its inputs only)."""

    def forward(batch: Mapping[str, Any]) -> Any:
        batch = pl_module.transfer_batch_to_device(batch, pl_module.device, 0)
        return pl_module(**model_inputs(batch))

    return forward
