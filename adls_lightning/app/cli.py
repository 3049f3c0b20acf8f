"""The entry points: ``train.py`` / ``search.py`` in a checkout, and the console commands ``adls-train`` /
``adls-search`` that ``pip install .`` installs (same overrides, same configs, runnable from any folder).

Both go through :func:`entry_point`: the config is checked by :func:`adls_lightning.app.preflight.preflight` before Hydra
runs or writes anything, and Hydra's execution whitelist is the project's (:mod:`adls_lightning.build`).
The packaged configs are ``adls_lightning/conf`` (a link to the repository's ``conf/``); the console commands
write outputs under the folder they run in (``$PROJECT_ROOT`` defaults to it).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from adls_lightning.app.preflight import exit_with, preflight
from adls_lightning.build import hydra_execution_whitelist
from adls_lightning.checkpoints import reading_once
from adls_lightning.errors import ConfigError

CONFIG_DIR = Path(__file__).resolve().parent.parent / "conf"


def run_training(cfg: DictConfig) -> float | None:
    """Hydra task of ``train``: fit, validate and test one configuration; returns ``optimized_metric``."""
    from adls_lightning.app.preflight import composition_checked
    from adls_lightning.app.training import one_line_errors, run  # imported late: `--help` stays fast

    _configure_logs()
    with one_line_errors():
        if cfg.get("init_from_study") is not None:
            check_from_command_line(cfg)
        metrics = run(cfg, checked=composition_checked())
    return metrics.get(cfg.get("optimized_metric"))


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


def entry_point(task: Callable[[DictConfig], Any], config_dir: Path, config_name: str) -> Callable[[], Any]:
    """``@hydra.main`` over ``task`` with the project's whitelist, wrapped in the up-front config check."""
    # No version_base: Hydra 1.4 deprecates the parameter (a warning on every run) and has no behaviour behind it.
    hydra_main = hydra.main(
        config_path=str(config_dir),
        config_name=config_name,
        execution_whitelist=hydra_execution_whitelist(),
    )(task)
    checked_main = preflight(hydra_main)

    def main() -> Any:
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


def train(config_dir: Path = CONFIG_DIR) -> Any:
    """``adls-train [overrides]``: see ``conf/train.yaml``."""
    os.environ.setdefault("PROJECT_ROOT", os.getcwd())
    return entry_point(run_training, config_dir, "train")()


def search(config_dir: Path = CONFIG_DIR) -> Any:
    """``adls-search [overrides]``: an Optuna study whose trials are training runs; see ``conf/search.yaml``."""
    os.environ.setdefault("PROJECT_ROOT", os.getcwd())
    return entry_point(run_search_trial, config_dir, "search")()
