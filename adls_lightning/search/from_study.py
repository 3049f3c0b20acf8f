"""Start a run from the best trial of a stored study: ``init_from_study=STUDY`` (Lab 3 from Lab 2's best).

``STUDY`` is the study's storage (a ``.db`` file or an SQLAlchemy URL holding one study) or a study name, looked up
where ``search.py`` keeps it (``${paths.log_dir}/search/<name>/<name>.db``, with the command's own ``paths.log_dir=``
when it gives one). The best trial's model becomes this run's model: its ``model=`` choice, its ``model/<group>=``
choices (``model/lora=none``: a full fine-tune) and the ``model.*`` overrides it ran with (the sampled architecture),
read from the trial's run record (``<trial dir>/.hydra``), and its weights: ``init_ckpt=`` its best checkpoint. A trial that
saved no checkpoint gives its model config only, and the run says so (the weights are then initialised afresh).

The expansion happens on the command line, before Hydra composes anything, so the run's own record
(``.hydra/overrides.yaml``) lists exactly what was taken from the study.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import optuna
import yaml
from optuna.trial import FrozenTrial, TrialState

from adls_lightning.errors import ConfigError
from adls_lightning.search.storage import open_storage, unmask_for_job

KEY = "init_from_study"
RUN_RECORD = ".hydra"


@dataclass(frozen=True)
class StudyStart:
    """What a run takes from a study's best trial.

    Attributes:
        study_name: the study.
        trial: the best trial's number.
        value: its objective value.
        overrides: the model overrides (``model=...``, ``model/<group>=...``, ``model.*=...``) and
            ``init_ckpt=...`` when it saved one.
        checkpoint: the best checkpoint of the trial, or None when it saved none.
    """

    study_name: str
    trial: int
    value: float
    overrides: list[str]
    checkpoint: Path | None

    def describe(self) -> str:
        weights = (
            f"weights {self.checkpoint}"
            if self.checkpoint
            else "no checkpoint saved: the model config only, weights initialised afresh"
        )
        return (
            f"{KEY}: study {self.study_name}, best trial {self.trial} (value {self.value:.4f}); "
            f"{' '.join(o for o in self.overrides if not o.startswith('init_ckpt='))}; {weights}"
        )


def study_storage(source: str, search_dir: Path, key: str = KEY) -> tuple[str, str | None]:
    """(storage spec, study name or None) of ``source``: a URL, an SQLite file or a journal file (told apart by
    SQLite's file header), or a study name under ``search_dir`` (``NAME/NAME.db`` or ``NAME/NAME.journal``, as search.py keeps them)."""
    if "://" in source:
        # the entry point masked its password; ADLS_OPTUNA_STORAGE holds the full URL
        return unmask_for_job(source, KEY), None
    path = Path(source).expanduser()
    if path.is_file():
        with path.open("rb") as handle:
            sqlite = handle.read(16) == b"SQLite format 3\x00"
        return (f"sqlite:///{path.resolve()}" if sqlite else str(path.resolve())), None
    if "/" not in source:
        if (search_dir / source / f"{source}.db").is_file():
            return f"sqlite:///{(search_dir / source / f'{source}.db').resolve()}", source
        if (search_dir / source / f"{source}.journal").is_file():
            return str((search_dir / source / f"{source}.journal").resolve()), source
    raise ConfigError(
        f"{key}={source}: no such study file, and no study of that name in {search_dir} "
        f"(give a .db or .journal file, an SQLAlchemy URL or a study name as in {search_dir}/NAME/NAME.db)"
    )


def open_study(source: str, url: str, name: str | None, key: str = KEY) -> optuna.Study:
    """The study ``name`` in the storage ``url`` (None: the storage's only study); ``source`` as the user gave it.

    Raises:
        ConfigError: naming ``key=source``: the storage cannot be opened, holds several studies and no name was
            given, or has no study of that name.
    """
    storage = open_storage(url, key=key, create=False)  # a reader: never creates the file it is given
    names = [s.study_name for s in optuna.get_all_study_summaries(storage, include_best_trial=False)]
    if name is None:
        if len(names) != 1:
            raise ConfigError(
                f"{key}={source}: holds {len(names)} studies ({', '.join(names) or 'none'}); "
                "give a storage with one study, or the study's name"
            )
        name = names[0]
    elif name not in names:
        raise ConfigError(f"{key}={source}: has no study {name} (its studies: {', '.join(names) or 'none'})")
    return optuna.load_study(study_name=name, storage=storage)


def best_trial(source: str, url: str, name: str | None) -> tuple[str, FrozenTrial]:
    """The study ``name`` (None: the only one) in the storage ``url`` and its best completed trial.

    Raises:
        ConfigError: the storage cannot be opened, holds several studies, or the study has several objectives
            or no completed trial (messages name ``init_from_study=source``).
    """
    study = open_study(source, url, name)
    name = study.study_name
    if len(study.directions) > 1:
        raise ConfigError(
            f"{KEY}={source}: study {name} has {len(study.directions)} objectives, so no single best trial; "
            f"pick one of its Pareto front ({name}_best.json) and give its init_ckpt and model overrides"
        )
    trials = study.get_trials(deepcopy=False)
    if not any(t.state == TrialState.COMPLETE for t in trials):
        states = {s.name: sum(t.state == s for t in trials) for s in TrialState}
        shown = ", ".join(f"{n} {k}" for k, n in states.items() if n) or "no trials"
        raise ConfigError(f"{KEY}={source}: study {name} has no completed trial ({shown})")
    return name, study.best_trial


def _trial_dir(trial: FrozenTrial, url: str) -> Path:
    """The trial's output folder: as recorded, or ``trial_<n>`` beside the study's .db (a moved sweep folder)."""
    recorded = trial.user_attrs.get("output_dir")
    if recorded and Path(recorded).is_dir():
        return Path(recorded)
    if url.startswith("sqlite:///"):
        beside = Path(url.removeprefix("sqlite:///")).parent / f"trial_{trial.number}"
        if beside.is_dir():
            return beside
    raise ConfigError(
        f"{KEY}: the output folder of trial {trial.number} ({recorded}) no longer exists; its model config and "
        "weights were there"
    )


def _read_yaml(path: Path) -> object:
    if not path.is_file():
        raise ConfigError(f"{KEY}: {path} is missing (the trial's run record); cannot rebuild its model")
    return yaml.safe_load(path.read_text())


def model_overrides(trial_dir: Path) -> list[str]:
    """``model=<choice>``, each ``model/<group>=<choice>`` (LoRA or none, optimizer, scheduler, backbone) and every
    ``model.*`` override the trial ran with (from its run record): the groups as chosen, so that a default of this
    run's own (LoRA) does not replace the trial's (``model/lora=none``)."""
    record = trial_dir / RUN_RECORD
    choices = (_read_yaml(record / "hydra.yaml") or {}).get("hydra", {}).get("runtime", {}).get("choices", {})
    if not choices.get("model"):
        raise ConfigError(f"{KEY}: {record / 'hydra.yaml'} names no model choice")
    overrides = [f"model={choices['model']}"]
    overrides += [
        f"{group}={choice}"
        for group, choice in choices.items()
        if group.startswith("model/") and choice is not None
    ]
    for line in _read_yaml(record / "overrides.yaml") or []:
        key = str(line).split("=", 1)[0].lstrip("+~")
        if key.startswith("model."):
            overrides.append(str(line))
    return overrides


def best_checkpoint(trial_dir: Path) -> Path | None:
    """The trial's best checkpoint (``checkpoints/best*.ckpt``, the newest if several), or None."""
    found = sorted((trial_dir / "checkpoints").glob("best*.ckpt"), key=lambda p: p.stat().st_mtime)
    return found[-1].resolve() if found else None


def start_from_study(source: str, search_dir: Path) -> StudyStart:
    """What ``init_from_study=source`` adds to a run's command line.

    Raises:
        ConfigError: see :func:`best_trial`, or the trial's folder or run record is gone.
    """
    url, name = study_storage(source, search_dir)
    name, trial = best_trial(source, url, name)
    folder = _trial_dir(trial, url)
    overrides = model_overrides(folder)
    checkpoint = best_checkpoint(folder)
    if checkpoint is not None:
        overrides.append(f"init_ckpt={checkpoint}")
    return StudyStart(name, trial.number, trial.value, overrides, checkpoint)


def command_line_key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def default_search_dir(args: Sequence[str]) -> Path:
    """Where ``search.py`` keeps its studies for the command line ``args``: ``${paths.log_dir}/search``, with the
    command's own ``paths.log_dir=`` when it gives one (else ``outputs/`` of the project: conf/paths/default.yaml).
    A relative folder is the run's working directory's, as Hydra leaves it."""
    log_dirs = [a.split("=", 1)[1] for a in args if command_line_key(a) == "paths.log_dir"]
    if log_dirs:
        return Path(log_dirs[-1]).expanduser() / "search"
    return Path(os.environ.get("PROJECT_ROOT", os.getcwd())) / "outputs" / "search"


def expand_command_line(
    args: Sequence[str], search_dir: Path | None = None, name_study: bool = False
) -> list[str]:
    """``args`` (the overrides of a train.py/search.py command line) with ``init_from_study=X`` expanded.

    The study's model overrides come first, so the command line's own ``model.*`` values win (``model.lora=...``
    on top of the study's architecture); ``init_from_study=X`` itself stays, so the run records where it started.
    ``name_study`` (search.py) adds ``search.name_suffix=-from-<study>``: a search from another study's best
    trial is a study of its own, not the resumption of one that started elsewhere.

    Raises:
        ConfigError: bad study (see :func:`start_from_study`), or the command line also sets ``model=`` or
            ``init_ckpt=`` (the study sets both).
    """
    sources = [a.split("=", 1)[1] for a in args if command_line_key(a) == KEY]
    if not sources or sources[-1] in ("", "null"):
        return list(args)
    search_dir = search_dir or default_search_dir(args)
    start = start_from_study(sources[-1], search_dir)
    clash = next((a for a in args if command_line_key(a) in ("model", "init_ckpt")), None)
    if clash is not None:
        raise ConfigError(
            f"{clash}: {KEY}={sources[-1]} sets the model and its weights ({start.overrides[0]}); remove one of them"
        )
    own = {command_line_key(a) for a in args}
    taken = [o for o in start.overrides if command_line_key(o) not in own]
    if name_study and "search.name_suffix" not in own:
        taken.append(f"search.name_suffix=-from-{start.study_name}")
    print(start.describe(), flush=True)
    return taken + list(args)
