"""Scoring exported folders on a run's test split: the verbs behind ``adls-evaluate``
(:mod:`adls_lightning.tools.evaluate`, ``python -m adls_lightning.export.evaluate DIR [DIR ...]``).

:func:`evaluation_setup` builds the test split a run's config gives (and returns the composed config);
:func:`folder_predictions` runs one loaded folder on it as the run's own evaluation would (bf16 weights where the
run evaluates in bf16, the GEMM backend ``runtime.gemm`` picks; an ONNX graph on ONNX Runtime's kernels, a mixed
export each layer in its runtime) and :func:`predictions` gives the predicted and true labels.
"""

from __future__ import annotations

# python -m adls_lightning.export.evaluate: the command runs before this module's own imports (torch: seconds)
if __name__ == "__main__":
    import sys

    from adls_lightning.tools.evaluate import main

    sys.exit(main())

import contextlib
from collections.abc import Sequence
from pathlib import Path

import torch

from adls_lightning.data.inputs import model_inputs
from adls_lightning.export.mixed import MIXED_CONFIG_FILE
from adls_lightning.export.onnx import OnnxClassifier
from adls_lightning.gemm import batch_rows, gemm_for
from adls_lightning.precision import inference_model
from adls_lightning.runs.loading import compose_train_config


@torch.inference_mode()
def predictions(model, loader) -> tuple[torch.Tensor, torch.Tensor]:
    predicted, labels = [], []
    for batch in loader:
        logits = model(**model_inputs(batch)).logits
        predicted.append(logits.argmax(-1))
        labels.append(batch["labels"])
    return torch.cat(predicted), torch.cat(labels)


def evaluation_loader(overrides: Sequence[str]):
    return evaluation_setup(overrides)[0]


def evaluation_setup(overrides: Sequence[str], options: Sequence[str] | None = None):
    """The run's test loader and its composed config (for ``runtime.gemm`` and the cache folder); ``options``:
    the calling tool's own keys, named when an override sets a key the config lacks."""
    from adls_lightning.build import build

    cfg = compose_train_config(overrides, return_hydra_config=True, options=options)
    data = build(cfg.data, "data")
    data.setup("test")
    return data.test_dataloader(), cfg


def folder_predictions(folder: Path, model, loader, cfg) -> tuple[torch.Tensor, torch.Tensor]:
    """``model`` (loaded from ``folder``) on ``loader`` as the run's own evaluation runs it; the predicted and the
    true labels."""
    # issue 59: bf16 weights where the run's own evaluation would use them (ONNX Runtime keeps its graph's)
    # issue 60: a mixed export (export/mixed.py) runs each layer in the runtime it was exported for: not recast
    rows, cache_dir = batch_rows(cfg.data), cfg.paths.get("cache_dir")
    mixed = (Path(folder) / MIXED_CONFIG_FILE).is_file()
    if not isinstance(model, OnnxClassifier) and not mixed:
        model = inference_model(
            model, cfg.model.get("eval_precision", "auto"), cfg.trainer.precision, rows, cache_dir
        )
    # ONNX Runtime runs its own kernels: runtime.gemm picks PyTorch's
    gemm = (
        contextlib.nullcontext()
        if isinstance(model, OnnxClassifier)
        else gemm_for(cfg.runtime.gemm, model, rows, cache_dir)
    )
    with gemm:
        return predictions(model, loader)
