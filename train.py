"""Train (fit + validate + test) one configuration: ``python train.py [overrides]``; see conf/train.yaml."""

import os
from pathlib import Path

import hydra
from omegaconf import DictConfig

os.environ.setdefault("PROJECT_ROOT", str(Path(__file__).resolve().parent))


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def main(cfg: DictConfig) -> float | None:
    from adls_lightning.training import one_line_errors, run  # imported late: `--help` stays fast

    with one_line_errors():
        metrics = run(cfg)
    return metrics.get(cfg.get("optimized_metric"))


if __name__ == "__main__":
    main()
