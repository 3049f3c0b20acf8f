"""I-BERT's integer-only kernels (Kim et al., 2021, "I-BERT: Integer-only BERT Quantization", ICML).

Each kernel takes an integer tensor ``q`` (int64) and its scale ``scale`` (a float: the real value is ``q * scale``)
and returns an integer tensor and its scale, using only integer additions, multiplications, floor divisions and
shifts on ``q`` (the constants are computed once from ``scale``, as an integer engine would at compile time):

* :func:`i_poly`: ``a (x + b)^2 + c`` (the paper's Algorithm 1).
* :func:`i_erf`, :func:`i_gelu`: ``GELU(x) ~ x/2 [1 + L(x / sqrt 2)]`` with ``L(x) = sgn(x) [a (clip(|x|, max=-b) +
  b)^2 + 1]``, ``a = -0.2888``, ``b = -1.769`` (Algorithm 2).
* :func:`i_exp`, :func:`i_softmax`: ``exp(x) ~ L(p) >> z`` for ``x = -z ln 2 + p`` (``x <= 0``, ``p`` in ``(-ln 2,
  0]``), ``L(p) = 0.3585 (p + 1.353)^2 + 0.344`` (Algorithm 3); softmax divides by the integer sum through a 31-bit
  fixed-point reciprocal and returns ``out_bits``-bit probabilities (scale ``2^-(out_bits-1)``, as the paper's code).
* :func:`i_sqrt`: ``floor(sqrt(n))`` by Newton's iteration from ``2^ceil(bits(n)/2)`` (Algorithm 4);
  :func:`i_layernorm` normalises with it (the mean and the variance summed in integers).

:func:`ibert_gelu`, :func:`ibert_softmax` and :func:`ibert_layernorm` wrap them for float tensors already quantized on
a per-tensor grid, with a straight-through gradient (the float function's gradient at the quantized input), so the
encoder points of :mod:`adls_lightning.quant.points` can train with them (QAT).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

#: i-GELU's erf approximation (the paper's Eq. 6)
ERF_A, ERF_B = -0.2888, -1.769
#: i-exp's polynomial on (-ln 2, 0] (the paper's Eq. 9)
EXP_A, EXP_B, EXP_C = 0.3585, 1.353, 0.344
#: i-exp: inputs below -EXP_MAX_SHIFT * ln 2 give 0 (the paper's code clamps there: 2^-30 is below any output step)
EXP_MAX_SHIFT = 30
#: bits of the reciprocal of the softmax's sum and of the LayerNorm's standard deviation (the paper's code: 2^31)
RECIPROCAL_BITS = 31
#: bits of the softmax's output (the paper: 8, probabilities in steps of 2^-7)
SOFTMAX_OUT_BITS = 8
#: bits the softmax's exponentials are requantized to before their sum (the paper's code: a 16-bit QuantAct), so that
#: the 31-bit reciprocal of the sum keeps its precision
EXP_BITS = 16


def _floor_div(a: Tensor, b: Tensor | int) -> Tensor:
    return torch.div(a, b, rounding_mode="floor")


def i_poly(q: Tensor, scale: float, a: float, b: float, c: float) -> tuple[Tensor, float]:
    """``a (x + b)^2 + c`` for ``x = q * scale``: ``((q + floor(b/S))^2 + floor(c / (a S^2)), a S^2)``."""
    q_b = math.floor(b / scale)
    q_c = math.floor(c / (a * scale * scale))
    return (q + q_b) ** 2 + q_c, a * scale * scale


def i_erf(q: Tensor, scale: float) -> tuple[Tensor, float]:
    """``L(x) = sgn(x) [a (clip(|x|, max=-b) + b)^2 + 1]``: the paper's integer erf."""
    q_b = math.floor(ERF_B / scale)
    clipped = q.abs().clamp(max=-q_b)
    q_l, scale_l = i_poly(clipped, scale, ERF_A, ERF_B, 1.0)
    return torch.sign(q) * q_l, scale_l


def i_gelu(q: Tensor, scale: float) -> tuple[Tensor, float]:
    """``x/2 [1 + L(x / sqrt 2)]``: ``q (q_erf + floor(1 / S_erf))`` at scale ``S S_erf / 2``."""
    q_erf, scale_erf = i_erf(q, scale / math.sqrt(2.0))
    q_one = math.floor(1.0 / scale_erf)
    return q * (q_erf + q_one), scale * scale_erf / 2


def i_exp(q: Tensor, scale: float) -> tuple[Tensor, float]:
    """``exp(x)`` for ``x = q * scale <= 0``: ``z = floor(-q / floor(ln2/S))``, ``p = q + z floor(ln2/S)``,
    ``L(p) >> z``."""
    q_ln2 = math.floor(math.log(2.0) / scale)
    q = q.clamp(min=-EXP_MAX_SHIFT * q_ln2)
    z = _floor_div(-q, q_ln2)
    q_p = q + z * q_ln2
    q_l, scale_l = i_poly(q_p, scale, EXP_A, EXP_B, EXP_C)
    return torch.bitwise_right_shift(q_l, z), scale_l


def i_softmax(
    q: Tensor, scale: float, mask: Tensor | None = None, out_bits: int = SOFTMAX_OUT_BITS
) -> tuple[Tensor, float]:
    """Softmax over the last dimension: ``e = i_exp(q - max q)`` shifted right to :data:`EXP_BITS` bits, then
    ``floor(e * floor(2^31 / sum e) / 2^(32 - out_bits))`` at scale ``2^-(out_bits - 1)``. ``mask`` (bool, True =
    kept) zeroes the masked positions' exp."""
    if mask is not None:
        q = q.masked_fill(~mask, torch.iinfo(torch.int64).min // 4)
    shifted = q - q.amax(dim=-1, keepdim=True)
    exp, exp_scale = i_exp(shifted, scale)
    # the largest exponential is L(0) = EXP_A EXP_B^2 + EXP_C at x = 0: shift it into EXP_BITS bits
    top = (EXP_A * EXP_B**2 + EXP_C) / exp_scale
    exp = exp >> max(0, math.ceil(math.log2(top)) - EXP_BITS)
    if mask is not None:
        exp = exp.masked_fill(~mask, 0)
    total = exp.sum(dim=-1, keepdim=True).clamp(min=1)
    factor = _floor_div(torch.full_like(total, 2**RECIPROCAL_BITS), total)
    return _floor_div(exp * factor, 2 ** (RECIPROCAL_BITS + 1 - out_bits)), 2.0 ** -(out_bits - 1)


def i_sqrt(n: Tensor) -> Tensor:
    """``floor(sqrt(n))`` of a non-negative int64 tensor by Newton's iteration (the paper's Algorithm 4)."""
    bits = torch.where(n > 0, torch.frexp(n.double()).exponent.to(torch.int64), 0)  # floor(log2 n) + 1
    x = torch.ones_like(n) << _floor_div(bits + 1, 2)  # 2^ceil(bits/2) >= sqrt(n)
    while True:
        y = _floor_div(x + _floor_div(n, x.clamp(min=1)), 2)
        step = y < x
        if not bool(step.any()):
            return torch.where(n > 0, x, 0)
        x = torch.where(step, y, x)


def i_layernorm(q: Tensor) -> tuple[Tensor, float]:
    """``(x - mean) / std`` over the last dimension (no affine): the integer mean (rounded), ``std_int = i_sqrt(sum (q -
    mean)^2)``, and ``floor((q - mean) floor(2^31 / std_int) / 2)`` at scale ``sqrt(C) / 2^30``."""
    channels = q.shape[-1]
    centred = q - _floor_div(2 * q.sum(dim=-1, keepdim=True) + channels, 2 * channels)  # the mean, rounded
    std = i_sqrt((centred * centred).sum(dim=-1, keepdim=True)).clamp(min=1)
    factor = _floor_div(torch.full_like(std, 2**RECIPROCAL_BITS), std)
    return _floor_div(centred * factor, 2), math.sqrt(channels) / 2 ** (RECIPROCAL_BITS - 1)


def _codes(x: Tensor, scale: float) -> Tensor:
    """The integers of ``x`` on a grid of step ``scale`` (``x`` already quantized on it: exact)."""
    return torch.round(x.double() / scale).to(torch.int64)


def _straight_through(exact: Tensor, integer: Tensor) -> Tensor:
    """``integer``'s values with ``exact``'s gradient."""
    return exact + (integer.to(exact.dtype) - exact).detach()


def ibert_gelu(x: Tensor, scale: float) -> Tensor:
    """i-GELU of ``x`` (quantized with step ``scale``), dequantized; gradient of the exact GELU."""
    q, s = i_gelu(_codes(x, scale), scale)
    return _straight_through(F.gelu(x), (q.double() * s).to(x.dtype))


def ibert_softmax(x: Tensor, scale: float, mask: Tensor | None = None) -> Tensor:
    """i-softmax of ``x`` over the last dimension (``mask``: bool, True = attended), dequantized; gradient of the
    exact softmax."""
    q, s = i_softmax(_codes(x, scale), scale, mask)
    exact = x if mask is None else x.masked_fill(~mask, torch.finfo(x.dtype).min)
    return _straight_through(F.softmax(exact, dim=-1), (q.double() * s).to(x.dtype))


def ibert_layernorm(
    x: Tensor, scale: float, weight: Tensor | None, bias: Tensor | None, eps: float
) -> Tensor:
    """i-LayerNorm of ``x`` (quantized with step ``scale``) with the float affine; gradient of the exact
    LayerNorm. ``eps`` only enters the gradient (the integer kernel has none)."""
    q, s = i_layernorm(_codes(x, scale))
    normed = (q.double() * s).to(x.dtype)
    exact = F.layer_norm(x, x.shape[-1:], None, None, eps)
    out = _straight_through(exact, normed)
    if weight is not None:
        out = out * weight
    if bias is not None:
        out = out + bias
    return out
