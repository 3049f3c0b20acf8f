"""What makes a study's trials comparable, recorded with the study so that another search never joins it.

A study is found by its name (``hydra.sweeper.study_name``, by default ``<space>-<objective>-<sampler>``), and two
different searches can share that name: another ``search=hparams`` space, the same space on another model or data.
Optuna would load the existing study and mix the two searches' trials, reporting one's trial as the other's best.

The *settings* of a search are everything its trials' results depend on: the trial config (model, data, trainer,
compression, seed... with the keys that only say where or how to report excluded, :data:`NOT_SETTINGS`), the
search space (``hydra.sweeper.search_space``, ``params`` and the command line's sweep overrides), the sampler,
its start-up trials and grid, and the directions. They are stored in the study's user attributes when it is
created; a later command on the same study must have the same settings (:func:`check_study_settings`), so
re-running a command resumes its study and any other command is refused, naming the keys that differ.
The budget and the bookkeeping (``n_trials``, ``n_jobs``, heartbeats, ``max_failure_rate``, the storage) are not
settings: raising ``n_trials`` to extend a study is a resume. Keys a user declares irrelevant
(``hydra.sweeper.settings_ignore``) are left out on both sides of the comparison: the study records the list it was
made with, and a key either that list or the resuming command's names is not compared.

The data are recorded as what the trials read, not as the config names them: ``data.data_dir`` holds the files'
content digest or the hub data set (:func:`~adls_lightning.data.sources.data_identity`). IMDb's default
``data.data_dir=auto`` finds ``$ADLS_IMDB_DIR``, ``../shared/data/imdb`` or the hub, so "auto" alone would let a
search on other data join the study; and a study resumes from another checkout or worker machine holding the same
files elsewhere. Caches (``*.cache_dir``) are where results are kept, not what they are: not settings either.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from adls_lightning.build import current_target, resolve_target
from adls_lightning.errors import ConfigError

SETTINGS_ATTR = "search_settings"
DIGEST_ATTR = "search_settings_digest"
# The settings_ignore the study was made with: its keys are not recorded, so they are never compared on a resume.
IGNORED_ATTR = "search_settings_ignored"
# Keys of the trial config that say where outputs go or how a run reports, not what it computes.
NOT_SETTINGS = (
    "paths",
    "logger",
    "tags",
    "overwrite",
    "keep_freed_memory",
    "runtime",  # the GEMM backend: the same products, timed differently
    "search.trial",  # set per trial by the sweeper
    "search.storage",  # where the study lives, not what it holds
    "trainer.default_root_dir",
    "trainer.enable_progress_bar",
    "trainer.enable_model_summary",
    "callbacks.rich_progress_bar",
    "callbacks.progress",
    "callbacks.throughput",
)
# A key ending so names where a cache lives (the tokenized data, the cost model's timings): moved, it holds the same.
CACHE_DIR = "cache_dir"
# The trial config's key recorded as the data read (:func:`_data_read`), not as the folder is configured.
DATA_SOURCE_KEY = "data.data_dir"
# The sweeper's own keys that shape what is sampled (the rest is budget, storage and bookkeeping).
SWEEPER_SETTINGS = ("search_space", "params", "grid", "sampler", "startup_trials", "direction")


def _excluded(key: str, ignore: Iterable[str]) -> bool:
    return key.rpartition(".")[2] == CACHE_DIR or any(
        key == k or key.startswith(k + ".") for k in (*NOT_SETTINGS, *ignore)
    )


def _leaves(node: Any, prefix: str, ignore: tuple[str, ...] = ()) -> Iterable[tuple[str, Any]]:
    """``(dotted key, value)`` of each leaf; a value that cannot be resolved here (``${hydra:...}`` of a job)
    keeps its interpolation text."""
    if isinstance(node, DictConfig):
        items = [(str(k), prefix + str(k)) for k in node]
        if not items:
            yield prefix.rstrip("."), {}
        for name, key in items:
            if _excluded(key, ignore) or key == "hydra":  # the sweeper's settings are read apart
                continue
            try:
                child = node[name]
            except Exception:  # an interpolation only a running job resolves
                yield key, node._get_node(name)._value()  # type: ignore[union-attr]
                continue
            yield from _leaves(child, key + ".", ignore)
    elif isinstance(node, ListConfig):
        try:
            yield prefix.rstrip("."), OmegaConf.to_container(node, resolve=True)
        except Exception:
            yield prefix.rstrip("."), OmegaConf.to_container(node, resolve=False)
    elif isinstance(node, Mapping):
        if not node:
            yield prefix.rstrip("."), {}
        for name, child in node.items():
            key = prefix + str(name)
            if not _excluded(key, ignore):
                yield from _leaves(child, key + ".", ignore)
    else:
        yield prefix.rstrip("."), node


def _plain(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=str)


def study_settings(
    config: DictConfig, distributions: Mapping[str, Any], ignore: Iterable[str] = ()
) -> dict[str, str]:
    """The settings of the search that ``config`` (composed with its ``hydra`` node) runs, flattened to
    ``{dotted key: JSON value}``; ``distributions``: the parameters of the sweep overrides and
    ``hydra.sweeper.params`` (``key=choice(...)``: Optuna distributions), each by its ``repr``; ``ignore``: more
    keys of the trial config that do not change what a trial computes (``hydra.sweeper.settings_ignore``)."""
    settings = {
        key: _plain(value)
        for key, value in _leaves(config, "", tuple(ignore))
        if key and key != "hydra" and not key.startswith("hydra.")
    }
    sweeper = OmegaConf.select(config, "hydra.sweeper", default=None) or {}
    for name in SWEEPER_SETTINGS:
        if name in sweeper:
            settings.update(
                (key, _plain(value)) for key, value in _leaves(sweeper[name], f"hydra.sweeper.{name}.")
            )
    # the sweep overrides, one key per parameter: their order on the command line does not matter
    settings.update((f"hydra.sweep.{name}", _plain(repr(d))) for name, d in distributions.items())
    if DATA_SOURCE_KEY in settings:
        data = OmegaConf.select(config, "data")
        try:
            node = OmegaConf.to_container(data, resolve=True) if isinstance(data, DictConfig) else None
        except Exception:  # an interpolation only a running job resolves: the value as configured
            node = None
        read = _data_read(node) if node is not None else None
        if read is not None:
            settings[DATA_SOURCE_KEY] = _plain(read)
    return dict(sorted(settings.items()))


def _data_read(data: Mapping[str, Any]) -> str | None:
    """The data a ``data`` node reads (:func:`~adls_lightning.data.sources.data_identity`), or None when it cannot be
    told here (another data module's kind, or a missing folder: the trial refuses that itself)."""
    # imported here: the data package (datasets, pyarrow) is read only when a study is checked
    from adls_lightning.data.sources import data_identity

    try:
        return data_identity(data)
    except (ConfigError, OSError):
        return None


def settings_digest(settings: Mapping[str, str]) -> str:
    """A short hash of the settings (suggests a study name of its own for a search that differs)."""
    return hashlib.sha256(_plain(dict(settings)).encode()).hexdigest()[:8]


def _short(text: str, width: int = 60) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def settings_difference(old: Mapping[str, str], new: Mapping[str, str], shown: int = 3) -> str:
    """The differing keys as ``key: old -> new`` (the first ``shown``, then how many more)."""
    # the search's own keys (space, sampler, sweep overrides) first: what a user changes between two searches
    keys = sorted(
        (k for k in set(old) | set(new) if old.get(k) != new.get(k)),
        key=lambda k: (not k.startswith("hydra."), k),
    )
    parts = [f"{k}: {_short(old.get(k, '(unset)'))} -> {_short(new.get(k, '(unset)'))}" for k in keys[:shown]]
    if len(keys) > shown:
        parts.append(f"and {len(keys) - shown} more")
    return "; ".join(parts)


def current_settings(recorded: Mapping[str, str], settings: Mapping[str, str]) -> dict[str, str]:
    """A study's recorded settings with each ``_target_`` under today's name
    (:func:`~adls_lightning.build.current_target`), so a study made before a rename resumes; without the keys that
    are no longer settings (a cache's folder); its ``data.data_dir`` as the data read when it was recorded as
    configured (:func:`_read_recorded_data`); and a recorded class whose settings choose the subclass it builds
    (``settings_choose_the_class``, the pruning callbacks) read as the subclass ``settings`` name when it is one:
    the other settings carry the difference."""
    current = {
        key: _plain(current_target(json.loads(value))) if key.endswith("._target_") else value
        for key, value in recorded.items()
        if not _excluded(key, ())  # recorded before it was known not to be a setting
    }
    _read_recorded_data(current)
    for key, value in current.items():
        new = settings.get(key)
        if key.endswith("._target_") and new is not None and new != value:
            old_class, new_class = (resolve_target(str(json.loads(v))) for v in (value, new))
            chooses = isinstance(old_class, type) and getattr(old_class, "settings_choose_the_class", False)
            if chooses and isinstance(new_class, type) and issubclass(new_class, old_class):
                current[key] = new
    return current


def _read_recorded_data(recorded: dict[str, str]) -> None:
    """A study recorded before the data read was (its ``data.data_dir`` as configured: ``auto``, a folder or null)
    gets the data that value reads here and now, so that its resume with the same data goes on. Its ``auto`` cannot
    tell which folder its trials read: it stands for what ``auto`` finds now, as it did when it was recorded; a
    folder that no longer exists stays as recorded (and differs)."""
    from adls_lightning.data.sources import is_data_identity

    value = recorded.get(DATA_SOURCE_KEY)
    if value is None or is_data_identity(json.loads(value)):
        return
    node = {
        key.removeprefix("data."): json.loads(text)
        for key, text in recorded.items()
        if key.startswith("data.") and key.count(".") == 1
    }
    read = _data_read(node)
    if read is not None:
        recorded[DATA_SOURCE_KEY] = _plain(read)


def data_recorded_as_configured(stored: Mapping[str, Any]) -> str | None:
    """The ``data.data_dir`` a study recorded as configured (``auto``, a folder, null), made before the data its
    trials read was recorded; None when it records that data (or no settings). Such a study is resumed as reading
    what that value reads now (:func:`_read_recorded_data`), which the sweeper says once and records in its place."""
    from adls_lightning.data.sources import is_data_identity

    value = (stored.get(SETTINGS_ATTR) or {}).get(DATA_SOURCE_KEY)
    if value is None or is_data_identity(json.loads(value)):
        return None
    configured = json.loads(value)
    return "null" if configured is None else str(configured)


def settings_record(settings: Mapping[str, str], ignore: Iterable[str] = ()) -> dict[str, Any]:
    """The user attributes that record a search's ``settings`` in its study, with the ``settings_ignore`` keys
    they leave out (:func:`check_study_settings` does not compare those on a resume)."""
    return {
        SETTINGS_ATTR: dict(settings),
        DIGEST_ATTR: settings_digest(settings),
        IGNORED_ATTR: sorted(set(ignore)),
    }


def _compared(settings: Mapping[str, str], ignore: tuple[str, ...]) -> dict[str, str]:
    """``settings`` without the trial config's keys under ``ignore`` (the search's own ``hydra.*`` keys stay, as
    :func:`study_settings` never ignores them)."""
    return {k: v for k, v in settings.items() if k.startswith("hydra.") or not _excluded(k, ignore)}


def check_study_settings(
    stored: Mapping[str, Any],
    settings: Mapping[str, str],
    study_name: str,
    where: str,
    ignore: Iterable[str] = (),
) -> bool:
    """Whether a study whose user attributes are ``stored`` may run a search with ``settings``.

    ``ignore`` (the resuming command's ``settings_ignore``) and the list the study was made with are left out of
    both the recorded settings and ``settings``: a study made before a key was ignored resumes with any value of
    it, and an ignored key is never reported as differing.

    Returns:
        True when the study already records these settings, False when it records none (a new study, or one made
        before settings were recorded: the caller records them).

    Raises:
        ConfigError: the study records other settings; names the differing keys and a study name of its own.
    """
    recorded = stored.get(SETTINGS_ATTR)
    if recorded is None:
        return False
    ignored = (*stored.get(IGNORED_ATTR, ()), *ignore)
    recorded = _compared(current_settings(recorded, settings), ignored)
    compared = _compared(settings, ignored)
    if recorded == compared:
        return True
    raise ConfigError(
        f"hydra.sweeper.study_name={study_name}: the study in {where} was made by another search "
        f"({settings_difference(recorded, compared)}); it is left unchanged. Repeat that search's command to "
        f"resume it, or give this search a study of its own: hydra.sweeper.study_name={study_name}-"
        f"{settings_digest(settings)}"
    )
