"""The static report of a study: ``python -m adls_lightning.reports.study <study name | .db | .journal | URL>
out=DIR [study=NAME]`` writes ``DIR/index.html``, one self-contained page (opens from a file, no server).

It holds Optuna's own plotly figures (optimisation history, parameter importances, parallel coordinates, and the
Pareto front of a two-objective study), a sortable table of every trial with the overrides its job ran with, and
the command line that re-runs the best trial as a single training run. A study priced by the cost model
(``search/objective=acc_latency`` or ``acc_bytes``) also gets each Pareto point's export command (``adls-budget
assignment=deployed``: the trial's model with each layer in its runtime, written to the trial's ``export/`` folder
and timed there), that export's measured speed beside the predicted one once the command has run, and the
best-accuracy trial under latency budgets of 0.5, 0.7 and 0.9 x fp32. For a live view of a study, Optuna's web UI
serves the same storage: ``optuna-dashboard sqlite:///outputs/search/NAME/NAME.db`` (docs/search.md).

``out`` is a new or empty folder, or one holding this command's earlier page (redrawn).

Bad input (an unknown option, an ``out`` that cannot be written or holds anything but this command's earlier page,
a storage that is damaged or holds no such study): one line naming it, exit code 2, nothing written. ``--help``:
this text.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from adls_lightning.reports.study import COMMAND, load_study, study_page
from adls_lightning.tools.options import check_out_dir, report_arguments, report_main

USAGE = "python -m adls_lightning.reports.study <study name | .db | .journal | URL> out=DIR [study=NAME]"


def parse_command(argv: Sequence[str]) -> dict[str, str]:
    """The command's arguments, checked (``tests/test_docs.py`` checks the documented ones with it).

    Raises:
        ConfigError: an unknown or missing argument.
    """
    return report_arguments(argv, "source", ("out", "study"), USAGE)


def write_report(argv: Sequence[str]) -> Path:
    """The command: parse ``argv``, check the output folder, read the study, write the page.

    Raises:
        ConfigError: bad arguments, an unwritable ``out``, or no such study.
    """
    args = parse_command(argv)
    out = check_out_dir(args["out"], COMMAND)
    study, shown = load_study(args["source"], args.get("study"))
    return study_page(study, shown).write(out)


def main() -> None:
    report_main(write_report, __doc__)


if __name__ == "__main__":
    main()
