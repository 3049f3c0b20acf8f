"""Figures from stored Optuna studies: best-so-far curves (one per study, or the mean and spread of a study run
with several seeds) and accuracy-vs-bits Pareto fronts.

Everything is read from the storages (SQLite files or SQLAlchemy URLs), so a figure can be redrawn at any time,
also while a study is still running.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import optuna
from optuna.trial import FrozenTrial, TrialState

from adls_lightning.errors import ConfigError
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
        storage = open_storage(storage_url(location), key="storage", create=False)
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


#: The part of a study name that names its seed (``nas-acc-tpe-seed2``): studies that differ only there are one
#: curve (labelled ``nas-acc-tpe-seed*``), drawn as the mean over the seeds with the spread (min to max) around it.
SEED_PART = re.compile(r"-seed\d+")


@dataclass(frozen=True)
class SeedBand:
    """Best-so-far over several seeds of one study: mean, min and max after each trial (first ``n`` trials of
    every seed, ``n`` the shortest study's length)."""

    label: str
    seeds: int
    trials: list[int]
    mean: list[float]
    low: list[float]
    high: list[float]

    @property
    def final(self) -> float:
        return self.mean[-1] if self.mean else math.nan


def group_seeds(curves: Sequence[Curve]) -> list[Curve | SeedBand]:
    """One entry per study name with its ``-seed<N>`` part read as ``-seed*``: the curve of a study without
    one, a band over the seeds of those with one.

    A trial position where some seed has no completed trial yet (NaN) is averaged over the seeds that have one.
    """
    groups: dict[str, list[Curve]] = {}
    for curve in curves:
        groups.setdefault(SEED_PART.sub("-seed*", curve.label), []).append(curve)
    out: list[Curve | SeedBand] = []
    for label, members in groups.items():
        if members[0].label == label:  # no seed part
            out.append(members[0])
            continue
        length = min(len(c.best) for c in members)
        columns = [[c.best[i] for c in members if not math.isnan(c.best[i])] for i in range(length)]
        out.append(
            SeedBand(
                label=label,
                seeds=len(members),
                trials=list(range(length)),
                mean=[sum(col) / len(col) if col else math.nan for col in columns],
                low=[min(col, default=math.nan) for col in columns],
                high=[max(col, default=math.nan) for col in columns],
            )
        )
    return out


def short_labels(labels: Sequence[str]) -> tuple[list[str], str]:
    """The labels without the ``-``-separated words all of them share at the start and end, and those words
    (``mixed_precision-integer-acc-tpe``, ``mixed_precision-log-acc-tpe`` -> ``integer``, ``log``;
    ``mixed_precision-*-acc-tpe``)."""
    if len(labels) < 2:
        return list(labels), ""
    words = [label.split("-") for label in labels]
    shortest = min(len(w) for w in words)
    head = next((i for i in range(shortest) if len({w[i] for w in words}) > 1), shortest)
    tail = next((i for i in range(shortest - head) if len({w[-1 - i] for w in words}) > 1), shortest - head)
    short = ["-".join(w[head : len(w) - tail]) or label for w, label in zip(words, labels)]
    common = "-".join([*words[0][:head], "*", *words[0][len(words[0]) - tail :]])
    return short, common if head or tail else ""


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


# More series than the default colour cycle (10) would repeat colours: beyond it, 20 colours and 4 dash styles.
_MANY_SERIES = 10


def _axes(series: int = 1):
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    # a legend of many series goes to the right of the axes
    return plt.subplots(figsize=(8.4 if series > 6 else 6.4, 4.2))


def _style(index: int, series: int) -> dict:
    if series <= _MANY_SERIES:
        return {"color": f"C{index}"}
    import matplotlib

    return {
        "color": matplotlib.colormaps["tab20"](index % 20),
        "linestyle": ("-", "--", "-.", ":")[index // 5 % 4],
    }


def _save(fig, ax, out: Path, xlabel: str, ylabel: str, title: str) -> list[str]:
    """Label, lay out and write the figure; returns its legend entries."""
    import matplotlib.pyplot as plt

    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize="medium")
    ax.grid(alpha=0.3)
    entries = ax.get_legend_handles_labels()[1]
    if len(entries) > 6:
        ax.legend(fontsize="x-small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    else:
        ax.legend(fontsize="small")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=150)
    plt.close(fig)
    return entries


def plot_best_so_far(
    curves: Sequence[Curve | SeedBand], out: Path, ylabel: str, title: str | None = None
) -> list[str]:
    """One step curve per study, or per study over seeds its mean with the min-max spread shaded; best value so
    far against trial number. Labels drop the words all studies share (the title shows them).

    Returns:
        the legend entries, one per curve.
    """
    labels, common = short_labels([c.label for c in curves])
    fig, ax = _axes(len(curves))
    for index, (curve, label) in enumerate(zip(curves, labels)):
        style = _style(index, len(curves))
        if isinstance(curve, SeedBand):
            label = f"{label} ({curve.final:.4f}, mean of {curve.seeds} seeds)"
            ax.step(curve.trials, curve.mean, where="post", label=label, **style)
            ax.fill_between(
                curve.trials, curve.low, curve.high, step="post", alpha=0.18, color=style["color"]
            )
        else:
            ax.step(curve.trials, curve.best, where="post", label=f"{label} ({curve.final:.4f})", **style)
    default = f"best {ylabel} so far" + (f": {common}" if common else "")
    if any(isinstance(c, SeedBand) for c in curves):
        default += " (mean over seeds, shaded: min-max)"
    return _save(fig, ax, out, "trial", f"best {ylabel} so far", title or default)


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
    studies = list(dict.fromkeys(labels))
    fig, ax = _axes(len(studies))
    for index, (label, short) in enumerate(zip(studies, short_labels(studies)[0])):
        xs = [p[0] for p, lab in zip(points, labels) if lab == label]
        ys = [p[1] for p, lab in zip(points, labels) if lab == label]
        ax.scatter(xs, ys, s=14, alpha=0.6, label=short, color=_style(index, len(studies))["color"])
    ax.step(
        [points[i][0] for i in front],
        [points[i][1] for i in front],
        where="post",
        color="black",
        label="Pareto front",
    )
    _save(fig, ax, out, xlabel, ylabel, title or f"{ylabel} vs {xlabel}")
    return front
