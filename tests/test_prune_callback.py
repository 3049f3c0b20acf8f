"""PruningCallback and CompressionCallback inside real training runs (tiny BERT, small synthetic IMDb)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hydra.utils import instantiate

from adls_lightning.app.training import run
from adls_lightning.errors import ConfigError
from adls_lightning.prune import MaskSpec, compute_weight_masks
from tests.helpers import assert_one_line_error, run_train

# 64 training rows = 8 steps of 8 per epoch; short sequences keep every run to a few seconds of compute.
SMALL = ["data.train_size=64", "data.val_size=32", "data.test_size=32", "data.max_length=32"]
STEPS_PER_EPOCH = 8
MASK_SUFFIX = ".parametrizations.weight.0.mask"
# tiny_random: 2 layers x (q, k, v, attention.output 32x32; intermediate 64x32; output 32x64) + pooler 32x32
TINY_PRUNED_WEIGHTS = 2 * (4 * 32 * 32 + 2 * 64 * 32) + 32 * 32


def checkpoint_masks(path: Path) -> dict[str, torch.Tensor]:
    state = torch.load(path, map_location="cpu", weights_only=True)["state_dict"]
    return {key: value for key, value in state.items() if key.endswith(MASK_SUFFIX)}


@pytest.mark.slow
def test_prune_preset_reports_counted_sparsity(compose_cfg):
    metrics = run(compose_cfg([*SMALL, "prune=l1_0.5"]))
    assert metrics["prune/weight_sparsity"] == 0.5  # every tiny layer has an even weight count
    # each sample's input to a pruned layer has exactly half its entries zeroed (even sizes); natural zeros add
    assert 0.5 <= metrics["prune/act_sparsity"] < 0.51


@pytest.mark.slow
def test_global_scope_weight_only_and_permanent_from_command_line(compose_cfg):
    overrides = [
        "prune=random_0.3",
        "prune.weight.scope=global",
        "prune.activation=null",
        "prune.make_permanent=true",
    ]
    metrics = run(compose_cfg([*SMALL, *overrides]))
    # zeros are still counted exactly after the masks were baked into plain weights at the end of each stage
    # (and the validate/test stages re-created the structure to load the best checkpoint's masks)
    assert metrics["prune/weight_sparsity"] == round(0.3 * TINY_PRUNED_WEIGHTS) / TINY_PRUNED_WEIGHTS
    assert metrics["prune/act_sparsity"] < 0.01  # no activation pruning: only natural zeros are counted


@pytest.mark.parametrize("at", ["fit_start", "1"])
def test_resumed_run_keeps_the_checkpoint_masks(compose_cfg, tmp_path, at):
    common = [*SMALL, "prune=random_0.5", f"prune.at={at}", "callbacks.last_checkpoint.every_n_train_steps=4"]
    # Run A stops in the middle of epoch 2; its last.ckpt (step 12) holds masks made before training or at epoch 1.
    first = run(
        compose_cfg([*common, "trainer.max_epochs=3", "+trainer.max_steps=12"], output_dir=tmp_path / "a")
    )
    saved = checkpoint_masks(tmp_path / "a/checkpoints/last.ckpt")
    assert len(saved) == 13
    shapes = {key: torch.empty(mask.shape) for key, mask in saved.items()}
    made_by_seed = {
        seed: compute_weight_masks(shapes, MaskSpec(0.5, "random"), torch.Generator().manual_seed(seed))
        for seed in (0, 1)
    }
    assert all(torch.equal(saved[key], made_by_seed[0][key]) for key in saved)
    # Run B resumes it with another mask seed (and model seed): recomputed masks would be seed 1's, restored ones
    # are A's. Pooler weights are trained and pruned, so the optimizer state must line up with the parameters.
    resumed = run(
        compose_cfg(
            [
                *common,
                "trainer.max_epochs=3",
                "seed=7",
                "prune.seed=1",
                f"ckpt_path={tmp_path}/a/checkpoints/last.ckpt",
            ],
            output_dir=tmp_path / "b",
        )
    )
    assert resumed["train/samples_seen"] == (3 * STEPS_PER_EPOCH - 12) * 8  # it did continue training
    final = checkpoint_masks(tmp_path / "b/checkpoints/last.ckpt")
    assert saved.keys() == final.keys()
    assert all(torch.equal(saved[key], final[key]) for key in saved)
    assert any(not torch.equal(final[key], made_by_seed[1][key]) for key in saved)
    assert resumed["prune/weight_sparsity"] == first["prune/weight_sparsity"] == 0.5


@pytest.mark.slow
def test_quant_and_prune_together(compose_cfg):
    metrics = run(compose_cfg([*SMALL, "quant=int8", "prune=l1_0.5"]))
    assert metrics["prune/weight_sparsity"] == 0.5
    assert metrics["quant/avg_weight_bits"] < 32
    assert 0.5 <= metrics["prune/act_sparsity"] < 0.51


@pytest.mark.slow
def test_compression_run_reports_before_after_and_final(compose_cfg):
    metrics = run(compose_cfg([*SMALL, "compress=int8_l1_0.5", "model.lora=null"]))
    for key in ("compress/val_acc_before", "compress/val_acc_after_compression", "compress/val_acc_final"):
        assert 0.0 <= metrics[key] <= 1.0
    assert metrics["prune/weight_sparsity"] == 0.5
    assert metrics["quant/avg_weight_bits"] < 32
    # trainer.max_epochs=1 in the config; the callback made it at_epoch + post_epochs = 2
    assert metrics["train/samples_seen"] == 2 * STEPS_PER_EPOCH * 8


@pytest.mark.slow
def test_compression_accuracies_match_independent_evaluations(compose_cfg, tmp_path):
    compressed = run(
        compose_cfg([*SMALL, "compress=int8_l1_0.5", "compress.post_epochs=0"], output_dir=tmp_path / "c")
    )
    assert compressed["train/samples_seen"] == STEPS_PER_EPOCH * 8
    assert compressed["compress/val_acc_final"] == compressed["compress/val_acc_after_compression"]
    # "after": the run's own final validation (best checkpoint, chosen among compressed ones) sees that model
    assert compressed["val/acc"] == pytest.approx(compressed["compress/val_acc_after_compression"], abs=1e-6)
    # "before": the same seed trained one epoch without compression reaches exactly that validation score
    dense = run(compose_cfg(SMALL, output_dir=tmp_path / "d"))
    assert compressed["compress/val_acc_before"] == pytest.approx(dense["val/acc"], abs=1e-6)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["prune=l1_0.5", "prune.weight.sparsity=1.0"],
            "prune.weight.sparsity=1.0: must be a number in [0.0, 1.0)",
        ),
        (
            ["prune=l1_0.5", "prune.activation.sparsity=-0.2"],
            "prune.activation.sparsity=-0.2: must be a number in [0.0, 1.0)",
        ),
        (
            ["prune=l1_0.5", "prune.weight.method=l2-norm"],
            "prune.weight.method='l2-norm': must be one of l1, random",
        ),
        (
            ["prune=l1_0.5", "prune.weight.scope=layer"],
            "prune.weight.scope='layer': must be one of local, global",
        ),
        (["prune=l1_0.5", "prune.at=0"], "prune.at=0: must be fit_start or a number of epochs >= 1"),
        (
            ["compress=int8_l1_0.5", "compress.prune.weight.sparsity=1"],
            "compress.prune.weight.sparsity=1: must",
        ),
        (["compress=int8_l1_0.5", "compress.at_epoch=0"], "compress.at_epoch=0: must be an integer >= 1"),
        (
            ["compress=int8_l1_0.5", "compress.quant.default.weight.format=int"],
            "compress.quant.default.weight",
        ),
    ],
)
def test_bad_preset_overrides_fail_on_construction(compose_cfg, overrides, message):
    cfg = compose_cfg(overrides)
    group = overrides[0].split("=")[0]
    with pytest.raises(ConfigError) as err:
        instantiate(
            cfg[group], _convert_="partial"
        )  # as adls_lightning.app.training.instantiate_callbacks does
    assert message in str(err.value) and "\n" not in str(err.value)


def test_prune_and_compress_pruning_together_is_refused(compose_cfg):
    with pytest.raises(ConfigError, match="compress.prune and prune= are both set"):
        run(compose_cfg([*SMALL, "compress=int8_l1_0.5", "prune=l1_0.5"]))


@pytest.mark.parametrize("at", [1, 5])
def test_prune_at_an_epoch_the_fit_never_starts_is_refused(compose_cfg, tmp_path, at):
    """prune.at=N prunes at the start of epoch N: with max_epochs <= N the run ended dense, rc 0, sparsity 0."""
    with pytest.raises(ConfigError) as err:
        run(compose_cfg([*SMALL, "prune=l1_0.5", f"prune.at={at}", "trainer.max_epochs=1"]))
    assert str(err.value).startswith(f"prune.at={at}: the fit has 1 epoch(s) (trainer.max_epochs=1)")
    assert "valid: prune.at < trainer.max_epochs, or prune.at=fit_start" in str(err.value)
    assert not list(tmp_path.rglob("*.ckpt"))  # refused before any training step


def test_train_py_refuses_prune_at_the_last_epoch_in_one_line(tiny_imdb_dir, cache_dir, tmp_path):
    """The user's command (pruning.md's prune.at=1 line without trainer.max_epochs=2): one line, exit 2, no run."""
    proc = run_train(
        tiny_imdb_dir,
        cache_dir,
        tmp_path / "run",
        *SMALL,
        "prune=l1_0.5",
        "prune.at=1",
        "trainer.max_epochs=1",
    )
    assert_one_line_error(proc, "error: prune.at=1: the fit has 1 epoch(s) (trainer.max_epochs=1)")
    assert not list(tmp_path.rglob("*.ckpt")) and not list(tmp_path.rglob("metrics.json"))


def test_prune_at_an_epoch_in_an_evaluation_only_run_of_dense_weights_is_refused(compose_cfg):
    with pytest.raises(ConfigError) as err:
        run(compose_cfg([*SMALL, "prune=l1_0.5", "prune.at=1", "train=false"]))
    assert str(err.value).startswith("prune.at=1: train=false trains no epoch")


def test_quant_and_compress_quantization_together_is_refused(compose_cfg, tmp_path):
    """quant=int4 would train an epoch and then be replaced by compress's int8 without a word: refused up front."""
    with pytest.raises(ConfigError) as err:
        run(compose_cfg([*SMALL, "compress=int8_l1_0.5", "quant=int4"]))
    assert str(err.value) == (
        "compress.quant and quant= are both set: quantize either from the start (quant=) or in compress"
    )
    assert not list(tmp_path.rglob("*.ckpt"))  # refused before any training step


@pytest.mark.slow
def test_fit_start_masks_come_from_the_init_ckpt_weights(compose_cfg, tmp_path):
    """init_ckpt loads after the callbacks' setup: fit_start pruning must rank the loaded weights, not the initial."""
    run(compose_cfg([*SMALL, "model/lora=none", "trainer.max_epochs=2", "model.optimizer.lr=5e-3"]))
    trained = next((tmp_path / "run/checkpoints").glob("best-*.ckpt"))
    state = torch.load(trained, map_location="cpu", weights_only=True)["state_dict"]
    # train=false: the evaluation-only run prunes at its first validation, from the init_ckpt weights
    overrides = [*SMALL, "model/lora=none", "prune=l1_0.5", "prune.activation=null", "train=false"]
    metrics = run(compose_cfg([*overrides, f"init_ckpt={trained}"], output_dir=tmp_path / "pruned"))
    assert metrics["prune/weight_sparsity"] == 0.5
    # the same pruning in a fit (lr ~ 0) saves its masks: they are the l1 masks of the checkpoint weights
    expected = compute_weight_masks(
        {k.removesuffix(".weight"): v for k, v in state.items() if k.endswith(".weight") and _pruned(k)},
        MaskSpec(0.5, "l1"),
        torch.Generator().manual_seed(0),
    )
    fitted = run(
        compose_cfg(
            [*overrides[:-1], f"init_ckpt={trained}", "trainer.max_epochs=1", "model.optimizer.lr=1e-12"],
            output_dir=tmp_path / "fitted",
        )
    )
    assert fitted["prune/weight_sparsity"] == 0.5
    saved = checkpoint_masks(next((tmp_path / "fitted/checkpoints").glob("best-*.ckpt")))
    assert len(saved) == len(expected) == 13
    for key, mask in saved.items():
        layer = key.removesuffix(MASK_SUFFIX)
        assert torch.equal(mask, expected[layer]), layer


def _pruned(key: str) -> bool:
    """The tiny BERT's linear weights that prune=... prunes: encoder linears and the pooler (not the classifier)."""
    return ("encoder.layer" in key and "LayerNorm" not in key) or "pooler.dense" in key
