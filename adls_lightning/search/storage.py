"""Optuna storages of a study: ``search/storage=sqlite|journal|postgresql`` resolved to one *spec* string, opened
with a one-line error (password masked), and the job side of the trial bridge (a job reopens its own trial from
the storage to report intermediate values).

A spec is either an SQLAlchemy URL (``sqlite:///...``, ``postgresql+psycopg://...``: Optuna's ``RDBStorage``) or
the path of a journal file (no ``://``: Optuna's ``JournalStorage`` over a ``JournalFileBackend``).
"""

from __future__ import annotations

import functools
import os
import re
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from adls_lightning.errors import ConfigError

if TYPE_CHECKING:
    import optuna
    from optuna.storages import BaseStorage

# Optuna and SQLAlchemy (0.4 s to import) are imported where a storage is opened: every train.py and search.py
# masks its command line with this module first, and a run that opens no study never needs them.

CREATE_ATTEMPTS = 5
STORAGE_KINDS = ("sqlite", "journal", "postgresql")
# The PostgreSQL URL when search.storage.url is null; also how a job gets the password its config never holds.
URL_ENV = "ADLS_OPTUNA_STORAGE"
MASK = "***"
# user:password@host, where the password may hold a raw "@" (it ends at the last "@" before the host)
_PASSWORD = re.compile(r"(://[^:/@\s]*:)(\S*)(@[^@/\s]*(?:[/\s]|$))")
# a whole URL inside an override value (ends at whitespace, a quote, a comma or a closing brace)
_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s'\",}]+")


def mask_password(text: str) -> str:
    """``text`` with the password of every URL in it (``scheme://user:PASSWORD@host``) replaced by ``***``."""
    return _PASSWORD.sub(lambda m: m.group(1) + MASK + m.group(3), text)


def mask_command_line(argv: list[str]) -> list[str]:
    """The command line with every URL password masked, the full URL handed to jobs in ``ADLS_OPTUNA_STORAGE``.

    Run before Hydra parses the overrides: Hydra writes them into ``.hydra/overrides.yaml``, ``config.yaml``,
    ``hydra.yaml`` and its log, loggers write the config (CSV hparams, W&B), so the password must never enter the
    config. Everything that opens a storage restores it with :func:`unmask_for_job`, as it already does for the
    masked URL the sweeper gives its jobs.

    Raises:
        ConfigError: two different URLs with passwords (one environment variable carries one).
    """
    urls = {
        m.group(0).rstrip("/ \t"): None
        for arg in argv
        for m in _URL.finditer(arg)
        if _PASSWORD.search(m.group(0))
    }
    if not urls:
        return list(argv)
    if len(urls) > 1:
        raise ConfigError(
            f"{', '.join(mask_password(u) for u in urls)}: more than one URL with a password; put the password in "
            "~/.pgpass or PGPASSWORD instead"
        )
    os.environ[URL_ENV] = next(iter(urls))
    return [mask_password(arg) for arg in argv]


def default_storage_url(sweep_dir: str | Path, study_name: str) -> str:
    """``sqlite:///<sweep_dir>/<study_name>.db`` with an absolute path (jobs may run from another directory)."""
    path = Path(sweep_dir).resolve() / f"{study_name}.db"
    path.parent.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{path}"


def is_journal(spec: str) -> bool:
    return "://" not in spec


def storage_spec(storage: str | Mapping[str, Any] | None, sweep_dir: str | Path, study_name: str) -> str:
    """The spec of the sweeper's ``storage`` setting (``hydra.sweeper.storage``, by default ``${search.storage}``).

    Args:
        storage: None (SQLite in the sweep dir), a URL or journal path, or a ``search/storage`` node:
            ``{kind: sqlite|journal|postgresql, url: ..., path: ...}``.
        sweep_dir: ``hydra.sweep.dir`` (default location of the SQLite and journal files).
        study_name: the study (names the default files).

    Raises:
        ConfigError: unknown kind, no PostgreSQL URL, or a journal path whose folder does not exist.
    """
    if storage is None:
        return default_storage_url(sweep_dir, study_name)
    if isinstance(storage, str):
        return storage if is_journal(storage) else checked_url(storage, storage_key(storage))
    kind = storage.get("kind")
    if kind not in STORAGE_KINDS:
        raise ConfigError(
            f"search.storage.kind={kind}: unknown storage; valid: {', '.join(STORAGE_KINDS)} "
            "(search/storage=sqlite|journal|postgresql)"
        )
    if kind == "sqlite":
        if not storage.get("url"):
            return default_storage_url(sweep_dir, study_name)
        return checked_url(str(storage["url"]), storage_key(storage))
    if kind == "journal":
        if not storage.get("path"):
            Path(sweep_dir).mkdir(parents=True, exist_ok=True)
            return str(Path(sweep_dir).resolve() / f"{study_name}.journal")
        path = Path(str(storage["path"])).expanduser().resolve()
        if not path.parent.is_dir():
            raise ConfigError(
                f"search.storage.path={storage['path']}: folder {path.parent} does not exist; create it or "
                "leave the path null (<hydra.sweep.dir>/<study_name>.journal)"
            )
        return str(path)
    url = storage.get("url") or os.environ.get(URL_ENV)
    if not url:
        raise ConfigError(
            f"search.storage.url: not set; give search.storage.url=postgresql+psycopg://USER@HOST:PORT/DB or set "
            f"{URL_ENV} (the password from ~/.pgpass or PGPASSWORD keeps it out of every file)"
        )
    url = unmask_for_job(str(url), "search.storage.url")
    if not str(url).startswith("postgresql"):
        raise ConfigError(
            f"search.storage.url={mask_password(str(url))}: not a PostgreSQL URL; expected "
            "postgresql+psycopg://USER@HOST:PORT/DB"
        )
    return checked_url(str(url), storage_key(storage))


#: The URLs a study's storage may have, as a refusal names them.
VALID_URLS = (
    "sqlite:///<file>.db (search/storage=sqlite), "
    "postgresql+psycopg://USER@HOST:PORT/DB (search/storage=postgresql)"
)


def storage_key(storage: str | Mapping[str, Any] | None) -> str:
    """The setting a user gave the storage by, as errors name it: ``search.storage.url`` / ``.path`` for a
    ``search/storage`` node (:func:`storage_spec`), ``hydra.sweeper.storage`` for a URL or path set there."""
    if not isinstance(storage, Mapping):
        return "hydra.sweeper.storage"
    if storage.get("kind") == "journal":
        return "search.storage.path"
    if storage.get("kind") == "postgresql" and not storage.get("url"):
        return URL_ENV
    return "search.storage.url"


def checked_url(url: str, key: str) -> str:
    """``url``, an SQLAlchemy URL of a study's storage, once its scheme is a database SQLAlchemy knows and, for an
    SQLite file, its folder exists: an explicit URL's folder is not made (a typo would start a new study elsewhere);
    the default file's is (:func:`default_storage_url`).

    Raises:
        ConfigError: naming ``key``, the URL (password masked) and the cause.
    """
    import sqlalchemy.engine
    import sqlalchemy.exc

    shown = mask_password(url)
    try:
        sqlalchemy.engine.make_url(url).get_dialect()
    except (sqlalchemy.exc.ArgumentError, sqlalchemy.exc.NoSuchModuleError):
        scheme = url.split("://", 1)[0]
        raise ConfigError(f"{key}={shown}: unknown URL scheme {scheme!r}; valid: {VALID_URLS}") from None
    path = sqlite_file(url)
    if path is not None and not path.absolute().parent.is_dir():
        raise ConfigError(
            f"{key}={shown}: folder {path.absolute().parent} does not exist; create it, or leave {key} null "
            "(<hydra.sweep.dir>/<study_name>.db)"
        )
    return url


def sqlite_file(spec: str) -> Path | None:
    """The database file of an ``sqlite://`` URL (None for another scheme, or an in-memory database)."""
    if not spec.startswith("sqlite:"):
        return None
    import sqlalchemy.engine

    database = sqlalchemy.engine.make_url(spec).database
    return Path(database).expanduser() if database and database != ":memory:" else None


# The files of a study's storage by kind, and the ``search/storage`` option that opens each.
STUDY_FILE_KINDS = {".db": "sqlite", ".journal": "journal"}


def study_file(spec: str) -> Path | None:
    """The file a spec's study lives in (a journal path, an SQLite database), absolute; None for a server."""
    path = Path(spec).expanduser() if is_journal(spec) else sqlite_file(spec)
    return path.resolve() if path is not None else None


def _file_spec(path: Path) -> str:
    return str(path) if path.suffix == ".journal" else f"sqlite:///{path}"


def holds_study(spec: str, study_name: str) -> bool:
    """Whether the storage of ``spec`` holds a study named ``study_name``; a file that does not exist holds none and
    is not created.

    Raises:
        ConfigError: the storage cannot be opened (:func:`open_storage`).
    """
    path = study_file(spec)
    if path is not None and not path.is_file():
        return False
    try:
        open_storage(spec, create=False).get_study_id_from_name(study_name)
    except KeyError:
        return False
    return True


def check_study_not_elsewhere(
    spec: str, storage: str | Mapping[str, Any] | None, sweep_dir: str | Path, study_name: str
) -> None:
    """Refuse to start ``study_name`` in the storage of ``spec`` while a storage file in the same place holds it: the
    other kind's file in the sweep dir (``search/storage=sqlite`` <-> ``journal``), or the one beside ``spec``'s own
    file with the other suffix. Optuna would create a second, empty study of that name, whose first trial then
    meets the earlier study's ``trial_0`` folder, and readers of the study would find the earlier one.

    Called before the storage is opened: nothing is created when it refuses.

    Raises:
        ConfigError: one line naming both storages and the ``search/storage`` that resumes the study.
    """
    own = study_file(spec)
    sweep_dir = Path(sweep_dir).resolve()
    places = {sweep_dir / f"{study_name}{suffix}" for suffix in STUDY_FILE_KINDS}
    if own is not None:
        places |= {own.with_suffix(suffix) for suffix in STUDY_FILE_KINDS}
    elsewhere = None
    for path in sorted(places - {own}):
        if not path.is_file():
            continue
        try:
            if holds_study(_file_spec(path), study_name):
                elsewhere = path
                break
        except ConfigError:  # not a study storage (or not one this Optuna reads): it holds no study to resume
            continue
    if elsewhere is None or holds_study(spec, study_name):
        return
    kind = STUDY_FILE_KINDS[elsewhere.suffix]
    choose = f"search/storage={kind}"
    if elsewhere.parent != sweep_dir or elsewhere.stem != study_name:  # not the kind's default file
        choose += f" search.storage.{'path' if kind == 'journal' else 'url'}={_file_spec(elsewhere)}"
    chosen = storage.get("kind") if isinstance(storage, Mapping) else None
    chosen = chosen or ("journal" if is_journal(spec) else spec.split(":", 1)[0].split("+", 1)[0])
    raise ConfigError(
        f"search/storage={chosen}: study {study_name} is in {elsewhere}, not in {mask_password(spec)}; choose "
        f"{choose} to resume it, or give this search another hydra.sweeper.study_name (nothing was created)"
    )


def open_storage(
    spec: str, key: str = "hydra.sweeper.storage", *, create: bool = True, **rdb_kwargs: Any
) -> BaseStorage:
    """Open (and create the tables of) the storage of a spec; ``rdb_kwargs`` go to ``RDBStorage`` only.

    ``create=False`` is for readers of an existing study (a report, ``init_from_study``): a SQLite or journal file
    that does not exist is refused instead of being created empty by the open.

    Raises:
        ConfigError: the storage cannot be opened, with the driver's first line of explanation (password masked),
            or (``create=False``) its file does not exist.
    """
    import sqlalchemy.exc
    from optuna.storages import JournalStorage, RDBStorage
    from optuna.storages.journal import JournalFileBackend

    if not create:
        path = Path(spec).expanduser() if is_journal(spec) else sqlite_file(spec)
        if (path is None and spec.startswith("sqlite:")) or (path is not None and not path.is_file()):
            raise ConfigError(
                f"{key}={mask_password(spec)}: no such study file"
                f"{f' ({path})' if path is not None else ''}; give an existing .db or .journal file or a URL"
            )
    if is_journal(spec):
        try:
            return JournalStorage(JournalFileBackend(spec))
        except OSError as err:
            raise ConfigError(f"{key}={spec}: cannot be opened ({_first_line(err)})") from None
    for attempt in range(1, CREATE_ATTEMPTS + 1):
        try:
            return RDBStorage(spec, **rdb_kwargs)
        except (
            sqlalchemy.exc.IntegrityError,
            sqlalchemy.exc.OperationalError,
            sqlalchemy.exc.ProgrammingError,
        ) as err:
            # Processes opening a new storage together race to create the schema ("UNIQUE constraint failed:
            # alembic_version", SQLite's "table ... already exists", PostgreSQL's 'type "studydirection" already
            # exists' and 'relation ... already exists', which SQLAlchemy raises as ProgrammingError): the loser
            # finds the winner's tables on its next try.
            lost_race = isinstance(err, sqlalchemy.exc.IntegrityError) or "already exists" in str(err)
            if not lost_race or attempt == CREATE_ATTEMPTS:
                raise ConfigError(
                    f"{key}={mask_password(spec)}: cannot be opened ({_first_line(err)})"
                ) from None
            time.sleep(0.5 * attempt)
        except Exception as err:  # SQLAlchemy/driver errors have no common base worth naming here
            raise ConfigError(f"{key}={mask_password(spec)}: cannot be opened ({_first_line(err)})") from None
    raise AssertionError("unreachable")


def _first_line(err: BaseException) -> str:
    text = mask_password(str(err).strip())
    return f"{type(err).__name__}: {text.splitlines()[0]}" if text else type(err).__name__


def job_spec(spec: str) -> str:
    """What the sweeper writes into a job's config (``search.trial.storage``): the spec, password masked.

    The job finds the password in ``ADLS_OPTUNA_STORAGE``, which :func:`unmask_for_job` reads; the sweeper sets it
    in its own environment, which launched jobs inherit.
    """
    masked = mask_password(spec)
    if masked != spec:
        os.environ[URL_ENV] = spec
    return masked


def unmask_for_job(spec: str, key: str = "search.trial.storage") -> str:
    """The full spec of a job's masked ``search.trial.storage``.

    Raises:
        ConfigError: the spec is masked and ``ADLS_OPTUNA_STORAGE`` does not hold the same URL.
    """
    if f":{MASK}@" not in spec:
        return spec
    full = os.environ.get(URL_ENV, "")
    if mask_password(full) != spec:
        raise ConfigError(
            f"{key}={spec}: the password is masked and {URL_ENV} does not hold this URL; "
            f"export {URL_ENV} with the full URL where the job runs"
        )
    return full


@functools.cache
def _job_storage(spec: str) -> BaseStorage:
    # One engine per storage and process: the basic launcher runs every trial in the sweeper's process.
    return open_storage(unmask_for_job(spec), key="search.trial.storage")


def open_trial(storage_spec: str, study_name: str, trial_number: int, pruner=None) -> optuna.Trial:
    """Reopen a running trial of a stored study, so a job can ``report`` to it and ask ``should_prune``.

    Args:
        storage_spec: the study's storage (URL, possibly with the password masked, or journal path).
        study_name: the study.
        trial_number: the trial's number within the study.
        pruner: the ``optuna.pruners.BasePruner`` that ``should_prune`` consults (None: never prune).

    Raises:
        ConfigError: the study or trial does not exist, or the trial is already finished.
    """
    import optuna

    storage = _job_storage(storage_spec)
    try:
        study = optuna.load_study(
            study_name=study_name, storage=storage, pruner=pruner or optuna.pruners.NopPruner()
        )
    except KeyError:
        raise ConfigError(
            f"search.trial.study_name={study_name}: no such study in {mask_password(storage_spec)}"
        ) from None
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
