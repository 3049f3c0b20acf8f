"""What a search trial returns to the sweeper: its objective value(s) and the run's metrics."""

from __future__ import annotations

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
    """

    names: tuple[str, ...]
    values: tuple[float, ...]
    metrics: dict[str, float] = field(default_factory=dict)


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

    A missing metric is an error, never a default (MASE's search scored a missing bit width as 32).

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
    if weights is None:
        return tuple(values)
    return (sum(w * v for w, v in zip(weights, values)),)


def run_trial(cfg: DictConfig) -> TrialResult:
    """Train and evaluate one configuration (``adls_lightning.app.training.run``) and score it by ``cfg.search.objective``."""
    from adls_lightning.app.training import run

    objective = cfg.search.objective
    metrics, weights = list(objective.metrics), objective.get("weights")
    weights = None if weights is None else [float(w) for w in weights]
    names = objective_names(metrics, weights)  # fail before training on a malformed objective
    run_metrics = run(cfg)
    return TrialResult(
        names=names, values=objective_values(run_metrics, metrics, weights), metrics=run_metrics
    )
