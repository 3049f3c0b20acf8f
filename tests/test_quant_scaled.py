"""The scaled integer format (``scaled_integer``, ``quant=int8_scaled``): its grids against formulas written here and
against PyTorch's own observers and fake quantization, each observer against a direct computation, calibration
against the ranges hooks record, and PTQ / QAT runs that calibrate and keep their ranges in the checkpoint."""

from __future__ import annotations

import logging

import pytest
import torch
from torch.ao.quantization import MinMaxObserver, PerChannelMinMaxObserver

from adls_lightning.app.training import run
from adls_lightning.errors import ConfigError
from adls_lightning.quant import LayerRecipe, OperandRecipe, calibrate, make_quantizer, quantize_model
from adls_lightning.quant.scaled import MSE_CLIP_RATIOS, ScaledIntegerQuantizer, scaled_quantizers


def evaluating(**params) -> ScaledIntegerQuantizer:
    """A quantizer that measures each tensor (eval mode, nothing observed)."""
    return make_quantizer("scaled_integer", **params).eval()


def symmetric_reference(x: torch.Tensor, amax: torch.Tensor, width: int = 8) -> torch.Tensor:
    qmax = 2 ** (width - 1) - 1
    scale = amax / qmax
    return torch.clamp(torch.round(x / scale), -qmax, qmax) * scale


def test_per_channel_symmetric_is_the_row_max_formula():
    w = torch.randn(6, 64) * torch.linspace(0.1, 3, 6)[:, None]
    out = evaluating(granularity="channel")(w)
    assert torch.equal(out, symmetric_reference(w, w.abs().amax(dim=1, keepdim=True)))
    # each row's largest magnitude is on the grid's end: 127 steps
    assert torch.allclose(out.abs().amax(dim=1), w.abs().amax(dim=1), rtol=1e-6, atol=0)
    assert out.unique().numel() > 100  # 8 bits per row, not a coarse shared grid


def test_per_group_and_per_token_scale_their_own_elements():
    x = torch.randn(4, 96)
    grouped = evaluating(granularity="group", group_size=32)(x)
    blocks = x.reshape(-1, 32)
    assert torch.equal(
        grouped, symmetric_reference(blocks, blocks.abs().amax(1, keepdim=True)).reshape(4, 96)
    )
    tokens = torch.randn(2, 5, 16)
    rows = tokens.reshape(-1, 16)
    expected = symmetric_reference(rows, rows.abs().amax(1, keepdim=True)).reshape(2, 5, 16)
    assert torch.equal(evaluating(granularity="token")(tokens), expected)


def test_asymmetric_per_tensor_matches_torch_observer_and_fake_quantize():
    x = torch.rand(8, 64) * 5 - 1  # mostly positive: an asymmetric range pays off
    observer = MinMaxObserver(dtype=torch.quint8, qscheme=torch.per_tensor_affine)
    observer(x)
    scale, zero_point = observer.calculate_qparams()
    expected = torch.fake_quantize_per_tensor_affine(x, float(scale), int(zero_point), 0, 255)
    ours = evaluating(symmetric=False)(x)
    # same grid; the two compute x / s and x * (1 / s), so a value at a tie may round one step apart
    assert (ours - expected).abs().max() <= float(scale) * 1.001
    assert (ours != expected).float().mean() < 0.01
    assert evaluating(symmetric=False)(torch.zeros(3)).eq(0).all()


def test_per_channel_matches_torch_per_channel_observer_range():
    w = torch.randn(5, 40)
    observer = PerChannelMinMaxObserver(ch_axis=0, dtype=torch.qint8, qscheme=torch.per_channel_symmetric)
    observer(w)
    amax = torch.maximum(observer.min_val.abs(), observer.max_val)  # torch's observed range per channel
    assert torch.equal(evaluating(granularity="channel")(w), symmetric_reference(w, amax[:, None]))


def test_percentile_observer_clips_at_the_percentile():
    x = torch.randn(1, 10_000)
    x[0, :5] = 50.0  # outliers
    q = evaluating(observer="percentile", percentile=99.9)
    amax = x.abs().sort().values[0, 9990 - 1]  # nearest rank: the 9,990th smallest of 10,000 magnitudes
    out = q(x)
    assert out.abs().max() <= amax * 1.0001  # the outliers are clipped to the percentile
    assert torch.allclose(out, symmetric_reference(x, amax), atol=float(amax) / 127 * 1.001)


def test_mse_observer_picks_the_clipping_with_the_least_error():
    w = torch.randn(4, 256)
    w[:, 0] = 6.0  # one outlier per row: on a 4-bit grid, clipping it helps the other 255
    ours = evaluating(granularity="channel", observer="mse", width=4)(w)
    for row, got in zip(w, ours, strict=True):
        amax = row.abs().max()
        candidates = [symmetric_reference(row, amax * ratio, width=4) for ratio in MSE_CLIP_RATIOS.tolist()]
        errors = torch.stack([(c - row).square().sum() for c in candidates])
        assert torch.equal(got, candidates[int(errors.argmin())])
    minmax = evaluating(granularity="channel", width=4)(w)
    assert (ours - w).square().sum() < (minmax - w).square().sum()


def test_gradient_passes_inside_the_range_and_stops_at_clipped_values():
    x = torch.tensor([[0.5, -1.0, 2.0, 40.0] + [1.0] * 60], requires_grad=True)
    q = make_quantizer("scaled_integer", observer="percentile", percentile=90.0).eval()
    q(x).sum().backward()
    clipped = x.detach().abs() > torch.quantile(x.detach().abs(), 0.9, interpolation="higher")
    assert torch.equal(x.grad, (~clipped).float())


def test_bits_per_element_count_the_scales():
    assert evaluating().bits_per_element(384) == 8
    assert evaluating(granularity="channel").bits_per_element(384) == 8 + 32 / 384
    assert evaluating(granularity="group", group_size=32, width=4).bits_per_element(384) == 4 + 1
    assert (
        evaluating(granularity="group", group_size=32, width=4, symmetric=False).bits_per_element(64)
        == 4 + 36 / 32
    )


@pytest.mark.parametrize(
    "params, key",
    [({"width": 1}, "width"), ({"granularity": "row"}, "granularity"), ({"observer": "kl"}, "observer"),
     ({"percentile": 40}, "percentile"), ({"averaging_constant": 0}, "averaging_constant")],
)  # fmt: skip
def test_bad_parameters_name_the_key(params, key):
    with pytest.raises(ConfigError, match=rf"^{key}="):
        make_quantizer("scaled_integer", **params)


def test_calibration_records_each_layer_input_range_and_then_quantizes_with_it(tiny_bert):
    model = tiny_bert().eval()
    recipe = LayerRecipe(
        data_in=OperandRecipe("scaled_integer", {"granularity": "tensor"}),
        weight=OperandRecipe("scaled_integer", {"granularity": "channel"}),
    )
    quantize_model(model, recipe)
    seen: dict[str, list[torch.Tensor]] = {}
    hooks = [
        module.register_forward_pre_hook(lambda m, args, name=name: seen.setdefault(name, []).append(args[0]))
        for name, module in model.named_modules()
        if type(module).__name__ == "QuantLinear"
    ]
    generator = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 100, (2, 12), generator=generator) for _ in range(4)]
    assert calibrate(model, batches, lambda ids: model(input_ids=ids), count=3) == 3
    for hook in hooks:
        hook.remove()
    layers = {
        name: module for name, module in model.named_modules() if type(module).__name__ == "QuantLinear"
    }
    for name, inputs in seen.items():
        assert len(inputs) == 3
        quantizer = layers[name].data_in_quantizer
        assert float(quantizer.min_val) == min(float(x.min()) for x in inputs)
        assert float(quantizer.max_val) == max(float(x.max()) for x in inputs)
        assert quantizer.is_static and not quantizer.observing
    # after calibration a new input is quantized with the recorded range, not its own
    quantizer = layers["classifier"].data_in_quantizer
    x = torch.randn(3, model.config.hidden_size) * 100
    amax = torch.maximum(-quantizer.min_val.clamp(max=0), quantizer.max_val.clamp(min=0))
    assert torch.equal(quantizer(x), symmetric_reference(x, amax))


def test_ptq_run_calibrates_before_evaluating(compose_cfg, tmp_path, caplog):
    caplog.set_level(logging.INFO)
    metrics = run(compose_cfg(["quant=int8_scaled", "quant.mode=ptq", "quant.calibration.batches=2"]))
    assert "Calibrated 14 activation scales on 2 training batches" in caplog.text
    assert metrics["quant/avg_act_bits"] == 8
    # 8 bits plus one 32-bit scale per output row of >= 32 inputs
    assert 8 < metrics["quant/avg_weight_bits"] <= 9


def test_qat_run_keeps_its_ranges_in_the_checkpoint(compose_cfg, tmp_path):
    run(compose_cfg(["quant=int8_scaled", "quant.calibration.batches=2", "trainer.max_epochs=1"]))
    checkpoint = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", weights_only=False)
    ranges = {k: v for k, v in checkpoint["state_dict"].items() if k.endswith("data_in_quantizer.max_val")}
    assert len(ranges) == 14 and all(torch.isfinite(v) and v > 0 for v in ranges.values())
    counts = [
        v for k, v in checkpoint["state_dict"].items() if k.endswith("data_in_quantizer.batches_observed")
    ]
    # 2 calibration batches, then one update per training step
    assert all(int(c) > 2 for c in counts)


def test_bad_calibration_value_is_one_line(compose_cfg):
    from hydra.utils import instantiate

    with pytest.raises(ConfigError, match=r"^quant.calibration.batches=-1: must be an integer >= 0"):
        instantiate(
            compose_cfg(["quant=int8_scaled", "quant.calibration.batches=-1"]).quant, _convert_="partial"
        )


def test_every_scaled_quantizer_is_found(tiny_bert):
    model = tiny_bert()
    quantize_model(model, LayerRecipe.uniform("scaled_integer"))
    assert len(scaled_quantizers(model)) == 2 * 14
