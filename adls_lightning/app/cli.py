"""The entry points: ``train.py`` / ``search.py`` in a checkout, and the console commands ``adls-train`` /
``adls-search`` that ``pip install .`` installs (same overrides, same configs, runnable from any folder).

Both go through :func:`entry_point`: the config is checked by :func:`adls_lightning.app.preflight.preflight` before Hydra
runs or writes anything, and Hydra's execution whitelist is the project's (:mod:`adls_lightning.build`).
The packaged configs are ``adls_lightning/conf`` (a link to the repository's ``conf/``); the console commands
write outputs under the folder they run in (``$PROJECT_ROOT`` defaults to it).
"""

from __future__ import annotations

import contextlib
import functools
import os
import shlex
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NoReturn

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from adls_lightning.app.preflight import exit_with, preflight
from adls_lightning.build import hydra_execution_whitelist
from adls_lightning.checkpoints import reading_once
from adls_lightning.configs import CONF_DIR
from adls_lightning.errors import ConfigError


def run_training(cfg: DictConfig) -> float | None:
    """Hydra task of ``train``: fit, validate and test one configuration; returns ``optimized_metric``."""
    from adls_lightning.app.preflight import composition_checked

    _configure_logs()
    with resume_hint_on_interrupt(cfg):
        # imported late (`--help` stays fast), and inside the block: a Ctrl-C in its seconds is a run's interrupt
        from adls_lightning.app.training import one_line_errors, run

        with one_line_errors():
            if cfg.get("init_from_study") is not None:
                check_from_command_line(cfg)
            metrics = run(cfg, checked=composition_checked())
    return metrics.get(cfg.get("optimized_metric"))


#: The shell's exit status for a process ended by SIGINT (128 + 2): what scripts and CI read as "interrupted".
INTERRUPTED_EXIT = 130


@contextlib.contextmanager
def resume_hint_on_interrupt(cfg: DictConfig) -> Iterator[None]:
    """A single run interrupted by Ctrl-C (SIGINT) ends with exit code 130 and, as stderr's last line, the command
    that resumes it when its ``last.ckpt`` is there (:func:`interrupted_line`). A multirun's jobs are left as they
    are (a search's sweeper says how to resume the study: :func:`exit_on_interrupt`).
    """
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not (HydraConfig.initialized() and HydraConfig.get().mode == RunMode.RUN):
        yield
        return
    with exit_on_interrupt(lambda: interrupted_line(cfg)):
        yield


@contextlib.contextmanager
def noting_interrupts() -> Iterator[list[int]]:
    """Ctrl-C (SIGINT) in the block noted as it arrives in the list yielded, the usual KeyboardInterrupt raised all
    the same: what catches it later tells an interrupt apart from a failure by the note. Lightning turns the
    KeyboardInterrupt inside ``fit``/``validate``/``test`` into a shutdown and exit code 1, and one landing in C code
    that calls back into Python can come out as another error (matplotlib's ``savefig``: a ValueError "Invalid
    affine transformation matrix"). Off the main thread, or under a SIGINT handler someone else installed (or SIGINT
    ignored), nothing is noted.
    """
    received: list[int] = []
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    ):
        yield received
        return

    def note_and_interrupt(signum: int, frame: Any) -> None:
        received.append(signum)
        signal.default_int_handler(signum, frame)

    signal.signal(signal.SIGINT, note_and_interrupt)
    try:
        yield received
    finally:
        if signal.getsignal(signal.SIGINT) is note_and_interrupt:
            signal.signal(signal.SIGINT, signal.default_int_handler)


@contextlib.contextmanager
def exit_on_interrupt(last_line: Callable[[], str]) -> Iterator[list[int]]:
    """Ctrl-C (SIGINT) in the block ends the process with exit code 130 and ``last_line()`` as stderr's last line
    (how to resume), instead of a traceback (Lightning's exit code 1 included: :func:`noting_interrupts`, whose
    list of the signals received it yields)."""
    with noting_interrupts() as received:
        try:
            yield received
        except (KeyboardInterrupt, SystemExit):
            if not received:
                raise
            print(last_line(), file=sys.stderr)
            sys.exit(INTERRUPTED_EXIT)


def exit_interrupted(state: str) -> NoReturn:
    """Ctrl-C's one line, ``interrupted: <state>`` on stderr, and exit code 130 (as ``train.py``'s), no traceback:
    how the tools that write a folder (``adls-export``, the graph tool) end when :func:`noting_interrupts` saw one."""
    print(f"interrupted: {state}", file=sys.stderr)
    sys.exit(INTERRUPTED_EXIT)


def interrupted_line(cfg: DictConfig) -> str:
    """``interrupted: resume with <the run's command> hydra.run.dir=<its folder> ckpt_path=last`` when a
    ``last*.ckpt`` is in the run's checkpoint folders (the ``last_checkpoint`` callback writes one every N training
    steps), else that nothing is there to resume."""
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf

    from adls_lightning.app.preflight import callback_nodes
    from adls_lightning.checkpoints import last_checkpoint

    hydra_cfg = HydraConfig.get()
    run_dir = hydra_cfg.runtime.output_dir
    if not cfg.get("train", True):
        return "interrupted: an evaluation, nothing to resume (run the command again)"
    job = OmegaConf.to_container(cfg, resolve=True)
    try:
        last_checkpoint(node["dirpath"] for _, node in callback_nodes(job) if node.get("dirpath"))
    except ConfigError:
        return (
            f"interrupted: no last.ckpt yet in {run_dir}, nothing to resume; start the run again "
            "(overwrite=true to reuse its folder)"
        )
    # the command line's overrides as Hydra recorded them (hydra.* apart), with the folder and ckpt_path replaced
    given = [*hydra_cfg.overrides.hydra, *hydra_cfg.overrides.task]
    kept = [o for o in given if not o.startswith(("hydra.run.dir=", "hydra.mode=", "ckpt_path="))]
    script = sys.argv[0]
    command = f"python {script}" if script.endswith(".py") else Path(script).name
    overrides = [*kept, f"hydra.run.dir={run_dir}", "ckpt_path=last"]
    return f"interrupted: resume with {command} {shlex.join(overrides)}"


def run_search_trial(cfg: DictConfig) -> Any:
    """Hydra task of ``search``: one trial (a training run of the sampled config)."""
    from adls_lightning.app.objective import run_trial  # imported late: `--help` stays fast

    _configure_logs()
    if cfg.get("init_from_study") is not None:
        check_from_command_line(cfg)
    return run_trial(cfg)


def check_from_command_line(cfg: object) -> None:
    """Refuse an ``init_from_study`` that a config file set: only the command line is expanded, so it would be
    ignored and the run would start from other weights than the user meant.

    Raises:
        ConfigError: ``init_from_study`` is set but not among the run's command-line overrides.
    """
    from adls_lightning.search.from_study import KEY, command_line_key

    value = cfg.get(KEY)
    if value is None or any(command_line_key(o) == KEY for o in HydraConfig.get().overrides.task):
        return
    raise ConfigError(
        f"{KEY}={value}: set in a config file, where it is not read; give it on the command line "
        f"(train.py/search.py {KEY}={value}), which turns it into the study's model and init_ckpt"
    )


def _configure_logs() -> None:
    from hydra.core.hydra_config import HydraConfig

    from adls_lightning import logs

    logs.configure(HydraConfig.get().verbose if HydraConfig.initialized() else False)


#: Set once Hydra calls the task in this process: a run (or a trial) has begun.
TASK_STARTED = threading.Event()


def _run_noting_start(task: Callable[[DictConfig], Any], cfg: DictConfig) -> Any:
    TASK_STARTED.set()
    return task(cfg)


def entry_point(task: Callable[[DictConfig], Any], config_dir: Path, config_name: str) -> Callable[[], Any]:
    """``@hydra.main`` over ``task`` with the project's whitelist, wrapped in the up-front config check."""
    # No version_base: Hydra 1.4 deprecates the parameter (a warning on every run) and has no behaviour behind it.
    # a module-level function: launchers (joblib, submitit) pickle the task, which a closure over an Event is not
    task_noting_start = functools.update_wrapper(functools.partial(_run_noting_start, task), task)

    hydra_main = hydra.main(
        config_path=str(config_dir),
        config_name=config_name,
        execution_whitelist=hydra_execution_whitelist(),
    )(task_noting_start)
    checked_main = preflight(hydra_main)

    def main() -> Any:
        try:
            return checked_and_run()
        except KeyboardInterrupt:
            # Ctrl-C outside the blocks that say how to resume (a single run's, the sweeper's): while the command
            # starts (the pre-flight check, composing the config) or in a job of a train.py multirun
            print(interrupted_outside_line(config_name, TASK_STARTED.is_set()), file=sys.stderr)
            sys.exit(INTERRUPTED_EXIT)

    def checked_and_run() -> Any:
        from adls_lightning.search.storage import mask_command_line

        sys.argv[1:] = overrides_last(sys.argv[1:])

        # a URL's password never enters the config Hydra saves and logs: masked here, the job reads the environment
        try:
            sys.argv[1:] = mask_command_line(sys.argv[1:])
        except ConfigError as err:
            exit_with(str(err))
        # init_from_study=STUDY becomes the best trial's model overrides and init_ckpt before Hydra parses them
        if any(arg.lstrip("+").startswith("init_from_study=") for arg in sys.argv[1:]):
            from adls_lightning.search.from_study import expand_command_line

            try:
                sys.argv[1:] = expand_command_line(sys.argv[1:], name_study=config_name == "search")
            except ConfigError as err:
                exit_with(str(err))
        # the pre-flight check, the run's checks and the model read each checkpoint file once, mapped
        with reading_once():
            return checked_main()

    return main


def interrupted_outside_line(config_name: str, started: bool) -> str:
    """The last line of a Ctrl-C that no run or sweeper handled: before anything began (nothing written, nothing to
    resume), or in a job of a ``train.py -m`` multirun (the jobs that finished keep their folders)."""
    if not started:
        what = "the search opened its study" if config_name == "search" else "the run began"
        return f"interrupted: stopped before {what}; nothing was written, run the command again"
    return "interrupted: stopped in a job; the jobs that finished have their metrics.json in their folders"


def overrides_last(argv: list[str]) -> list[str]:
    """``argv`` with every override after the flags: ``train.py a=1 -m b=1,2`` as ``train.py -m a=1 b=1,2``.

    Hydra's parser reads the overrides as one run of positional arguments, so overrides on both sides of a flag
    leave the second run unrecognised (and the pre-flight would check the config without them); a user means them
    all. A command line whose overrides already form one run is returned as it is.
    """
    from hydra._internal.utils import get_args_parser  # the parser @hydra.main itself uses

    parser = get_args_parser()
    _, unknown = parser.parse_known_args(argv)
    if not unknown:
        return list(argv)
    overrides = parser.parse_known_intermixed_args(argv)[0].overrides
    flags = list(argv)
    for override in overrides:
        flags.remove(override)
    return flags + list(overrides)


def train(config_dir: Path = CONF_DIR) -> Any:
    """``adls-train [overrides]``: see ``conf/train.yaml``."""
    os.environ.setdefault("PROJECT_ROOT", os.getcwd())
    return entry_point(run_training, config_dir, "train")()


def search(config_dir: Path = CONF_DIR) -> Any:
    """``adls-search [overrides]``: an Optuna study whose trials are training runs; see ``conf/search.yaml``."""
    os.environ.setdefault("PROJECT_ROOT", os.getcwd())
    return entry_point(run_search_trial, config_dir, "search")()
