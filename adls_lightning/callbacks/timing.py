"""Training throughput, reported into metrics.json."""

from __future__ import annotations

import time

import lightning as L
from typing_extensions import override

from adls_lightning.compile import process_compile_seconds


class TrainThroughput(L.Callback):
    """Counts training samples and the wall time spent in training epochs, excluding validation inside them
    and torch.compile's compilation (reported as ``compile/seconds`` by the compile callback)."""

    def __init__(self) -> None:
        self.samples = 0
        self.seconds = 0.0
        self._started: float | None = None
        self._compile_started = 0.0

    def _resume_clock(self) -> None:
        self._started = time.perf_counter()
        self._compile_started = process_compile_seconds()

    def _pause_clock(self) -> None:
        if self._started is not None:
            compiling = process_compile_seconds() - self._compile_started
            self.seconds += time.perf_counter() - self._started - compiling
            self._started = None

    @override
    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._resume_clock()

    @override
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.samples += int(batch["labels"].shape[0])

    @override
    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._pause_clock()

    @override
    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.training:
            self._resume_clock()

    @override
    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._pause_clock()

    def report(self) -> dict[str, float]:
        """``train/samples_per_sec`` over this process's training (0 when nothing trained)."""
        rate = self.samples / self.seconds if self.seconds > 0 else 0.0
        return {"train/samples_per_sec": rate, "train/samples_seen": self.samples}
