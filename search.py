"""Optuna search over training runs: ``python search.py search=nas hydra/sweeper/sampler=tpe``; see conf/search.yaml.

The config sets Hydra's multirun mode, so this sweeps without ``-m``; every trial is one ``train.py``-style run.
"""

import os
from pathlib import Path

import hydra
from omegaconf import DictConfig

os.environ.setdefault("PROJECT_ROOT", str(Path(__file__).resolve().parent))

from adls_lightning.build import hydra_execution_whitelist  # noqa: E402 (PROJECT_ROOT first)
from adls_lightning.config import preflight  # noqa: E402

CONF_DIR = Path(__file__).resolve().parent / "conf"


@hydra.main(config_path="conf", config_name="search", execution_whitelist=hydra_execution_whitelist())
def hydra_main(cfg: DictConfig):
    from adls_lightning.search.objective import run_trial  # imported late: `--help` stays fast

    return run_trial(cfg)


# Every target and value of the command line's config (sweeper parts included) is checked before the sweep.
main = preflight(hydra_main, CONF_DIR, "search")


if __name__ == "__main__":
    main()
