"""The progress display: Rich's bar in a terminal, timed progress lines without one (adls_lightning/progress.py)."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import ProgressBar, RichProgressBar
from typing_extensions import override

from adls_lightning.errors import ConfigError
from adls_lightning.logs import is_terminal
from adls_lightning.progress import Heartbeat, StageClock, progress_line

log = logging.getLogger(__name__)


def progress_bar(interval_s: float = 25.0, leave: bool = True) -> ProgressBar:
    """Rich's bar when the console is a terminal, else :class:`LineProgressBar` (``interval_s`` between lines)."""
    if isinstance(interval_s, bool) or not isinstance(interval_s, (int, float)) or not interval_s >= 0:
        raise ConfigError(
            f"callbacks.rich_progress_bar.interval_s={interval_s!r}: must be a number of seconds >= 0"
        )
    return RichProgressBar(leave=leave) if is_terminal() else LineProgressBar(interval_s)


def _batch_size(batch: Any) -> int:
    if isinstance(batch, Mapping):
        batch = batch.get("labels", next(iter(batch.values()), None))
    shape = getattr(batch, "shape", None)
    return int(shape[0]) if shape else 0


class LineProgressBar(ProgressBar):
    """One log line every ``interval_s`` seconds of a stage (training, a long validation or test) and one at the
    end of every training epoch (with the validation metrics): step/total, epoch, loss, samples/s, elapsed, ETA."""

    def __init__(self, interval_s: float = 25.0) -> None:
        super().__init__()
        self.interval_s = float(interval_s)
        self._enabled = True
        self._train: StageClock | None = None  # the training epoch's clock
        self._eval: StageClock | None = None  # the running validation's or test's clock
        self._train_metrics: dict[str, Any] = {}  # the last batch's, for a line between batches
        self._heartbeat: Heartbeat | None = None
        # when the run's last progress line was written (the clocks' time), whichever stage wrote it
        self._last_line: float | None = None

    def _clock(self, stage: str, total: float | None) -> StageClock:
        # A new stage's interval runs from the run's last line, not from the stage's start: a validation or a test
        # after a quiet stretch still speaks up within interval_s.
        clock = StageClock(stage, total, self.interval_s)
        if self._last_line is not None:
            clock.last_line = self._last_line
        return clock

    def disable(self) -> None:
        self._enabled = False

    def enable(self) -> None:
        self._enabled = True

    def _epoch(self) -> str:
        trainer = self.trainer
        # Lightning counts epochs from 0; people count from 1.
        return f"{trainer.current_epoch + 1}/{trainer.max_epochs if trainer.max_epochs != -1 else '?'}"

    def _metrics(self, pl_module: L.LightningModule, prefixes: tuple[str, ...] = ("",)) -> dict[str, Any]:
        metrics = self.get_metrics(self.trainer, pl_module)
        return {k: v for k, v in metrics.items() if k != "v_num" and k.startswith(prefixes)}

    def _line(self, clock: StageClock, epoch: str = "", metrics: dict | None = None) -> None:
        clock.last_line = self._last_line = clock.clock()  # a line at an epoch's end counts too
        if self._enabled:
            log.info(progress_line(clock, epoch, metrics))

    def _beat(self) -> None:
        # From the heartbeat thread: the running stage's line, when no batch end wrote one for an interval.
        clock = self._eval or self._train
        if clock is not None and clock.due():
            metrics = self._train_metrics if clock is self._train else None
            self._line(clock, self._epoch() if clock is self._train else "", metrics)

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)  # attaches the trainer
        if self._last_line is None:
            # the first line is due interval_s after the run's setup, not after its first epoch starts: the
            # loggers' start and the first batch's loading are quiet seconds too
            self._last_line = time.monotonic()
        if self._heartbeat is None and self.interval_s > 0:
            # checked every second: a line is at most a second late, however long one step takes
            self._heartbeat = Heartbeat(min(self.interval_s, 1.0), self._beat)

    @override
    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        super().teardown(trainer, pl_module, stage)
        if self._heartbeat is not None:
            self._heartbeat.stop()
            self._heartbeat = None

    @override
    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._train = self._clock("train", self.total_train_batches)

    @override
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        # the training metrics, and a pruning schedule's sparsity and score consistency as they change
        self._train_metrics = self._metrics(pl_module, ("train/", "prune/"))
        if self._train is not None and self._train.advance(_batch_size(batch)):
            self._line(self._train, self._epoch(), self._train_metrics)

    @override
    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._train is not None:  # after the epoch's validation: its metrics are in the line
            self._line(self._train, self._epoch(), self._metrics(pl_module))

    @override
    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.sanity_checking:
            self._eval = self._clock("val", self.total_val_batches)

    @override
    def on_validation_batch_end(
        self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0
    ) -> None:
        if not trainer.sanity_checking and self._eval is not None and self._eval.advance(_batch_size(batch)):
            self._line(self._eval)

    @override
    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._train is not None and self._last_line is not None:
            self._train.last_line = self._last_line
        self._eval = None  # the heartbeat goes back to the training clock

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._train = None

    @override
    def on_test_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._eval = None

    @override
    def on_test_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._eval = self._clock("test", sum(trainer.num_test_batches))

    @override
    def on_test_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        if self._eval is not None and self._eval.advance(_batch_size(batch)):
            self._line(self._eval)
