"""Optuna RDB storages: the default SQLite file of a sweep, opening a URL with a one-line error, and the job side
of the trial bridge (a job reopens its own trial from the storage to report intermediate values)."""

from __future__ import annotations

import functools
import time
from pathlib import Path

import optuna
import sqlalchemy.exc
from optuna.storages import RDBStorage

from adls_lightning.config import ConfigError

CREATE_ATTEMPTS = 5


def default_storage_url(sweep_dir: str | Path, study_name: str) -> str:
    """``sqlite:///<sweep_dir>/<study_name>.db`` with an absolute path (jobs may run from another directory)."""
    path = Path(sweep_dir).resolve() / f"{study_name}.db"
    path.parent.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{path}"


def open_storage(url: str, key: str = "hydra.sweeper.storage", **rdb_kwargs) -> RDBStorage:
    """Open (and create the tables of) an RDB storage at any SQLAlchemy URL.

    Raises:
        ConfigError: the URL cannot be opened, with the driver's first line of explanation.
    """
    for attempt in range(1, CREATE_ATTEMPTS + 1):
        try:
            return RDBStorage(url, **rdb_kwargs)
        except (sqlalchemy.exc.IntegrityError, sqlalchemy.exc.OperationalError) as err:
            # Processes opening a new storage together race to create the schema ("UNIQUE constraint failed:
            # alembic_version", "table ... already exists"): the loser finds the winner's tables on its next try.
            lost_race = isinstance(err, sqlalchemy.exc.IntegrityError) or "already exists" in str(err)
            if not lost_race or attempt == CREATE_ATTEMPTS:
                raise ConfigError(f"{key}={url}: cannot be opened ({_first_line(err)})") from None
            time.sleep(0.5 * attempt)
        except Exception as err:  # SQLAlchemy/driver errors have no common base worth naming here
            raise ConfigError(f"{key}={url}: cannot be opened ({_first_line(err)})") from None
    raise AssertionError("unreachable")


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0]}" if text else type(err).__name__


@functools.cache
def _job_storage(url: str) -> RDBStorage:
    # One engine per URL and process: the basic launcher runs every trial in the sweeper's process.
    return open_storage(url, key="search.trial.storage")


def open_trial(storage_url: str, study_name: str, trial_number: int, pruner=None) -> optuna.Trial:
    """Reopen a running trial of a stored study, so a job can ``report`` to it and ask ``should_prune``.

    Args:
        storage_url: SQLAlchemy URL of the study's storage.
        study_name: the study.
        trial_number: the trial's number within the study.
        pruner: the ``optuna.pruners.BasePruner`` that ``should_prune`` consults (None: never prune).

    Raises:
        ConfigError: the study or trial does not exist, or the trial is already finished.
    """
    storage = _job_storage(storage_url)
    try:
        study = optuna.load_study(
            study_name=study_name, storage=storage, pruner=pruner or optuna.pruners.NopPruner()
        )
    except KeyError:
        raise ConfigError(f"search.trial.study_name={study_name}: no such study in {storage_url}") from None
    study_id = storage.get_study_id_from_name(study_name)
    try:
        trial_id = storage.get_trial_id_from_study_id_trial_number(study_id, trial_number)
    except KeyError:
        raise ConfigError(
            f"search.trial.number={trial_number}: no such trial in study {study_name}"
        ) from None
    state = storage.get_trial(trial_id).state
    if state.is_finished():
        raise ConfigError(
            f"search.trial.number={trial_number}: trial of study {study_name} is already {state.name}"
        )
    return optuna.Trial(study, trial_id)
