"""Lab 1 figure: accuracy vs sparsity, one curve per pruning method, from a multirun's ``metrics.json`` files.

Each job folder of the sweep holds ``metrics.json`` (written by ``adls_lightning.training.run``) and Hydra's
``.hydra/config.yaml``; the method comes from ``prune.weight.method`` of that config and the x value is the
*measured* ``prune/weight_sparsity``. Jobs without pruning (``prune=none``) are drawn as a dashed "dense" line.

Usage::

    python scripts/plot_lab1_sparsity.py outputs/lab1_prune/multiruns/<date> --out docs/figures/lab1_sparsity.png

Prints a markdown table of the points it plotted.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import yaml


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
    for root in roots:
        for metrics_file in sorted(Path(root).rglob("metrics.json")):
            run_dir = metrics_file.parent
            metrics = json.loads(metrics_file.read_text())
            if metric not in metrics:
                print(f"skipping {run_dir}: no {metric} in metrics.json", file=sys.stderr)
                continue
            config_file = run_dir / ".hydra" / "config.yaml"
            config = yaml.safe_load(config_file.read_text()) if config_file.is_file() else {}
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


def markdown_table(points: Iterable[Point], metric: str) -> str:
    """A table with one row per sparsity and one column per method (plus the dense baseline)."""
    points = list(points)
    per_method = curves(points)
    dense = [p.accuracy for p in points if p.method is None]
    sparsities = sorted({s for values in per_method.values() for s, _ in values})
    lines = [f"| sparsity | {' | '.join(per_method)} |", "|---" * (len(per_method) + 1) + "|"]
    for sparsity in sparsities:
        cells = []
        for values in per_method.values():
            match = [acc for s, acc in values if s == sparsity]
            cells.append(f"{match[0]:.4f}" if match else "")
        lines.append(f"| {sparsity:.3f} | {' | '.join(cells)} |")
    if dense:
        lines.append(f"\ndense {metric}: {sum(dense) / len(dense):.4f}")
    return "\n".join(lines)


def plot(points: list[Point], out: Path, metric: str, title: str) -> None:
    """Draws accuracy vs sparsity (one line per method, dense baseline dashed) and saves a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4), dpi=150)
    for method, values in curves(points).items():
        xs, ys = zip(*values)
        ax.plot(xs, ys, marker="o", label=method)
    dense = [p.accuracy for p in points if p.method is None]
    if dense:
        ax.axhline(sum(dense) / len(dense), color="gray", linestyle="--", label="dense")
    ax.set_xlabel("weight sparsity (measured)")
    ax.set_ylabel(metric)
    ax.set_title(title, fontsize="medium", wrap=True)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("roots", nargs="+", type=Path, help="multirun folder(s) to search for metrics.json")
    parser.add_argument(
        "--out", type=Path, default=Path("docs/figures/lab1_sparsity.png"), help="PNG to write"
    )
    parser.add_argument(
        "--metric", default="test/acc", help="metrics.json key on the y axis (default test/acc)"
    )
    parser.add_argument("--title", default="Lab 1: accuracy vs sparsity (pruning + fine-tuning)")
    args = parser.parse_args(argv)
    points = read_points(args.roots, args.metric)
    if not any(p.method for p in points):
        print(
            f"error: no pruned run with {args.metric} under {', '.join(map(str, args.roots))}",
            file=sys.stderr,
        )
        return 2
    plot(points, args.out, args.metric, args.title)
    print(markdown_table(points, args.metric))
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
