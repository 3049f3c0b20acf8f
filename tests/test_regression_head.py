"""Where a regression's new output layer starts (``model.regression_bias_init``): at the training targets' mean by
default, at the backbone's zero with ``zero``; a classification head and a head loaded from ``init_ckpt`` untouched.
Each run trains one step at a rate too small to move a weight, so its checkpoint holds the head as it started."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
import torch

from adls_lightning.app.training import run
from adls_lightning.build import build
from tests.glue_layouts import write_glue_task

HEAD_BIAS = "model.base_model.model.classifier.modules_to_save.default.bias"
FROZEN = ["model.optimizer.lr=1e-9"]  # AdamW moves each weight by about lr per step: the start stays readable


def all_rows_overrides(root: Path, task: str) -> list[str]:
    """One epoch over every training row (no batch limit: a limit would also cap the rows the run reads)."""
    return [
        "data=glue",
        f"data.task={task}",
        f"data.data_dir={root}",
        "data.val_size=20",
        "data.batch_size=32",
    ]


def head_bias(out: Path) -> torch.Tensor:
    ckpt = next((out / "checkpoints").glob("best-*.ckpt"))
    return torch.load(ckpt, map_location="cpu", weights_only=False)["state_dict"][HEAD_BIAS]


def training_targets_mean(cfg, root: Path) -> float:
    """The train.tsv scores less the rows the run carved out for validation, summed here from the file."""
    scores = pd.read_csv(root / "STS-B" / "train.tsv", sep="\t", quoting=3)["score"].astype("float64")
    datamodule = build(cfg.data, "data")
    datamodule.setup("fit")
    carved = datamodule.splits["val"]["label"][:].double()
    return (scores.sum() - carved.sum().item()) / (len(scores) - len(carved))


def test_a_regression_head_starts_at_the_training_targets_mean(compose_cfg, tmp_path, caplog):
    root = write_glue_task(tmp_path / "glue", "stsb")
    cfg = compose_cfg([*all_rows_overrides(root, "stsb"), *FROZEN])
    expected = training_targets_mean(cfg, root)
    assert 1.0 < expected < 4.0  # the fixture's scores: far from the zero a fresh layer starts at
    with caplog.at_level("INFO", logger="adls_lightning.module"):
        run(cfg)
    assert head_bias(tmp_path / "run").tolist() == pytest.approx([expected], abs=1e-5)
    assert f"output bias starts at the training targets' mean {expected:.4f}" in caplog.text

    run(
        compose_cfg(
            [*all_rows_overrides(root, "stsb"), *FROZEN, "model.regression_bias_init=zero"], tmp_path / "z"
        )
    )
    assert head_bias(tmp_path / "z").tolist() == pytest.approx([0.0], abs=1e-5)


def test_a_head_from_init_ckpt_keeps_its_bias_and_a_new_one_starts_at_the_mean(compose_cfg, tmp_path):
    root = write_glue_task(tmp_path / "glue", "stsb")
    run(compose_cfg([*all_rows_overrides(root, "stsb"), *FROZEN], tmp_path / "first"))
    ckpt = next((tmp_path / "first" / "checkpoints").glob("best-*.ckpt"))
    checkpoint = torch.load(ckpt, map_location="cpu", weights_only=False)
    checkpoint["state_dict"][HEAD_BIAS] = torch.tensor([7.0])  # a trained head, far from the targets' mean
    torch.save(checkpoint, tmp_path / "trained.ckpt")

    cfg = compose_cfg([*all_rows_overrides(root, "stsb"), *FROZEN, f"init_ckpt={tmp_path / 'trained.ckpt'}"])
    run(cfg)
    assert head_bias(tmp_path / "run").tolist() == pytest.approx([7.0], abs=1e-5)

    new_head = [
        *all_rows_overrides(root, "stsb"),
        *FROZEN,
        f"init_ckpt={tmp_path / 'trained.ckpt'}",
        "init_head=new",
    ]
    run(compose_cfg(new_head, tmp_path / "new"))
    assert head_bias(tmp_path / "new").tolist() == pytest.approx([training_targets_mean(cfg, root)], abs=1e-5)


def test_a_classification_head_keeps_its_initialisation(compose_cfg, tmp_path):
    root = write_glue_task(tmp_path / "glue", "mrpc")
    run(compose_cfg([*all_rows_overrides(root, "mrpc"), *FROZEN]))
    assert head_bias(tmp_path / "run").tolist() == pytest.approx([0.0, 0.0], abs=1e-5)
