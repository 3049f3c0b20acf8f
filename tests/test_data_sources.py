"""What a finished run read, as ``adls-table``'s footer says it: the local folder of ``data.data_dir`` (not the hub
name the IMDb preset also records), the hub data set when there was no folder, ``auto`` resolved and said so, a
GLUE task with its folder; each source of the runs once."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from adls_lightning.reports.table import results_table

IMDB = {
    "_target_": "adls_lightning.data.IMDbDataModule",
    "hub_name": "stanfordnlp/imdb",
    "main_metric": "acc",
}


def run_folder(folder: Path, data: dict, seed: int = 1) -> Path:
    """A run folder as train.py leaves it (metrics.json and the .hydra record) with the data node ``data``."""
    (folder / ".hydra").mkdir(parents=True)
    (folder / "metrics.json").write_text(json.dumps({"test/acc": 0.5 + seed / 10}))
    (folder / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump([f"seed={seed}"]))
    (folder / ".hydra" / "config.yaml").write_text(yaml.safe_dump({"seed": seed, "data": data}))
    return folder


def footer(*folders: Path) -> str:
    text = results_table([str(folder) for folder in folders])
    (line,) = [line for line in text.splitlines() if "mean ± std (sample) over the n runs" in line]
    return line.split(": mean ± std")[0]


def test_the_footer_names_the_folder_the_runs_read(tmp_path, monkeypatch):
    local = run_folder(tmp_path / "local", {**IMDB, "data_dir": "/data/imdb"})
    assert footer(local) == "/data/imdb"
    hub = run_folder(tmp_path / "hub", {**IMDB, "data_dir": None}, seed=2)
    assert footer(hub) == "stanfordnlp/imdb"
    assert footer(local, hub) == "/data/imdb; stanfordnlp/imdb"
    # auto: the record does not say what the run found; resolved here, as a run here would, and said so
    monkeypatch.setenv("ADLS_IMDB_DIR", str(tmp_path / "shared_imdb"))
    auto = run_folder(tmp_path / "auto", {**IMDB, "data_dir": "auto"})
    assert footer(auto) == f"{tmp_path / 'shared_imdb'} (data.data_dir=auto, as found here)"
    glue = {"_target_": "adls_lightning.data.GlueDataModule", "task": "rte", "main_metric": "acc"}
    assert footer(run_folder(tmp_path / "glue", {**glue, "data_dir": "/data/glue"})) == "rte from /data/glue"
    assert footer(run_folder(tmp_path / "glue_hub", {**glue, "data_dir": None})) == "rte from nyu-mll/glue"
