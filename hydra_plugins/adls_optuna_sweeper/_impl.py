"""A Hydra sweeper over an Optuna study kept in an RDB storage (SQLite by default).

What it adds to the stock ``hydra-optuna-sweeper`` (whose override-grammar parsing it reuses):

- **Define-by-run spaces**: ``search_space`` is a callable ``space(trial) -> {override key: value}`` called after
  ``study.ask()``, so a parameter may depend on earlier ones (the stock ``custom_search_space`` hook can only
  suggest parameters whose names are also the override keys).
- **One budget for all workers**: ``n_trials`` is the size of the study, not a per-process count. Before launching
  a trial a worker checks that fewer than ``n_trials`` trials started before it (by start time, then number), so
  any number of processes on one storage run exactly ``n_trials``; re-running the command resumes the study.
  An over-budget ask is handed back as a ``WAITING`` ticket (no parameters, reused by the next ask) instead of
  leaving a stray failed trial in the study.
- **Crash safety**: trials send heartbeats; a trial whose worker died (or was interrupted) is failed and re-queued
  with the same parameters (``RetryHeartbeatStaleTrialCallback``, once), and the retry does not count twice. A
  re-run on the same host finds a dead worker's trial at once (its process is gone); otherwise a worker whose
  budget is used up waits for the other workers' running trials, saying so, and runs their retries.
- **Pruning**: the job gets the study name, storage URL and trial number as config (``search.trial.*``), so a
  Lightning callback can reopen its trial and report per-epoch values; a job that raises ``optuna.TrialPruned``
  is recorded ``PRUNED``, any other exception ``FAIL`` (with the reason), and the sweep goes on until more than
  ``max_failure_rate * n_trials`` trials have failed.
- **Best-k checkpoints** (``keep_checkpoints=K``): after each trial, the ``checkpoints/*.ckpt`` files of finished
  trials not among the K best by the objective are deleted, so a study's disk use stays that of K runs.
- **Reproducible seeds per trial**: the sampler is re-created with a seed derived from (``sampler.seed``, trial
  number), so a resumed study or a second worker never replays the first worker's random draws (grid and QMC
  samplers keep one seed: it defines their shared sequence, indexed by trial number).
"""

from __future__ import annotations

import contextlib
import difflib
import json
import logging
import math
import os
import socket
import threading
import time
import warnings
import zlib
from collections.abc import Iterator, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np
import optuna
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import IntervalSweep, Quote, QuotedString, RangeSweep
from hydra.core.plugins import Plugins
from hydra.errors import CompactHydraException, HydraException
from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction

# The stock sweeper's override-grammar parsing (``choice``/``interval``/``range`` -> Optuna distributions) and its
# grid-choice helper are private to hydra-optuna-sweeper 1.4.0rc3; no public API does this, so they are reused
# here rather than copied (pinned by hydra-optuna-sweeper==1.4.0rc3 in pyproject.toml).
from hydra_plugins.hydra_optuna_sweeper._impl import OptunaSweeperImpl, create_params_from_overrides
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException
from optuna.distributions import BaseDistribution, CategoricalDistribution, FloatDistribution, IntDistribution
from optuna.exceptions import UpdateFinishedTrialError
from optuna.storages import BaseStorage, RDBStorage, RetryHeartbeatStaleTrialCallback
from optuna.trial import FrozenTrial, TrialState

from adls_lightning.app.cli import exit_on_interrupt
from adls_lightning.app.objective import TrialResult, objective_names
from adls_lightning.build import build
from adls_lightning.errors import ConfigError, composition_error_line, did_you_mean, exit_with
from adls_lightning.files.atomic import atomic_write_json
from adls_lightning.progress import trial_line
from adls_lightning.search.identity import (
    DATA_SOURCE_KEY,
    IGNORED_ATTR,
    SETTINGS_ATTR,
    check_study_settings,
    data_recorded_as_configured,
    settings_record,
    study_settings,
)
from adls_lightning.search.storage import (
    check_study_not_elsewhere,
    is_journal,
    job_spec,
    mask_password,
    open_storage,
    storage_key,
    storage_spec,
)

log = logging.getLogger(__name__)
# Heartbeat-based stale-trial handling and metric names are marked experimental in Optuna; this module relies on
# their current behaviour (pinned by tests), so their warnings are noise to users.
warnings.filterwarnings(
    "ignore",
    message=r".*(fail_stale_trials|RetryHeartbeatStaleTrialCallback|set_metric_names|heartbeat_interval|grace_period"
    r"|heartbeat_stale_trial_callback).* is (an )?experimental",
    category=optuna.exceptions.ExperimentalWarning,
)
# ask() warns that heartbeats are meant for Study.optimize; this sweeper sends them itself (``heartbeats``).
warnings.filterwarnings("ignore", message="Heartbeat of storage is supposed to be used with Study.optimize")

GRID_SAMPLER = "optuna.samplers.GridSampler"
# Samplers whose seed fixes a sequence shared by all trials and workers (the grid's shuffled order, the scrambled
# QMC sequence): they keep one seed. All others are re-seeded per trial.
SEQUENCE_SAMPLERS = (GRID_SAMPLER, "optuna.samplers.QMCSampler")
# Trials that use up the budget. WAITING trials are tickets not yet run; FAIL trials re-queued after a crash are
# excluded separately (their retry counts instead).
BUDGET_STATES = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL, TrialState.RUNNING)
# A crashed worker's trial is re-queued once (with its parameters); a second crash leaves it FAIL.
MAX_RETRY = 1
# user attr naming the worker process that runs a trial: a re-run on the same host detects a dead one at once
WORKER_ATTR = "worker"
WAIT_POLL_S = 2.0
# where a trial's checkpoints are (conf/callbacks/*_checkpoint.yaml: ${paths.output_dir}/checkpoints) and their suffix
CHECKPOINTS_DIR = "checkpoints"
CHECKPOINT_SUFFIX = ".ckpt"
# trials whose checkpoints keep_checkpoints may delete: those that ended with a result, or were pruned. A failed
# trial keeps its own (a manual resume with ckpt_path=last, a look at what went wrong); a running one is never seen.
PRUNABLE_STATES = (TrialState.COMPLETE, TrialState.PRUNED)
# user attr saying why a completed trial's value is not its metric as logged (TrialResult.notes)
OBJECTIVE_NOTE_ATTR = "objective_note"
# Why a trial that never returned was failed: a Ctrl-C or a broken launcher (a job that raised has ``fail_reason``)
STOPPED_ATTR = "stopped"
# the tags of a sweep override the stock parser reads (tag(log, interval(...))); it drops any other unread
SWEEP_TAGS = ("log",)


class SearchConfigError(ConfigError, CompactHydraException):
    """Bad sweeper input; Hydra prints it as one line (a ``CompactHydraException``) and exits non-zero."""


class StudyStopped(CompactHydraException):
    """Too many of the study's trials failed; Hydra prints it as one line and exits with code 1."""


def format_override_value(value: Any) -> str:
    """A value in Hydra's override grammar: strings quoted, lists and dicts recursively, None as null."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return QuotedString(value, Quote.single).with_quotes()
    if isinstance(value, Mapping):
        return "{" + ",".join(f"{k}:{format_override_value(v)}" for k, v in value.items()) + "}"
    if isinstance(value, Sequence):
        return "[" + ",".join(format_override_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {value!r} ({type(value).__name__}) as a Hydra override value")


def trial_seed(base_seed: int, trial_number: int, stream: str = "") -> int:
    """A 32-bit seed for one trial, statistically independent across trial numbers (numpy ``SeedSequence``).

    ``stream`` (the sampler's target) gives every sampler its own draws: without it TPE's random start-up trials
    were the very draws of the random sampler, and a sampler comparison compared random with random.
    """
    entropy = [base_seed, trial_number] + ([zlib.crc32(stream.encode())] if stream else [])
    return int(np.random.SeedSequence(entropy).generate_state(1)[0])


def retried_trial_numbers(trials: Sequence[FrozenTrial]) -> set[int]:
    """Numbers of the failed trials that were re-queued (their retry trials carry the history)."""
    return {n for t in trials for n in RetryHeartbeatStaleTrialCallback.retry_history(t)}


def budget_trials(trials: Sequence[FrozenTrial]) -> list[FrozenTrial]:
    """The trials that use up ``n_trials``: started or finished, except failures that were re-queued."""
    retried = retried_trial_numbers(trials)
    return [t for t in trials if t.state in BUDGET_STATES and t.number not in retried]


def job_failures(trials: Sequence[FrozenTrial]) -> list[FrozenTrial]:
    """Trials whose job raised (recorded with a ``fail_reason``); crashed-and-re-queued trials are not among them."""
    return [t for t in trials if t.state == TrialState.FAIL and "fail_reason" in t.user_attrs]


def _dominates(a: Sequence[float], b: Sequence[float]) -> bool:
    return all(x >= y for x, y in zip(a, b)) and any(x > y for x, y in zip(a, b))


def ranked_trials(trials: Sequence[FrozenTrial], directions: Sequence[str]) -> list[FrozenTrial]:
    """The COMPLETE trials, best first: by the objective (one direction), or front by front of non-dominated
    sorting (several; Optuna's ``best_trials`` is the first front); ties by trial number, the earlier first."""
    signs = [1.0 if d == "maximize" else -1.0 for d in directions]
    scored = [
        (t, [s * v for s, v in zip(signs, t.values)])
        for t in trials
        if t.state == TrialState.COMPLETE and t.values is not None
    ]
    ranked: list[FrozenTrial] = []
    while scored:
        front = [(t, v) for t, v in scored if not any(_dominates(w, v) for _, w in scored)]
        ranked += sorted((t for t, _ in front), key=lambda t: t.number)
        numbers = {t.number for t, _ in front}
        scored = [(t, v) for t, v in scored if t.number not in numbers]
    return ranked


def remove_checkpoints(folder: Path) -> tuple[int, int]:
    """Delete the ``*.ckpt`` files directly in ``folder`` (each unlink is atomic: a reader finds a checkpoint
    whole or not at all), then the folder if nothing else is left in it; returns (files, bytes) deleted."""
    files = bytes_ = 0
    if not folder.is_dir():
        return 0, 0
    for path in sorted(folder.iterdir()):
        if path.suffix != CHECKPOINT_SUFFIX or not (path.is_file() or path.is_symlink()):
            continue
        size = path.lstat().st_size
        with contextlib.suppress(FileNotFoundError):  # another worker of the study removed it first
            path.unlink()
            files, bytes_ = files + 1, bytes_ + size
    with contextlib.suppress(OSError):  # not empty (other files are not ours to delete), or gone
        folder.rmdir()
    return files, bytes_


def _start_order(trial: FrozenTrial) -> tuple[datetime, int]:
    # Trials added already finished (no start time) come first.
    return trial.datetime_start or datetime.min, trial.number


def trials_started_before(trials: Sequence[FrozenTrial], number: int) -> int:
    """How many budget trials started before trial ``number``: all workers agree on this order."""
    mine = next(t for t in trials if t.number == number)
    return sum(1 for t in budget_trials(trials) if _start_order(t) < _start_order(mine))


class GridTrialView:
    """The trial as a space sees it under the grid sampler: parameters outside the grid keep their first choice.

    A define-by-run space suggests more parameters (one per layer) than anyone wants to grid over, and Optuna's
    ``GridSampler`` refuses a parameter missing from its grid. The fixed values are recorded as user attrs.
    """

    def __init__(self, trial: optuna.Trial, grid: Mapping[str, Sequence[Any]]) -> None:
        self._trial, self._grid = trial, grid
        self.asked: list[str] = []  # every parameter the space asked for, in the grid or not

    def suggest_categorical(self, name: str, choices: Sequence[Any]) -> Any:
        self.asked.append(name)
        if name in self._grid:
            return self._trial.suggest_categorical(name, choices)
        self._trial.set_user_attr(f"fixed/{name}", choices[0])
        return choices[0]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._trial, name)


def suggest(trial: optuna.Trial, name: str, distribution: BaseDistribution) -> Any:
    """Sample a prepared distribution through the trial's public ``suggest_*`` API (the stock sweeper calls the
    private ``Trial._suggest``)."""
    if isinstance(distribution, CategoricalDistribution):
        return trial.suggest_categorical(name, distribution.choices)
    if isinstance(distribution, IntDistribution):
        return trial.suggest_int(
            name, distribution.low, distribution.high, step=distribution.step, log=distribution.log
        )
    if isinstance(distribution, FloatDistribution):
        return trial.suggest_float(
            name, distribution.low, distribution.high, step=distribution.step, log=distribution.log
        )
    raise TypeError(f"{name}: no suggest_* for {type(distribution).__name__}")


# Storage calls (heartbeats, state changes) take Optuna's trial id, which ``Trial``/``FrozenTrial`` expose only as
# ``_trial_id``; there is no public accessor, so this module reads it.
def heartbeat_interval(storage: BaseStorage) -> int | None:
    """The storage's heartbeat interval; None when it has none (journal storages, or heartbeats off)."""
    return storage.get_heartbeat_interval() if isinstance(storage, RDBStorage) else None


def this_worker() -> dict[str, Any]:
    return {"host": socket.gethostname(), "pid": os.getpid()}


def worker_is_dead(worker: Mapping[str, Any] | None) -> bool:
    """True when ``worker`` (a trial's ``worker`` attr) ran on this host and its process no longer exists."""
    if not worker or worker.get("host") != socket.gethostname() or worker.get("pid") == os.getpid():
        return False
    try:
        os.kill(int(worker["pid"]), 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, another user's
        return False
    return False


@contextlib.contextmanager
def heartbeats(storage: BaseStorage, trial_ids: Sequence[int]) -> Iterator[None]:
    """Record the trials' heartbeats every ``heartbeat_interval`` s while the block runs.

    Optuna's own heartbeat thread (``optuna.storages._heartbeat.get_heartbeat_thread``) is private and started only
    by ``Study.optimize`` for one trial; an ask/tell sweeper has no public way to run it, so this small thread calls
    the public ``RDBStorage.record_heartbeat``. Stale detection and retry are Optuna's public pieces:
    ``fail_stale_trials`` and ``RetryHeartbeatStaleTrialCallback``.
    """
    interval = heartbeat_interval(storage)
    if not interval:
        yield
        return
    stop = threading.Event()

    def beat() -> None:
        while True:
            for trial_id in trial_ids:
                storage.record_heartbeat(trial_id)
            if stop.wait(interval):
                return

    thread = threading.Thread(target=beat, name="optuna-heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def _one_line(err: BaseException) -> str:
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0] if text else ''}".rstrip(": ")


def sweep_distributions(params: list[str]) -> tuple[dict[str, BaseDistribution], dict[str, Any], list[str]]:
    """The stock ``create_params_from_overrides(params)``, each sweep override checked first: the stock parser
    drops a tag it does not know (the linear scale without a word) and turns bad bounds into a traceback.

    Raises:
        SearchConfigError: an unknown tag, ``log`` outside an ``interval``, an interval whose low is above its
            high, a log scale from 0 or below, or a ``range`` that holds no value; the line names the key.
    """
    for override in OverridesParser.create().parse_overrides(params):
        if override.is_sweep_override():
            check_sweep_override(override.get_key_element(), override.value())
    return create_params_from_overrides(params)


def check_sweep_override(key: str, sweep: Any) -> None:
    """Refuse (one line naming ``key``) a sweep the stock parser would misread or fail on; see
    :func:`sweep_distributions`."""
    tags = sorted(sweep.tags)
    if unknown := [tag for tag in tags if tag not in SWEEP_TAGS]:
        raise SearchConfigError(f"{key}: unknown tag {unknown[0]!r} (valid: {', '.join(SWEEP_TAGS)})")
    if isinstance(sweep, IntervalSweep):
        shown = f"interval({sweep.start}, {sweep.end})"
        if sweep.start > sweep.end:
            raise SearchConfigError(
                f"{key}: {shown}: low is above high; valid: interval(low, high) with low <= high"
            )
        if "log" in tags and sweep.start <= 0:
            raise SearchConfigError(
                f"{key}: tag(log, {shown}): a log scale needs low > 0; valid: a positive low, or the interval "
                "without the tag (a linear scale)"
            )
    elif tags:
        # choice and range would ignore the tag: the linear scale of a range, without a word
        raise SearchConfigError(
            f"{key}: tag({', '.join(tags)}, ...) applies to interval(low, high) only, not to "
            f"{type(sweep).__name__.removesuffix('Sweep').lower()}(...)"
        )
    if isinstance(sweep, RangeSweep) and (sweep.step == 0 or (sweep.stop - sweep.start) * sweep.step <= 0):
        raise SearchConfigError(
            f"{key}: range({sweep.start}, {sweep.stop}, {sweep.step}) holds no value; valid: range(start, stop"
            "[, step]) with stop above start for a positive step, below it for a negative one (stop excluded)"
        )


def unknown_config_key(config: DictConfig, key: str) -> str | None:
    """Why the dotted ``key`` is not a key of ``config``, with the close keys at the level where it leaves the
    config (``did you mean ...?``); None when it is one."""
    node, parts = config, key.split(".")
    for depth, part in enumerate(parts):
        keys = [str(k) for k in node] if isinstance(node, DictConfig) else []
        if part not in keys:
            level = ".".join(parts[:depth] + [""]) if depth else ""
            rest = "".join(f".{p}" for p in parts[depth + 1 :])
            close = did_you_mean([f"{level}{match}{rest}" for match in difflib.get_close_matches(part, keys)])
            return f"{key} is not a key of the config{close or ' (the command with --cfg job lists them)'}"
        try:
            node = node[part]
        except OmegaConfBaseException:
            return None  # an interpolation only a running job resolves: its keys cannot be checked here
    return None


class StudySweeper(Sweeper):
    """Runs an Optuna study whose trials are Hydra jobs; see the module docstring.

    Args:
        sampler: sampler config (``hydra/sweeper/sampler=tpe|random|grid|cmaes|gp|nsgaii|qmc``); its ``seed``
            is the base of every trial's seed.
        direction: ``maximize``/``minimize``, or a list of them for a multi-objective study.
        storage: a ``search/storage`` node ``{kind: sqlite|journal|postgresql, url, path}``, an SQLAlchemy URL or
            a journal file path; None = ``sqlite:///<hydra.sweep.dir>/<study_name>.db``.
        study_name: the study (created, or loaded to resume).
        n_trials: size of the study: trials already in the storage count, whichever worker ran them.
        n_jobs: trials asked and launched together (the launcher may run them in parallel).
        max_failure_rate: abort once more than ``max_failure_rate * n_trials`` trials of the study failed.
        params: stock override-grammar space (``key: choice(...)``, ``interval(...)``, ``range(...)``).
        search_space: a define-by-run space config (``_target_`` callable ``space(trial) -> overrides``).
        grid: the explicit grid for the grid sampler: ``{parameter: [values]}``.
        heartbeat_interval: seconds between a running trial's heartbeats (None disables crash detection).
        grace_period: seconds without a heartbeat after which a running trial counts as crashed.
        startup_trials: the ``n_startup_trials`` (random start) of samplers that have one (TPE, GP, CMA-ES), and
            the ``population_size`` (a random first generation) of NSGA-II/III; None keeps the sampler's own. Lab
            budgets of ~8 trials need ~3, or TPE (10) and NSGA-II (50) never leave their random start.
        settings_ignore: keys of the trial config, besides where outputs go and how runs report, that do not change
            what a trial computes; every other key is part of the study's recorded settings, and a command whose
            settings differ from its study's is refused (:mod:`adls_lightning.search.identity`).
        keep_checkpoints: keep the checkpoints of the K best trials only (:func:`ranked_trials`): after each
            trial, the ``checkpoints/*.ckpt`` of the others that completed or were pruned are deleted (logged).
            None keeps every trial's.
    """

    def __init__(
        self,
        sampler: DictConfig,
        direction: Any = "maximize",
        storage: str | DictConfig | None = None,
        study_name: str | None = None,
        n_trials: int = 20,
        n_jobs: int = 1,
        max_failure_rate: float = 0.0,
        params: DictConfig | None = None,
        search_space: DictConfig | None = None,
        grid: DictConfig | None = None,
        heartbeat_interval: int | None = 60,
        grace_period: int | None = 180,
        startup_trials: int | None = None,
        settings_ignore: Sequence[str] | None = None,
        keep_checkpoints: int | None = None,
    ) -> None:
        self.sampler_cfg = sampler
        self.startup_trials = startup_trials
        self.directions = [direction] if isinstance(direction, str) else list(direction)
        self.storage_cfg = storage
        self.study_name = study_name
        self.n_trials = n_trials
        self.n_jobs = n_jobs
        self.max_failure_rate = max_failure_rate
        self.params = params
        self.search_space_cfg = search_space
        self.grid_cfg = grid
        self.heartbeat_interval = heartbeat_interval
        self.grace_period = grace_period
        self.settings_ignore = settings_ignore
        self.keep_checkpoints = keep_checkpoints
        # the Ctrl-Cs :meth:`sweep` received (a trial stopped by one is recorded as interrupted, not as broken)
        self.sigints_received: list[int] = []
        # search.objective's names (:meth:`_check_objectives`), given to the study as it is opened
        self.objective_names: tuple[str, ...] | None = None
        self._validate()

    def _validate(self) -> None:
        for d in self.directions:
            if d not in ("maximize", "minimize"):
                raise SearchConfigError(
                    f"hydra.sweeper.direction={d}: must be maximize or minimize (or a list)"
                )
        if not isinstance(self.n_trials, int) or self.n_trials < 1:
            raise SearchConfigError(f"hydra.sweeper.n_trials={self.n_trials}: must be a positive integer")
        if not isinstance(self.n_jobs, int) or self.n_jobs < 1:
            raise SearchConfigError(f"hydra.sweeper.n_jobs={self.n_jobs}: must be a positive integer")
        if not 0.0 <= self.max_failure_rate <= 1.0:
            raise SearchConfigError(
                f"hydra.sweeper.max_failure_rate={self.max_failure_rate}: must be in [0, 1]"
            )
        if self.startup_trials is not None and (
            isinstance(self.startup_trials, bool)
            or not isinstance(self.startup_trials, int)
            or self.startup_trials < 1
        ):
            raise SearchConfigError(
                f"hydra.sweeper.startup_trials={self.startup_trials}: must be a positive integer or null"
            )
        if self.settings_ignore is not None and (
            not isinstance(self.settings_ignore, Sequence)
            or isinstance(self.settings_ignore, str)
            or not all(isinstance(k, str) and k for k in self.settings_ignore)
        ):
            raise SearchConfigError(
                f"hydra.sweeper.settings_ignore={self.settings_ignore}: must be a list of config keys "
                "(e.g. [my_app.verbose]) or null"
            )
        if self.keep_checkpoints is not None and (
            isinstance(self.keep_checkpoints, bool)
            or not isinstance(self.keep_checkpoints, int)
            or self.keep_checkpoints < 0
        ):
            raise SearchConfigError(
                f"hydra.sweeper.keep_checkpoints={self.keep_checkpoints}: must be a whole number of trials (0 or "
                "more) whose checkpoints to keep, or null to keep all"
            )
        if not self.study_name:
            raise SearchConfigError(
                "hydra.sweeper.study_name: must be set (it names the study and its .db file)"
            )

    def _check_settings_ignore(self) -> None:
        """Each ``settings_ignore`` key is a key of the composed config: a misspelt one would ignore nothing."""
        for key in self.settings_ignore or ():
            if problem := unknown_config_key(self.config, key):
                raise SearchConfigError(
                    f"hydra.sweeper.settings_ignore=[{','.join(self.settings_ignore)}]: {problem}"
                )

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.config = config
        self.hydra_context = hydra_context
        self.launcher = Plugins.instance().instantiate_launcher(
            config=config, hydra_context=hydra_context, task_function=task_function
        )
        self.sweep_dir = Path(str(config.hydra.sweep.dir))

    # -- configuration ------------------------------------------------------------------------------------------

    @property
    def is_grid(self) -> bool:
        return self.sampler_cfg.get("_target_") == GRID_SAMPLER

    def _make_sampler(self, seed: int | None) -> optuna.samplers.BaseSampler:
        if self.is_grid:
            return optuna.samplers.GridSampler(self.grid, seed=seed)
        cfg = OmegaConf.to_container(self.sampler_cfg, resolve=True)
        if "seed" in cfg or seed is not None:
            cfg["seed"] = seed
        if self.startup_trials is not None and "n_startup_trials" in cfg:
            # TPE/GP start with n_startup_trials random draws (10 by default): a lab budget of 8 would be all random.
            cfg["n_startup_trials"] = self.startup_trials
        if self.startup_trials is not None and "population_size" in cfg:
            # NSGA-II/III's first generation (population_size, 50 by default) is random draws too; 2 parents at least
            cfg["population_size"] = max(self.startup_trials, 2)
        return self._build(cfg, "hydra.sweeper.sampler")

    @staticmethod
    def _build(node: Any, key: str) -> Any:
        try:
            return build(node, key)
        except ConfigError as err:
            raise SearchConfigError(str(err)) from None

    def _build_grid(self, distributions: Mapping[str, BaseDistribution]) -> dict[str, list[Any]]:
        grid = {name: OptunaSweeperImpl._to_grid_sampler_choices(d) for name, d in distributions.items()}
        explicit = OmegaConf.to_container(self.grid_cfg, resolve=True) if self.grid_cfg is not None else {}
        for name, values in explicit.items():
            if not isinstance(values, list) or not values:
                raise SearchConfigError(
                    f"hydra.sweeper.grid.{name}={values}: must be a non-empty list of values"
                )
            grid[name] = values
        if not grid:
            raise SearchConfigError(
                "hydra/sweeper/sampler=grid needs an explicit grid: set hydra.sweeper.grid, e.g. "
                "'hydra.sweeper.grid={hidden_size:[128,256],num_hidden_layers:[2,4]}'"
            )
        return grid

    def _check_objectives(self) -> None:
        """Check ``search.objective`` against the directions and keep its objectives' names (None: a plain task
        function's values, named by the first trial that returns them)."""
        self.objective_names = None
        objective = OmegaConf.select(self.config, "search.objective")
        if objective is None:
            return
        try:
            names = objective_names(list(objective.metrics), objective.get("weights"))
        except ConfigError as err:
            raise SearchConfigError(str(err)) from None
        self.objective_names = names
        if len(names) != len(self.directions):
            raise SearchConfigError(
                f"hydra.sweeper.direction={self.directions}: one direction per objective {list(names)} "
                "(search.objective.metrics, or one for a weighted sum)"
            )

    def _open_study(self) -> optuna.Study:
        cfg = self.storage_cfg
        cfg = OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else cfg
        try:
            url = storage_spec(cfg, self.sweep_dir, self.study_name)
            # before the storage is opened (which creates its file): another kind's file may hold the study
            check_study_not_elsewhere(url, cfg, self.sweep_dir, self.study_name)
            rdb = {}
            if not is_journal(url):  # journal storages have no heartbeats: dead workers are found by pid
                rdb = {
                    "heartbeat_interval": self.heartbeat_interval,
                    "grace_period": self.grace_period,
                    "heartbeat_stale_trial_callback": RetryHeartbeatStaleTrialCallback(max_retry=MAX_RETRY),
                }
            self.storage = open_storage(url, storage_key(cfg), **rdb)
        except ConfigError as err:
            raise SearchConfigError(str(err)) from None
        self.storage_url = url
        self.shown_url = mask_password(url)
        try:
            stored = self.storage.get_study_user_attrs(self.storage.get_study_id_from_name(self.study_name))
        except KeyError:  # no such study yet
            stored = {}
        try:
            recorded = check_study_settings(
                stored, self.settings, self.study_name, self.shown_url, self.settings_ignore or ()
            )
        except ConfigError as err:
            # exit code 2 like every refusal of the entry points; nothing of the study has been touched
            exit_with(str(err))
        try:
            study = optuna.create_study(
                study_name=self.study_name,
                storage=self.storage,
                sampler=self._make_sampler(self.base_seed),
                directions=self.directions,
                load_if_exists=True,
            )
        except ValueError as err:  # e.g. an existing study with other directions
            raise SearchConfigError(f"hydra.sweeper.study_name={self.study_name}: {err}") from None
        if [d.name.lower() for d in study.directions] != self.directions:
            raise SearchConfigError(
                f"hydra.sweeper.direction={self.directions}: study {self.study_name} in {self.shown_url} was created with "
                f"{[d.name.lower() for d in study.directions]}; use another study_name or storage"
            )
        if study.metric_names is None and self.objective_names is not None:
            # named from the start: a study whose every trial is pruned or fails is still labelled by its metrics
            study.set_metric_names(list(self.objective_names))
        configured = data_recorded_as_configured(stored) if recorded else None
        if configured is not None:
            # what it read cannot be known: said once, and the data read now recorded, so later searches compare
            log.warning(
                "Study %s recorded %s=%s as configured, not the data its trials read (it was made before that "
                "was recorded): resuming it as reading %s, what that finds here now, and recording that",
                self.study_name,
                DATA_SOURCE_KEY,
                configured,
                json.loads(self.settings[DATA_SOURCE_KEY]),
            )
            self._record_settings(study, stored)
        if not recorded:
            if study.trials:
                log.warning(
                    "Study %s holds %d trials but no record of its search's settings (made before they were "
                    "recorded): recording this command's; a later command with other settings will be refused",
                    self.study_name,
                    len(study.trials),
                )
            self._record_settings(study, stored)
        return study

    def _record_settings(self, study: optuna.Study, stored: Mapping[str, Any]) -> None:
        """Record this search's settings in ``study``; a study made before keeps the ``settings_ignore`` it was
        made with, as its recorded settings still lack those keys."""
        made_with = stored.get(IGNORED_ATTR, ()) if stored.get(SETTINGS_ATTR) is not None else ()
        ignored = (*made_with, *(self.settings_ignore or ()))
        for name, value in settings_record(self.settings, ignored).items():
            study.set_user_attr(name, value)

    # -- the sweep ----------------------------------------------------------------------------------------------

    def sweep(self, arguments: list[str]) -> list[FrozenTrial]:
        # (trial number, re-queued) of the batch a Ctrl-C stopped
        self.interrupted: list[tuple[int, bool]] = []
        with exit_on_interrupt(self._interrupted_line) as self.sigints_received:
            try:
                study, budget = self._prepare(arguments)
            except ConfigError as err:
                # a refusal before any trial ran or the study was touched: exit code 2 like the entry points' own
                exit_with(str(err))
            return self._run(study, budget)

    def _interrupted_line(self) -> str:
        """What a Ctrl-C of the sweep leaves, and how to go on (the last line of a search stopped by Ctrl-C)."""
        study = f"study {self.study_name}" if self.study_name else "the search"
        requeued = [str(number) for number, again in self.interrupted if again]
        failed = [str(number) for number, again in self.interrupted if not again]
        done = "".join(
            [
                f", trial {', '.join(requeued)} re-queued with its parameters" if requeued else "",
                f", trial {', '.join(failed)} recorded failed (a retry is re-queued once)" if failed else "",
            ]
        )
        return f"interrupted: {study}{done}; re-run the same command to resume"

    def _prepare(self, arguments: list[str]) -> tuple[optuna.Study, int]:
        """Everything before the first trial: the space, its dry run, the study opened (or refused); returns the
        study and its budget (``n_trials``, or the grid's size when smaller).

        Raises:
            ConfigError: bad input, before any trial ran or the study was written to.
        """
        self._check_settings_ignore()
        params = [f"{k!s}={v}" for k, v in (self.params or {}).items()] + list(arguments)
        self.sweep_texts = {param.split("=", 1)[0]: param for param in params}  # as the user wrote them
        distributions, fixed_params, fixed_overrides = sweep_distributions(params)
        for name in fixed_params:
            distributions.pop(name, None)
        self.fixed_overrides = [f"{k}={v}" for k, v in fixed_params.items()] + list(fixed_overrides)
        self.distributions = distributions
        self.space = (
            self._build(self.search_space_cfg, "hydra.sweeper.search_space")
            if self.search_space_cfg
            else None
        )
        if not distributions and self.space is None:
            raise SearchConfigError(
                "hydra.sweeper: no search space (set hydra.sweeper.search_space or params)"
            )
        self.base_seed = self.sampler_cfg.get("seed")
        budget = self.n_trials
        if self.is_grid:
            self.grid = self._build_grid(distributions)
            budget = min(budget, math.prod(len(v) for v in self.grid.values()))
        self._check_objectives()
        self._dry_run()
        # what makes this search's trials comparable: a study made by another search is refused, not joined
        self.settings = study_settings(self.config, self.distributions, self.settings_ignore or ())

        study = self._open_study()
        log.info(
            "Study %s in %s: %d of %d trials already counted",
            self.study_name,
            self.shown_url,
            len(budget_trials(study.get_trials(deepcopy=False))),
            budget,
        )
        return study, budget

    def _run(self, study: optuna.Study, budget: int) -> list[FrozenTrial]:
        """Ask, launch and record trials until the study holds ``budget`` of them; the best trial(s)."""
        allowed_failures = math.floor(self.max_failure_rate * budget)
        while True:
            self._retry_dead_workers(study)
            if len(budget_trials(study.get_trials(deepcopy=False))) >= budget and not self._wait_for_others(
                study, budget
            ):
                break
            trials = self._ask(study, budget)
            if not trials:
                break
            jobs = []
            for trial in trials:
                try:
                    jobs.append((trial, self._trial_overrides(trial)))
                except optuna.TrialPruned as reason:
                    trial.set_user_attr("pruned_reason", str(reason))
                    self._tell(study, trial, state=TrialState.PRUNED)
                    log.info("Trial %d not run: %s", trial.number, reason)
                except BaseException as err:  # nothing of this batch is launched: fail it, with the reason
                    for unlaunched in trials:
                        if not self.storage.get_trial(unlaunched._trial_id).state.is_finished():
                            unlaunched.set_user_attr("fail_reason", _one_line(err))
                            self._tell(study, unlaunched, state=TrialState.FAIL)
                    raise
            if not jobs:
                continue
            for trial, job_failure in self._launch(study, jobs):
                self._keep_best_checkpoints(study)
                if job_failure is None:
                    continue
                failures = job_failures(study.get_trials(deepcopy=False))
                if len(failures) > allowed_failures:
                    # each failure was logged with its reason (and is recorded in the study): one line, no traceback
                    raise StudyStopped(
                        f"error: study {self.study_name} stopped: {len(failures)} trial(s) failed, more than "
                        f"hydra.sweeper.max_failure_rate={self.max_failure_rate} x {budget} trials allows; the last, "
                        f"trial {trial.number}: {_one_line(job_failure)}; fix the cause (or raise "
                        "hydra.sweeper.max_failure_rate) and re-run the same command to go on"
                    ) from None
        self._keep_best_checkpoints(study)
        return self._report(study)

    def _keep_best_checkpoints(self, study: optuna.Study) -> None:
        """``keep_checkpoints=K``: delete the checkpoints of the finished trials not among the K best."""
        if self.keep_checkpoints is None:
            return
        trials = study.get_trials(deepcopy=False)
        keep = {t.number for t in ranked_trials(trials, self.directions)[: self.keep_checkpoints]}
        for trial in trials:
            output_dir = trial.user_attrs.get("output_dir")
            if trial.state not in PRUNABLE_STATES or trial.number in keep or not output_dir:
                continue
            # a folder of another host's worker is not here: that worker prunes it
            files, size = remove_checkpoints(Path(output_dir) / CHECKPOINTS_DIR)
            if files:
                outcome = trial.state.name.lower() if trial.values is None else f"values {trial.values}"
                log.info(
                    "keep_checkpoints=%d: deleted %d checkpoint file(s), %.1f MB, of trial %d (%s) in %s",
                    self.keep_checkpoints,
                    files,
                    size / 1e6,
                    trial.number,
                    outcome,
                    Path(output_dir) / CHECKPOINTS_DIR,
                )

    def _retry_dead_workers(self, study: optuna.Study) -> None:
        """Fail and re-queue (once) the running trials whose worker died: stale heartbeats (Optuna's
        ``fail_stale_trials``), or a dead process on this host, found at once instead of after ``grace_period``."""
        if heartbeat_interval(self.storage):
            optuna.storages.fail_stale_trials(study)
        for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            if not worker_is_dead(trial.user_attrs.get(WORKER_ATTR)):
                continue
            try:  # the state update is atomic: of two workers re-running together, one re-queues the trial
                self.storage.set_trial_state_values(trial._trial_id, TrialState.FAIL)
            except UpdateFinishedTrialError:
                continue
            log.warning(
                "Trial %d: its worker (pid %s) is gone; failed and re-queued with its parameters",
                trial.number,
                trial.user_attrs[WORKER_ATTR]["pid"],
            )
            RetryHeartbeatStaleTrialCallback(max_retry=MAX_RETRY)(
                study, self.storage.get_trial(trial._trial_id)
            )

    def _wait_for_others(self, study: optuna.Study, budget: int) -> bool:
        """The budget is used up, but other workers' trials may still be running: wait until they finish.

        Returns:
            True when one of them died and was re-queued (this worker runs the retry), False when all finished.
        """
        announced = False
        while True:
            running = study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
            if not running:
                return False
            if not announced:
                shown = ", ".join(
                    f"{t.number} (worker {t.user_attrs.get(WORKER_ATTR, {}).get('host', '?')}:"
                    f"{t.user_attrs.get(WORKER_ATTR, {}).get('pid', '?')})"
                    for t in running
                )
                stale = (
                    f"a dead worker's trial is re-queued after {self.grace_period} s without a heartbeat"
                    if heartbeat_interval(self.storage)
                    else "this storage has no heartbeats: a worker that died on another host is not detected; "
                    "if it is dead, stop this one (Ctrl-C) and run the same command on that host"
                )
                log.warning(
                    "Study %s: %d of %d trials counted; waiting for running trial(s) %s of other workers to "
                    "finish (%s). Ctrl-C stops waiting; the same command finishes the study later.",
                    self.study_name,
                    len(budget_trials(study.get_trials(deepcopy=False))),
                    budget,
                    shown,
                    stale,
                )
                announced = True
            time.sleep(WAIT_POLL_S)
            self._retry_dead_workers(study)
            if len(budget_trials(study.get_trials(deepcopy=False))) < budget:
                return True

    def _ask(self, study: optuna.Study, budget: int) -> list[optuna.Trial]:
        trials = []
        for _ in range(self.n_jobs):
            trial = study.ask()
            trial.set_user_attr(WORKER_ATTR, this_worker())
            if heartbeat_interval(self.storage):
                # A first heartbeat at once: a worker killed before launching still leaves a trial that goes stale.
                self.storage.record_heartbeat(trial._trial_id)
            if trials_started_before(study.get_trials(deepcopy=False), trial.number) >= budget:
                # Another worker took the last slot between our count and our ask: hand the ticket back.
                self.storage.set_trial_state_values(trial._trial_id, TrialState.WAITING)
                break
            trials.append(trial)
        return trials

    def _space_overrides(self, trial: optuna.Trial, view: GridTrialView | None = None) -> dict[str, Any]:
        """Sample the trial's parameters; the overrides (key -> value) of its job."""
        for name, distribution in self.distributions.items():
            suggest(trial, name, distribution)
        overrides = {name: trial.params[name] for name in self.distributions}
        if self.space is not None:
            if view is None and self.is_grid:
                view = GridTrialView(trial, self.grid)
            overrides.update(self.space(view or trial))
        return overrides

    def _dry_run(self) -> None:
        """Sample one trial in memory and compose its job config: bad spaces, grids or keys fail before any run."""
        sampler = (
            optuna.samplers.GridSampler(self.grid, seed=0)
            if self.is_grid
            else optuna.samplers.RandomSampler(0)
        )
        verbosity = optuna.logging.get_verbosity()
        optuna.logging.set_verbosity(optuna.logging.WARNING)  # no "new study created in memory" line
        try:
            trial = optuna.create_study(sampler=sampler, directions=self.directions).ask()
        finally:
            optuna.logging.set_verbosity(verbosity)
        view = GridTrialView(trial, self.grid) if self.is_grid else None
        try:
            overrides = self._space_overrides(trial, view)
        except optuna.TrialPruned:
            return
        except ConfigError as err:
            raise SearchConfigError(str(err)) from None
        except ValueError as err:  # the grid sampler proposing a value outside the space's choices
            if not self.is_grid:
                raise
            raise SearchConfigError(f"hydra.sweeper.grid: {err}") from None
        if self.is_grid:
            names = set(self.distributions) | set(view.asked)
            if unknown := sorted(set(self.grid) - names):
                raise SearchConfigError(
                    f"hydra.sweeper.grid.{unknown[0]}: not a parameter of this search space (its parameters: "
                    f"{', '.join(sorted(names))})"
                )
        fixed_keys = {o.split("=", 1)[0].lstrip("+~") for o in self.fixed_overrides}
        if clash := sorted(fixed_keys & {k.lstrip("+~") for k in overrides}):
            raise SearchConfigError(
                f"{clash[0]}: set on the command line and by the search space; remove one"
            )
        try:
            self.validate_batch_is_legal([self._job_overrides(overrides, {})])
        except (HydraException, OmegaConfBaseException) as err:
            raise SearchConfigError(self._composition_error_line(err, overrides)) from None

    def _composition_error_line(self, err: Exception, sampled: Mapping[str, Any]) -> str:
        """Hydra's error composing the dry run's job as one line (:func:`composition_error_line`), naming a sweep
        override as the user wrote it (``key=interval(...)``) rather than by the value the dry run sampled."""
        line = composition_error_line(err)
        for key, value in sampled.items():
            written = self.sweep_texts.get(key)
            if written is None:
                continue
            if line.startswith(f"{key}: "):
                line = f"{written}: {line.removeprefix(f'{key}: ')}"
            line = line.replace(f"{key}={format_override_value(value)}", written)
        return line

    def _trial_overrides(self, trial: optuna.Trial) -> list[str]:
        if self.base_seed is not None and self.sampler_cfg.get("_target_") not in SEQUENCE_SAMPLERS:
            stream = str(self.sampler_cfg.get("_target_"))
            trial.study.sampler = self._make_sampler(trial_seed(self.base_seed, trial.number, stream))
        overrides = self._space_overrides(trial)
        # the password never enters a job's config (nor its .hydra files): the job reads it from the environment
        trial_keys = {
            "number": trial.number,
            "study_name": self.study_name,
            "storage": job_spec(self.storage_url),
        }
        return self._job_overrides(overrides, trial_keys)

    def _job_overrides(self, overrides: Mapping[str, Any], trial_keys: Mapping[str, Any]) -> list[str]:
        """The job's command line: the sweep's own overrides, the sampled values, the trial's identity."""
        return (
            list(self.fixed_overrides)
            + [f"{key}={format_override_value(value)}" for key, value in overrides.items()]
            + [f"++search.trial.{key}={format_override_value(value)}" for key, value in trial_keys.items()]
        )

    def _tell(self, study: optuna.Study, trial: optuna.Trial, **kwargs: Any) -> None:
        try:
            study.tell(trial, **kwargs)
        except RuntimeError as err:
            # GridSampler calls study.stop() once the grid is exhausted, which only works inside optimize();
            # the trial is stored before that (Optuna's tell stores it in a `finally`), and the budget stops us.
            if not (self.is_grid and "Study.stop" in str(err)):
                raise

    def _launch(
        self, study: optuna.Study, jobs: list[tuple[optuna.Trial, list[str]]]
    ) -> Iterator[tuple[optuna.Trial, Exception | None]]:
        """Run the jobs, record each outcome; yields (trial, the job's exception if it failed)."""
        try:
            with heartbeats(self.storage, [t._trial_id for t, _ in jobs]):
                returns = self.launcher.launch([o for _, o in jobs], initial_job_idx=jobs[0][0].number)
        except BaseException as err:
            # Interrupted (Ctrl-C) or the launcher broke: fail the trials and queue them again for the next run.
            # (Lightning turns a Ctrl-C in a job into SystemExit(1): the signal itself tells)
            why = "interrupted (Ctrl-C)" if self.sigints_received else f"the launcher: {_one_line(err)}"
            for trial, _ in jobs:
                if not self.storage.get_trial(trial._trial_id).state.is_finished():
                    trial.set_user_attr(STOPPED_ATTR, why)
                self._tell(study, trial, state=TrialState.FAIL, skip_if_finished=True)
                failed = self.storage.get_trial(trial._trial_id)
                # the callback re-queues a trial retried fewer than MAX_RETRY times (read first: it extends the list)
                requeued = len(RetryHeartbeatStaleTrialCallback.retry_history(failed)) < MAX_RETRY
                RetryHeartbeatStaleTrialCallback(max_retry=MAX_RETRY)(study, failed)
                self.interrupted.append((trial.number, requeued))
            raise
        for (trial, _), ret in zip(jobs, returns):
            yield trial, self._record(study, trial, ret)

    def _record(self, study: optuna.Study, trial: optuna.Trial, ret: Any) -> Exception | None:
        if ret.hydra_cfg is not None:
            trial.set_user_attr("output_dir", str(ret.hydra_cfg.hydra.runtime.output_dir))
        try:
            value = ret.return_value
        except optuna.TrialPruned as reason:
            trial.set_user_attr("pruned_reason", str(reason))
            self._tell(study, trial, state=TrialState.PRUNED)
            log.info("Trial %d pruned: %s", trial.number, reason)
            return None
        except Exception as err:
            return self._fail(study, trial, err)
        note = None
        if isinstance(value, TrialResult):
            values = list(value.values)
            trial.set_user_attr("metrics", value.metrics)
            if value.notes:  # a value not taken as logged (a correlation of constant predictions): say why
                note = "; ".join(value.notes)
                trial.set_user_attr(OBJECTIVE_NOTE_ATTR, note)
            if study.metric_names is None:
                study.set_metric_names(list(value.names))
        else:  # a plain task function, as for the stock sweeper
            values = list(value) if isinstance(value, (list, tuple, ListConfig)) else [value]
        try:
            values = [float(v) for v in values]
            if len(values) != len(self.directions):
                raise ValueError(f"{len(values)} objective values for {len(self.directions)} directions")
            if any(math.isnan(v) for v in values):
                raise ValueError(f"objective is NaN ({values})")
        except (TypeError, ValueError) as err:
            return self._fail(study, trial, err)
        self._tell(study, trial, values=values)
        best = study.best_trials if len(self.directions) > 1 else [study.best_trial]
        names = study.metric_names or [f"objective_{i}" for i in range(len(values))]
        line = trial_line(trial.number, values, trial.params, names, [(t.number, t.values) for t in best])
        log.info(line if note is None else f"{line} | {note}")
        return None

    def _fail(self, study: optuna.Study, trial: optuna.Trial, err: Exception) -> Exception:
        """Record a failed trial with its reason; returns the error."""
        trial.set_user_attr("fail_reason", _one_line(err))
        self._tell(study, trial, state=TrialState.FAIL)
        log.warning("Trial %d failed: %s", trial.number, _one_line(err))
        return err

    # -- the result ---------------------------------------------------------------------------------------------

    def _report(self, study: optuna.Study) -> list[FrozenTrial]:
        trials = study.get_trials(deepcopy=False)
        counts = {state.name: sum(t.state == state for t in trials) for state in TrialState}
        names = study.metric_names or [f"objective_{i}" for i in range(len(self.directions))]
        summary: dict[str, Any] = {
            "study_name": self.study_name,
            "storage": self.shown_url,
            "directions": self.directions,
            "metric_names": names,
            "trials": {k: v for k, v in counts.items() if v},
        }

        def describe(t: FrozenTrial) -> dict[str, Any]:
            return {
                "number": t.number,
                "values": dict(zip(names, t.values)),
                "params": t.params,
                "metrics": t.user_attrs.get("metrics", {}),
                "output_dir": t.user_attrs.get("output_dir"),
                **(
                    {"note": t.user_attrs[OBJECTIVE_NOTE_ATTR]} if OBJECTIVE_NOTE_ATTR in t.user_attrs else {}
                ),
            }

        best = study.best_trials  # the Pareto front; a single best trial for one objective
        if len(self.directions) == 1 and best:
            best = best[:1]
        summary["best_trials"] = [describe(t) for t in best]
        path = self.sweep_dir / f"{self.study_name}_best.json"
        atomic_write_json(path, summary)
        if not best:
            log.warning("Study %s: no completed trial (%s)", self.study_name, summary["trials"])
        for t in best:
            values = ", ".join(f"{n}={v:.4f}" for n, v in zip(names, t.values))
            print(
                f"Best trial {t.number} of study {self.study_name}: {values}  params={json.dumps(t.params)}"
            )
        print(f"Study summary written to {path}")
        return best
