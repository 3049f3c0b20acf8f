"""Figures of stored Optuna studies (search.py), each from one command.

Examples:
    # Lab 2 task 1: one best-so-far curve per sampler
    python scripts/plot_search.py best-so-far outputs/search/nas-acc-*/*.db --out figures/nas_samplers.png
    # Lab 2 task 2: no compression vs compression-aware without / with post-compression training
    python scripts/plot_search.py best-so-far outputs/search/nas-acc-tpe/*.db \\
        outputs/search/nas_compression-post*-acc-tpe/*.db --out figures/nas_compression.png
    # Lab 3: one curve per precision (12 formats: 12 curves)
    python scripts/plot_search.py best-so-far outputs/search/mixed_precision-*-acc-tpe/*.db --out figures/mp.png
    # several seeds per study: studies named <name>-seed<N> are one curve, the mean, with the min-max spread
    python scripts/plot_search.py best-so-far outputs/search/nas-acc-*-seed*/*.db --out figures/samplers.png
    # accuracy vs average weight bits, with the Pareto front
    python scripts/plot_search.py pareto outputs/search/mixed_precision-*/*.db --out figures/pareto.png
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing


def main(argv: list[str] | None = None) -> int:
    from adls_lightning.errors import ConfigError
    from adls_lightning.script_args import Parser, check_outputs
    from adls_lightning.search import plots

    parser = Parser(description=__doc__)
    sub = parser.add_subparsers(dest="figure", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("storages", nargs="+", help=".db files or SQLAlchemy URLs")
    common.add_argument("--study", action="append", help="only these studies (repeat); default: all found")
    common.add_argument("--out", type=Path, required=True, help="PNG file to write")
    common.add_argument("--title")
    best = sub.add_parser(
        "best-so-far", parents=[common], help="best value so far vs trial, one curve per study"
    )
    best.add_argument(
        "--metric", help="a recorded metric (e.g. test/acc) instead of the study's first objective"
    )
    best.add_argument("--minimize", action="store_true", help="with --metric: lower is better")
    pareto = sub.add_parser("pareto", parents=[common], help="every trial's y vs x, with the Pareto front")
    pareto.add_argument(
        "--x", default="quant/avg_weight_bits", help="metric to minimize (default: %(default)s)"
    )
    pareto.add_argument("--y", default="val/acc", help="metric to maximize (default: %(default)s)")
    args = parser.parse_args(argv)
    check_outputs(parser, figures={"--out": args.out})  # before the studies are read

    try:
        studies = plots.load_studies(args.storages, args.study)
        if args.figure == "best-so-far":
            maximize = None if args.metric is None else not args.minimize
            curves = plots.group_seeds([plots.best_so_far(s, args.metric, maximize) for s in studies])
            ylabel = args.metric or (studies[0].metric_names or ["objective"])[0]
            plots.plot_best_so_far(curves, args.out, ylabel, args.title)
            for curve in curves:
                if isinstance(curve, plots.SeedBand):
                    print(
                        f"{curve.label}: best {ylabel} after {len(curve.trials)} trials, mean of {curve.seeds} "
                        f"seeds {curve.final:.4f} (min {curve.low[-1]:.4f}, max {curve.high[-1]:.4f})"
                    )
                else:
                    print(
                        f"{curve.label}: best {ylabel} {curve.final:.4f} at trial {curve.reached_at} "
                        f"of {len(curve.trials)}"
                    )
        else:
            points, labels = [], []
            for study in studies:
                for trial in study.get_trials(deepcopy=False):
                    x, y = plots.trial_value(trial, args.x), plots.trial_value(trial, args.y)
                    if x is not None and y is not None:
                        points.append((x, y))
                        labels.append(study.study_name)
            if not points:
                raise ConfigError(f"no completed trial recorded both {args.x} and {args.y}")
            front = plots.plot_pareto(points, labels, args.out, args.x, args.y, args.title)
            print(f"Pareto front ({len(front)} of {len(points)} trials), {args.x} -> {args.y}:")
            for i in front:
                print(f"  {points[i][0]:8.3f}  {points[i][1]:.4f}  ({labels[i]})")
    except ConfigError as err:
        print(f"error: {' '.join(str(err).split())}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
