"""The static report of a study: the study read from its storage (:func:`load_study`) and its page
(:func:`study_page`: Optuna's figures, the trials' table, the best trial's re-run command and, for a study priced by
the cost model, the Pareto points' export commands). The command is ``python -m adls_lightning.reports.study``
(:mod:`adls_lightning.tools.study_report`).
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
from adls_lightning.reports.page import Page
from adls_lightning.search.from_study import open_study, study_storage
from adls_lightning.search.storage import mask_password

#: the command that writes the page (named in it: a redraw recognises its own earlier page)
COMMAND = "adls_lightning.reports.study"
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

    spec, name = _storage(source, search_dir)
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


def search_dirs() -> list[Path]:
    """Where a study's name is looked up: ``outputs/search`` of ``$PROJECT_ROOT`` (else of the working folder: where
    ``adls-search`` writes), then of this checkout (where ``python /path/to/search.py`` writes, wherever it is
    started from)."""
    from adls_lightning.data.folder import PROJECT_ROOT  # the checkout's folder

    here = Path(os.environ.get("PROJECT_ROOT", os.getcwd())) / "outputs" / "search"
    checkout = PROJECT_ROOT / "outputs" / "search"
    return [here] if here.resolve() == checkout.resolve() else [here, checkout]


def _storage(source: str, search_dir: Path | None) -> tuple[str, str | None]:
    """:func:`study_storage` of ``source``, a name looked up in ``search_dir`` or else in each of :func:`search_dirs`.

    Raises:
        ConfigError: no such storage; for a name, naming every folder looked in.
    """
    folders = [search_dir] if search_dir else search_dirs()
    for folder in folders[:-1]:
        try:
            return study_storage(source, folder, key="source")
        except ConfigError:
            continue
    try:
        return study_storage(source, folders[-1], key="source")
    except ConfigError:
        if len(folders) == 1 or "/" in source or "://" in source:
            raise
        raise ConfigError(
            f"source={source}: no such study file, and no study of that name in {' or '.join(map(str, folders))} "
            "(give a .db or .journal file, an SQLAlchemy URL or a study name as in DIR/NAME/NAME.db)"
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
    """The objectives' names: the study's metric names (the sweeper stores them as it opens the study; a study
    made before that was done, with no completed trial, has none: ``objective_<i>``)."""
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


#: objectives priced by the cost model (search/objective=acc_latency, acc_bytes): their Pareto points get exports
COST_METRICS = ("cost/latency_ms", "cost/model_bytes")
#: latency budgets (x the fp32 model's predicted latency) whose best-accuracy trial the page names
LATENCY_BUDGETS = (0.5, 0.7, 0.9)
#: where a point's export command writes (inside the trial's folder), and what it measures there
EXPORT_DIR = "export"
EXPORT_RESULT = "budget.json"


def trial_checkpoint(folder: Path) -> Path | None:
    """The checkpoint a trial's model is exported from: a PTQ run's ``compressed.ckpt``, else its best one."""
    checkpoints = folder / "checkpoints"
    for pattern in ("compressed.ckpt", "best*.ckpt", "last.ckpt"):
        found = sorted(checkpoints.glob(pattern))
        if found:
            return found[0]
    return None


def cost_settings(folder: Path) -> dict[str, int]:
    """The batch, tokens and threads the trial's cost report priced at (its ``callbacks.cost_model``)."""
    settings = {"batch": 8, "tokens": 128, "threads": 1}
    record = folder / ".hydra" / "config.yaml"
    if record.is_file():
        node = ((yaml.safe_load(record.read_text()) or {}).get("callbacks") or {}).get("cost_model") or {}
        settings.update({k: int(node[k]) for k in settings if isinstance(node.get(k), int)})
    return settings


def export_command(folder: Path) -> str | None:
    """``adls-budget`` exporting the trial's model as it deploys (each layer in the runtime its format has here) to
    ``<trial>/export`` and measuring it there; None without a checkpoint."""
    ckpt = trial_checkpoint(folder)
    if ckpt is None:
        return None
    settings = " ".join(f"{k}={v}" for k, v in cost_settings(folder).items())
    out = folder / EXPORT_DIR
    return (
        f"adls-budget {shell_word(f'ckpt={ckpt}')} assignment=deployed {settings} {shell_word(f'out={out}')}"
    )


def measured_export(folder: Path) -> dict[str, Any] | None:
    """What the export command measured (its ``budget.json``), or None before it ran."""
    import json

    record = folder / EXPORT_DIR / EXPORT_RESULT
    try:
        return json.loads(record.read_text()) if record.is_file() else None
    except ValueError:
        return None


def cost_section(page: Page, study: optuna.Study, best: Sequence[FrozenTrial]) -> None:
    """For a study priced by the cost model: each Pareto point's predicted cost, its commands (retrain; export and
    measure), the export's measured speed beside the prediction once the command ran, and the best-accuracy
    trial under each latency budget."""
    names = metric_names(study)
    cost = next(name for name in names if name in COST_METRICS)
    accuracy = next(name for name in names if name != cost)
    page.heading(f"Pareto points as deployed ({accuracy} against {cost})")
    page.paragraph(
        "Each point's model exported with each linear layer in the runtime its format has on this machine "
        f"(adls-budget assignment=deployed, written to the trial's {EXPORT_DIR}/ folder), then reloaded from the "
        "folder and timed against the fp32 model. The measured columns fill in once the command has run; "
        "regenerate the page."
    )
    columns = [
        "trial",
        accuracy,
        "test acc",
        cost,
        "predicted x as fast as fp32",
        "measured ms (export)",
        "measured x as fast as fp32",
        "prediction error",
        "export test acc",
        "export command",
        "retrain command",
    ]
    rows = []
    for t in sorted(best, key=lambda t: t.values[names.index(cost)]):
        folder = Path(t.user_attrs.get("output_dir", ""))
        metrics = t.user_attrs.get("metrics", {})
        measured = measured_export(folder)
        overrides = trial_overrides(t)
        rows.append(
            [
                t.number,
                t.values[names.index(accuracy)],
                metrics.get("test/acc"),
                t.values[names.index(cost)],
                metrics.get("cost/latency_x_fp32"),
                measured.get("measured_ms") if measured else None,
                measured.get("measured_x_fp32") if measured else None,
                f"{measured['prediction_error_pct']:+.1f}%" if measured else None,
                measured.get(f"test/{measured.get('metric')}") if measured else None,
                export_command(folder) or "(no checkpoint)",
                rerun_command(overrides) if overrides is not None else "(folder gone)",
            ]
        )
    page.table(columns, rows, table_id="pareto_exports")
    if cost != "cost/latency_ms":
        return
    complete = [t for t in study.get_trials(deepcopy=False) if t.state == TrialState.COMPLETE]
    for ratio in LATENCY_BUDGETS:
        within = [
            t for t in complete if t.user_attrs.get("metrics", {}).get("cost/latency_x_fp32", 0) >= 1 / ratio
        ]
        if not within:
            page.paragraph(
                f"Latency budget {ratio:g} of fp32's latency: no trial's predicted latency meets it."
            )
            continue
        top = max(within, key=lambda t: (t.values[names.index(accuracy)], -t.values[names.index(cost)]))
        command = export_command(Path(top.user_attrs.get("output_dir", "")))
        page.paragraph(
            f"Latency budget {ratio:g} of fp32's latency: best {accuracy} {top.values[names.index(accuracy)]:.4f} is trial "
            f"{top.number} (predicted {top.values[names.index(cost)]:.1f} ms, "
            f"{top.user_attrs['metrics']['cost/latency_x_fp32']:.2f}x as fast as fp32); export and measure it:"
        )
        page.code(command or "(no checkpoint in its folder)")


def study_page(study: optuna.Study, shown_storage: str) -> Page:
    names = metric_names(study)
    trials = study.get_trials(deepcopy=False)
    page = Page(f"Study {study.study_name}", COMMAND)
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
    if best and len(names) == 2 and any(name in COST_METRICS for name in names):
        cost_section(page, study, best)
    for title, figure in study_figures(study):
        page.heading(title)
        page.figure(figure)
    page.heading(f"Trials ({len(trials)})")
    page.table(*trial_rows(study), table_id="trials")
    return page


if __name__ == "__main__":  # `python -m adls_lightning.reports.study`, the spelling the docs use
    from adls_lightning.tools.study_report import main

    main()
