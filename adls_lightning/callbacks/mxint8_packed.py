"""Post-training MXINT8: evaluate the model with its linear layers packed as ``QLinearPacked``."""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any

import lightning as L
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

from adls_lightning.compression_record import PackingRecord, merge_into
from adls_lightning.data.tasks import DEFAULT_MAIN_METRIC
from adls_lightning.errors import ConfigError, require_positive_int
from adls_lightning.lora import merge_before_compression
from adls_lightning.mxint8 import (
    PackedLayer,
    check_packable,
    module_bytes,
    native_kernels_loaded,
    pack_linear_layers,
    restore_layers,
)
from adls_lightning.quant import weight_storage

log = logging.getLogger(__name__)


class MXInt8PackedEvaluation(L.Callback):
    """Packs the linear layers into MXINT8 (:func:`adls_lightning.mxint8.pack_linear_layers`) for
    ``trainer.validate`` / ``trainer.test``, never during ``fit``.

    Packing happens in ``on_validation_start`` / ``on_test_start`` when ``trainer.state.fn`` is
    ``VALIDATING`` / ``TESTING``, i.e. after Lightning restored the evaluated checkpoint, and the
    original modules are put back in ``on_validation_end`` / ``on_test_end``. So training and its
    checkpoints stay full precision, and each evaluation restores the checkpoint into the original
    layers and packs it afresh. PEFT LoRA layers are replaced by one packed layer holding the merged
    weight ``W + scaling * B A`` (the weight a deployed model would carry); the adapters are not
    packed on their own, and the ``exclude`` names (the classifier) stay in floating point.

    :meth:`report` gives ``quant/avg_weight_bits`` and ``quant/weight_bytes`` of the packed model (the storage every
    run records, :func:`adls_lightning.quant.weight_storage`), ``mxint8/packed_layers``, ``mxint8/bits_per_weight``,
    ``mxint8/linear_weight_bytes_float`` / ``_packed`` / ``mxint8/linear_weight_saving`` (of the packed
    layers' weights), ``mxint8/model_bytes_float`` / ``_packed`` / ``mxint8/model_saving`` (all
    parameters and buffers of the LightningModule), and ``mxint8/<monitor>_float`` /
    ``mxint8/<monitor>_packed`` (e.g. ``mxint8/val_acc_float``: the best checkpoint's score, or the
    last full-precision validation when no best checkpoint is evaluated, or -- in an evaluation-only run, which
    has neither -- a validation of the float model run just before packing, on the same data; and the packed
    score).

    Args:
        group_size: elements per MXINT8 group along each layer's input features.
        exclude: module name components to leave unpacked.
        monitor: the validation metric reported before/after packing.

    Raises:
        ConfigError: bad ``group_size``/``exclude`` (here), or a layer whose input size the group size
            does not divide (in ``setup``, before training starts).
    """

    def __init__(
        self,
        group_size: int = 32,
        exclude: Sequence[str] = ("classifier",),
        monitor: str = DEFAULT_MAIN_METRIC,
    ):
        require_positive_int("quant.group_size", group_size)
        if isinstance(exclude, str) or not all(isinstance(name, str) for name in exclude):
            raise ConfigError(f"quant.exclude={exclude!r}: must be a list of module names, e.g. [classifier]")
        self.group_size = group_size
        self.exclude = tuple(exclude)
        self.monitor = monitor
        self._swaps: list[PackedLayer] = []
        self._report: dict[str, float] = {}

    @override
    def on_save_checkpoint(
        self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        """The packing record (:mod:`adls_lightning.compression_record`): the checkpoints hold the float weights,
        which the evaluation packed this way."""
        merge_into(
            checkpoint,
            packing=PackingRecord(format="mxint8", group_size=self.group_size, exclude=list(self.exclude)),
        )

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        try:
            count = check_packable(pl_module, self.group_size, self.exclude)
        except ValueError as error:
            raise ConfigError(f"quant.group_size={self.group_size}: {error}") from error
        if count == 0:
            raise ConfigError(f"quant.exclude={list(self.exclude)!r}: leaves no linear layer to pack")

    def _pack(self, trainer: L.Trainer, pl_module: L.LightningModule, fn: TrainerFn) -> None:
        if trainer.state.fn != fn or self._swaps:
            return
        if fn == TrainerFn.VALIDATING:
            score = self._float_score(trainer)
            if math.isnan(score):
                score = self._evaluate_float(trainer, pl_module)
            self._report[self._metric_key("float")] = score
        merge_before_compression(pl_module)
        bytes_before = module_bytes(pl_module)
        self._swaps = pack_linear_layers(pl_module, self.group_size, self.exclude)
        bytes_after = module_bytes(pl_module)
        linear_float = sum(swap.original_weight_bytes for swap in self._swaps)
        linear_packed = sum(swap.packed.packed_weight_bytes() for swap in self._swaps)
        weights = sum(swap.packed.weight_mantissa.numel() for swap in self._swaps)
        self._report.update(
            {
                "mxint8/packed_layers": float(len(self._swaps)),
                "mxint8/bits_per_weight": 8.0 * linear_packed / weights,
                "mxint8/linear_weight_bytes_float": float(linear_float),
                "mxint8/linear_weight_bytes_packed": float(linear_packed),
                "mxint8/linear_weight_saving": 1.0 - linear_packed / linear_float,
                "mxint8/model_bytes_float": float(bytes_before),
                "mxint8/model_bytes_packed": float(bytes_after),
                "mxint8/model_saving": 1.0 - bytes_after / bytes_before,
                # the storage every run records (quant/avg_weight_bits, quant/weight_bytes), of the model as
                # evaluated: the packed layers at their packed tensors' bytes
                **weight_storage(pl_module),
            }
        )
        log.info(
            "MXINT8 packed %d layers (native kernels: %s): linear weights %.2f MB -> %.2f MB, model %.2f MB -> %.2f MB",
            len(self._swaps),
            native_kernels_loaded(),
            linear_float / 1e6,
            linear_packed / 1e6,
            bytes_before / 1e6,
            bytes_after / 1e6,
        )

    def _float_score(self, trainer: L.Trainer) -> float:
        checkpoint = trainer.checkpoint_callback
        if (
            checkpoint is not None
            and getattr(checkpoint, "monitor", None) == self.monitor
            and checkpoint.best_model_score is not None
            and trainer.ckpt_path == checkpoint.best_model_path
        ):
            return float(checkpoint.best_model_score)
        score = trainer.callback_metrics.get(self.monitor)
        return float(score) if score is not None else float("nan")

    def _evaluate_float(self, trainer: L.Trainer, pl_module: L.LightningModule) -> float:
        """The monitored score of the float model as it is now (the evaluated checkpoint restored), by a validation
        on this validation's own data: an evaluation-only run (``train=false``) has no earlier validation whose
        score could be read, and a ``nan`` in its place reads as a failed model in every table.

        A second, bare Trainer runs it (Lightning cannot start a validation inside another): same device,
        precision and batch limit, no logger, no callbacks, no checkpoints, so nothing is written or reported twice.
        """
        if trainer.world_size > 1:
            # each rank holds a shard of the data: one process's validation would not be the model's score
            log.warning(
                "MXINT8: %s of the float model not measured in an evaluation-only run on %d processes",
                self.monitor,
                trainer.world_size,
            )
            return float("nan")
        device = trainer.strategy.root_device
        inner = L.Trainer(
            accelerator=device.type,
            devices=[device.index] if device.index is not None else 1,
            precision=trainer.precision,
            limit_val_batches=trainer.limit_val_batches,
            logger=False,
            callbacks=[],
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=trainer.default_root_dir,
        )
        try:
            inner.validate(pl_module, dataloaders=trainer.val_dataloaders, verbose=False)
        finally:
            # the bare Trainer's teardown moved the module to the CPU and took it over: give it back
            pl_module.to(device)
            pl_module.trainer = trainer
        score = inner.callback_metrics.get(self.monitor)
        if score is None:
            return float("nan")
        log.info("MXINT8: %s of the float model before packing: %.4f", self.monitor, float(score))
        return float(score)

    def _metric_key(self, variant: str) -> str:
        return f"mxint8/{self.monitor.replace('/', '_')}_{variant}"

    def _restore(self) -> None:
        restore_layers(self._swaps)
        self._swaps = []

    @override
    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._pack(trainer, pl_module, TrainerFn.VALIDATING)

    @override
    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._swaps and self.monitor in trainer.callback_metrics:
            self._report[self._metric_key("packed")] = float(trainer.callback_metrics[self.monitor])
        self._restore()

    @override
    def on_test_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._pack(trainer, pl_module, TrainerFn.TESTING)

    @override
    def on_test_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._restore()

    @override
    def on_exception(
        self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException
    ) -> None:
        self._restore()

    def report(self) -> dict[str, float]:
        """Storage numbers of the packed model and the monitored score before/after packing."""
        return dict(self._report)
