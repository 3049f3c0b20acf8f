"""Float32 bit arithmetic for the formats that round to floating-point or logarithmic grids.

Rounding to a grid of powers of two (and to the significant bits of a minifloat) is done on the float32 bit
pattern: exact, and several times faster than ``torch.frexp``/``log2``. Used by the elementwise minifloat and
``log`` formats (:mod:`~adls_lightning.quant.formats.minifloat`) and by the block formats, whose elements are
such numbers with a per-block exponent or bias (:mod:`~adls_lightning.quant.formats.block`).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

#: float32's smallest subnormal is 2^-149; a quantization step below it is float32's own.
_F32_MIN_STEP_EXPONENT = -149
_F32_MAX = torch.finfo(torch.float32).max
_F32_EXP_SHIFT = 23
_F32_BIAS = 127
_F32_FRACTION_MASK = (1 << 23) - 1
#: A float32 1.f (fraction bits f) has log2(1.f) > 1/2 exactly when f > this (sqrt(2) is irrational).
_SQRT2_FRACTION = math.floor((math.sqrt(2) - 1) * 2**23)


def _biased_exponent(a: Tensor) -> Tensor:
    """float32 exponent field of non-negative ``a`` (int32): ``floor(log2 a) + 127`` for normal ``a``.

    0 for zero and subnormals, 255 for inf/NaN. Bit arithmetic: ``torch.frexp`` is several times slower.
    """
    return a.view(torch.int32) >> _F32_EXP_SHIFT


def _pow2(biased: Tensor, lowest: int) -> Tensor:
    """``2^(biased - 127)`` as float32 for an int32 tensor; ``lowest`` is a static lower bound of ``biased``.

    Normal powers of two are built from their bit pattern; when ``lowest < 1`` (subnormal results are
    possible) ``exp2`` is used, flushing below 2^-149 to 0.
    """
    if lowest >= 1:
        return (biased << _F32_EXP_SHIFT).view(torch.float32)
    return torch.exp2((biased - _F32_BIAS).clamp_(min=_F32_MIN_STEP_EXPONENT).to(torch.float32))


def _round_to_float_grid(
    a: Tensor, precision: int, min_exponent: int | Tensor, max_value: float | Tensor, lowest_step: int
) -> Tensor:
    """Round non-negative float32 ``a`` to a floating-point grid; ``NaN`` stays ``NaN``, ``inf`` saturates.

    The grid holds ``precision`` significant bits: for ``a`` in ``[2^E, 2^(E+1))`` with
    ``E >= min_exponent`` the step is ``2^(E - precision + 1)``; below ``2^min_exponent`` the step is
    fixed at ``2^(min_exponent - precision + 1)`` (subnormals). Values above ``max_value`` (a grid
    point) saturate. ``min_exponent`` and ``max_value`` may be tensors broadcasting against ``a``
    (per-block formats); ``lowest_step`` is a static lower bound of the step's exponent.

    Exact for every float32 input when ``min_exponent >= -126``; for grids reaching below float32's
    normal range, float32-subnormal inputs are rounded with the step of the 2^-127 binade.
    """
    a = torch.clamp(a, max=max_value)
    exponent = _biased_exponent(a)
    if isinstance(min_exponent, Tensor):
        exponent = torch.maximum(exponent, min_exponent + _F32_BIAS)
    else:
        exponent = exponent.clamp_(min=min_exponent + _F32_BIAS)
    step = _pow2(exponent.sub_(precision - 1), lowest_step + _F32_BIAS)
    # a / step and q * step are exact (power-of-two step, no overflow or underflow), so the only
    # rounding is torch.round: nearest, ties to even. A carry into the next binade is representable
    # and stays <= max_value because max_value is a grid point.
    return torch.div(a, step).round_().mul_(step)


def _round_to_log_grid(a: Tensor, zero_exponent: int | Tensor, max_exponent: int | Tensor) -> Tensor:
    """Round non-negative float32 ``a`` to ``{0} U {2^k : zero_exponent < k <= max_exponent}`` in the log domain.

    ``k = round(log2 a)``: from the float32 bits, ``floor(log2 a)`` plus one when the mantissa
    ``1.f`` exceeds sqrt(2) (a float32 is never exactly on a geometric midpoint, so there are no
    ties). ``k <= zero_exponent`` flushes to 0, larger ``k`` saturate at ``max_exponent``; ``NaN``
    stays ``NaN``. Powers of two below 2^-126 (float32 subnormals) flush to 0.
    """
    max_value = _pow2(max_exponent + _F32_BIAS, 1) if isinstance(max_exponent, Tensor) else 2.0**max_exponent
    a = torch.clamp(a, max=max_value)  # inf saturates, NaN stays
    bits = a.view(torch.int32)
    k = (bits >> _F32_EXP_SHIFT) + ((bits & _F32_FRACTION_MASK) > _SQRT2_FRACTION)  # biased round(log2 a)
    zero = zero_exponent + _F32_BIAS
    k = torch.clamp(
        k, min=zero.clamp(min=0) if isinstance(zero, Tensor) else max(zero, 0), max=max_exponent + _F32_BIAS
    )
    k = k * (k - zero).clamp_(0, 1)  # the zero code -> biased exponent 0, whose bit pattern is +0.0
    return (k << _F32_EXP_SHIFT).view(torch.float32).add_(a - a)  # a - a: 0, or NaN for NaN
