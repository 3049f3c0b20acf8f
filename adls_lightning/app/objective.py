"""What a search trial returns to the sweeper: its objective value(s) and the run's metrics."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from omegaconf import DictConfig

from adls_lightning.errors import ConfigError


@dataclass(frozen=True)
class TrialResult:
    """A finished trial: one value per study direction, their names, and every metric of the run.

    Attributes:
        names: the objectives' names, stored as the study's metric names (plot labels).
        values: the objective values, in the order of ``hydra.sweeper.direction``.
        metrics: all metrics of the run (``metrics.json``), stored on the trial as the user attr ``metrics``.
        notes: why a value is not the run's metric as logged (:func:`undefined_correlation_note`), stored on the
            trial as the user attr ``objective_note``.
    """

    names: tuple[str, ...]
    values: tuple[float, ...]
    metrics: dict[str, float] = field(default_factory=dict)
    notes: tuple[str, ...] = ()


#: Metrics that are correlations (GLUE's regression task STS-B): torchmetrics gives ``nan`` when the predictions do
#: not vary (a collapsed regression head, common in low-bit trials), where the covariance with the labels is exactly 0.
CORRELATION_METRICS = ("pearson", "spearman")
#: The objective value of such a correlation: 0, "no correlation", what a constant prediction has (its covariance
#: with the labels is 0) and what a guessing model scores on average. Not -1, which would claim a perfectly inverted
#: model; and not a failure, which is a job that broke: a search must learn that this region of its space is bad.
UNDEFINED_CORRELATION = 0.0


def undefined_correlation_note(name: str, value: float) -> str | None:
    """Why the objective scores metric ``name`` as :data:`UNDEFINED_CORRELATION`, or None when it takes ``value``."""
    if math.isnan(value) and name.rsplit("/", 1)[-1] in CORRELATION_METRICS:
        return (
            f"{name} is nan (the predictions do not vary): scored {UNDEFINED_CORRELATION:g}, no correlation"
        )
    return None


def objective_names(metrics: Sequence[str], weights: Sequence[float] | None = None) -> tuple[str, ...]:
    """Names of the objectives: the metrics themselves, or one weighted sum (``1*val/acc + -0.01*quant/...``).

    Raises:
        ConfigError: no metric, or a weight count that does not match the metrics.
    """
    if not metrics:
        raise ConfigError("search.objective.metrics: empty; give at least one metric, e.g. [val/acc]")
    if weights is None:
        return tuple(metrics)
    if len(weights) != len(metrics):
        raise ConfigError(
            f"search.objective.weights={list(weights)}: needs one weight per metric in "
            f"search.objective.metrics={list(metrics)} (or null for one objective per metric)"
        )
    return (" + ".join(f"{w:g}*{m}" for w, m in zip(weights, metrics)),)


def objective_values(
    run_metrics: Mapping[str, float], metrics: Sequence[str], weights: Sequence[float] | None = None
) -> tuple[float, ...]:
    """The objective values of a run: the named metrics, or their weighted sum when ``weights`` is given.

    A missing metric is an error, never a default (MASE's search scored a missing bit width as 32). A correlation of
    predictions that do not vary (``nan``) is :data:`UNDEFINED_CORRELATION` (:func:`undefined_correlation_note`).

    Raises:
        ConfigError: a named metric is not among the run's metrics.
    """
    objective_names(metrics, weights)
    missing = [name for name in metrics if name not in run_metrics]
    if missing:
        raise ConfigError(
            f"search.objective.metrics: {missing[0]!r} is not a metric of this run "
            f"(it has: {', '.join(sorted(run_metrics))}); enable the callback that reports it"
        )
    values = [float(run_metrics[name]) for name in metrics]
    values = [
        UNDEFINED_CORRELATION if undefined_correlation_note(n, v) else v for n, v in zip(metrics, values)
    ]
    if weights is None:
        return tuple(values)
    return (sum(w * v for w, v in zip(weights, values)),)


def run_trial(cfg: DictConfig) -> TrialResult:
    """Train and evaluate one configuration (``adls_lightning.app.training.run``) and score it by ``cfg.search.objective``."""
    from adls_lightning.app.training import run

    objective = cfg.search.objective
    metrics, weights = list(objective.metrics), objective.get("weights")
    weights = None if weights is None else [float(w) for w in weights]
    objective_names(metrics, weights)  # fail before training on a malformed objective
    return trial_result(run(cfg), metrics, weights)


def trial_result(
    run_metrics: Mapping[str, float], metrics: Sequence[str], weights: Sequence[float] | None = None
) -> TrialResult:
    """A run's metrics scored as a trial (:func:`objective_values`), with a note for each value not taken as logged."""
    notes = (
        undefined_correlation_note(name, float(run_metrics[name])) for name in metrics if name in run_metrics
    )
    return TrialResult(
        names=objective_names(metrics, weights),
        values=objective_values(run_metrics, metrics, weights),
        metrics=dict(run_metrics),
        notes=tuple(note for note in notes if note),
    )
