"""Lightning's checkpoint and CSV writers over :mod:`adls_lightning.files.atomic`, so a killed run never leaves a
half-written checkpoint or log that looks whole, nor loses the last good one.

Every write goes to a temporary file beside its target (same folder, so the same file system) and is renamed over
it. Lightning's own checkpoint writer stages in ``$TMPDIR`` (fsspec's local transaction), hence
:class:`AtomicCheckpointIO`. Lightning's CSV logger deletes the log of the run it resumes, hence
:class:`ResumableCSVLogger`.
"""

from __future__ import annotations

import csv
import io
import os
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.loggers.logger import rank_zero_experiment
from lightning.pytorch.core.saving import save_hparams_to_yaml
from lightning.pytorch.loggers.csv_logs import CSVLogger, ExperimentWriter
from lightning.pytorch.plugins.io import TorchCheckpointIO

# the atomic writes themselves need no torch
from adls_lightning.files.atomic import atomic_write, atomic_write_bytes


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning's checkpoint writer, writing beside the target and renaming (whatever file system $TMPDIR is on).

    A kill during a save leaves the previous ``last.ckpt`` whole; the next save removes the stale temporary file.
    """

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: str | os.PathLike, storage_options=None
    ) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint takes no storage_options")
        buffer = io.BytesIO()
        torch.save(checkpoint, buffer)
        atomic_write_bytes(path, buffer.getvalue())


class ResumableCSVWriter(ExperimentWriter):
    """Lightning's CSV experiment writer that continues an existing ``metrics.csv`` instead of deleting it.

    The rows already in the file are read when the writer opens its folder. At the first row this run logs (at
    step ``s``) the file keeps the earlier rows of steps before ``s``: a run resumed with ``ckpt_path=last``
    keeps its log up to the checkpoint and drops the rows the killed run logged after it (those steps are trained
    and logged again), while a fresh run (step 0) starts an empty log. A line cut by a kill is dropped; the
    files are rewritten beside themselves and renamed (``metrics.csv`` when its columns change, ``hparams.yaml``),
    so a kill during a rewrite leaves the previous file whole.
    """

    def log_hparams(self, params: dict[str, Any]) -> None:
        self.hparams.update(params)
        target = os.path.join(self.log_dir, self.NAME_HPARAMS_FILE)
        atomic_write(target, lambda tmp: save_hparams_to_yaml(tmp, self.hparams))

    def _check_log_dir_exists(self) -> None:  # Lightning's deletes metrics.csv here
        self._earlier_rows: list[dict[str, str]] | None = None
        if not os.path.isfile(self.metrics_file_path):
            return
        with open(self.metrics_file_path, newline="") as handle:
            text = handle.read()
        if not text.endswith("\n"):  # the last line was being written when the run was killed
            text = text[: text.rfind("\n") + 1]
        reader = csv.DictReader(io.StringIO(text))
        self._earlier_rows = [row for row in reader if None not in row and _step(row) is not None]
        self.metrics_keys = sorted(reader.fieldnames or [])

    def log_metrics(self, metrics_dict: dict[str, float], step: int | None = None) -> None:
        if self._earlier_rows is not None:
            first = len(self.metrics) if step is None else step
            kept = [row for row in self._earlier_rows if _step(row) < first]
            self._earlier_rows = None
            if kept:
                self._write_rows(kept, self.metrics_keys)
            else:
                self.metrics_keys = []
                Path(self.metrics_file_path).unlink()
        super().log_metrics(metrics_dict, step)

    def _rewrite_with_new_header(self, fieldnames: list[str]) -> None:
        with open(self.metrics_file_path, newline="") as handle:
            rows = list(csv.DictReader(handle))
        self._write_rows(rows, fieldnames)

    def _write_rows(self, rows: list[dict[str, str]], fieldnames: list[str]) -> None:
        text = io.StringIO()
        writer = csv.DictWriter(text, fieldnames=fieldnames)
        writer.writeheader()
        writer.writerows(rows)
        atomic_write_bytes(self.metrics_file_path, text.getvalue().encode())


def _step(row: dict[str, str]) -> int | None:
    try:
        return int(float(row["step"]))
    except (KeyError, TypeError, ValueError):
        return None


class ResumableCSVLogger(CSVLogger):
    """Lightning's :class:`CSVLogger` with :class:`ResumableCSVWriter`: a resumed run's log keeps its earlier rows.

    ``flush_logs_every_n_steps`` defaults to 1 here (Lightning's is 100): rows still in memory when a run is
    killed are lost, and a resumed run does not log the steps before its checkpoint again.
    """

    def __init__(self, *args: Any, flush_logs_every_n_steps: int = 1, **kwargs: Any) -> None:
        super().__init__(*args, flush_logs_every_n_steps=flush_logs_every_n_steps, **kwargs)

    @property
    @rank_zero_experiment
    def experiment(self) -> ResumableCSVWriter:
        if self._experiment is None:
            self._fs.makedirs(self.root_dir, exist_ok=True)
            self._experiment = ResumableCSVWriter(log_dir=self.log_dir)
        return self._experiment
