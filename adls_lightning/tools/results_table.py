"""One results table for any runs: ``adls-table RUN_OR_GLOB... [out=DIR]`` (or
``python -m adls_lightning.reports.table``) prints a markdown table of the runs; ``out=DIR`` also writes
``DIR/table.md``, ``DIR/table.csv`` and ``DIR/table.png``.

Each argument is a run folder, a folder holding runs (a multirun's numbered job folders, a search's trials: every
``metrics.json`` below it), a glob of either (quoted: ``'outputs/train/multiruns/*'``), or an Optuna study (its
``.db`` or ``.journal`` file, URL or name under ``outputs/search`` of the working folder or of this checkout, where
``search.py`` writes: the folders its trials recorded).

One row per configuration: the overrides (``.hydra/overrides.yaml``) that differ between the runs, with the
per-seed keys (``seed``, ``data.seed``, any ``*.seed``) and a search trial's identity left out, so the seeds of a
configuration share its row. A run that left a key alone shows what it ran with: the config group option it
composed (``compile``: ``none``), else its saved config's value (``compile.backend``: ``inductor``), else ``none``
(a setting it did not have: an uncompiled run's ``compile.backend``). Columns: the task's metrics (``test/*`` then ``val/*`` in ``metrics.json``, the main
metric first; losses left out) as mean ± std over the runs of the row (sample std), the number of runs ``n``, and,
where ``metrics.json`` has them, trainable and total parameters, bits per weight, weight sparsity and stored size;
last, the precision the row's runs trained in (``trainer/precision``: ``auto``'s choice or the value given; each value
its runs recorded, blank for runs recorded before the key existed).
The figure shows the main metric's mean ± std per configuration.

A value that is not a number (``nan``: a diverged run) or missing from some runs of a row is never averaged
silently: the mean is over the numbers, says over how many (``0.8123 ± 0.0100 (2/3)``), and a footnote names each
run left out (as ``scripts/glue_table.py`` does for its averages). A run is counted once however it is named (two
spellings of its folder, a symlink, overlapping globs). A job folder with a run record and no ``metrics.json`` below
a folder given (a job that failed, was killed or is still running) is named in a footnote and its row's ``n`` reads
``2/3``. Runs of a row with the same seed (a copy, a study that sampled one configuration twice) stay in ``n`` and
are named in a footnote: their spread is not a spread over seeds.

``out`` is a new or empty folder, or one holding an earlier table (only those three files: redrawn).

Bad input (no run matched, a damaged ``metrics.json`` or run record, runs of different tasks, runs of one row
that read different data, an ``out`` that cannot be written or holds anything but an earlier table): one ``error:`` line naming it, exit code 2, nothing
written. ``--help``: this text.

Example::

    python train.py -m prune=l1_0.5,wanda_0.5,none seed=1,2,3 hydra.sweep.dir=outputs/prune_seeds
    adls-table outputs/prune_seeds out=outputs/prune_seeds/table
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from adls_lightning.reports.table import OUTPUTS, USAGE, results_table
from adls_lightning.tools.options import run_tool, split_options

OPTIONS = {"out": None}


def parse_command(argv: Sequence[str]) -> tuple[list[str], Path | None]:
    """The runs (in the order given) and ``out`` (None: print only) of a command line.

    Raises:
        HelpRequested: ``--help`` / ``-h``.
        ConfigError: an unknown ``key=value``, naming the valid keys.
    """
    # a run folder's own name may hold "=" (a sweep's subdir=${hydra.job.override_dirname}): what exists is a run
    paths = [token for token in argv if "=" in token and Path(token).expanduser().exists()]
    options, _ = split_options(
        [t for t in argv if t not in paths], OPTIONS, USAGE, overrides=False, positional="runs"
    )
    out = Path(options["out"]).expanduser() if options["out"] else None
    return [t for t in argv if t in paths or t in options["runs"]], out


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)

    def body() -> None:
        sources, out = parse_command(argv)
        print(results_table(sources, out))
        if out is not None:
            print(f"\nwrote {', '.join(str(out / name) for name in OUTPUTS)}")

    return run_tool(body, __doc__)


if __name__ == "__main__":
    sys.exit(main())
