"""A folder task's labels and metrics, as a new user writes them: ``data.main_metric`` is one of the metrics the
run logs (``data.metrics`` when given), a class with a single training row and integer labels that are not 0..K-1
are refused in one line naming the file, and ``data.labels`` maps any integers to ids."""

from __future__ import annotations

import json
import os
import re
import subprocess

import pandas as pd
import pytest

from adls_lightning.build import build
from adls_lightning.data.folder import load_folder
from adls_lightning.errors import ConfigError
from tests.helpers import ROOT, assert_one_line_error, make_reviews, run_train, train_cmd


def write_folder(folder, train: pd.DataFrame, test: pd.DataFrame, suffix: str = "parquet"):
    folder.mkdir()
    for split, frame in (("train", train), ("test", test)):
        path = folder / f"{split}.{suffix}"
        frame.to_csv(path, index=False) if suffix == "csv" else frame.to_parquet(path)
    return folder


def named(frame: pd.DataFrame, names: list[str]) -> pd.DataFrame:
    """``frame`` with its 0/1 labels as ``names``, every third row relabelled ``names[2]`` when there is one."""
    out = frame.assign(label=[names[v] for v in frame["label"]])
    if len(names) > 2:
        out.loc[::3, "label"] = names[2]
    return out


def test_main_metric_may_be_any_of_data_metrics(compose_cfg, tmp_path):
    # extending.md section 6's command: three classes, whose default metrics are acc alone
    three = ["negative", "positive", "neutral"]
    own = write_folder(
        tmp_path / "own", named(make_reviews(200, 0), three), named(make_reviews(40, 1), three)
    )
    mcc_first = ["data.main_metric=mcc", "data.metrics=[mcc,acc]"]
    folder = [
        "data=folder",
        f"data.data_dir={own}",
        "data.labels=[negative,neutral,positive]",
        "data.val_size=20",
    ]
    for overrides in (folder, ["data.val_size=50"]):  # the folder task, and IMDb (whose defaults are acc, f1)
        data = build(compose_cfg([*overrides, *mcc_first]).data, "data")
        data.setup("fit")
        assert data.task.metrics == ("mcc", "acc")
    # the check still holds against the metrics given
    data = build(compose_cfg([*folder, "data.main_metric=f1", "data.metrics=[mcc,acc]"]).data, "data")
    with pytest.raises(
        ConfigError, match=r"^data\.main_metric=f1: not a metric of this task \(its metrics: mcc, acc\)"
    ):
        data.setup("fit")
    _, _, task = load_folder(own, None, None, "mcc", metrics=["acc", "mcc"])
    assert task.metrics == ("mcc", "acc")
    # a data.metrics that is no list is the data module's to refuse by name, not a main-metric error here
    assert load_folder(own, None, None, "mcc", metrics="mcc")[2].metrics == ("acc",)


def test_the_documented_command_with_its_own_main_metric_runs(tmp_path, cache_dir):
    """extending.md section 6's command through train.py: the pre-flight check reads the metrics given too."""
    three = ["negative", "positive", "neutral"]
    own = write_folder(
        tmp_path / "own", named(make_reviews(200, 0), three), named(make_reviews(40, 1), three)
    )
    out = tmp_path / "run"
    proc = run_train(
        own, cache_dir, out, "data=folder", "data.labels=[negative,neutral,positive]", "data.main_metric=mcc",
        "data.metrics=[mcc,acc]", "data.val_size=20", "trainer.max_epochs=1",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert {"val/mcc", "test/mcc", "val/acc"} <= set(json.loads((out / "metrics.json").read_text()))


def test_a_label_with_one_training_row_is_one_line_naming_it_and_the_file(tmp_path, cache_dir):
    train = named(make_reviews(200, 0), ["negative", "positive"])
    train.loc[5, "label"] = "postive"  # a typo
    own = write_folder(tmp_path / "own", train, named(make_reviews(40, 1), ["negative", "positive"]), "csv")
    proc = run_train(own, cache_dir, tmp_path / "out", "data=folder")
    line = assert_one_line_error(proc, contains=f"{own / 'train.csv'}: label 'postive' has a single row")
    assert "at least 2 training rows" in line


def test_integer_labels_not_from_zero_are_refused_unless_data_labels_lists_them(
    compose_cfg, tmp_path, cache_dir
):
    train, test = make_reviews(200, 0), make_reviews(40, 1)
    one_two = write_folder(
        tmp_path / "own", train.assign(label=train.label + 1), test.assign(label=test.label + 1)
    )
    proc = run_train(one_two, cache_dir, tmp_path / "out", "data=folder")
    line = assert_one_line_error(
        proc, contains=f"{one_two / 'train.parquet'}: integer labels 1, 2 are not 0..K-1"
    )
    assert "data.labels=[1,2]" in line
    # as the message says: data.labels takes them as two classes, 1 -> id 0 and 2 -> id 1
    cfg = compose_cfg(["data=folder", f"data.data_dir={one_two}", "data.labels=[1,2]", "data.val_size=20"])
    data = build(cfg.data, "data")
    data.setup("fit")
    assert (data.task.label_names, data.task.metrics) == (("1", "2"), ("acc", "f1"))
    assert sorted(data.splits["test"].with_format(None)["label"]) == sorted(
        test["label"].tolist()
    )  # ids: 1 -> 0, 2 -> 1


def test_a_missing_label_names_the_file(tmp_path):
    train = make_reviews(40, 0).astype({"label": "object"})
    train.loc[3, "label"] = None
    own = write_folder(tmp_path / "own", train, make_reviews(10, 1))
    with pytest.raises(
        ConfigError, match=rf"^data\.data_dir: {re.escape(str(own / 'train.parquet'))}: row 3 has label None"
    ):
        load_folder(own, None, None, None)


def test_data_folder_without_data_dir_says_what_to_give(tmp_path, cache_dir):
    """``data=folder`` alone: one line naming data.data_dir and the folder it needs (not IMDb's ``auto``)."""
    out = tmp_path / "out"
    cmd = [
        arg
        for arg in train_cmd(tmp_path, cache_dir, out, "data=folder")
        if not arg.startswith("data.data_dir=")
    ]
    proc = subprocess.run(
        cmd,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    line = assert_one_line_error(proc, starts="error: data.data_dir: required by data=folder")
    assert "data.data_dir=<your folder>" in line and "auto" not in line
    assert "one train and one test file (.parquet/.csv/.jsonl/.json)" in line and "data.hub_name=" in line
    assert not out.exists()  # refused before the run folder is made


@pytest.mark.parametrize("name", ["validation.csv", "val.parquet", "dev.jsonl"])
def test_a_validation_file_is_refused_naming_it(tmp_path, cache_dir, name):
    """A folder with its own validation file: one line naming it, not a run that silently trains without it."""
    own = write_folder(tmp_path / "own", make_reviews(200, 0), make_reviews(40, 1), "csv")
    (own / name).write_text("text,label\ngreat,1\n")
    proc = run_train(own, cache_dir, tmp_path / "out", "data=folder")
    line = assert_one_line_error(proc, starts=f"error: data.data_dir={own}: {name} is not read")
    assert (
        "carved out of the train file (data.val_size rows" in line
        and f"move {name} out of the folder" in line
    )
    # the same refusal from the library, wherever the folder is read
    with pytest.raises(
        ConfigError, match=rf"^data\.data_dir={re.escape(str(own))}: {re.escape(name)} is not"
    ):
        load_folder(own, None, None, None)
