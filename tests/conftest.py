"""Shared fixtures: real configs composed in-process (``compose_cfg``), a tiny synthetic IMDb-like data set
(``tiny_imdb_dir``), a tiny randomly initialised BERT (``tiny_bert``), ``search.py`` on the tiny data (``search``),
the toy sweeper app (``toy``) and a throwaway PostgreSQL server (``postgres``). Shared functions and constants are
in ``tests/helpers.py`` (the one compose helper and the one skip helper for what a machine may lack are
``helpers.compose_config`` and ``helpers.requires``)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest
import torch
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, open_dict
from transformers import BertForSequenceClassification

from adls_lightning.models import build_from_config
from tests.helpers import (
    PG_PASSWORD,
    TINY_OVERRIDES,
    compose_config,
    free_port,
    make_reviews,
    pg_bin,
    train_run,
)
from tests.toy_sweeper import APP, CONFIG

ROOT = Path(__file__).resolve().parent.parent
CONF_DIR = ROOT / "conf"
os.environ.setdefault("PROJECT_ROOT", str(ROOT))
os.environ.setdefault("WANDB_MODE", "offline")


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


@pytest.fixture
def search(tmp_path, tiny_imdb_dir, cache_dir):
    """``search(*overrides)`` runs search.py on the tiny data, sweep dir ``tmp_path/sweep``."""

    def run(*overrides: str) -> subprocess.CompletedProcess:
        cmd = [
            sys.executable, str(ROOT / "search.py"),
            f"hydra.sweep.dir={tmp_path / 'sweep'}",
            f"data.data_dir={tiny_imdb_dir}", f"paths.cache_dir={cache_dir}",
            "trainer=cpu", "trainer.max_epochs=1", "callbacks.rich_progress_bar=null",
            "data.max_length=32", "data.batch_size=16", "data.val_size=64", "data.train_size=128",
            "data.test_size=64",
            *overrides,
        ]  # fmt: skip
        env = {**os.environ, "PROJECT_ROOT": str(ROOT)}
        return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)

    return run


@pytest.fixture
def toy(tmp_path):
    """Run the toy app: ``toy(*overrides, wait=True)`` -> CompletedProcess (or Popen when wait=False)."""
    (tmp_path / "app").mkdir()
    (tmp_path / "app" / "toy.py").write_text(APP)
    (tmp_path / "app" / "toy.yaml").write_text(textwrap.dedent(CONFIG).replace("ROOT", str(ROOT)))
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(Path(__file__).parent)]),
        "ADLS_EXTRA_TARGETS": "toy_sweeper.*",  # the toy space lives in tests/toy_sweeper.py
    }

    def run(*overrides, sweep_dir=tmp_path / "sweep", wait=True):
        cmd = [sys.executable, str(tmp_path / "app" / "toy.py"), f"hydra.sweep.dir={sweep_dir}", *overrides]
        if not wait:
            return subprocess.Popen(
                cmd, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
            )
        return subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)

    return run


@pytest.fixture(scope="session")
def postgres():
    """A PostgreSQL server on 127.0.0.1 for the session: yields its URL (user ``adls``, password auth)."""
    bindir = pg_bin()
    if bindir is None:
        pytest.skip("no PostgreSQL server binary (initdb) on this machine: apt-get install postgresql")
    folder = Path(tempfile.mkdtemp(prefix="adls-pg-"))
    # initdb refuses to run as root: the server runs as the `postgres` user, in a folder it owns
    as_user = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
    if as_user:
        shutil.chown(folder, "postgres")
    (folder / "pw").write_text(PG_PASSWORD)
    if as_user:
        shutil.chown(folder / "pw", "postgres")
    data, port = folder / "data", free_port()
    subprocess.run(
        [*as_user, str(bindir / "initdb"), "-D", str(data), "-U", "adls", f"--pwfile={folder / 'pw'}",
         "--auth=scram-sha-256", "-E", "UTF8"],
        check=True, capture_output=True,
    )  # fmt: skip
    opts = f"-p {port} -k {folder} -c listen_addresses=127.0.0.1 -c max_connections=50 -c fsync=off"
    pg_ctl = [*as_user, str(bindir / "pg_ctl"), "-D", str(data), "-l", str(folder / "log")]
    subprocess.run([*pg_ctl, "-o", opts, "-w", "start"], check=True, capture_output=True)
    try:
        yield f"postgresql+psycopg://adls:{PG_PASSWORD}@127.0.0.1:{port}/postgres"
    finally:
        subprocess.run([*pg_ctl, "-m", "immediate", "stop"], capture_output=True)
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="session")
def fine_tuned(tmp_path_factory, tiny_imdb_dir, cache_dir) -> Path:
    """A tiny model fine-tuned in full (no LoRA) until it separates the keyword reviews: the start of the export
    tests' compressed runs (tests/test_export_compressed.py, tests/test_compression_record.py)."""
    out = tmp_path_factory.mktemp("fine_tuned")
    overrides = ["model/lora=none", "model.optimizer.lr=1e-3", "trainer.max_epochs=4"]
    assert train_run(out, overrides, tiny_imdb_dir, cache_dir)["test/acc"] >= 0.9
    return next((out / "checkpoints").glob("best-*.ckpt"))
