"""SmoothQuant (``quant.smoothquant.alpha``): the factors against the paper's formula on recorded inputs, the smoothed
layer against the product it stands for, its benefit on a layer with outlier channels, and a PTQ run."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from adls_lightning.app.training import run
from adls_lightning.errors import ConfigError
from adls_lightning.quant import QuantLinear, make_quantizer
from adls_lightning.quant.smoothquant import Smoothed, smooth


def outlier_layer(seed: int = 0) -> tuple[nn.Linear, list[torch.Tensor]]:
    """A linear layer and input batches with a few channels 50x larger than the rest (LLM/BERT-style outliers)."""
    generator = torch.Generator().manual_seed(seed)
    linear = nn.Linear(64, 32)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(32, 64, generator=generator) * 0.1)
    gain = torch.ones(64)
    gain[[3, 17, 40]] = 50.0
    batches = [torch.randn(8, 64, generator=generator) * gain for _ in range(3)]
    return linear, batches


def w8a8(linear: nn.Linear) -> QuantLinear:
    return QuantLinear(
        linear,
        make_quantizer("scaled_integer", granularity="tensor").eval(),
        make_quantizer("scaled_integer", granularity="channel").eval(),
    )


def test_factors_are_the_papers_formula_and_the_output_the_smoothed_product():
    linear, batches = outlier_layer()
    layer = w8a8(linear)
    model = nn.Sequential(layer)
    names, run_batches = smooth(model, batches, model, count=2, alpha=0.5)
    assert names == ["0"] and run_batches == 2
    act = torch.stack([b.abs().amax(dim=0) for b in batches[:2]]).amax(dim=0)
    expected = act.sqrt() / linear.weight.abs().amax(dim=0).sqrt()
    torch.testing.assert_close(layer.data_in_quantizer.scale, expected)
    assert isinstance(layer.weight_quantizer, Smoothed) and torch.equal(
        layer.weight_quantizer.scale, expected
    )
    # the layer computes Q_a(x / s) Q_w(W s)^T + b, with the stored weight unchanged
    x = batches[2]
    inner_a, inner_w = layer.data_in_quantizer.inner, layer.weight_quantizer.inner
    direct = inner_a(x / expected) @ inner_w(linear.weight * expected).T + linear.bias
    torch.testing.assert_close(layer(x), direct, rtol=1e-5, atol=1e-5)


def test_smoothing_reduces_the_w8a8_error_on_outlier_channels():
    linear, batches = outlier_layer(seed=1)
    plain, smoothed = w8a8(linear), w8a8(linear)
    smooth(nn.Sequential(smoothed), batches, nn.Sequential(smoothed), count=3, alpha=0.5)
    x = batches[0]
    exact = linear(x)
    error = lambda layer: float((layer(x) - exact).square().mean())  # noqa: E731
    assert error(smoothed) < 0.5 * error(plain)


def test_ptq_run_smooths_then_calibrates(compose_cfg, caplog):
    caplog.set_level(logging.INFO)
    metrics = run(
        compose_cfg(
            [
                "quant=int8_scaled",
                "quant.mode=ptq",
                "quant.calibration.batches=2",
                "quant.smoothquant.alpha=0.5",
            ]
        )
    )
    assert "SmoothQuant (alpha 0.5) smoothed 14 layers from 2 training batches" in caplog.text
    assert "Calibrated 14 activation scales on 2 training batches" in caplog.text
    assert metrics["quant/avg_act_bits"] == 8


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["quant.smoothquant.alpha=2"], "quant.smoothquant.alpha=2: must be a number in [0, 1]"),
        (
            ["quant.smoothquant.alpha=0.5", "quant.calibration.batches=0"],
            "quant.smoothquant.alpha: SmoothQuant's",
        ),
    ],
)
def test_bad_smoothquant_settings_are_one_line(compose_cfg, overrides, message):
    from hydra.utils import instantiate

    with pytest.raises(ConfigError) as error:
        instantiate(compose_cfg(["quant=int8_scaled", *overrides]).quant, _convert_="partial")
    assert str(error.value).startswith(message)
