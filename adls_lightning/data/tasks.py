"""What a task is, as data: its label set, its official metrics and its main metric -- and GLUE's nine tasks.

A :class:`Task` is what the data hands to the model and the metrics: the class names in id order (``None`` for a
regression: one output, MSE loss), the metrics it reports and which of them is its **main metric** (the first
listed). Checkpoint selection, ``optimized_metric``, the search objectives and the run summary all read the main
metric from one key, ``main_metric`` in ``conf/train.yaml`` (``val/${data.main_metric}``), which each data preset
sets: GLUE through the ``task_main_metric`` resolver below, from this table.

Adding a GLUE-style task is one :data:`GLUE_TASKS` entry; adding a metric is one function registered with
:func:`register_metric` (in :data:`METRICS`, by the name ``data.metrics`` and ``metrics.json`` use; see
``docs/extending.md``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from omegaconf import OmegaConf

from adls_lightning.errors import ConfigError
from adls_lightning.registry import Registry

if TYPE_CHECKING:  # torch only where a model runs: the pre-flight reads tasks before torch is imported
    import torch

# The monitored metric of a callback built without a config (configs pass ${main_metric}): IMDb's main metric.
DEFAULT_MAIN_METRIC = "val/acc"
#: The built-in metrics' names as they appear in metrics.json (val/<name>, test/<name>); :data:`METRICS` holds them
#: and any registered from outside.
METRIC_NAMES = ("acc", "f1", "mcc", "pearson", "spearman")
CLASSIFICATION_METRICS = ("acc", "f1", "mcc")
REGRESSION_METRICS = ("pearson", "spearman")
#: where a new regression head's output bias starts (``model.regression_bias_init``): the training targets' mean, or
#: the backbone's own initialisation
REGRESSION_BIAS_INITS = ("mean", "zero")


@dataclass(frozen=True)
class MetricEntry:
    """A metric as the registry holds it.

    Args:
        build: ``build(num_labels) -> torchmetrics.Metric``. A classification metric is updated with predicted class
            ids and the labels, a regression metric with the one output and the target (the module's
            ``predictions``).
        classification: whether the metric needs a classification head (two or more labels).
    """

    build: Callable[[int], Any]
    classification: bool


#: Metric name -> :class:`MetricEntry`, filled by :func:`register_metric` (the built-ins below, then any plugin's).
METRICS: Registry[MetricEntry] = Registry("metric")


def register_metric(name: str, *, classification: bool = True) -> Callable:
    """``@register_metric("name")`` on ``build(num_labels) -> torchmetrics.Metric`` adds the metric ``name``;
    ``classification=False`` for a metric of a regression's output. A run logs it as ``val/<name>``,
    ``test/<name>`` when its task lists it (``data.metrics``)."""

    def decorate(build: Callable[[int], Any]) -> Callable[[int], Any]:
        existing = METRICS.get(name)
        if existing is not None and existing.build.__qualname__ == build.__qualname__:
            METRICS.unregister(
                name
            )  # the same function again (a re-imported module), as the other registries allow
        METRICS.register(name, MetricEntry(build, classification))
        return build

    return decorate


@register_metric("acc")
def _accuracy(num_labels: int):
    from torchmetrics.classification import MulticlassAccuracy

    return MulticlassAccuracy(num_classes=num_labels, average="micro")


@register_metric("f1")
def _f1(num_labels: int):
    """The positive class's (id 1) F1, as GLUE scores it."""
    from torchmetrics.classification import BinaryF1Score

    if num_labels != 2:
        raise ConfigError(f"metric f1: defined for two classes here (this task has {num_labels})")
    return BinaryF1Score()


@register_metric("mcc")
def _matthews(num_labels: int):
    from torchmetrics.classification import BinaryMatthewsCorrCoef, MulticlassMatthewsCorrCoef

    return BinaryMatthewsCorrCoef() if num_labels == 2 else MulticlassMatthewsCorrCoef(num_labels)


@register_metric("pearson", classification=False)
def _pearson(num_labels: int):
    from torchmetrics.regression import PearsonCorrCoef

    return PearsonCorrCoef()


@register_metric("spearman", classification=False)
def _spearman(num_labels: int):
    from torchmetrics.regression import SpearmanCorrCoef

    return SpearmanCorrCoef()


def build_metric(name: str, num_labels: int):
    """The torchmetrics object of the registered metric ``name`` for a head of ``num_labels`` outputs (1 =
    regression)."""
    entry = METRICS.get(name)
    if entry is None:
        raise ConfigError(f"metric {name!r}: unknown (known: {', '.join(METRICS)})")
    if entry.classification and num_labels < 2:
        raise ConfigError(f"metric {name}: needs a classification task (this one is a regression)")
    return entry.build(num_labels)


def scored_predictions(logits: torch.Tensor, regression: bool) -> torch.Tensor:
    """What a task's metrics are updated with: a regression's one output, or the predicted class id (the run's
    evaluation and an export's, so their numbers compare)."""
    return logits.squeeze(-1) if regression else logits.argmax(dim=-1)


@dataclass(frozen=True)
class Task:
    """A task as the model and the metrics see it.

    Args:
        name: e.g. ``glue/mnli`` or ``folder``.
        label_names: class names in id order; None for a regression (one output, MSE loss).
        metrics: reported metric names (entries of :data:`METRICS`); the first is the main metric.
        test_splits: names of the labelled evaluation splits (MNLI: ``test`` matched, ``test_mm`` mismatched).
    """

    name: str
    label_names: tuple[str, ...] | None
    metrics: tuple[str, ...]
    test_splits: tuple[str, ...] = ("test",)

    @property
    def is_regression(self) -> bool:
        return self.label_names is None

    @property
    def num_labels(self) -> int:
        return 1 if self.label_names is None else len(self.label_names)

    @property
    def main_metric(self) -> str:
        return self.metrics[0]

    def model_overrides(self) -> dict[str, Any]:
        """Keyword overrides of ``cfg.model`` that shape the model for this task (head size, labels, metrics)."""
        return {
            "backbone": {"num_labels": self.num_labels},
            "label_names": None if self.label_names is None else list(self.label_names),
            "metrics": list(self.metrics),
            "test_splits": list(self.test_splits),
        }


def default_metrics(num_labels: int) -> tuple[str, ...]:
    """Metrics of a task that names none: regression -> Pearson, Spearman; 2 classes -> acc, F1; more -> acc."""
    if num_labels == 1:
        return REGRESSION_METRICS
    return ("acc", "f1") if num_labels == 2 else ("acc",)


def with_main_metric(
    metrics: tuple[str, ...], main: str | None, key: str = "data.main_metric"
) -> tuple[str, ...]:
    """``metrics`` reordered so that ``main`` comes first; ConfigError when ``main`` is not one of them."""
    if main is None or main == metrics[0]:
        return metrics
    if main not in metrics:
        raise ConfigError(f"{key}={main}: not a metric of this task (its metrics: {', '.join(metrics)})")
    return (main, *(m for m in metrics if m != main))


@dataclass(frozen=True)
class GlueTask:
    """One GLUE task: where its files are, their column layout, its labels and metrics.

    Columns are header names, or positions for a file without a header row (CoLA). ``file_labels`` are the label
    values as the TSVs write them, in id order (the hub's ``ClassLabel`` order, so files and hub agree); None for a
    regression (a float score).
    """

    folder: str
    header: tuple[str, ...] | None
    text: str | int
    text_pair: str | int | None
    label: str | int
    label_names: tuple[str, ...] | None
    file_labels: tuple[str, ...] | None
    metrics: tuple[str, ...]
    hub_columns: tuple[str, ...]
    # this project's labelled evaluation splits: name -> (file in the task folder, hub split)
    dev: Mapping[str, tuple[str, str]] = field(default_factory=lambda: {"test": ("dev.tsv", "validation")})
    # the label does not depend on the order of the two texts (paraphrase, similarity), so data.swap_pairs may
    # mirror them; entailment is one-way (RTE, MNLI, QNLI, WNLI) and a question-answer pair is not symmetric
    symmetric: bool = False

    @property
    def main_metric(self) -> str:
        return self.metrics[0]

    def task(self, name: str) -> Task:
        return Task(f"glue/{name}", self.label_names, self.metrics, tuple(self.dev))


_PAIR = ("index", "sentence1", "sentence2", "label")
_BINARY = ("0", "1")
_NLI = ("entailment", "not_entailment")

GLUE_TASKS: dict[str, GlueTask] = {
    "cola": GlueTask(
        folder="CoLA",
        header=None,  # source, label, original label, sentence; no header row
        text=3,
        text_pair=None,
        label=1,
        label_names=("unacceptable", "acceptable"),
        file_labels=_BINARY,
        metrics=("mcc",),
        hub_columns=("sentence",),
    ),
    "sst2": GlueTask(
        folder="SST-2",
        header=("sentence", "label"),
        text="sentence",
        text_pair=None,
        label="label",
        label_names=("negative", "positive"),
        file_labels=_BINARY,
        metrics=("acc",),
        hub_columns=("sentence",),
    ),
    "mrpc": GlueTask(
        folder="MRPC",
        header=("Quality", "#1 ID", "#2 ID", "#1 String", "#2 String"),
        text="#1 String",
        text_pair="#2 String",
        label="Quality",
        label_names=("not_equivalent", "equivalent"),
        file_labels=_BINARY,
        metrics=("f1", "acc"),
        hub_columns=("sentence1", "sentence2"),
        symmetric=True,
    ),
    "stsb": GlueTask(
        folder="STS-B",
        header=(
            "index",
            "genre",
            "filename",
            "year",
            "old_index",
            "source1",
            "source2",
            "sentence1",
            "sentence2",
            "score",
        ),
        text="sentence1",
        text_pair="sentence2",
        label="score",
        label_names=None,
        file_labels=None,
        metrics=("pearson", "spearman"),
        hub_columns=("sentence1", "sentence2"),
        symmetric=True,
    ),
    "qqp": GlueTask(
        folder="QQP",
        header=("id", "qid1", "qid2", "question1", "question2", "is_duplicate"),
        text="question1",
        text_pair="question2",
        label="is_duplicate",
        label_names=("not_duplicate", "duplicate"),
        file_labels=_BINARY,
        metrics=("f1", "acc"),
        hub_columns=("question1", "question2"),
        symmetric=True,
    ),
    "mnli": GlueTask(
        folder="MNLI",
        # train.tsv; the dev files hold label1..label5 before gold_label
        header=(
            "index",
            "promptID",
            "pairID",
            "genre",
            "sentence1_binary_parse",
            "sentence2_binary_parse",
            "sentence1_parse",
            "sentence2_parse",
            "sentence1",
            "sentence2",
            "label1",
            "gold_label",
        ),
        text="sentence1",
        text_pair="sentence2",
        label="gold_label",
        label_names=("entailment", "neutral", "contradiction"),
        file_labels=("entailment", "neutral", "contradiction"),
        metrics=("acc",),
        hub_columns=("premise", "hypothesis"),
        dev={
            "test": ("dev_matched.tsv", "validation_matched"),
            "test_mm": ("dev_mismatched.tsv", "validation_mismatched"),
        },
    ),
    "qnli": GlueTask(
        folder="QNLI",
        header=("index", "question", "sentence", "label"),
        text="question",
        text_pair="sentence",
        label="label",
        label_names=_NLI,
        file_labels=_NLI,
        metrics=("acc",),
        hub_columns=("question", "sentence"),
    ),
    "rte": GlueTask(
        folder="RTE",
        header=_PAIR,
        text="sentence1",
        text_pair="sentence2",
        label="label",
        label_names=_NLI,
        file_labels=_NLI,
        metrics=("acc",),
        hub_columns=("sentence1", "sentence2"),
    ),
    "wnli": GlueTask(
        folder="WNLI",
        header=_PAIR,
        text="sentence1",
        text_pair="sentence2",
        label="label",
        label_names=("not_entailment", "entailment"),
        file_labels=_BINARY,
        metrics=("acc",),
        hub_columns=("sentence1", "sentence2"),
    ),
}


def glue_task(name: str) -> GlueTask:
    """The :data:`GLUE_TASKS` entry of ``name``; ConfigError listing the valid names otherwise."""
    if name not in GLUE_TASKS:
        raise ConfigError(f"data.task={name}: unknown GLUE task (valid: {', '.join(GLUE_TASKS)})")
    return GLUE_TASKS[name]


def check_swappable(name: str) -> None:
    """``data.swap_pairs=true`` for GLUE task ``name``: ConfigError unless its pairs keep their label when swapped."""
    spec = glue_task(name)
    if spec.text_pair is None:
        raise ConfigError(f"data.swap_pairs=true: GLUE {name} has single texts, no pair to swap")
    if not spec.symmetric:
        symmetric = ", ".join(task for task, entry in GLUE_TASKS.items() if entry.symmetric)
        raise ConfigError(
            f"data.swap_pairs=true: GLUE {name}'s label depends on the order of its texts "
            f"(swapping is for the symmetric tasks: {symmetric})"
        )


def task_main_metric(name: str) -> str:
    """``${task_main_metric:${data.task}}``: a GLUE task's main metric, for the config's ``main_metric``."""
    return glue_task(str(name)).main_metric


OmegaConf.register_resolver("task_main_metric", task_main_metric, replace=True)


def study_name_task(task: str | None) -> str:
    """``${study_name_task:${oc.select:data.task,null}}``: ``-<task>`` in a GLUE search's default study name
    (``mixed_precision-integer-stsb-acc-tpe``), so that searches of one space on two tasks (or on IMDb, whose
    names have no task) keep studies of their own; nothing without a task."""
    return "" if task is None else f"-{task}"


OmegaConf.register_resolver("study_name_task", study_name_task, replace=True)


# The task-head helpers live beside the models (adls_lightning.models); their old names here keep working.
_MOVED_TO_MODELS = ("TASK_HEAD_MODULES", "is_task_head_key", "without_task_head", "head_outputs")


def __getattr__(name: str) -> Any:
    if name in _MOVED_TO_MODELS:
        from adls_lightning import models

        return getattr(models, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
