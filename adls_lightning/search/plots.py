"""Figures from stored Optuna studies: best-so-far curves (one per study) and accuracy-vs-bits Pareto fronts.

Everything is read from the storages (SQLite files or SQLAlchemy URLs), so a figure can be redrawn at any time,
also while a study is still running.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import optuna
from optuna.trial import FrozenTrial, TrialState

from adls_lightning.config import ConfigError
from adls_lightning.search.storage import open_storage


def storage_url(location: str) -> str:
    """A SQLAlchemy URL as given, or ``sqlite:///<absolute path>`` for a path to an existing file."""
    if "://" in location:
        return location
    path = Path(location)
    if not path.is_file():
        raise ConfigError(f"storage {location}: no such file (give a .db file or a SQLAlchemy URL)")
    return f"sqlite:///{path.resolve()}"


def load_studies(locations: Sequence[str], names: Sequence[str] | None = None) -> list[optuna.Study]:
    """Every study stored in ``locations`` (or only those named), in the order found.

    Raises:
        ConfigError: a storage cannot be opened, or a named study is in none of them.
    """
    studies = []
    for location in locations:
        storage = open_storage(storage_url(location), key="storage")
        for summary in optuna.get_all_study_summaries(storage, include_best_trial=False):
            if names is None or summary.study_name in names:
                studies.append(optuna.load_study(study_name=summary.study_name, storage=storage))
    missing = sorted(set(names or ()) - {s.study_name for s in studies})
    if missing:
        raise ConfigError(f"--study {missing[0]}: not in {', '.join(locations)}")
    if not studies:
        raise ConfigError(f"no study in {', '.join(locations)}")
    return studies


def trial_value(trial: FrozenTrial, metric: str | None) -> float | None:
    """The trial's first objective (``metric`` None) or a metric it recorded; None unless the trial completed."""
    if trial.state != TrialState.COMPLETE:
        return None
    if metric is None:
        return trial.values[0]
    value = trial.user_attrs.get("metrics", {}).get(metric)
    return None if value is None else float(value)


@dataclass(frozen=True)
class Curve:
    """Best value so far after each trial (NaN before the first completed one)."""

    label: str
    trials: list[int]
    best: list[float]

    @property
    def final(self) -> float:
        return self.best[-1] if self.best else math.nan

    @property
    def reached_at(self) -> int | None:
        """The first trial number at which the final best was reached."""
        return next((n for n, b in zip(self.trials, self.best) if b == self.final), None)


def best_so_far(study: optuna.Study, metric: str | None = None, maximize: bool | None = None) -> Curve:
    """The study's best-so-far curve over trial numbers; pruned and failed trials carry the best forward.

    Args:
        study: the study.
        metric: a recorded metric (``test/acc``) instead of the first objective.
        maximize: direction; None = the study's first direction.
    """
    if maximize is None:
        maximize = study.directions[0] == optuna.study.StudyDirection.MAXIMIZE
    better = max if maximize else min
    trials = sorted(study.get_trials(deepcopy=False), key=lambda t: t.number)
    best, curve = math.nan, []
    for trial in trials:
        value = trial_value(trial, metric)
        if value is not None:
            best = value if math.isnan(best) else better(best, value)
        curve.append(best)
    return Curve(study.study_name, [t.number for t in trials], curve)


def pareto_front(points: Sequence[tuple[float, float]]) -> list[int]:
    """Indices of the points no other point dominates, minimizing x (bits) and maximizing y (accuracy).

    Sorted by x: a point is on the front when its y beats every point with smaller (or equal, earlier) x.
    """
    order = sorted(range(len(points)), key=lambda i: (points[i][0], -points[i][1]))
    front, best_y = [], -math.inf
    for i in order:
        if points[i][1] > best_y:
            front.append(i)
            best_y = points[i][1]
    return front


def _axes():
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    return plt.subplots(figsize=(6.4, 4.2))


def _save(fig, ax, out: Path, xlabel: str, ylabel: str, title: str) -> None:
    import matplotlib.pyplot as plt

    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=150)
    plt.close(fig)


def plot_best_so_far(curves: Sequence[Curve], out: Path, ylabel: str, title: str | None = None) -> None:
    """One step curve per study: best value so far against trial number."""
    fig, ax = _axes()
    for curve in curves:
        ax.step(curve.trials, curve.best, where="post", label=f"{curve.label} ({curve.final:.4f})")
    _save(fig, ax, out, "trial", f"best {ylabel} so far", title or f"best {ylabel} so far")


def plot_pareto(
    points: Sequence[tuple[float, float]],
    labels: Sequence[str],
    out: Path,
    xlabel: str,
    ylabel: str,
    title: str | None = None,
) -> list[int]:
    """Every trial as a point (one colour per study), the Pareto front as a line; returns the front's indices."""
    front = pareto_front(points)
    fig, ax = _axes()
    for label in dict.fromkeys(labels):
        xs = [p[0] for p, lab in zip(points, labels) if lab == label]
        ys = [p[1] for p, lab in zip(points, labels) if lab == label]
        ax.scatter(xs, ys, s=14, alpha=0.6, label=label)
    ax.step(
        [points[i][0] for i in front],
        [points[i][1] for i in front],
        where="post",
        color="black",
        label="Pareto front",
    )
    _save(fig, ax, out, xlabel, ylabel, title or f"{ylabel} vs {xlabel}")
    return front
