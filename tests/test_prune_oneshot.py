"""One-shot pruning from calibration data (Wanda, SparseGPT) and N:M patterns, against expectations computed here:
Wanda's mask from |W|·‖X‖ on hand-made inputs, SparseGPT against a direct float64 version of the paper's update
(inverse Hessian downdated column by column, no Cholesky, no lazy blocks), exact 2:4 groups on every pruned linear,
exact counts, one-line errors, the reload of SparseGPT's weights and a run of ``train.py``."""

from __future__ import annotations

import json

import pytest
import torch
from hydra.utils import instantiate
from torch import nn

from adls_lightning.errors import ConfigError
from adls_lightning.obs import LayerInputs
from adls_lightning.prune import (
    MaskSpec,
    Pruner,
    SparseGPTConfig,
    find_prune_targets,
    num_to_prune,
    sparsegpt,
)
from tests.helpers import assert_one_line_error, layer_problem, run_train

SMALL = ["data.train_size=64", "data.val_size=32", "data.test_size=32", "data.max_length=32"]


def inputs_of(x: torch.Tensor) -> LayerInputs:
    return LayerInputs(x.T @ x, x.shape[0])


def one_linear(weight: torch.Tensor) -> nn.Sequential:
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    with torch.no_grad():
        layer.weight.copy_(weight)
    return nn.Sequential(layer)


def prune_one_linear(weight, batches, **spec):
    """Prunes a one-layer model with calibration ``batches`` (a list of input tensors); returns its layer."""
    model = one_linear(weight)
    Pruner(weight=spec, exclude=None).prune(model, batches, model, len(batches))
    return model[0]


def output_error(weight, pruned, x):
    return float(((x @ weight.T) - (x @ pruned.T)).square().sum())


def test_wanda_mask_is_the_lowest_weight_times_input_norm_of_each_row():
    weight, _ = layer_problem(6, 16, 1)
    # hand-made calibration inputs: two batches (3 samples x 5 tokens), feature j scaled by (j + 1) ** 2 / 16
    generator = torch.Generator().manual_seed(3)
    batches = [
        torch.randn(3, 5, 16, generator=generator) * (torch.arange(16.0) + 1) ** 2 / 16 for _ in range(2)
    ]
    tokens = torch.cat([b.reshape(-1, 16) for b in batches])
    norms = torch.sqrt((tokens**2).sum(dim=0))  # ‖X_j‖₂ over all 30 calibration tokens
    scores = weight.abs() * norms
    expected = torch.ones_like(weight, dtype=torch.bool)
    for row in range(6):
        expected[row, scores[row].argsort()[:8]] = False  # each output row loses its 8 lowest scores
    layer = prune_one_linear(weight, batches, sparsity=0.5, method="wanda")
    assert torch.equal(layer.parametrizations.weight[0].mask, expected)
    assert torch.equal(layer.parametrizations.weight.original, weight)  # Wanda does not change kept weights
    assert torch.equal(layer.weight, weight * expected)
    l1 = weight.abs() >= weight.abs().sort(dim=1).values[:, 8:9]
    assert not torch.equal(expected, l1)  # the input norms changed the choice: not magnitude pruning


def test_wanda_counts_are_exact_per_row():
    weight, x = layer_problem(5, 13, 40, seed=4)
    layer = prune_one_linear(weight, [x], sparsity=0.3, method="wanda")
    zeros = (layer.weight == 0).sum(dim=1)
    assert zeros.tolist() == [num_to_prune(13, 0.3)] * 5  # round(3.9) = 4 in every row


def direct_sparsegpt(weight, h, sparsity, damp, block, nm=None):
    """The paper's algorithm without the Cholesky reformulation or lazy updates, in float64: column by column,
    prune, spread ``err * Hinv[i, j] / Hinv[i, i]`` over the later columns j, then remove i from ``Hinv`` by Gaussian
    elimination. Masks: at each block start over the whole block (exact count up to the block end) or per group of
    M (keep N), by ``w² / [H_F⁻¹]_jj`` with ``F`` the columns from ``j`` on (the trailing submatrix inverted)."""
    w = weight.double().clone()
    h = h.double().clone()
    h += damp * h.diagonal().mean() * torch.eye(h.shape[0], dtype=torch.float64)
    inverse = torch.linalg.inv(h)
    out, columns = w.shape
    pruned = torch.zeros(out, columns, dtype=torch.bool)
    obs = torch.tensor([torch.linalg.inv(h[j:, j:])[0, 0] for j in range(columns)], dtype=torch.float64)
    for i in range(columns):
        if nm is None and i % block == 0:
            end = min(i + block, columns)
            saliency = (w[:, i:end] ** 2 / obs[i:end]).flatten()
            k = round(sparsity * out * end) - round(sparsity * out * i)
            flat = torch.zeros(saliency.numel(), dtype=torch.bool)
            flat[saliency.argsort(stable=True)[:k]] = True
            pruned[:, i:end] = flat.view(out, end - i)
        elif nm is not None and i % nm[1] == 0:
            n, m = nm
            saliency = w[:, i : i + m] ** 2 / obs[i : i + m]
            for row in range(out):
                pruned[row, i + saliency[row].argsort(stable=True)[: m - n]] = True
        kept = w[:, i].masked_fill(pruned[:, i], 0.0)
        error = (w[:, i] - kept) / inverse[i, i]
        w[:, i + 1 :] -= error[:, None] * inverse[i, i + 1 :][None, :]
        w[:, i] = kept
        inverse -= inverse[:, i : i + 1] @ inverse[i : i + 1, :] / inverse[i, i]
    return ~pruned, w.float()


@pytest.mark.parametrize(
    ("spec", "nm"), [({"sparsity": 0.5}, None), ({"sparsity": 0.3}, None), ({"pattern": "2:4"}, (2, 4))]
)
def test_sparsegpt_equals_the_papers_direct_update(spec, nm):
    weight, x = layer_problem(6, 16, 200)
    mask_spec = MaskSpec.from_config({"method": "sparsegpt", **spec}, "prune.weight")
    config = SparseGPTConfig(damp=0.01, block_size=4)  # 4 lazy blocks of 4 columns
    keep, solved = sparsegpt(weight, inputs_of(x), mask_spec, config)
    expected_keep, expected = direct_sparsegpt(weight, 2 * x.T @ x / 200, mask_spec.sparsity, 0.01, 4, nm)
    assert torch.equal(keep, expected_keep)
    torch.testing.assert_close(solved, expected, rtol=0, atol=1e-4)
    assert bool((solved[~keep] == 0).all())
    assert not torch.allclose(solved[keep], weight[keep])  # the kept weights compensate
    # the layer's exact count although 0.3 x 6 x 4 = 7.2 per block: blocks take 7, 7, 8, 7 (cumulative rounding)
    assert int((~keep).sum()) == num_to_prune(weight.numel(), mask_spec.sparsity)


def test_sparsegpt_reconstructs_better_than_magnitude_and_wanda_at_half():
    weight, x = layer_problem(32, 64, 512, seed=1)
    l1 = prune_one_linear(weight, [x], sparsity=0.5, method="l1").weight
    wanda = prune_one_linear(weight, [x], sparsity=0.5, method="wanda").weight
    solved = prune_one_linear(weight, [x], sparsity=0.5, method="sparsegpt").weight
    assert (solved == 0).sum() == (l1 == 0).sum() == (wanda == 0).sum() == weight.numel() // 2
    errors = {
        name: output_error(weight, w.detach(), x)
        for name, w in [("l1", l1), ("wanda", wanda), ("sgpt", solved)]
    }
    assert errors["sgpt"] < 0.5 * errors["l1"], errors
    assert errors["sgpt"] < errors["wanda"] < errors["l1"], errors


@pytest.mark.parametrize("method", ["l1", "random", "wanda", "sparsegpt"])
def test_2_of_4_holds_exactly_on_every_pruned_linear(method, tiny_bert):
    model = tiny_bert()
    generator = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 100, (4, 12), generator=generator) for _ in range(2)]
    pruner = Pruner(weight={"method": method, "pattern": "2:4"}, sparsegpt={"block_size": 8})
    pruner.prune(model, batches, lambda ids: model(input_ids=ids), 2)
    targets = find_prune_targets(model)
    assert len(targets) == 13  # every encoder linear and the pooler (not the classifier)
    for target in targets:
        mask = target.linear.parametrizations.weight[0].mask
        groups = (target.linear.weight == 0).reshape(-1, 4)
        assert bool((groups.sum(dim=1) == 2).all()), target.name  # exactly 2 zeros in every group of 4
        assert torch.equal(groups, ~mask.reshape(-1, 4)), target.name  # and they are the masked ones
    assert pruner.weight_sparsity(model) == 0.5
    assert bool(pruner.solved) == (method == "sparsegpt")


def test_pattern_of_a_score_keeps_the_highest_of_each_group():
    weight = torch.tensor(
        [[4.0, -1.0, 3.0, 2.0, 0.5, -0.6, 0.7, 0.8], [1.0, 1.0, 1.0, 1.0, -5.0, 6.0, 7.0, 8.0]]
    )
    keep = Pruner(weight={"method": "l1", "pattern": "1:4"}, exclude=None).prune(model := one_linear(weight))
    assert keep == {"0": 0.75}
    expected = [[1, 0, 0, 0, 0, 0, 0, 1], [0, 0, 0, 1, 0, 0, 0, 1]]  # ties: the lower index is pruned first
    assert model[0].parametrizations.weight[0].mask.int().tolist() == expected


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["prune=wanda_0.5", "prune.calibration.batches=0"],
            "prune.calibration.batches=0: prune.weight.method=wanda prunes from calibration data; give N >= 1",
        ),
        (
            ["prune=sparsegpt_0.5", "prune.calibration.batches=-1"],
            "prune.calibration.batches=-1: must be an integer",
        ),
        (
            ["prune=l1_2of4", "prune.weight.pattern=4:2"],
            "prune.weight.pattern='4:2': must be a string 'N:M' with",
        ),
        (["prune=l1_2of4", "prune.weight.pattern=2-4"], "prune.weight.pattern='2-4': must be a string 'N:M'"),
        (
            ["prune=l1_2of4", "prune.weight.sparsity=0.3"],
            "prune.weight.sparsity=0.3: prune.weight.pattern='2:4' prunes 2 of every 4 weights; set "
            "prune.weight.sparsity=0.5 or null",
        ),
        (["prune=wanda_0.5", "prune.weight.scope=global"], "prune.weight.scope='global': the method 'wanda'"),
        (
            ["prune=l1_0.5", "prune.activation.method=wanda"],
            "prune.activation.method='wanda': must be one of l1, random",
        ),
        (
            ["prune=sparsegpt_0.5", "prune.weight.pattern=2:4", "prune.sparsegpt.block_size=6"],
            "prune.sparsegpt.block_size=6: must be a multiple of M=4",
        ),
        (
            ["prune=sparsegpt_0.5", "prune.sparsegpt.damp=0"],
            "prune.sparsegpt.damp=0: must be a number in (0, 1)",
        ),
        (
            ["prune=l1_0.5", "prune.weight.method=obs"],
            "prune.weight.method='obs': must be one of l1, random, wanda",
        ),
        (
            ["compress=int8_l1_0.5", "compress.prune.weight.method=wanda"],
            "compress.prune.weight.method=wanda: one-shot methods need calibration batches",
        ),
    ],
)
def test_bad_values_fail_on_construction_in_one_line(compose_cfg, overrides, message):
    group = overrides[0].split("=")[0]
    with pytest.raises(ConfigError) as err:
        instantiate(compose_cfg(overrides)[group], _convert_="partial")
    assert str(err.value).startswith(message) and "\n" not in str(err.value), str(err.value)


def test_a_pattern_that_does_not_divide_a_layer_fails_before_pruning(tiny_bert):
    pruner = Pruner(weight={"method": "l1", "pattern": "3:5"})
    with pytest.raises(ConfigError) as err:
        pruner.register_placeholders(tiny_bert())
    assert str(err.value).startswith(
        "prune.weight.pattern='3:5': layer bert.encoder.layer.0.attention.self.query has 32 input features, not a "
        "multiple of 5"
    )
    with pytest.raises(
        ConfigError, match=r"^prune.weight.method='wanda': prunes from calibration data; give"
    ):
        Pruner(weight={"method": "wanda", "sparsity": 0.5}).prune(tiny_bert())  # no batches given


def test_sparsegpt_weights_are_what_validation_and_test_score_and_reload(compose_cfg, tmp_path):
    """An evaluation stage reloads the dense checkpoint SparseGPT solved from: the solved weights go back in; a
    checkpoint saved after pruning brings back its masks and solved weights by itself."""
    import lightning as L

    cfg = compose_cfg([*SMALL, "model/lora=none", "prune=sparsegpt_0.5", "prune.calibration.batches=2"])
    datamodule = instantiate(cfg.data)
    quiet = {"logger": False, "enable_progress_bar": False, "enable_model_summary": False}
    dense_model = instantiate(cfg.model, _convert_="partial")
    trainer = L.Trainer(max_epochs=1, limit_train_batches=2, enable_checkpointing=False, **quiet)
    trainer.fit(dense_model, datamodule=datamodule)
    dense = tmp_path / "dense.ckpt"
    trainer.save_checkpoint(dense)
    key = "model.bert.encoder.layer.0.output.dense.weight"
    dense_weight = torch.load(dense, weights_only=True)["state_dict"][key]

    model = instantiate(cfg.model, _convert_="partial")
    trainer = L.Trainer(callbacks=[instantiate(cfg.prune, _convert_="partial")], **quiet)
    trainer.validate(model, datamodule=datamodule, ckpt_path=dense, verbose=False)
    layer = model.model.bert.encoder.layer[0].output.dense
    mask = layer.parametrizations.weight[0].mask.clone()
    solved = layer.parametrizations.weight.original.detach().clone()
    assert float((~mask).float().mean()) == 0.5
    assert not torch.equal(solved[mask], dense_weight[mask])  # compensated
    trainer.test(model, datamodule=datamodule, ckpt_path=dense, verbose=False)
    assert torch.equal(layer.parametrizations.weight.original, solved)  # not the reloaded dense weights
    assert torch.equal(layer.parametrizations.weight[0].mask, mask)
    pruned = tmp_path / "pruned.ckpt"
    trainer.save_checkpoint(pruned)

    fresh = instantiate(cfg.model, _convert_="partial")
    callback = instantiate(cfg.prune, _convert_="partial")
    L.Trainer(callbacks=[callback], **quiet).test(
        fresh, datamodule=datamodule, ckpt_path=pruned, verbose=False
    )
    fresh_layer = fresh.model.bert.encoder.layer[0].output.dense
    assert callback.applied and not callback.pruner.solved  # learnt from the loaded masks, not pruned again
    assert torch.equal(fresh_layer.parametrizations.weight[0].mask, mask)
    assert torch.equal(fresh_layer.parametrizations.weight.original, solved)


def test_wanda_preset_runs_through_train_py(tiny_imdb_dir, cache_dir, tmp_path):
    out = tmp_path / "wanda"
    proc = run_train(
        tiny_imdb_dir,
        cache_dir,
        out,
        *SMALL,
        "prune=wanda_0.5",
        "prune.calibration.batches=2",
        "trainer.max_epochs=1",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "prune: wanda masks from 2 calibration batches" in proc.stderr + proc.stdout
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["prune/weight_sparsity"] == 0.5
    assert 0.0 <= metrics["test/acc"] <= 1.0


def test_wanda_without_calibration_batches_is_one_line_on_the_command_line(
    tiny_imdb_dir, cache_dir, tmp_path
):
    proc = run_train(
        tiny_imdb_dir, cache_dir, tmp_path / "bad", "prune=wanda_0.5", "prune.calibration.batches=0"
    )
    assert_one_line_error(proc, "error: prune.calibration.batches=0: prune.weight.method=wanda prunes from")
