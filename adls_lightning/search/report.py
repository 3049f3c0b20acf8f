"""The static report of a study: ``python -m adls_lightning.search.report <study name | .db | .journal | URL>
out=DIR [study=NAME]`` writes ``DIR/index.html``, one self-contained page (opens from a file, no server).

It holds Optuna's own plotly figures (optimisation history, parameter importances, parallel coordinates, and the
Pareto front of a two-objective study), a sortable table of every trial with the overrides its job ran with, and
the command line that re-runs the best trial as a single training run. For a live view of a study, Optuna's web UI
serves the same storage: ``optuna-dashboard sqlite:///outputs/search/NAME/NAME.db`` (docs/search.md).

Bad input (an unknown option, an ``out`` that cannot be written, a storage that is damaged or holds no such
study): one line naming it, exit code 2, nothing written. ``--help``: this text.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import optuna
import yaml
from optuna.trial import FrozenTrial, TrialState

from adls_lightning.errors import ConfigError
from adls_lightning.html_report import Page, check_out_dir, main_guard, parse_args
from adls_lightning.search.from_study import open_study, study_storage
from adls_lightning.search.storage import mask_password

USAGE = "python -m adls_lightning.search.report <study name | .db | .journal | URL> out=DIR [study=NAME]"
# The overrides the sweeper gives each job to find its trial again: not part of what the trial trained.
TRIAL_IDENTITY = "++search.trial."
# A trial's job is a run of conf/search.yaml; as one run (not a sweep), without reporting to a trial.
SINGLE_RUN = ("--config-name", "search", "hydra.mode=RUN", "callbacks.optuna_pruning=null")


def load_study(
    source: str, study: str | None = None, search_dir: Path | None = None
) -> tuple[optuna.Study, str]:
    """The study of ``source`` (the only one in its storage, or ``study``) and its storage as shown (masked).

    Raises:
        ConfigError: no such storage or study, or several studies and no ``study=``.
    """
    from sqlalchemy.exc import SQLAlchemyError

    search_dir = search_dir or Path(os.environ.get("PROJECT_ROOT", os.getcwd())) / "outputs" / "search"
    spec, name = study_storage(source, search_dir, key="source")
    try:
        return open_study(mask_password(source), spec, study or name, key="source"), mask_password(spec)
    except ConfigError:
        raise
    except (
        ValueError,
        KeyError,
        TypeError,
        OSError,
        SQLAlchemyError,
        optuna.exceptions.OptunaError,
    ) as error:
        # a damaged storage (a journal file of random bytes, a .db that is no SQLite database): one line naming it
        first = str(error).splitlines()[0][:200] if str(error) else ""
        raise ConfigError(
            f"source={mask_password(source)}: not a readable Optuna storage ({type(error).__name__}: {first}); "
            "give a study's .db, .journal or URL as search.py wrote it"
        ) from None


def trial_overrides(trial: FrozenTrial) -> list[str] | None:
    """The overrides the trial's job ran with (its ``.hydra/overrides.yaml``), without the trial's identity;
    None when the trial's folder or record is gone."""
    folder = trial.user_attrs.get("output_dir")
    record = Path(folder, ".hydra", "overrides.yaml") if folder else None
    if record is None or not record.is_file():
        return None
    return [str(o) for o in yaml.safe_load(record.read_text()) or [] if not str(o).startswith(TRIAL_IDENTITY)]


def rerun_command(overrides: Sequence[str]) -> str:
    """The shell command that trains the trial's configuration once (``train.py`` on the search's config)."""
    return " ".join(["python", "train.py", *SINGLE_RUN, *map(shell_word, overrides)])


def shell_word(text: str) -> str:
    """``text`` quoted for a POSIX shell, in double quotes when it holds single quotes (Hydra's list syntax)."""
    if "'" in text and not any(c in text for c in '"$`\\!'):
        return f'"{text}"'
    return shlex.quote(text)


def metric_names(study: optuna.Study) -> list[str]:
    return list(study.metric_names or [f"objective_{i}" for i in range(len(study.directions))])


def study_figures(study: optuna.Study) -> list[tuple[str, Any]]:
    """(title, plotly figure) of Optuna's plots of ``study``; a plot that needs more trials is left out."""
    from optuna import visualization as vis

    names = metric_names(study)
    complete = [t for t in study.get_trials(deepcopy=False) if t.state == TrialState.COMPLETE]
    figures: list[tuple[str, Any]] = []
    if not complete:
        return figures
    multi = len(names) > 1
    with warnings.catch_warnings():
        # the Pareto plot is marked experimental; importances of a few trials come with an accuracy caveat
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        warnings.filterwarnings("ignore", category=UserWarning, module=r"optuna\.importance")
        if len(names) == 2:
            figures.append(("Pareto front", vis.plot_pareto_front(study, target_names=names)))
        for index, name in enumerate(names):
            target = {"target": (lambda t, i=index: t.values[i]), "target_name": name} if multi else {}
            figures.append((f"Optimisation history: {name}", vis.plot_optimization_history(study, **target)))
            if study.best_trials and complete[0].params:
                figures.append(
                    (f"Parallel coordinates: {name}", vis.plot_parallel_coordinate(study, **target))
                )
            if multi:  # Optuna's evaluator ranks by how params lower a given target: negate one to maximise
                sign = -1.0 if study.directions[index] == optuna.study.StudyDirection.MAXIMIZE else 1.0
                target = {"target": (lambda t, i=index, s=sign: s * t.values[i]), "target_name": name}
            # (none with fewer than 2 completed trials, or no parameter that varied)
            with contextlib.suppress(ValueError, RuntimeError):
                figures.append(
                    (f"Parameter importances: {name}", vis.plot_param_importances(study, **target))
                )
    return figures


def trial_rows(study: optuna.Study) -> tuple[list[str], list[list[Any]]]:
    """Columns and rows of the trial table: number, state, values, params, metrics, duration, overrides."""
    trials = study.get_trials(deepcopy=False)
    names = metric_names(study)
    params = sorted({p for t in trials for p in t.params})
    metrics = sorted({m for t in trials for m in t.user_attrs.get("metrics", {})} - set(names))
    columns = ["trial", "state", *names, *params, *metrics, "duration (s)", "overrides", "folder"]
    rows = []
    for t in trials:
        values = list(t.values) if t.values else [None] * len(names)
        duration = t.duration.total_seconds() if t.duration else None
        overrides = trial_overrides(t)
        measured = t.user_attrs.get("metrics", {})
        rows.append(
            [
                t.number,
                t.state.name,
                *values,
                *(t.params.get(p) for p in params),
                *(measured.get(m) for m in metrics),
                duration,
                " ".join(overrides) if overrides is not None else "",
                t.user_attrs.get("output_dir"),
            ]
        )
    return columns, rows


def study_page(study: optuna.Study, shown_storage: str) -> Page:
    names = metric_names(study)
    trials = study.get_trials(deepcopy=False)
    page = Page(f"Study {study.study_name}")
    counts = {s.name.lower(): sum(t.state == s for t in trials) for s in TrialState}
    page.facts(
        {
            "storage": shown_storage,
            "objectives": ", ".join(f"{n} ({d.name.lower()})" for n, d in zip(names, study.directions)),
            "trials": ", ".join(f"{n} {state}" for state, n in counts.items() if n) or "none",
        }
    )
    best = study.best_trials if any(t.state == TrialState.COMPLETE for t in trials) else []
    if len(names) == 1:
        best = best[:1]
    page.heading("Best trial" if len(names) == 1 else f"Pareto front ({len(best)} trials)")
    if not best:
        page.paragraph("No completed trial yet.")
    for t in best:
        values = ", ".join(f"{n} = {v:.4f}" for n, v in zip(names, t.values))
        page.paragraph(f"Trial {t.number}: {values}; params {t.params}")
        overrides = trial_overrides(t)
        if overrides is None:
            page.paragraph(
                f"Its folder ({t.user_attrs.get('output_dir')}) is gone: no command line to re-run it."
            )
        else:
            page.paragraph("Re-run it as one training run (from the project's folder):")
            page.code(rerun_command(overrides))
    for title, figure in study_figures(study):
        page.heading(title)
        page.figure(figure)
    page.heading(f"Trials ({len(trials)})")
    page.table(*trial_rows(study), table_id="trials")
    return page


def parse_command(argv: Sequence[str]) -> dict[str, str]:
    """The command's arguments, checked (``tests/test_docs.py`` checks the documented ones with it).

    Raises:
        ConfigError: an unknown or missing argument.
    """
    return parse_args(argv, "source", ("out", "study"), USAGE)


def write_report(argv: Sequence[str]) -> Path:
    """The command: parse ``argv``, check the output folder, read the study, write the page.

    Raises:
        ConfigError: bad arguments, an unwritable ``out``, or no such study.
    """
    args = parse_command(argv)
    out = check_out_dir(args["out"])
    study, shown = load_study(args["source"], args.get("study"))
    return study_page(study, shown).write(out)


if __name__ == "__main__":
    main_guard(write_report, __doc__)
