"""The curve figure and table drawn from runs' records (:func:`adls_lightning.runs.record.iter_run_records`); shared by
``scripts/plot_lab1_sparsity.py`` and ``scripts/plot_lab1_width.py``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

#: Curve label -> [(x, y)] sorted by x.
Curves = Mapping[str, Sequence[tuple[float, float]]]


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
