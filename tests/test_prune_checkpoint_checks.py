"""The pre-flight of ``init_ckpt=`` / ``ckpt_path=`` (``adls_lightning.app.training``): a checkpoint of another task
with the same number of labels, and a pruned or quantized checkpoint loaded into a run without that compression,
are refused in one line before anything is written (they loaded silently, or failed at load with hundreds of keys).
"""

from __future__ import annotations

import pytest
import torch

from adls_lightning.app.training import check_task, run
from adls_lightning.data.datamodule import checkpoint_task
from adls_lightning.data.tasks import GLUE_TASKS
from adls_lightning.errors import ConfigError
from tests.helpers import SHORT_RUN

IMDB_TASK = "imdb"


def glue_checkpoint(task: str) -> dict:
    """What Lightning saves of a GLUE run's data module: its state under the class's name, its hyper-parameters."""
    return {
        "GlueDataModule": {},
        "datamodule_hyper_parameters": {"task": task, "data_dir": "/somewhere/glue"},
    }


@pytest.mark.parametrize(
    ("checkpoint", "expected"),
    [
        (glue_checkpoint("mrpc"), "glue/mrpc"),
        (glue_checkpoint("sst2"), "glue/sst2"),
        ({"IMDbDataModule": {}, "datamodule_hyper_parameters": {"data_dir": "/a/local/copy"}}, "imdb"),
        ({"IMDbDataModule": {}, "datamodule_hyper_parameters": {"data_dir": None}}, "imdb"),  # the hub's
        ({"FolderDataModule": {}, "datamodule_hyper_parameters": {}}, None),  # any data set: not compared
        ({"state_dict": {}}, None),  # saved outside train.py
    ],
)
def test_a_checkpoint_records_its_task(checkpoint, expected):
    assert checkpoint_task(checkpoint) == expected


class _Task:
    def __init__(self, name):
        self.name = name


def test_same_task_and_unrecorded_checkpoints_pass():
    for cfg in ({"train": True}, {"train": False}):
        check_task(
            {"IMDbDataModule": {}, "datamodule_hyper_parameters": {}}, _Task("imdb"), "x", "ckpt_path", cfg
        )
        check_task({"state_dict": {}}, _Task("imdb"), "x", "init_ckpt", cfg)
        check_task(glue_checkpoint("mrpc"), _Task("glue/mrpc"), "x", "init_ckpt", cfg)
    # another task's encoder with a new head, trained on this task: the documented transfer
    check_task(glue_checkpoint("mrpc"), _Task("imdb"), "x", "init_ckpt", {"train": True, "init_head": "new"})


@pytest.mark.parametrize(
    ("key", "cfg", "expected"),
    [
        (
            "ckpt_path",
            {"train": False},
            "train=false evaluates its classifier, trained for glue/mrpc, on imdb",
        ),
        ("init_ckpt", {"train": False, "init_head": "new"}, "train=false evaluates its classifier"),
        ("ckpt_path", {"train": True}, "valid: a checkpoint of imdb to resume, or init_ckpt=X init_head=new"),
        ("init_ckpt", {"train": True}, "to start from its encoder with a new head, add init_head=new"),
    ],
)
def test_another_tasks_checkpoint_is_refused(key, cfg, expected):
    assert "mrpc" in GLUE_TASKS and GLUE_TASKS["mrpc"].label_names is not None  # 2 labels, as IMDb
    with pytest.raises(ConfigError) as err:
        check_task(glue_checkpoint("mrpc"), _Task(IMDB_TASK), "X", key, cfg)
    message = str(err.value)
    assert (
        message.startswith(f"{key}=X: a glue/mrpc checkpoint, this run's task is imdb")
        and "\n" not in message
    )
    assert expected in message


@pytest.fixture(scope="module")
def pruned_run(tmp_path_factory, tiny_imdb_dir, cache_dir):
    from tests.helpers import train_run

    out = tmp_path_factory.mktemp("pruned") / "run"
    train_run(out, [*SHORT_RUN, "model/lora=none", "prune=l1_0.5"], tiny_imdb_dir, cache_dir)
    return next((out / "checkpoints").glob("best-*.ckpt"))


def test_a_pruned_checkpoint_into_a_run_without_its_preset_names_the_preset(
    compose_cfg, tmp_path, pruned_run
):
    with pytest.raises(ConfigError) as err:
        run(compose_cfg([*SHORT_RUN, "model/lora=none", f"init_ckpt={pruned_run}", "quant=int8"]))
    assert str(err.value) == (
        f"init_ckpt={pruned_run}: a pruned checkpoint (prune=l1_0.5), and this run has no prune= to load its layers "
        "into; valid: add prune=l1_0.5 to this run, or start from the checkpoint it was compressed from"
    )
    assert not (tmp_path / "run").exists() or not list((tmp_path / "run").rglob("*.ckpt"))


def test_a_checkpoint_of_another_task_is_refused_before_evaluating(compose_cfg, tmp_path, pruned_run):
    """The same checkpoint as a GLUE MRPC run would have saved it (2 labels, as IMDb): refused for train=false."""
    checkpoint = torch.load(pruned_run, weights_only=False)
    checkpoint.pop("IMDbDataModule", None)
    checkpoint.update(glue_checkpoint("mrpc"))
    mrpc = tmp_path / "mrpc.ckpt"
    torch.save(checkpoint, mrpc)
    overrides = [*SHORT_RUN, "model/lora=none", "prune=l1_0.5", "train=false", f"ckpt_path={mrpc}"]
    with pytest.raises(
        ConfigError, match=r"a glue/mrpc checkpoint, this run's task is imdb, and train=false"
    ):
        run(compose_cfg(overrides))
    # the IMDb original evaluates as before
    metrics = run(compose_cfg([*overrides[:-1], f"ckpt_path={pruned_run}"], tmp_path / "same"))
    assert metrics["prune/weight_sparsity"] == pytest.approx(0.5)
