"""An evaluation-only pruning run (``train=false``: one-shot on a fine-tuned model) saves the model it evaluated as
``<run>/checkpoints/compressed.ckpt``, as a PTQ run does: the masks and SparseGPT's solved weights exist nowhere
else. With PTQ in the same run, one checkpoint holds both records. The checkpoint reloads (``init_ckpt=``) and
exports like a PTQ run's."""

from __future__ import annotations

import logging

import pytest
import torch

from adls_lightning.compression_record import COMPRESSED_CHECKPOINT, CompressionRecord
from adls_lightning.runs.loading import load_checkpoint_model
from adls_lightning.tools.export import main as export_main
from tests.helpers import SHORT_RUN, call, recorded_run, train_run

EVALUATION_ONLY = [*SHORT_RUN, "model/lora=none", "train=false", "prune.calibration.batches=2"]


@pytest.fixture(scope="module")
def sparsegpt_run(tmp_path_factory, tiny_imdb_dir, cache_dir):
    out = tmp_path_factory.mktemp("sparsegpt") / "run"
    monkeypatch = pytest.MonkeyPatch()
    try:
        metrics, recorder = recorded_run(
            out, [*EVALUATION_ONLY, "prune=sparsegpt_0.5"], tiny_imdb_dir, cache_dir, monkeypatch
        )
    finally:
        monkeypatch.undo()
    return out, metrics, recorder


def test_evaluation_only_pruning_saves_the_model_it_tested(sparsegpt_run):
    run, metrics, recorder = sparsegpt_run
    ckpt = run / "checkpoints" / COMPRESSED_CHECKPOINT
    assert ckpt.is_file(), sorted(p.name for p in run.rglob("*"))
    checkpoint = torch.load(ckpt, weights_only=False)
    record = CompressionRecord.from_checkpoint(checkpoint, "test")
    assert record is not None and record.pruning is not None and record.quantization is None
    assert record.pruning.weight["method"] == "sparsegpt" and record.pruning.weight["sparsity"] == 0.5
    masks = [
        value
        for key, value in checkpoint["state_dict"].items()
        if key.endswith("parametrizations.weight.0.mask")
    ]
    # tiny_random: 13 pruned linear layers (the classifier excluded), each with exactly half its weights masked
    assert len(masks) == 13
    assert all(float((mask == 0).float().mean()) == 0.5 for mask in masks)
    # the checkpoint alone rebuilds the model the run tested: SparseGPT's solved weights and masks, not the dense ones
    rebuilt = load_checkpoint_model(ckpt, []).model
    assert recorder.batches
    with torch.inference_mode():
        for inputs, expected in zip(recorder.batches, recorder.logits, strict=True):
            torch.testing.assert_close(rebuilt(**inputs).logits, expected, rtol=1e-5, atol=1e-5)


def test_the_saved_model_exports_and_loads_as_init_ckpt(sparsegpt_run, tmp_path, tiny_imdb_dir, cache_dir):
    run, metrics, _ = sparsegpt_run
    ckpt = run / "checkpoints" / COMPRESSED_CHECKPOINT
    code, _, stderr = call(export_main, f"ckpt={ckpt}", f"out={tmp_path / 'hf'}", "format=hf")
    assert code == 0, stderr[-3000:]
    assert (tmp_path / "hf" / "config.json").is_file()
    # the next step of the road: evaluate it again (its masks load into the run's placeholders, and are kept)
    again = train_run(
        tmp_path / "again",
        [*SHORT_RUN, "model/lora=none", "train=false", f"init_ckpt={ckpt}", "prune=l1_0.5"],
        tiny_imdb_dir,
        cache_dir,
    )
    assert again["prune/weight_sparsity"] == pytest.approx(0.5)
    assert again["test/acc"] == pytest.approx(metrics["test/acc"])


def test_pruning_and_ptq_evaluated_together_save_one_checkpoint(tmp_path, tiny_imdb_dir, cache_dir, caplog):
    overrides = [*EVALUATION_ONLY, "prune=wanda_0.5", "quant=int8", "quant.mode=ptq"]
    with caplog.at_level(logging.INFO, logger="adls_lightning.callbacks.evaluated_model"):
        train_run(tmp_path / "run", overrides, tiny_imdb_dir, cache_dir)
    saved = [r.getMessage() for r in caplog.records if "the evaluated model saved" in r.getMessage()]
    assert len(saved) == 1, saved
    ckpt = tmp_path / "run" / "checkpoints" / COMPRESSED_CHECKPOINT
    record = CompressionRecord.from_checkpoint(torch.load(ckpt, weights_only=False), "test")
    assert record.pruning is not None and record.pruning.weight["method"] == "wanda"
    assert (
        record.quantization is not None and record.quantization.mode == "ptq" and record.quantization.applied
    )


def test_a_training_pruning_run_keeps_its_fit_checkpoints_only(tmp_path, tiny_imdb_dir, cache_dir):
    """A fit's best checkpoint holds its masks already: no second copy."""
    train_run(tmp_path / "run", [*SHORT_RUN, "model/lora=none", "prune=l1_0.5"], tiny_imdb_dir, cache_dir)
    assert not (tmp_path / "run" / "checkpoints" / COMPRESSED_CHECKPOINT).exists()
    assert list((tmp_path / "run" / "checkpoints").glob("best-*.ckpt"))
