"""A checkpoint keeps its task through the export and the soup: ``adls-export`` refuses data overrides that name
another task than the checkpoint's (its classifier would be written with that task's labels, and ``adls-evaluate``
would score it there), as ``train.py train=false ckpt_path=`` does; a soup of MRPC runs exports as MRPC with no
overrides and is refused for RTE as its runs are.

Expectations are written out here: MRPC's label names, the task names, the refusal's first words.

The runs, the soup and its export are made in this process (their command lines are other tests' subject); the
refusals, whose one line and exit code are the subject here, are the commands themselves."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from adls_lightning.errors import ConfigError
from adls_lightning.tools.export import main as export_main
from adls_lightning.tools.soup import main as soup_main
from tests.glue_layouts import ONE_STEP, write_glue_tasks
from tests.helpers import assert_one_line_error, call, run_export, run_train, train_run

pytestmark = pytest.mark.slow  # two training runs

MRPC_LABELS = {"0": "not_equivalent", "1": "equivalent"}  # GLUE's MRPC: 1 = the sentences are paraphrases
FULL_FINE_TUNE = ["model/lora=none", *ONE_STEP]  # a soup averages full fine-tunes


@pytest.fixture(scope="module")
def glue_root(tmp_path_factory) -> Path:
    return write_glue_tasks(tmp_path_factory.mktemp("glue"), "mrpc", "rte")


@pytest.fixture(scope="module")
def mrpc_runs(tmp_path_factory, glue_root, cache_dir) -> list[Path]:
    """The best checkpoints of two tiny MRPC runs of train.py (with their run records) that differ in ``seed``,
    shared by every test here."""
    base = tmp_path_factory.mktemp("mrpc_runs")
    checkpoints = []
    for seed in (1, 2):
        out = base / f"seed{seed}"
        train_run(out, ["data=glue", "data.task=mrpc", *FULL_FINE_TUNE, f"seed={seed}"], glue_root, cache_dir)
        checkpoints.extend(sorted((out / "checkpoints").glob("best*.ckpt")))
    assert len(checkpoints) == 2
    return checkpoints


@pytest.fixture(scope="module")
def soup(mrpc_runs, tmp_path_factory) -> Path:
    """The soup of the two MRPC runs, written outside their run folders."""
    path = tmp_path_factory.mktemp("soup") / "soup.ckpt"
    code, _, err = call(soup_main, f"ckpts={mrpc_runs[0]},{mrpc_runs[1]}", f"out={path}")
    assert code == 0, err[-3000:]
    return path


def test_export_refuses_a_data_override_of_another_task(mrpc_runs, tmp_path):
    ckpt = mrpc_runs[0]
    out = tmp_path / "x1"
    line = assert_one_line_error(
        run_export(f"ckpt={ckpt}", f"out={out}", "format=hf", "data.task=rte", "check=agreement"),
        starts=f"error: ckpt={ckpt}: a glue/mrpc checkpoint, this export's task is glue/rte (data.task=rte)",
    )
    assert "valid: without data.task=rte (the run's own data), or a checkpoint of glue/rte" in line
    assert not out.exists()


def test_export_outside_the_run_folder_refuses_the_default_task(mrpc_runs, tmp_path):
    """Without its run record the export starts from the defaults (IMDb): refused, not labelled as IMDb."""
    ckpt = shutil.copy(mrpc_runs[0], tmp_path / "mrpc.ckpt")
    out = tmp_path / "x2"
    line = assert_one_line_error(
        run_export(f"ckpt={ckpt}", f"out={out}", "format=hf", "model=tiny_random", "model/lora=none"),
        starts=f"error: ckpt={ckpt}: a glue/mrpc checkpoint, this export's task is imdb (the default data",
    )
    assert "valid: the data overrides of its run (glue/mrpc)" in line
    assert not out.exists()


def test_soup_of_mrpc_runs_exports_as_mrpc_without_overrides(soup, tmp_path):
    out = tmp_path / "hf"
    code, _, err = call(export_main, f"ckpt={soup}", f"out={out}", "format=hf", "check=none")
    assert code == 0, err[-3000:]
    config = json.loads((out / "config.json").read_text())
    assert config["id2label"] == MRPC_LABELS
    assert config["adls_inputs"]["task"] == "glue/mrpc" and config["adls_inputs"]["text_pair"] is True


def test_soup_is_refused_on_another_task_as_its_runs_are(soup, mrpc_runs, glue_root, cache_dir, tmp_path):
    refused_for_rte = ["data=glue", "data.task=rte", "model/lora=none", "train=false"]
    # a run's checkpoint is refused in train.py's code (this process) ...
    with pytest.raises(ConfigError) as refusal:
        train_run(
            tmp_path / "eval_run", [*refused_for_rte, f"ckpt_path={mrpc_runs[0]}"], glue_root, cache_dir
        )
    assert str(refusal.value).startswith(
        f"ckpt_path={mrpc_runs[0]}: a glue/mrpc checkpoint, this run's task is glue/rte"
    )
    # ... and the soup as it is, by the command: one line, exit code 2
    proc = run_train(glue_root, cache_dir, tmp_path / "eval_soup", *refused_for_rte, f"ckpt_path={soup}")
    assert_one_line_error(
        proc, starts=f"error: ckpt_path={soup}: a glue/mrpc checkpoint, this run's task is glue/rte"
    )
