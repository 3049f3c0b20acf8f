"""Train (fit + validate + test) one configuration: ``python train.py [overrides]``; see conf/train.yaml."""

import os
from pathlib import Path

import hydra
from omegaconf import DictConfig

os.environ.setdefault("PROJECT_ROOT", str(Path(__file__).resolve().parent))

from adls_lightning.build import hydra_execution_whitelist  # noqa: E402 (PROJECT_ROOT first)
from adls_lightning.config import preflight  # noqa: E402

CONF_DIR = Path(__file__).resolve().parent / "conf"


@hydra.main(
    version_base="1.3",
    config_path="conf",
    config_name="train",
    execution_whitelist=hydra_execution_whitelist(),
)
def hydra_main(cfg: DictConfig) -> float | None:
    from adls_lightning.training import one_line_errors, run  # imported late: `--help` stays fast

    with one_line_errors():
        metrics = run(cfg)
    return metrics.get(cfg.get("optimized_metric"))


# Every target and value of the command line's config is checked before Hydra runs or writes anything.
main = preflight(hydra_main, CONF_DIR, "train")


if __name__ == "__main__":
    main()
