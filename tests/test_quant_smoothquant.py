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
    names, run_batches = smooth(model, batches, model, count=2, alpha=0.5, scope="all")
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
    smooth(nn.Sequential(smoothed), batches, nn.Sequential(smoothed), count=3, alpha=0.5, scope="all")
    x = batches[0]
    exact = linear(x)
    error = lambda layer: float((layer(x) - exact).square().mean())  # noqa: E731
    assert error(smoothed) < 0.5 * error(plain)


class PostNormBlock(nn.Module):
    """BERT's shape in small: a LayerNorm feeding three projections, their sum through a second LayerNorm into a
    feed-forward pair; the second linear of the pair and the last layer read no normalisation's output."""

    def __init__(self, width: int = 16, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.dropout = nn.Dropout(0.1)  # the identity in eval mode: its output is still the norm's tensor
        self.q, self.k, self.v = (w8a8(nn.Linear(width, width)) for _ in range(3))
        self.fc1, self.fc2 = w8a8(nn.Linear(width, 2 * width)), w8a8(nn.Linear(2 * width, width))
        self.head = w8a8(nn.Linear(width, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.dropout(self.norm1(x))
        h = self.norm2(h + self.q(h) + self.k(h) + self.v(h))
        h = h + self.fc2(torch.relu(self.fc1(h)))
        return self.head(h[:, 0])  # a slice of the output, as BERT's pooler reads token 0


def test_norm_fed_scope_smooths_the_layers_a_layernorm_feeds_with_one_factor_per_norm():
    generator = torch.Generator().manual_seed(3)
    gain = torch.ones(16)
    gain[[2, 9]] = 30.0
    batches = [torch.randn(4, 5, 16, generator=generator) * gain for _ in range(3)]
    model = PostNormBlock().eval()
    # the inputs each layer receives, recorded independently of the code under test
    seen: dict[str, list[torch.Tensor]] = {}
    hooks = [
        getattr(model, name).register_forward_pre_hook(
            lambda module, args, name=name: seen.setdefault(name, []).append(args[0].detach().clone())
        )
        for name in ("q", "fc1")
    ]
    with torch.no_grad():
        for batch in batches[:2]:
            model(batch)
    for hook in hooks:
        hook.remove()
    weights = {name: getattr(model, name).linear.weight.detach().clone() for name in ("q", "k", "v", "fc1")}

    names, run = smooth(model, batches, model, count=2, alpha=0.5)

    assert names == ["q", "k", "v", "fc1"] and run == 2
    assert not isinstance(model.fc2.data_in_quantizer, Smoothed) and not isinstance(
        model.head.data_in_quantizer, Smoothed
    )
    act = lambda name: torch.cat([x.reshape(-1, x.shape[-1]) for x in seen[name]]).abs().amax(dim=0)  # noqa: E731
    # q, k and v read one LayerNorm's output: one factor, the weight maximum over the three
    qkv_weight = torch.cat([weights["q"], weights["k"], weights["v"]]).abs().amax(dim=0)
    expected_qkv = act("q").sqrt() / qkv_weight.sqrt()
    for name in ("q", "k", "v"):
        torch.testing.assert_close(getattr(model, name).data_in_quantizer.scale, expected_qkv)
        torch.testing.assert_close(getattr(model, name).weight_quantizer.scale, expected_qkv)
    expected_fc1 = act("fc1").sqrt() / weights["fc1"].abs().amax(dim=0).sqrt()
    torch.testing.assert_close(model.fc1.data_in_quantizer.scale, expected_fc1)


def test_bad_scope_is_one_line():
    from adls_lightning.quant.smoothquant import check_scope

    with pytest.raises(ConfigError, match=r"^quant.smoothquant.scope='qkv': must be one of norm_fed, all"):
        check_scope("qkv")


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
    # the tiny BERT's 2 layers: query, key, value and the feed-forward's first linear read a LayerNorm's output
    assert "SmoothQuant (alpha 0.5, norm_fed) smoothed 8 layers from 2 training batches" in caplog.text
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
