"""Console commands installed by ``pip install .``: ``adls-train`` and ``adls-search``, the same as ``train.py``
and ``search.py`` (same overrides, same configs) but runnable from any folder.

The configs come with the package (``adls_lightning/conf``, a link to the repository's ``conf/``); outputs go to
``./outputs`` of the folder the command runs in (``paths.root_dir``, i.e. ``$PROJECT_ROOT``, defaults to it).
"""

from __future__ import annotations

import os
from pathlib import Path

import hydra
from omegaconf import DictConfig

CONFIG_DIR = str(Path(__file__).resolve().parent / "conf")


def _train(cfg: DictConfig) -> float | None:
    from adls_lightning.training import one_line_errors, run  # imported late: `--help` stays fast

    with one_line_errors():
        metrics = run(cfg)
    return metrics.get(cfg.get("optimized_metric"))


def _search(cfg: DictConfig):
    from adls_lightning.search.objective import run_trial

    return run_trial(cfg)


def train() -> None:
    """``adls-train [overrides]``: fit, validate and test one configuration (see ``conf/train.yaml``)."""
    os.environ.setdefault("PROJECT_ROOT", os.getcwd())
    hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="train")(_train)()  # as train.py


def search() -> None:
    """``adls-search [overrides]``: an Optuna study whose trials are training runs (see ``conf/search.yaml``)."""
    os.environ.setdefault("PROJECT_ROOT", os.getcwd())
    hydra.main(config_path=CONFIG_DIR, config_name="search")(_search)()  # as search.py
