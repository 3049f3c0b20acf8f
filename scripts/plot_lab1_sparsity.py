"""Lab 1 figure: accuracy vs sparsity, one curve per pruning method, from a multirun's ``metrics.json`` files.

Each job folder of the sweep holds ``metrics.json`` (written by ``adls_lightning.app.training.run``) and Hydra's
``.hydra/config.yaml``; the method comes from ``prune.weight.method`` of that config and the x value is the
*measured* ``prune/weight_sparsity``. Jobs without pruning (``prune=none``) are drawn as a dashed "dense" line.

Usage::

    python scripts/plot_lab1_sparsity.py outputs/lab1_prune/multiruns/<date> --out docs/figures/lab1_sparsity.png

Prints a markdown table of the points it plotted.
"""

from __future__ import annotations

import sys
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from adls_lightning.reports import curves as curve_figures
from adls_lightning.runs.record import iter_run_records
from adls_lightning.script_args import Parser, check_outputs, existing_folder


@dataclass(frozen=True)
class Point:
    """One finished run: its pruning method (None = dense), measured sparsity and accuracy."""

    method: str | None
    sparsity: float
    accuracy: float
    run_dir: Path


def read_points(roots: Iterable[Path], metric: str = "test/acc") -> list[Point]:
    """Collects one :class:`Point` per ``metrics.json`` found under ``roots`` (recursively).

    Runs without ``metric`` are skipped with a note on stderr (e.g. a job that failed before testing).
    """
    points = []
    for run_dir, metrics, config in iter_run_records(roots, metric):
        weight = (config.get("prune") or {}).get("weight") or {}
        method = weight.get("method")
        sparsity = metrics.get("prune/weight_sparsity", 0.0) if method else 0.0
        points.append(Point(method, float(sparsity), float(metrics[metric]), run_dir))
    return points


def curves(points: Iterable[Point]) -> dict[str, list[tuple[float, float]]]:
    """Method → [(sparsity, mean accuracy)] sorted by sparsity; repeated sparsities (seeds) are averaged."""
    grouped: dict[str, dict[float, list[float]]] = defaultdict(lambda: defaultdict(list))
    for point in points:
        if point.method is not None:
            grouped[point.method][round(point.sparsity, 3)].append(point.accuracy)
    return {
        method: sorted((s, sum(accs) / len(accs)) for s, accs in by_sparsity.items())
        for method, by_sparsity in sorted(grouped.items())
    }


def _dense(points: list[Point], metric: str) -> tuple[str, float] | None:
    dense = [p.accuracy for p in points if p.method is None]
    return (f"dense {metric}", sum(dense) / len(dense)) if dense else None


def markdown_table(points: Iterable[Point], metric: str) -> str:
    """A table with one row per sparsity and one column per method (plus the dense baseline)."""
    points = list(points)
    return curve_figures.markdown_table("sparsity", curves(points), ".3f", _dense(points, metric))


def plot(points: list[Point], out: Path, metric: str, title: str) -> None:
    """Draws accuracy vs sparsity (one line per method, dense baseline dashed) and saves a PNG."""
    dense = _dense(points, metric)
    curve_figures.plot_curves(
        curves(points),
        ("dense", dense[1]) if dense else None,
        out,
        ("weight sparsity (measured)", metric, title),
        title_style={"fontsize": "medium", "wrap": True},
    )


def main(argv: list[str] | None = None) -> int:
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "roots", nargs="+", type=existing_folder, help="multirun folder(s) to search for metrics.json"
    )
    parser.add_argument(
        "--out", type=Path, default=Path("docs/figures/lab1_sparsity.png"), help="PNG to write"
    )
    parser.add_argument(
        "--metric", default="test/acc", help="metrics.json key on the y axis (default test/acc)"
    )
    parser.add_argument("--title", default="Lab 1: accuracy vs sparsity (pruning + fine-tuning)")
    args = parser.parse_args(argv)
    check_outputs(parser, figures={"--out": args.out})
    try:
        points = read_points(args.roots, args.metric)
    except ValueError as error:  # a damaged metrics.json or config, named
        parser.error(str(error))
    return curve_figures.write_figure(
        points, any(p.method for p in points), "pruned run", args, plot, markdown_table
    )


if __name__ == "__main__":
    sys.exit(main())
