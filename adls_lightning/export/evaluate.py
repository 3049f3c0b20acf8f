"""Scoring exported folders on a run's test split: the verbs behind ``adls-evaluate``
(:mod:`adls_lightning.tools.evaluate`, ``python -m adls_lightning.export.evaluate DIR [DIR ...]``).

:func:`evaluation_data` builds the data module a run's config gives (and returns the composed config),
:func:`check_data_fits_export` refuses data of another task than the folder's model was trained on,
:func:`evaluation_setup` gives the test split's loader; :func:`folder_predictions` runs one loaded folder on it as
the run's own evaluation would (bf16 weights where the run evaluates in bf16, the GEMM backend ``runtime.gemm``
picks; an ONNX graph on ONNX Runtime's kernels, a mixed export each layer in its runtime), :func:`predictions`
gives what the task's metrics score (the predicted class ids, or a regression's output) and the true labels,
and :func:`task_scores` scores them with the task's own metrics -- the run's ``test/<name>`` of ``metrics.json``.
"""

from __future__ import annotations

# python -m adls_lightning.export.evaluate: the command runs before this module's own imports (torch: seconds)
if __name__ == "__main__":
    import sys

    from adls_lightning.tools.evaluate import main

    sys.exit(main())

import contextlib
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from adls_lightning.data.inputs import model_inputs
from adls_lightning.data.tasks import Task, build_metric, scored_predictions
from adls_lightning.errors import ConfigError
from adls_lightning.export.folder import INPUTS_KEY, task_inputs
from adls_lightning.export.mixed import MIXED_CONFIG_FILE
from adls_lightning.export.onnx import OnnxClassifier
from adls_lightning.gemm import batch_rows, gemm_for
from adls_lightning.precision import inference_model
from adls_lightning.runs.loading import compose_train_config


@torch.inference_mode()
def predictions(model, loader, regression: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """What the task's metrics score of ``model`` on ``loader`` (the predicted class ids, or a regression's one
    output), and the true labels."""
    predicted, labels = [], []
    for batch in loader:
        logits = model(**model_inputs(batch)).logits.float()
        predicted.append(scored_predictions(logits, regression))
        labels.append(batch["labels"])
    return torch.cat(predicted), torch.cat(labels)


def task_scores(predicted: torch.Tensor, labels: torch.Tensor, task: Task) -> dict[str, float]:
    """The task's own metrics (its main metric first) of ``predicted`` against ``labels``, with the torchmetrics
    objects the run's evaluation logs as ``test/<name>``."""
    scores = {}
    for name in task.metrics:
        metric = build_metric(name, task.num_labels)
        with warnings.catch_warnings():
            # Spearman's note that it keeps every prediction: one test split's worth, by design
            warnings.filterwarnings("ignore", message=".*will save all targets and predictions")
            metric.update(predicted, labels)
        scores[name] = float(metric.compute())
    return scores


def evaluation_loader(overrides: Sequence[str]):
    return evaluation_setup(overrides)[0]


def evaluation_data(overrides: Sequence[str], options: Sequence[str] | None = None):
    """The run's data module (built, not yet set up: its task is known, nothing tokenized) and its composed config
    (for ``runtime.gemm`` and the cache folder); ``options``: the calling tool's own keys, named when an override
    sets a key the config lacks."""
    from adls_lightning.build import build

    cfg = compose_train_config(overrides, return_hydra_config=True, options=options)
    return build(cfg.data, "data"), cfg


def evaluation_setup(overrides: Sequence[str], options: Sequence[str] | None = None):
    """The run's test loader (MNLI: a list, matched and mismatched) and its composed config."""
    data, cfg = evaluation_data(overrides, options)
    data.setup("test")
    return data.test_dataloader(), cfg


def recorded_labels(config: Mapping[str, Any]) -> tuple[str, ...] | None:
    """The class names an export's Hugging Face ``config`` gives its outputs in id order; None for a regression
    (one output)."""
    id2label = config.get("id2label") or {}
    if len(id2label) == 1 or config.get("problem_type") == "regression":
        return None
    return tuple(str(id2label[key]) for key in sorted(id2label, key=int))


def _labels(names: tuple[str, ...] | None) -> str:
    return "a regression (one output)" if names is None else ", ".join(names)


def check_data_fits_export(folder: Path, config: Mapping[str, Any], data) -> None:
    """Refuses ``data`` (a data module) whose task is not the one the export in ``folder`` was trained on: another
    task name, another label set or a regression, or pairs of texts for a single-text model (and the reverse),
    as the folder's ``config`` records them (:data:`~adls_lightning.export.folder.INPUTS_KEY`, ``id2label``).
    Data overrides that keep the task (``data.test_size``, ``data.max_length``, the same task's ``data.data_dir``)
    pass. The pairs are known once the data is set up (a folder task reads its files): checked when
    ``data`` is.

    Raises:
        ConfigError: naming the folder, its task and the data's.
    """
    # an export written before it recorded its inputs has only its labels (``id2label``) to hold the data to
    recorded = config.get(INPUTS_KEY) or {}
    trained_on = recorded.get("task") or "its run's task"
    task = data.task
    valid = (
        f"valid: the data of {trained_on} (overrides that keep its task: data.test_size, data.max_length, "
        f"data.data_dir of {trained_on}), or the export of a {task.name} run"
    )
    if recorded.get("task") is not None and recorded["task"] != task.name:
        raise ConfigError(
            f"{folder}: its model was trained on {recorded['task']}, the data given is {task.name}; {valid}"
        )
    labels = recorded_labels(config)
    default = labels is not None and all(name == f"LABEL_{i}" for i, name in enumerate(labels))
    if not default and labels != task.label_names:
        raise ConfigError(
            f"{folder}: its model's labels are {_labels(labels)}, the data's are {_labels(task.label_names)}; "
            f"{valid}"
        )
    if recorded and getattr(data, "splits", None):  # set up: the data says whether it holds pairs
        pairs, given = recorded.get("text_pair"), task_inputs(data)["text_pair"]
        if pairs is not None and given is not None and pairs != given:
            kind = {True: "pairs of texts", False: "single texts"}
            raise ConfigError(
                f"{folder}: its model was trained on {kind[pairs]}, the data given has {kind[given]}; {valid}"
            )


def folder_predictions(
    folder: Path, model, loaders: Sequence, cfg, regression: bool = False
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``model`` (loaded from ``folder``) on each of ``loaders`` (the task's test splits) as the run's own
    evaluation runs it; per loader, what the task's metrics score (:func:`predictions`) and the true labels."""
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
        return [predictions(model, loader, regression) for loader in loaders]
