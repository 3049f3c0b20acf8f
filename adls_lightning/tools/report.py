"""The report of a Hydra multirun of ``train.py``: ``python -m adls_lightning.reports.sweep sweep=<multirun folder>
out=DIR [metric=NAME]`` writes ``DIR/index.html``: a sortable table of every job's overrides and metrics, and the
main metric (``metric=``, else the runs' ``optimized_metric``) against each swept parameter.

Jobs are the folders under ``sweep`` holding a run record (``.hydra/overrides.yaml``, written once a run's
checks passed); a job without ``metrics.json`` (failed or still running) is listed without metrics. A search's
folder (``search.py``) is a study: ``python -m adls_lightning.reports.study`` draws it with Optuna's figures.

``out`` is a new or empty folder, or one holding this command's earlier page (redrawn).

Bad input (an unknown option, a ``metric`` no finished job has, jobs of different tasks (refused as ``adls-table``
refuses them), an ``out`` that cannot be written or holds anything but this command's earlier page, a damaged run
record or ``metrics.json``): one line naming it (and, for
``metric``, the metrics the jobs have), exit code 2, nothing written. ``--help``: this text.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from adls_lightning.errors import ConfigError
from adls_lightning.reports.sweep import COMMAND, read_jobs, sweep_page
from adls_lightning.tools.options import check_out_dir, report_arguments, report_main

USAGE = "python -m adls_lightning.reports.sweep sweep=<multirun folder> out=DIR [metric=NAME]"


def parse_command(argv: Sequence[str]) -> dict[str, str]:
    """The command's arguments, checked (``tests/test_docs.py`` checks the documented ones with it).

    Raises:
        ConfigError: an unknown or missing argument.
    """
    args = report_arguments(argv, None, ("sweep", "out", "metric"), USAGE)
    if not args.get("sweep"):
        raise ConfigError(f"sweep: missing ({USAGE})")
    return args


def write_report(argv: Sequence[str]) -> Path:
    """The command: parse ``argv``, check ``out``, read the jobs, write the page.

    Raises:
        ConfigError: bad arguments, an unwritable ``out``, or no job under ``sweep``.
    """
    args = parse_command(argv)
    out = check_out_dir(args["out"], COMMAND)
    sweep = Path(args["sweep"]).expanduser().absolute()
    return sweep_page(sweep, read_jobs(sweep), args.get("metric")).write(out)


def main() -> None:
    report_main(write_report, __doc__)


if __name__ == "__main__":
    main()
