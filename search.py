"""Optuna search over training runs: ``python search.py search=nas hydra/sweeper/sampler=tpe``; see conf/search.yaml.

The config sets Hydra's multirun mode, so this sweeps without ``-m``; every trial is one ``train.py``-style run.
The same command as the installed ``adls-search`` (adls_lightning/app/cli.py), with this checkout's configs.
"""

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parent
os.environ.setdefault("PROJECT_ROOT", str(ROOT))

if __name__ == "__main__":
    from adls_lightning.app.cli import search

    search(ROOT / "conf")
