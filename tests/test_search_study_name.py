"""A search's default study name tells the data task apart: the GLUE searches of docs/glue.md and the IMDb searches
of docs/search.md no longer share a study name (and its folder), where the second was refused as another search's.
IMDb's names are as before, so its studies still resume."""

from __future__ import annotations

import pytest
from hydra.core.hydra_config import HydraConfig
from omegaconf import OmegaConf

from tests.helpers import compose_config


def _default_study_name(*overrides: str) -> str:
    cfg = compose_config("search", list(overrides), return_hydra_config=True)
    HydraConfig.instance().set_config(cfg)  # ${hydra:runtime.choices...} as search.py resolves them
    try:
        return OmegaConf.select(cfg, "hydra.sweeper.study_name")
    finally:
        HydraConfig.instance().cfg = None


@pytest.mark.parametrize(
    ("overrides", "name"),
    [
        (["search=mixed_precision"], "mixed_precision-integer-acc-tpe"),  # IMDb: unchanged
        (["search=mixed_precision", "data=glue", "data.task=stsb"], "mixed_precision-integer-stsb-acc-tpe"),
        (["search=nas", "data=glue", "data.task=mrpc", "hydra/sweeper/sampler=random"], "nas-mrpc-acc-random"),
        (["search=hparams", "data=folder", "data.data_dir=/d"], "hparams-acc-tpe"),
        (["search=mixed_precision", "data=glue", "data.task=rte", "search.name_suffix=-from-nas-rte-acc-tpe"],
         "mixed_precision-integer-from-nas-rte-acc-tpe-rte-acc-tpe"),
    ],
)  # fmt: skip
def test_the_default_study_name_has_the_glue_task(overrides, name):
    assert _default_study_name(*overrides) == name
