"""Run records of ``train.py`` sweeps (``metrics.json`` + Hydra's ``.hydra/config.yaml`` per job folder) and the
curve figure and table drawn from them; shared by ``scripts/plot_lab1_sparsity.py`` and ``scripts/plot_lab1_width.py``.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

#: Curve label -> [(x, y)] sorted by x.
Curves = Mapping[str, Sequence[tuple[float, float]]]


def iter_run_records(
    roots: Iterable[Path], metric: str
) -> Iterator[tuple[Path, dict[str, Any], dict[str, Any]]]:
    """``(run folder, metrics, config)`` per ``metrics.json`` under ``roots`` (recursively, sorted).

    Runs without ``metric`` are skipped with a note on stderr (e.g. a job that failed before testing); a run
    without a saved config gets ``{}``.

    Raises:
        ValueError: a ``metrics.json`` that is not a JSON object (a file cut by a killed job) or a saved config
            that is not a YAML mapping, naming the file: a figure drawn without that run would be silently wrong.
    """
    for root in roots:
        for metrics_file in sorted(Path(root).rglob("metrics.json")):
            run_dir = metrics_file.parent
            metrics, config = read_run_record(run_dir)
            if metric not in metrics:
                print(f"skipping {run_dir}: no {metric} in metrics.json", file=sys.stderr)
                continue
            yield run_dir, metrics, config


def read_run_record(run_dir: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(metrics, config)`` of one run folder: its ``metrics.json`` and saved ``.hydra/config.yaml`` (``{}`` when
    it saved none).

    Raises:
        ValueError: as :func:`iter_run_records`, naming the file.
    """
    metrics = _read_mapping(run_dir / "metrics.json", json.loads, "JSON")
    config_file = run_dir / ".hydra" / "config.yaml"
    config = _read_mapping(config_file, yaml.safe_load, "YAML") if config_file.is_file() else {}
    return metrics, config


def _read_mapping(path: Path, parse: Callable[[str], Any], kind: str) -> dict[str, Any]:
    try:
        value = parse(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError, yaml.YAMLError) as err:
        raise ValueError(f"{path}: not readable {kind} ({' '.join(str(err).split())})") from err
    if not isinstance(value, dict):
        raise ValueError(f"{path}: not a {kind} mapping of names to values (holds {type(value).__name__})")
    return value


def markdown_table(x_name: str, curves: Curves, x_format: str, baseline: tuple[str, float] | None) -> str:
    """One row per x, one column per curve, then ``<baseline label>: <value>`` when there is a baseline."""
    xs = sorted({x for values in curves.values() for x, _ in values})
    lines = [f"| {x_name} | {' | '.join(curves)} |", "|---" * (len(curves) + 1) + "|"]
    for x in xs:
        cells = [next((f"{y:.4f}" for vx, y in values if vx == x), "") for values in curves.values()]
        lines.append(f"| {x:{x_format}} | {' | '.join(cells)} |")
    if baseline is not None:
        lines.append(f"\n{baseline[0]}: {baseline[1]:.4f}")
    return "\n".join(lines)


def plot_curves(
    curves: Curves,
    baseline: tuple[str, float] | None,
    out: Path,
    labels: tuple[str, str, str],
    xticks: Sequence[float] | None = None,
    title_style: Mapping[str, Any] | None = None,
) -> None:
    """One line per curve, the baseline dashed, saved as a PNG at ``out``.

    Args:
        labels: x label, y label, title.
        xticks: x ticks to show (None: matplotlib's).
        title_style: keyword arguments of ``Axes.set_title``.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4), dpi=150)
    for label, values in curves.items():
        xs, ys = zip(*values)
        ax.plot(xs, ys, marker="o", label=label)
    if baseline is not None:
        ax.axhline(baseline[1], color="gray", linestyle="--", label=baseline[0])
    if xticks is not None:
        ax.set_xticks(xticks)
    xlabel, ylabel, title = labels
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, **(title_style or {}))
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)


def write_figure(items: Any, found: bool, missing: str, args: Any, plot: Callable, table: Callable) -> int:
    """A plot script's ending, for its parsed ``args`` (``roots``, ``out``, ``metric``, ``title``): draw
    ``plot(items, out, metric, title)`` and print ``table(items, metric)`` (exit status 0), or, when nothing was
    ``found``, print one error line ``no <missing> with <metric> under <roots>`` (exit status 2)."""
    if not found:
        roots = ", ".join(map(str, args.roots))
        print(f"error: no {missing} with {args.metric} under {roots}", file=sys.stderr)
        return 2
    plot(items, args.out, args.metric, args.title)
    print(table(items, args.metric))
    print(f"\nwrote {args.out}")
    return 0
