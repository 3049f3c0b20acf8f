"""Optuna search over training runs: ``python search.py search=nas hydra/sweeper/sampler=tpe``; see conf/search.yaml.

The config sets Hydra's multirun mode, so this sweeps without ``-m``; every trial is one ``train.py``-style run.
"""

import os
from pathlib import Path

import hydra
from omegaconf import DictConfig

os.environ.setdefault("PROJECT_ROOT", str(Path(__file__).resolve().parent))


@hydra.main(config_path="conf", config_name="search")
def main(cfg: DictConfig):
    from adls_lightning.search.objective import run_trial  # imported late: `--help` stays fast

    return run_trial(cfg)


if __name__ == "__main__":
    main()
