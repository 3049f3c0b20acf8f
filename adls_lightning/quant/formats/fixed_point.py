"""Signed fixed point: the ``integer`` format (MASE's ``integer``, chop's fixed point).

A ``width``-bit two's-complement integer with ``frac_width`` fractional bits: a fixed grid, no scale from the data
(for a grid scaled by the data see :mod:`adls_lightning.quant.scaled`).
"""

from __future__ import annotations

from torch import Tensor

from adls_lightning.quant.quantizers import (
    _MAX_WIDTH,
    Quantizer,
    _bool_param,
    _float_compute,
    _int_param,
    register_format,
)

#: Largest fractional width: 2^-64 steps are far below any weight's float32 resolution that matters.
_MAX_FRAC_WIDTH = 64


@register_format
class IntegerQuantizer(Quantizer):
    """Signed fixed point: ``q = clamp(round(x * 2^f), -2^(w-1), 2^(w-1) - 1) / 2^f``.

    For width 8, frac_width 4 the grid is [-8, 7.9375] in steps of 1/16. Widths above 24 cannot be
    represented exactly in float32 near the top of the range; there float32 rounds as well.

    Computed in float32 with composite ops (``torch.fake_quantize_per_tensor_affine`` gives the same
    finite values but maps NaN to the most negative code and was measured slower on CPU; see
    ``benchmarks/bench_quant.py``).

    Args:
        width: total bits including the sign, 1..32.
        frac_width: fractional bits, 0..``width`` (default ``width // 2``).
        floor: round towards -inf instead of to nearest (MASE's ``floor`` key).
        frac_above_width: allow ``frac_width`` up to 64, above ``width``: the grid then lies inside (-1, 1) (8 bits
            with 9 fractional ones step by 2^-9 over [-2^-2, 2^-2 - 2^-9]). chop computes such a config without a
            word; here it is asked for explicitly (the reader of chop's configs sets it), since a fractional width
            above the width is far more often a typo than a wish.
    """

    format_name = "integer"
    search_space = {"params": {"width": [8, 16, 32], "frac_width": [2, 4, 8]}}
    layer_params = ("floor",)

    def __init__(
        self, width: int, frac_width: int | None = None, floor: bool = False, frac_above_width: bool = False
    ) -> None:
        super().__init__()
        self.width = _int_param("width", width, 1, _MAX_WIDTH)
        frac_width = width // 2 if frac_width is None else frac_width
        # above the width is valid fixed point only when asked for (chop's reading); the 64 bound keeps 2^f a
        # normal float32
        self.frac_above_width = _bool_param("frac_above_width", frac_above_width)
        if self.frac_above_width:
            self.frac_width = _int_param("frac_width", frac_width, 0, _MAX_FRAC_WIDTH)
        else:
            hint = f" (width={width}; frac_above_width: true for chop's grid inside (-1, 1))"
            self.frac_width = _int_param("frac_width", frac_width, 0, width, hint)
        self.floor = _bool_param("floor", floor)
        self.qmin, self.qmax = -(2 ** (width - 1)), 2 ** (width - 1) - 1

    def quantize(self, x: Tensor, need_mask: bool) -> tuple[Tensor, Tensor | None]:
        scaled = _float_compute(x) * 2.0**self.frac_width
        rounded = scaled.floor_() if self.floor else scaled.round_()
        # rounded in [qmin, qmax] = [-qmax - 1, qmax]  <=>  |rounded + 0.5| <= qmax + 0.5 (one comparison)
        mask = (rounded + 0.5).abs_() <= self.qmax + 0.5 if need_mask else None
        return rounded.clamp_(self.qmin, self.qmax).mul_(2.0**-self.frac_width).to(x.dtype), mask

    def bits_per_element(self, last_dim: int) -> float:
        return float(self.width)

    def extra_repr(self) -> str:
        return f"width={self.width}, frac_width={self.frac_width}" + (", floor=True" if self.floor else "")
