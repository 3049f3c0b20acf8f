"""Per-channel activation scales (``scaled_integer`` ``granularity: embedding``; Bondarenko et al. 2021): one static,
calibrated scale per hidden channel of an activation. Checked against the per-channel max/127 formula in float64
(numpy), on the outlier channels that make one per-tensor scale fail BERT's residual stream, through QAT's
straight-through gradient and bf16, and through a checkpoint (saved, loaded into a fresh model, same logits)."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from adls_lightning.app.training import run
from adls_lightning.build import build
from adls_lightning.errors import ConfigError
from adls_lightning.quant import QuantRecipe, calibrate, make_quantizer, quantize_model
from adls_lightning.quant.points import quantized_points
from adls_lightning.quant.scaled import calibrating

HIDDEN = 48


def per_embedding() -> torch.nn.Module:
    return make_quantizer("scaled_integer", width=8, granularity="embedding")


def reference(x: np.ndarray, amax: np.ndarray, qmax: int = 127) -> np.ndarray:
    """Symmetric fake quantization in float64 with one step amax / qmax per column (last dimension)."""
    step = amax / qmax
    return np.clip(np.round(x / step), -qmax, qmax) * step


def residual_stream(seed: int = 0, outliers: tuple[int, ...] = (5, 17)) -> torch.Tensor:
    """Activations like MiniLM's FFN residual sum: ordinary channels of magnitude ~1, a few at 40x and more."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4, 32, HIDDEN, generator=g)
    for channel in outliers:
        x[..., channel] = x[..., channel] * 5 + 150.0  # max 120-220 as measured, the rest 99.9 % below 6-9
    return x


def test_calibrated_embedding_scales_are_the_per_channel_max_over_the_batches_in_float64():
    quantizer = per_embedding()
    batches = [residual_stream(seed) for seed in range(3)]
    with calibrating(quantizer):
        for batch in batches:
            assert torch.equal(quantizer(batch), batch)  # observing: passes values through
    quantizer.eval()
    assert quantizer.is_static and quantizer.min_val.shape == (HIDDEN,)
    stacked = np.concatenate([b.double().numpy().reshape(-1, HIDDEN) for b in batches])
    amax = np.abs(stacked).max(axis=0)  # per channel, over every token of every calibration batch
    assert np.allclose(quantizer.max_val.double().numpy(), stacked.max(axis=0), rtol=0, atol=0)
    # a new tensor is put on the recorded grids, not on its own range
    x = residual_stream(seed=9) * 0.8
    out = quantizer(x).double().numpy().reshape(-1, HIDDEN)
    expected = reference(x.double().numpy().reshape(-1, HIDDEN), amax)
    step = amax / 127
    # float32 vs float64: equal up to float32 rounding (a tie may land one step apart: none here)
    assert np.all(np.abs(out - expected) <= 1e-5 * step + 1e-6 * np.abs(expected))
    # each channel has its own step: at most 255 codes per channel, the outlier channels' step ~20x the others'
    codes = np.round(out / step)
    assert np.abs(codes).max() <= 127
    assert step[5] / np.median(step) > 20


def test_an_outlier_channel_ruins_a_per_tensor_scale_and_not_per_channel_ones():
    """Relative error per channel (||q(x) - x|| / ||x||): one per-tensor step sized by the outliers rounds the
    ordinary channels coarsely; one step per channel keeps every channel within 8-bit error."""
    calibration, x = residual_stream(seed=1), residual_stream(seed=2)
    errors = {}
    for granularity in ("tensor", "embedding"):
        quantizer = make_quantizer("scaled_integer", width=8, granularity=granularity)
        # the ranges cover x (no clipping): what is left is each grid's rounding
        calibrate(quantizer, [calibration, x], quantizer, count=2)
        out = quantizer.eval()(x).double().reshape(-1, HIDDEN)
        values = x.double().reshape(-1, HIDDEN)
        errors[granularity] = ((out - values).norm(dim=0) / values.norm(dim=0)).numpy()
    ordinary = np.setdiff1d(np.arange(HIDDEN), [5, 17])
    # per tensor: the step is ~1.3 (max ~160 / 127), so most ordinary channels (|x| ~ 1) lose 20 % and more
    assert (errors["tensor"][ordinary] > 0.2).sum() >= 0.9 * len(ordinary)
    # per channel: every channel, outliers included, within 2 %
    assert (errors["embedding"] > 0.02).sum() == 0
    assert errors["embedding"][[5, 17]].max() < 0.005


def test_qat_gradient_is_straight_through_inside_each_channels_range_and_bf16_keeps_its_dtype():
    quantizer = per_embedding()
    calibration = torch.randn(64, 8) * torch.arange(1, 9)  # channel c in about +-3c
    calibrate(quantizer, [calibration], quantizer, count=1)
    quantizer.eval()
    x = torch.zeros(2, 8)
    x[0] = calibration.abs().amax(0) * 0.5  # inside every channel's range
    x[1] = calibration.abs().amax(0) * 1.5  # outside: clipped, no gradient
    x.requires_grad_()
    quantizer(x).sum().backward()
    assert torch.equal(x.grad, torch.tensor([[1.0] * 8, [0.0] * 8]))
    # bf16: computed in float32, returned in bf16, the float32 result rounded to bf16
    xb = (torch.randn(3, 5, 8) * torch.arange(1, 9)).bfloat16()
    assert quantizer(xb).dtype == torch.bfloat16
    assert torch.equal(quantizer(xb), quantizer(xb.float()).bfloat16())
    # QAT's training updates move each channel's recorded range with the running average
    before = quantizer.max_val.clone()
    quantizer.train()(torch.full((4, 8), 100.0))
    assert torch.allclose(quantizer.max_val, before + 0.01 * (100.0 - before))


def test_a_tensor_with_other_channels_and_lsq_are_refused():
    quantizer = per_embedding()
    calibrate(quantizer, [torch.randn(4, 8)], quantizer, count=1)
    with pytest.raises(ValueError, match="recorded range has 8 channels, the tensor has 6"):
        quantizer.eval()(torch.randn(4, 6))
    with pytest.raises(ConfigError, match=r"^lsq=true: granularity embedding has no learned steps"):
        make_quantizer("scaled_integer", granularity="embedding", lsq=True)


def test_int8_scaled_all_gives_the_residual_stream_per_channel_scales_kept_through_a_checkpoint(
    compose_cfg, tiny_bert, tmp_path
):
    """The preset's LayerNorm inputs and residual summands are calibrated per hidden channel; a state dict saved
    after calibration loads into a freshly quantized model (its ranges sized from the checkpoint) with the same
    logits, and without it the fresh model's logits differ (dynamic scales)."""
    recipe: QuantRecipe = build(
        compose_cfg(["quant=int8_scaled_all"]).quant.config, "quant.config", _convert_="partial"
    )
    model = tiny_bert()
    quantize_model(model, recipe)
    hidden = model.config.hidden_size
    per_channel = {
        f"{name}.{operand}": q
        for name, kind, point in quantized_points(model)
        for operand, q in point.quantizers().items()
        if getattr(q, "granularity", None) == "embedding"
    }
    # 5 LayerNorm inputs (embeddings + 2 per block), 4 adds x 2 summands
    assert len(per_channel) == 5 + 4 * 2
    assert all(name.split(".")[-1] in ("data_in", "data_in_1") for name in per_channel)
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 100, (3, 12), generator=g) for _ in range(3)]
    calibrate(model, batches, lambda ids: model(input_ids=ids), count=3)
    assert all(q.is_static and q.max_val.shape == (hidden,) for q in per_channel.values())
    probe = torch.randint(0, 100, (2, 12), generator=g)
    with torch.no_grad():
        logits = model(input_ids=probe).logits
    path = tmp_path / "calibrated.ckpt"
    torch.save({"state_dict": model.state_dict()}, path)

    fresh = tiny_bert(seed=1)
    quantize_model(fresh, recipe)
    fresh.eval()  # the point modules are built in training mode (QAT would update their ranges)
    with torch.no_grad():
        fresh.load_state_dict(torch.load(path, weights_only=True)["state_dict"])
        uncalibrated = tiny_bert(seed=1)
        quantize_model(uncalibrated, recipe)
        uncalibrated.eval()
        uncalibrated.load_state_dict(
            {k: v for k, v in model.state_dict().items() if "_quantizer." not in k}, strict=False
        )
        assert torch.equal(fresh(input_ids=probe).logits, logits)
        assert not torch.equal(uncalibrated(input_ids=probe).logits, logits)
    loaded = dict(fresh.named_modules())
    for q in per_channel.values():
        module_name = next(n for n, m in model.named_modules() if m is q)
        assert torch.equal(loaded[module_name].max_val, q.max_val)


def test_qat_run_keeps_per_channel_ranges_in_its_checkpoint(compose_cfg, tmp_path):
    """The user's path: train.py quant=int8_scaled_all (QAT) calibrates the per-channel scales, updates them in
    training and saves one range per hidden channel for each LayerNorm input and residual summand."""
    cfg = compose_cfg(
        ["quant=int8_scaled_all", "quant.calibration.batches=2", "trainer.max_epochs=1",
         "+trainer.limit_train_batches=3", "+trainer.limit_val_batches=1", "+trainer.limit_test_batches=1"]
    )  # fmt: skip
    run(cfg)
    state = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", weights_only=False)["state_dict"]
    ranges = {
        k: v
        for k, v in state.items()
        if k.endswith("max_val") and (".LayerNorm.data_in_" in k or ".add.data_in" in k)
    }
    hidden = 32  # model=tiny_random
    assert len(ranges) == 5 + 4 * 2
    assert all(v.shape == (hidden,) and torch.isfinite(v).all() for v in ranges.values())
    observed = [state[k.replace("max_val", "batches_observed")] for k in ranges]
    assert all(int(c) == 2 + 3 for c in observed)  # 2 calibration batches, then one update per training step


def test_a_recipe_whose_only_static_scales_are_per_channel_is_calibrated(compose_cfg, tmp_path, caplog):
    """Calibration runs for per-embedding-channel ranges alone (it once looked for per-tensor ones only, so such a
    recipe was never calibrated): here only LayerNorm inputs and residual summands hold static scales."""
    cfg = compose_cfg(
        ["quant=int8_scaled_all", "quant.calibration.batches=2", "trainer.max_epochs=1",
         "quant.config.default=null", "quant.config.matmul=null", "quant.config.softmax=null",
         "quant.config.gelu=null", "quant.config.layer_norm.weight=null", "quant.config.layer_norm.bias=null",
         "+trainer.limit_train_batches=3", "+trainer.limit_val_batches=1", "+trainer.limit_test_batches=1"]
    )  # fmt: skip
    with caplog.at_level(logging.INFO):
        run(cfg)
    state = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", weights_only=False)["state_dict"]
    observed = {k: int(v) for k, v in state.items() if k.endswith("batches_observed")}
    assert observed and all(".LayerNorm." in k or ".add." in k for k in observed)
    assert set(observed.values()) == {2 + 3}  # 2 calibration batches, then one update per training step
    assert f"Calibrated {len(observed)} activation scales on 2 training batches" in caplog.text
