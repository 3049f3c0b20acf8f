"""I-BERT's integer kernels (adls_lightning/quant/ibert.py) against the paper's formulas (Kim et al. 2021), written out
here independently in float64, and the ibert_int8 preset on a tiny model."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from adls_lightning.quant import QuantRecipe, quantize_model
from adls_lightning.quant.ibert import i_exp, i_gelu, i_layernorm, i_softmax, i_sqrt
from adls_lightning.quant.points import quantized_points
from tests.helpers import compose_config


def _codes(values: np.ndarray, scale: float) -> torch.Tensor:
    return torch.from_numpy(np.round(values / scale).astype(np.int64))


def paper_gelu(x: np.ndarray) -> np.ndarray:
    """Eq. (6)-(7): GELU(x) ~ x/2 [1 + L(x/sqrt 2)], L(x) = sgn(x) [a (clip(|x|, max=-b) + b)^2 + 1]."""
    a, b = -0.2888, -1.769
    u = x / math.sqrt(2.0)
    erf = np.sign(u) * (a * (np.minimum(np.abs(u), -b) + b) ** 2 + 1)
    return x / 2 * (1 + erf)


def paper_exp(x: np.ndarray) -> np.ndarray:
    """Eq. (8)-(9): exp(x) ~ L(p) 2^-z, z = floor(-x / ln 2), p = x + z ln 2, L(p) = 0.3585 (p + 1.353)^2 + 0.344."""
    z = np.floor(-x / math.log(2.0))
    p = x + z * math.log(2.0)
    return (0.3585 * (p + 1.353) ** 2 + 0.344) * 2.0**-z


def test_i_sqrt_is_floor_sqrt():
    rng = np.random.default_rng(0)
    values = [0, 1, 2, 3, 4, 15, 16, 17, 2**31 - 1, 2**40, 2**40 + 1, 10**15]
    values += [int(v) for v in rng.integers(0, 2**50, 500)] + [k * k for k in range(200)]
    got = i_sqrt(torch.tensor(values, dtype=torch.int64)).tolist()
    assert got == [math.isqrt(v) for v in values]


@pytest.mark.parametrize("bits", [8, 16])
def test_i_gelu_is_the_papers_polynomial(bits):
    """Integer i-GELU x scale equals the paper's float64 formula on the same inputs, up to the floors of its
    constants (q_b = floor(b/S), floor(1/S_erf)): a few output steps at most."""
    rng = np.random.default_rng(1)
    x = rng.uniform(-6, 6, 4000)
    scale = 6 / (2 ** (bits - 1) - 1)
    q = _codes(x, scale)
    xq = q.numpy() * scale
    out, out_scale = i_gelu(q, scale)
    got = out.numpy() * out_scale
    expected = paper_gelu(xq)
    assert np.abs(got - expected).max() < 4 * scale + 1e-9
    # and the approximation itself is close to the exact GELU (the paper's erf approximation error)
    exact = xq / 2 * (1 + np.vectorize(math.erf)(xq / math.sqrt(2)))
    assert np.abs(expected - exact).max() < 0.02


def test_i_exp_is_the_papers_polynomial_with_shift():
    rng = np.random.default_rng(2)
    x = -rng.uniform(0, 12, 4000)
    scale = 12 / 32767
    q = _codes(x, scale)
    xq = q.numpy() * scale
    out, out_scale = i_exp(q, scale)
    got = out.numpy() * out_scale
    expected = paper_exp(xq)
    # floors of ln2/S, b/S and c/(aS^2), then the right shift: relative error of a few steps of the input grid
    assert np.abs(got - expected).max() < 1e-3
    assert np.abs(expected - np.exp(xq)).max() < 0.01  # the polynomial's own error (the paper's)


def test_i_softmax_against_the_papers_exp_normalised():
    rng = np.random.default_rng(3)
    x = rng.normal(0, 3, (64, 20))
    mask = np.ones_like(x, dtype=bool)
    mask[:8, 15:] = False
    scale = np.abs(x).max() / 32767
    q = _codes(x, scale)
    out, out_scale = i_softmax(q, scale, torch.from_numpy(mask))
    got = out.numpy() * out_scale
    xq = q.numpy() * scale
    shifted = xq - np.where(mask, xq, -np.inf).max(axis=1, keepdims=True)
    e = np.where(mask, paper_exp(np.maximum(shifted, -30 * math.log(2))), 0.0)
    expected = e / e.sum(axis=1, keepdims=True)
    assert out_scale == 2.0**-7  # 8-bit probabilities, as the paper's kernel
    # the output floor (one step of 2^-7) and the 16-bit requantization of the exponentials (a relative 2^-15)
    assert np.abs(got - expected).max() <= 2.0**-7 + 1e-3
    assert (got[~mask] == 0).all()


def test_i_layernorm_against_float64():
    rng = np.random.default_rng(4)
    x = rng.normal(0.5, 2, (50, 384))
    scale = np.abs(x).max() / 127
    q = _codes(x, scale)
    out, out_scale = i_layernorm(q)
    got = out.numpy() * out_scale
    xq = q.numpy() * scale
    std = xq.std(axis=1, keepdims=True)
    expected = (xq - xq.mean(axis=1, keepdims=True)) / std
    # the integer mean is rounded: half a step of the input grid off, i.e. 0.5 S / std in the output; the square
    # root's floor and the 31-bit reciprocal add a relative ~1/(sqrt(C) std/S) ~ 1e-4
    bound = 0.5 * scale / std.min() + 1e-3 * np.abs(expected).max()
    assert np.abs(got - expected).max() < bound


def test_ibert_preset_trains_through_the_integer_kernels(tiny_bert):
    """quant=ibert_int8's recipe on a tiny BERT: the GELUs, softmaxes and LayerNorms run I-BERT's kernels (the output
    differs from the same grids in float), and the loss's gradient reaches the weights."""
    from hydra.utils import instantiate

    config = compose_config("train", ["quant=ibert_int8"]).quant.config
    recipe: QuantRecipe = instantiate(config)
    model = tiny_bert()
    batch = {"input_ids": torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(0))}
    quantize_model(model, recipe)
    kernels = {kind: point.kernel for _, kind, point in quantized_points(model)}
    assert kernels == {
        "matmul": "float",
        "softmax": "ibert",
        "gelu": "ibert",
        "layer_norm": "ibert",
        "add": "float",
    }
    model.train()
    logits = model(**batch).logits
    logits.square().sum().backward()
    assert model.bert.encoder.layer[0].attention.self.query.weight.grad.abs().sum() > 0
    model.eval()
    with torch.no_grad():
        integer = model(**batch).logits
        for _, _, point in quantized_points(model):
            point.kernel = "float"
        floating = model(**batch).logits
    assert not torch.equal(integer, floating)
    torch.testing.assert_close(integer, floating, atol=0.05 * floating.abs().max().item(), rtol=0)
