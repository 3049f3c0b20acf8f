"""Elementwise floating-point formats: ``minifloat_ieee``, ``minifloat_denorm`` and ``log``.

Each element is a sign and a magnitude code of its own (no shared scale): a minifloat's exponent and mantissa, or
a logarithmic format's exponent alone. They round ``|x|`` to their grid with the float32 bit arithmetic of
:mod:`~adls_lightning.quant.formats.float32_grid`, saturate, and restore the sign.
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch
from torch import Tensor

from adls_lightning.quant.formats.float32_grid import _round_to_float_grid, _round_to_log_grid
from adls_lightning.quant.quantizers import (
    _MAX_WIDTH,
    Quantizer,
    QuantizerParamError,
    _float_compute,
    _int_param,
    register_format,
)


class _SignMagnitudeQuantizer(Quantizer):
    """Elementwise formats stored as sign + magnitude code that saturate: round ``|x|``, restore the sign.

    Subclasses set ``width`` and ``clip_threshold`` (inputs at or beyond it get zero gradient) and
    implement :meth:`_round_magnitude`.
    """

    width: int
    clip_threshold: float

    def _round_magnitude(self, a: Tensor) -> Tensor:
        raise NotImplementedError

    def quantize(self, x: Tensor, need_mask: bool) -> tuple[Tensor, Tensor | None]:
        xf = _float_compute(x)
        a = xf.abs()
        q = self._round_magnitude(a)
        mask = a < self.clip_threshold if need_mask else None
        return torch.copysign(q, xf).to(x.dtype), mask

    def bits_per_element(self, last_dim: int) -> float:
        return float(self.width)


class _MinifloatBase(_SignMagnitudeQuantizer):
    """Shared parameters of the two minifloats: 1 sign bit, ``exponent_width`` exponent bits, the rest mantissa."""

    min_mantissa_bits: ClassVar[int] = 0

    def __init__(self, width: int, exponent_width: int, exponent_bias: int | None = None) -> None:
        super().__init__()
        self.width = _int_param("width", width, 2, _MAX_WIDTH)
        low = 1 + self.min_mantissa_bits
        self.exponent_width = _int_param(
            "exponent_width",
            exponent_width,
            1,
            width - low,
            hint=f" (width={width}: 1 sign bit, >= {low - 1} mantissa)",
        )
        self.mantissa_bits = width - exponent_width - 1
        bias = 2 ** (exponent_width - 1) - 1 if exponent_bias in (None, "none") else exponent_bias
        self.exponent_bias = _int_param("exponent_bias", bias, -(2**31))
        self.max_exponent = 2**exponent_width - 1 - self.exponent_bias
        self.precision, self.min_exponent, max_value = self._grid()
        if self.min_exponent > 126:
            raise QuantizerParamError(
                "exponent_bias",
                f"={self.exponent_bias}: the smallest normal value 2^{self.min_exponent} is beyond float32; "
                f"use exponent_bias >= {self.exponent_bias + self.min_exponent - 126}",
            )
        # Values are float32: a range beyond float32's ends at the largest float32 on the grid.
        self.max_value = min(max_value, math.ldexp(2.0 - 2.0 ** (1 - self.precision), 127))
        self.lowest_step = self.min_exponent - self.precision + 1
        # Gradients pass for inputs that round to at most max_value (the midpoint above it).
        top_binade = math.floor(math.log2(self.max_value))
        self.clip_threshold = self.max_value + 2.0 ** (top_binade - self.precision)

    def _grid(self) -> tuple[int, int, float]:
        raise NotImplementedError

    def _round_magnitude(self, a: Tensor) -> Tensor:
        return _round_to_float_grid(a, self.precision, self.min_exponent, self.max_value, self.lowest_step)

    def extra_repr(self) -> str:
        return f"width={self.width}, exponent_width={self.exponent_width}, exponent_bias={self.exponent_bias}"


@register_format
class MinifloatIEEEQuantizer(_MinifloatBase):
    """IEEE-754-style minifloat without Inf/NaN codes: implicit leading 1, subnormals, saturation.

    With ``m = width - exponent_width - 1`` mantissa bits and bias ``B`` (default ``2^(e-1) - 1``):
    normals ``2^E * (1 + k/2^m)`` for ``E`` in ``[1-B, 2^e-1-B]``, subnormals ``2^(1-B) * k/2^m``.
    Every exponent code encodes numbers (none is reserved), so the largest value is
    ``2^(2^e-1-B) * (2 - 2^-m)``: e4m3 (bias 7) reaches 480 where OCP's float8_e4m3fn stops at 448.

    MASE's ``_minifloat_ieee_quantize`` uses ``2^-B`` as the subnormal exponent with a halved
    mantissa; this follows IEEE 754 (smallest normal ``2^(1-B)``, subnormal step ``2^(1-B-m)``), so
    it agrees bit for bit with torch's bfloat16/float16/float8 casts within their finite ranges.
    """

    format_name = "minifloat_ieee"
    search_space = {"params": {"width": [8, 16], "exponent_width": [4, 5]}}

    def _grid(self) -> tuple[int, int, float]:
        m = self.mantissa_bits
        return m + 1, 1 - self.exponent_bias, math.ldexp(2.0 - 2.0**-m, self.max_exponent)


@register_format
class MinifloatDenormQuantizer(_MinifloatBase):
    """Minifloat with no implicit leading bit: values ``2^E * k / 2^m``, ``k`` in ``[0, 2^m - 1]``.

    ``E`` in ``[-B, 2^e-1-B]`` (bias default ``2^(e-1) - 1``). Each value is rounded to the nearest
    representable number, so a value in ``[2^(E-1), 2^E)`` uses exponent ``E`` (step ``2^(E-m)``) and
    values below ``2^-B`` use the fixed step ``2^(-B-m)``. Largest value ``(2^m - 1) * 2^(2^e-1-B-m)``.

    MASE picks ``E = ceil(log2|x|)``, so an exact power of two gets mantissa ``2^m``, clamped to
    ``2^m - 1``: it comes out slightly too small even though it is representable. Here it is exact.
    """

    format_name = "minifloat_denorm"
    search_space = {"params": {"width": [8, 16], "exponent_width": [4, 5]}}
    min_mantissa_bits = 1

    def _grid(self) -> tuple[int, int, float]:
        m = self.mantissa_bits
        return m, -self.exponent_bias - 1, math.ldexp(2.0**m - 1, self.max_exponent - m)


@register_format
class LogQuantizer(_SignMagnitudeQuantizer):
    """Logarithmic: 1 sign bit and ``width - 1`` exponent bits, values ``+-2^k`` and 0.

    Exponent codes cover ``[-B, 2^(w-1) - 1 - B]`` (bias ``B`` default ``2^(w-2) - 1``); the lowest
    code encodes **zero**, so the magnitudes are ``0`` and ``2^k`` for ``k`` in ``[1-B, 2^(w-1)-1-B]``.
    ``k = round(log2|x|)`` in the log domain; anything that rounds to the zero code or below becomes 0.

    MASE spends every code on a power of two and adds ``0.1 * 2^-B`` before the log, so it cannot
    represent 0: pruned weights would come back nonzero. One code is spent on zero here.
    """

    format_name = "log"
    # widths above 8 need an exponent_bias other than the default (2^(w-1)-1-B would exceed float32's range)
    search_space = {"params": {"width": [5, 6, 8]}}

    def __init__(self, width: int, exponent_bias: int | None = None) -> None:
        super().__init__()
        self.width = _int_param("width", width, 2, _MAX_WIDTH)
        bias = 2 ** (width - 2) - 1 if exponent_bias in (None, "none") else exponent_bias
        self.exponent_bias = _int_param("exponent_bias", bias, -(2**31))
        self.max_exponent = 2 ** (width - 1) - 1 - self.exponent_bias
        if not -126 <= self.max_exponent <= 127:
            raise QuantizerParamError(
                "exponent_bias",
                f"={self.exponent_bias}: largest value 2^{self.max_exponent} is outside float32's normal range; "
                f"use exponent_bias in [{2 ** (width - 1) - 1 - 127}, {2 ** (width - 1) - 1 + 126}]",
            )
        self.clip_threshold = 2.0 ** (self.max_exponent + 0.5)

    def _round_magnitude(self, a: Tensor) -> Tensor:
        return _round_to_log_grid(a, -self.exponent_bias, self.max_exponent)

    def extra_repr(self) -> str:
        return f"width={self.width}, exponent_bias={self.exponent_bias}"
