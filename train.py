"""Train (fit + validate + test) one configuration: ``python train.py [overrides]``; see conf/train.yaml.

The same command as the installed ``adls-train`` (adls_lightning/app/cli.py), with this checkout's configs.
"""

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parent
os.environ.setdefault("PROJECT_ROOT", str(ROOT))

if __name__ == "__main__":
    from adls_lightning.app.cli import train

    train(ROOT / "conf")
