"""Lab 1 figure: best accuracy vs fixed-point width, one curve for PTQ and one for QAT, from run records.

Reads every ``metrics.json`` under the given folders (the job folders of ``train.py -m`` sweeps) and
Hydra's ``.hydra/config.yaml`` beside it. A run's mode is ``quant.mode`` and its width is the
integer preset's weight width (from the config: ``quant.config.default.weight.params.width``, or a lab dict's
``weight_width``; without one, ``quant/avg_weight_bits``, which
is the width for the integer presets). Runs without quantization are drawn as a dashed
"full precision" line. Any subset of widths and modes works.

"Best accuracy": each run reports the accuracy of its best checkpoint (selected on ``val/acc``);
when several runs share a width and mode (seeds, learning rates), the one with the best
``--select`` metric is drawn, so the test split is never used for selection.

Usage::

    python scripts/plot_lab1_width.py outputs/cpu/multiruns/<date> --out docs/figures/lab1_width.png

Prints a markdown table of the plotted points.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from adls_lightning.reports import curves as curve_figures
from adls_lightning.runs.record import iter_run_records
from adls_lightning.script_args import Parser, check_outputs

MODES = ("ptq", "qat")


@dataclass(frozen=True)
class Run:
    """One finished run: quantization mode (None = full precision), width, accuracy and selection score."""

    mode: str | None
    width: int | None
    accuracy: float
    score: float
    run_dir: Path


def _integer_width(config: dict, metrics: dict) -> int | None:
    quant = (config.get("quant") or {}).get("config") or {}
    # a typed recipe (the presets: default.weight = {format, params}) or a lab's MASE dict (linear.config)
    weight = (quant.get("default") or {}).get("weight") if isinstance(quant, dict) else None
    linear = quant.get("linear") or {} if isinstance(quant, dict) else {}
    layer = linear.get("config", linear) if isinstance(linear, dict) else {}
    if (
        isinstance(weight, dict)
        and weight.get("format") == "integer"
        and "width" in (weight.get("params") or {})
    ):
        return int(weight["params"]["width"])
    if layer.get("name") == "integer" and layer.get("weight_width") is not None:
        return int(layer["weight_width"])
    bits = metrics.get("quant/avg_weight_bits")
    return round(bits) if bits is not None and not layer and not weight else None


def read_runs(roots: Iterable[Path], metric: str = "test/acc", select: str = "val/acc") -> list[Run]:
    """One :class:`Run` per ``metrics.json`` under ``roots``; runs without ``metric`` are skipped (noted on stderr)."""
    runs = []
    for run_dir, metrics, config in iter_run_records(roots, metric):
        quant = config.get("quant") or {}
        # quant=none (no callback) is full precision even when a sweep added ++quant.mode to it
        mode = quant.get("mode") if "_target_" in quant or "config" in quant else None
        if mode is None and "quant/avg_weight_bits" in metrics:  # no saved config: infer from the metrics
            mode = "ptq" if "ptq/val_acc_after" in metrics else "qat"
        width = _integer_width(config, metrics) if mode else None
        if mode and width is None:
            print(f"skipping {run_dir}: not a fixed-point (integer) run", file=sys.stderr)
            continue
        score = float(metrics.get(select, metrics[metric]))
        runs.append(Run(mode, width, float(metrics[metric]), score, run_dir))
    return runs


def best_per_width(runs: Iterable[Run]) -> dict[str, list[tuple[int, float]]]:
    """Mode -> [(width, accuracy of the run with the best selection score)] sorted by width."""
    best: dict[tuple[str, int], Run] = {}
    for run in runs:
        if run.mode is None:
            continue
        key = (run.mode, run.width)
        if key not in best or run.score > best[key].score:
            best[key] = run
    return {
        mode: sorted((width, run.accuracy) for (m, width), run in best.items() if m == mode)
        for mode in MODES
        if any(m == mode for m, _ in best)
    }


def full_precision(runs: Iterable[Run]) -> float | None:
    baseline = [run for run in runs if run.mode is None]
    return max(baseline, key=lambda run: run.score).accuracy if baseline else None


def best_run(runs: Iterable[Run], mode: str = "qat") -> Run | None:
    """The run of ``mode`` with the best selection score; ties go to the lower width (the more compressed)."""
    candidates = [run for run in runs if run.mode == mode]
    return max(candidates, key=lambda run: (run.score, -run.width)) if candidates else None


def _baseline(runs: list[Run], metric: str) -> tuple[str, float] | None:
    baseline = full_precision(runs)
    return (f"full precision {metric}", baseline) if baseline is not None else None


def _upper(curves: dict[str, list[tuple[int, float]]]) -> dict[str, list[tuple[int, float]]]:
    return {mode.upper(): values for mode, values in curves.items()}


def markdown_table(runs: list[Run], metric: str) -> str:
    return curve_figures.markdown_table("width", _upper(best_per_width(runs)), "", _baseline(runs, metric))


def plot(runs: list[Run], out: Path, metric: str, title: str) -> None:
    """Draws accuracy vs width (PTQ and QAT curves, full precision dashed) and saves a PNG."""
    curves = best_per_width(runs)
    baseline = full_precision(runs)
    curve_figures.plot_curves(
        _upper(curves),
        ("full precision", baseline) if baseline is not None else None,
        out,
        ("fixed-point width (bits; frac = width / 2)", f"best {metric}", title),
        xticks=sorted({w for values in curves.values() for w, _ in values}),
    )


def main(argv: list[str] | None = None) -> int:
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "roots", nargs="+", type=Path, help="folder(s) to search for metrics.json (multirun dirs)"
    )
    parser.add_argument("--out", type=Path, default=Path("docs/figures/lab1_width.png"), help="PNG to write")
    parser.add_argument(
        "--metric", default="test/acc", help="metrics.json key on the y axis (default test/acc)"
    )
    parser.add_argument(
        "--select", default="val/acc", help="picks the best of repeated runs (default val/acc)"
    )
    parser.add_argument("--title", default="Lab 1: accuracy vs fixed-point width")
    parser.add_argument(
        "--best-run",
        action="store_true",
        help="print '<run dir> <width>' of the best QAT run (by --select) instead of plotting",
    )
    args = parser.parse_args(argv)
    if missing := [root for root in args.roots if not root.is_dir()]:
        # returned, not raised: main() is also called in-process, and its status is the answer
        print(f"error: roots: no such folder {missing[0]}", file=sys.stderr)
        return 2
    if not args.best_run:
        check_outputs(parser, figures={"--out": args.out})
    try:
        runs = read_runs(args.roots, args.metric, args.select)
    except ValueError as error:  # a damaged metrics.json or config, named
        parser.error(str(error))
    if args.best_run:
        best = best_run(runs)
        if best is None:
            print(f"error: no QAT run under {', '.join(map(str, args.roots))}", file=sys.stderr)
            return 2
        print(best.run_dir, best.width)
        return 0
    return curve_figures.write_figure(
        runs, any(run.mode for run in runs), "quantized run", args, plot, markdown_table
    )


if __name__ == "__main__":
    sys.exit(main())
