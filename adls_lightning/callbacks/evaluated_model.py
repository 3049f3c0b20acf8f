"""The evaluated model of a run that compresses at evaluation, saved after its test as
:data:`~adls_lightning.compression_record.COMPRESSED_CHECKPOINT` beside the fit's checkpoints.

Post-training quantization (quantized, calibrated, GPTQ's weights, SmoothQuant's factors) and the pruning of an
evaluation-only run (``train=false``: masks, SparseGPT's solved weights) make the evaluated model at evaluation,
after any checkpoint the fit wrote (or with no fit at all): without this save it exists only in memory, and nothing
can export, evaluate or fine-tune it next. One checkpoint per run, whichever callbacks compressed: each writes its
part of the compression record into it (``on_save_checkpoint``).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Protocol, runtime_checkable

import lightning as L
import torch

from adls_lightning.compression_record import COMPRESSED_CHECKPOINT

log = logging.getLogger(__name__)


@runtime_checkable
class CompressesAtEvaluation(Protocol):
    """A callback that may make the evaluated model at evaluation (PTQ, evaluation-only pruning)."""

    def compressed_at_evaluation(self, trainer: L.Trainer) -> str | None:
        """What it compressed at this evaluation, as the log names it (``PTQ``, ``prune``); None: nothing."""
        ...


def save_evaluated_model(trainer: L.Trainer, caller: L.Callback) -> Path | None:
    """From a callback's ``on_test_end``: save the evaluated model with its compression record as
    ``<checkpoint folder>/compressed.ckpt`` when some callback compressed it at evaluation, once per test: by the last
    such callback (``caller``; the others return None), when every one's test hooks have run. Returns the path."""
    compressors = [
        (callback, what)
        for callback in trainer.callbacks
        if isinstance(callback, CompressesAtEvaluation)
        and (what := callback.compressed_at_evaluation(trainer))
    ]
    if not compressors or compressors[-1][0] is not caller:
        return None
    what = " + ".join(dict.fromkeys(name for _, name in compressors))
    folder = getattr(trainer.checkpoint_callback, "dirpath", None)
    if not folder:
        log.warning("%s: no checkpoint folder (no ModelCheckpoint); the evaluated model is not saved", what)
        return None
    path = Path(folder) / COMPRESSED_CHECKPOINT
    # not weights_only: Lightning calls the callbacks' on_save_checkpoint (the records) only for full checkpoints
    # (after a test there is no optimizer state to add); written atomically by the run's writer
    with torch.inference_mode(False):
        trainer.save_checkpoint(path, weights_only=False)
    log.info(
        "%s: the evaluated model saved with its compression record to %s (python -m adls_lightning.export "
        "ckpt=%s out=DIR format=hf)",
        what,
        path,
        path,
    )
    return path
