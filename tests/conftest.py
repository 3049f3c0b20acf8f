"""Shared fixtures: real configs composed in-process (``compose_cfg``), a tiny synthetic IMDb-like data set
(``tiny_imdb_dir``), a tiny randomly initialised BERT (``tiny_bert``) (the one compose helper and the one skip
helper for what a machine may lack are ``helpers.compose_config`` and ``helpers.requires``)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, open_dict
from transformers import BertForSequenceClassification

from adls_lightning.models import build_from_config
from tests.helpers import compose_config

ROOT = Path(__file__).resolve().parent.parent
CONF_DIR = ROOT / "conf"
os.environ.setdefault("PROJECT_ROOT", str(ROOT))
os.environ.setdefault("WANDB_MODE", "offline")

POSITIVE = ["great", "wonderful", "loved", "excellent", "superb", "brilliant"]
NEGATIVE = ["awful", "terrible", "hated", "boring", "worst", "dreadful"]
FILLER = ["the", "movie", "film", "plot", "actors", "scene", "story", "was", "and", "it", "a", "of"]


def make_reviews(n: int, seed: int) -> pd.DataFrame:
    """Synthetic reviews whose label is given by sentiment keywords in filler text (learnable by a tiny BERT)."""
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        label = i % 2
        words = list(rng.choice(FILLER, rng.integers(5, 40)))
        for _ in range(rng.integers(1, 4)):
            words.insert(int(rng.integers(0, len(words))), str(rng.choice(POSITIVE if label else NEGATIVE)))
        rows.append((" ".join(words), label))
    return pd.DataFrame(rows, columns=["text", "label"])


@pytest.fixture(scope="session")
def tiny_imdb_dir(tmp_path_factory) -> Path:
    """A folder with train.parquet (400 rows) and test.parquet (200 rows), balanced labels."""
    folder = tmp_path_factory.mktemp("tiny_imdb")
    make_reviews(400, seed=0).to_parquet(folder / "train.parquet")
    make_reviews(200, seed=1).to_parquet(folder / "test.parquet")
    return folder


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    """One tokenized-data cache for the whole test session."""
    return tmp_path_factory.mktemp("token_cache")


TINY_OVERRIDES = [
    "model=tiny_random",
    "logger=none",
    "trainer=cpu",
    "data.max_length=64",
    "data.batch_size=8",
    "data.val_size=100",
    "callbacks.rich_progress_bar=null",
]


@pytest.fixture
def compose_cfg(tmp_path, tiny_imdb_dir, cache_dir):
    """``compose_cfg(overrides) -> DictConfig``: the real train.yaml with a tiny model and data, output in tmp_path.

    The Hydra config is registered as if train.py ran, so ``${hydra:...}`` interpolations and
    ``adls_lightning.app.training.run`` work in-process.
    """

    def _compose(overrides: list[str] | None = None, output_dir: Path | None = None) -> DictConfig:
        GlobalHydra.instance().clear()
        out = output_dir or tmp_path / "run"
        all_overrides = [
            *TINY_OVERRIDES,
            f"data.data_dir={tiny_imdb_dir}",
            f"paths.cache_dir={cache_dir}",
            f"hydra.run.dir={out}",
            *(overrides or []),
        ]
        cfg = compose_config("train", all_overrides, return_hydra_config=True)
        with open_dict(cfg):
            cfg.hydra.runtime.output_dir = str(out)
            cfg.hydra.job.num = 0
        HydraConfig.instance().set_config(cfg)
        return cfg

    yield _compose
    GlobalHydra.instance().clear()


@pytest.fixture(scope="session")
def tiny_bert():
    """``tiny_bert(seed=0, **BertConfig fields) -> model``: a tiny randomly initialised BERT classifier in eval mode,
    built as ``model=tiny_random`` builds its backbone (``models.build_from_config``: hidden 32, 2 layers, 2 heads,
    intermediate 64), with a 100-token vocabulary; ``seed`` seeds its weights."""

    def build(seed: int = 0, **config) -> BertForSequenceClassification:
        torch.manual_seed(seed)
        return build_from_config(**{"vocab_size": 100, **config}).eval()

    return build
