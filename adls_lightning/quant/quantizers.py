"""Fake quantizers: one ``nn.Module`` per number format of the ADLS labs.

A quantizer maps a float tensor to the nearest value of its format and returns it as a float
tensor of the same shape and dtype ("fake quantization"), so a quantized layer still runs a float
``F.linear``. Every quantizer:

* works on tensors of any rank, on any device; block formats group consecutive elements along the
  **last** dimension (the reduction dimension of ``F.linear`` for both the input and the weight);
* is differentiable with a straight-through estimator (STE): the backward pass treats rounding as
  the identity. Formats that saturate (``integer``, minifloats, ``log``, ``binary*``) are
  clipping-aware: inputs outside the representable range get zero gradient, as PyTorch's own
  ``fake_quantize_*`` ops do;
* rounds to nearest with ties to even (``torch.round``), unless documented otherwise;
* maps 0 to 0 when the format can represent zero, so pruned weights stay exactly zero
  (``binary``, ``binary_scaling`` and ``binary_residual`` cannot: ``+0.0`` becomes the positive
  code and ``-0.0`` the negative one);
* saturates ``+-inf`` to the largest finite value of the format and keeps ``NaN`` as ``NaN``;
  block formats turn a whole block into ``NaN`` when it holds a ``NaN`` (as OCP MX does), and
  formats scaled by a statistic (``binary_scaling`` per row, ``ternary`` per tensor) turn the
  row/tensor holding an inf or NaN into ``NaN``.

Non-integer formats compute in float32 (the result is cast back to the input dtype). Grids finer
than float32's smallest subnormal (2^-149) are limited by float32.

Build one with :func:`make_quantizer`; the format names and parameters are in :data:`QUANTIZERS`
and in ``docs/quantization.md``.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Mapping
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from adls_lightning.errors import ConfigError
from adls_lightning.registry import Registry

#: float32's smallest subnormal is 2^-149; a quantization step below it is float32's own.
_F32_MIN_STEP_EXPONENT = -149
_F32_MAX = torch.finfo(torch.float32).max
_F32_EXP_SHIFT = 23
_F32_BIAS = 127
_F32_FRACTION_MASK = (1 << 23) - 1
#: A float32 1.f (fraction bits f) has log2(1.f) > 1/2 exactly when f > this (sqrt(2) is irrational).
_SQRT2_FRACTION = math.floor((math.sqrt(2) - 1) * 2**23)
_MAX_WIDTH = 32


class QuantizerParamError(ConfigError):
    """A bad quantizer parameter. ``str(err)`` is ``param + detail``, e.g. ``width=0: must be ...``.

    Config parsers re-raise it under the full config key (``quant.config.linear.config.weight_width``).
    """

    def __init__(self, param: str, detail: str) -> None:
        super().__init__(f"{param}{detail}")
        self.param = param
        self.detail = detail


#: Format name -> quantizer class, filled by :func:`register_format` (in definition order).
QUANTIZERS: Registry[type[Quantizer]] = Registry("quantization format")


def register_format(cls: type[Quantizer]) -> type[Quantizer]:
    """Class decorator: make ``cls`` available in configs as ``name: <cls.format_name>``.

    Everything else reads the class: its constructor's keyword arguments are the format's parameters
    (with their defaults), and :attr:`Quantizer.slots`, :attr:`~Quantizer.zero_representable`,
    :attr:`~Quantizer.blocked`, :attr:`~Quantizer.search_space` and :meth:`~Quantizer.bits_per_element`
    describe it to ``quantize_model``, the mixed-precision search and the tests (``docs/extending.md``).
    """
    if not cls.format_name:
        raise ValueError(f"{cls.__name__}: set format_name (the name configs use)")
    return QUANTIZERS.register(cls.format_name, cls)


def _int_param(name: str, value: Any, low: int, high: int | None = None, hint: str = "") -> int:
    """Validate an integer parameter in ``[low, high]``; raise ConfigError naming it otherwise."""
    if (
        isinstance(value, bool)
        or not isinstance(value, int)
        or value < low
        or (high is not None and value > high)
    ):
        bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise QuantizerParamError(name, f"={value!r}: must be an integer {bound}{hint}")
    return value


def _bool_param(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise QuantizerParamError(name, f"={value!r}: must be true or false")
    return value


def _block_size_param(value: Any) -> int:
    """MASE writes block sizes as lists right-aligned to the tensor shape ([1, 16] = 16 along the last dim).

    Only 1-D blocks along the last dimension exist here, so leading entries must be 1.
    """
    if isinstance(value, (list, tuple)) and value and all(v == 1 for v in value[:-1]):
        value = value[-1]
    return _int_param(
        "block_size", value, 1, hint=" (or a list [1, ..., n]: blocks run along the last dimension)"
    )


class _StraightThrough(torch.autograd.Function):
    """Forward: the quantizer. Backward: identity, times the quantizer's in-range mask when it has one."""

    @staticmethod
    def forward(ctx, x: Tensor, quantizer: Quantizer) -> Tensor:
        q, mask = quantizer.quantize(x, need_mask=True)
        ctx.has_mask = mask is not None
        if mask is not None:
            # Multiplying by a uint8 view of the bool mask is about twice as fast as by the bool.
            ctx.save_for_backward(mask.view(torch.uint8))
        return q

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        if ctx.has_mask:
            (mask,) = ctx.saved_tensors
            grad = grad * mask
        return grad, None


class Quantizer(nn.Module):
    """Base class: ``forward(x)`` returns fake-quantized ``x`` (same shape and dtype) with an STE backward.

    Subclasses implement :meth:`quantize` and :meth:`bits_per_element`.
    """

    #: Name used in configs (``name: integer``).
    format_name: ClassVar[str] = ""
    #: Operands a layer config naming only the format quantizes (MASE: weight only for the binary family).
    slots: ClassVar[tuple[str, ...]] = ("data_in", "weight")
    #: Whether 0 maps to exactly 0 (pruned weights stay pruned).
    zero_representable: ClassVar[bool] = True
    #: Whether elements share a scale per block of ``block_size`` along the last dimension.
    blocked: ClassVar[bool] = False
    #: Default mixed-precision search space ``{"params": {parameter: [choices]}, "slots": [operands]}``
    #: (``conf/search/mixed_precision.yaml``); None = not searched unless a config lists it.
    search_space: ClassVar[Mapping[str, Any] | None] = None
    #: Parameters also accepted once per layer (MASE's ``floor``), applied to every operand in this format.
    layer_params: ClassVar[tuple[str, ...]] = ()

    def forward(self, x: Tensor) -> Tensor:
        if torch.is_grad_enabled() and x.requires_grad:
            return _StraightThrough.apply(x, self)
        return self.quantize(x, need_mask=False)[0]

    def quantize(self, x: Tensor, need_mask: bool) -> tuple[Tensor, Tensor | None]:
        """Quantized values and, when ``need_mask``, a bool mask of the elements whose gradient passes.

        A ``None`` mask means every gradient passes (plain STE). Not differentiable itself.
        """
        raise NotImplementedError

    def bits_per_element(self, last_dim: int) -> float:
        """Average storage bits per element of a tensor whose last dimension has ``last_dim`` elements.

        Counts shared per-block or per-row scales; per-tensor scalars (ternary's or binary_residual's
        scale) are negligible and not counted.
        """
        raise NotImplementedError

    def check_last_dim(self, size: int) -> str | None:
        """A reason why tensors with last dimension ``size`` cannot be quantized, or None when they can."""
        return None

    def bind(self, shape: tuple[int, ...] | None) -> None:
        """Told, when its layer is built, the shape of the operand it quantizes (``None`` for an activation,
        whose leading dimensions vary): formats with learned per-row state size it here, before an optimizer
        is made. Raises :class:`QuantizerParamError` for an operand it cannot learn on."""


def _float_compute(x: Tensor) -> Tensor:
    return x if x.dtype == torch.float32 else x.to(torch.float32)


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


def _blocks(x: Tensor, block_size: int) -> tuple[Tensor, int]:
    """View ``x`` as ``[..., n_blocks, block_size]`` along its last dim, zero-padding a partial last block."""
    if x.dim() == 0:
        x = x.reshape(1)
    pad = -x.shape[-1] % block_size
    if pad:
        x = nn.functional.pad(x, (0, pad))
    return x.reshape(*x.shape[:-1], x.shape[-1] // block_size, block_size), pad


def _unblock(q: Tensor, like: Tensor, pad: int) -> Tensor:
    q = q.reshape(*q.shape[:-2], -1)
    if pad:
        q = q[..., : q.shape[-1] - pad]
    return q.reshape(like.shape)


def _block_amax(blocks: Tensor) -> tuple[Tensor, Tensor]:
    """Per-block ``max |x|`` (NaN if the block has a NaN, float32 max if it has an inf) and a NaN poison.

    The poison is 0 for ordinary blocks and NaN for blocks holding a NaN: adding it to a per-block
    quantity turns that whole block into NaN.
    """
    amax = blocks.abs().amax(dim=-1, keepdim=True).clamp_(max=_F32_MAX)
    return amax, amax - amax


def _shared_bits(bits: int, block_size: int, last_dim: int) -> float:
    """Bits per element of a ``bits``-bit value shared by each (zero-padded) block of the last dimension."""
    return bits * math.ceil(last_dim / block_size) / last_dim


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
        frac_width: fractional bits, 0..64 (default ``width // 2``); above ``width`` the grid lies inside
            (-1, 1), as in chop.
        floor: round towards -inf instead of to nearest (MASE's ``floor`` key).
    """

    format_name = "integer"
    search_space = {"params": {"width": [8, 16, 32], "frac_width": [2, 4, 8]}}
    layer_params = ("floor",)

    def __init__(self, width: int, frac_width: int | None = None, floor: bool = False) -> None:
        super().__init__()
        self.width = _int_param("width", width, 1, _MAX_WIDTH)
        frac_width = width // 2 if frac_width is None else frac_width
        # above the width is valid fixed point (chop computes it): 8 bits with 9 fractional ones step by 2^-9
        # over [-2^-2, 2^-2 - 2^-9]; the bound keeps 2^f a normal float32
        self.frac_width = _int_param("frac_width", frac_width, 0, _MAX_FRAC_WIDTH)
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


@register_format
class BlockFPQuantizer(Quantizer):
    """Block floating point (MSFP-style): a shared exponent per block, sign-magnitude integer elements.

    Per block of ``block_size`` consecutive elements along the last dim: ``E = floor(log2 max|x|) + 1``
    clamped to ``[-B, 2^e - 1 - B]`` (bias default ``2^(e-1) - 1``); elements
    ``k * 2^(E - (w-1))`` with ``|k| <= 2^(w-1) - 1``. All-zero blocks stay zero; a partial last block
    is zero-padded. MASE uses ``ceil(log2 max)``, which clamps a block max that is an exact power of
    two to ``(2^(w-1)-1)/2^(w-1)`` of itself; ``floor + 1`` represents it exactly.

    Args:
        width: element bits including the sign (>= 2).
        exponent_width: bits of the shared exponent.
        exponent_bias: bias of the shared exponent.
        block_size: elements per block along the last dimension (MASE's ``[1, n]`` is accepted).
    """

    format_name = "block_fp"
    blocked = True
    search_space = {"params": {"width": [6, 8], "exponent_width": [8], "block_size": [16]}}

    def __init__(
        self, width: int, exponent_width: int, exponent_bias: int | None = None, block_size: Any = 16
    ) -> None:
        super().__init__()
        self.width = _int_param("width", width, 2, _MAX_WIDTH)
        self.exponent_width = _int_param("exponent_width", exponent_width, 1, 16)
        bias = 2 ** (exponent_width - 1) - 1 if exponent_bias in (None, "none") else exponent_bias
        self.exponent_bias = _int_param("exponent_bias", bias, -(2**31))
        self.block_size = _block_size_param(block_size)
        self.min_exponent, self.max_exponent = -self.exponent_bias, 2**exponent_width - 1 - self.exponent_bias
        if self.max_exponent > 128:
            raise QuantizerParamError(
                "exponent_bias",
                f"={self.exponent_bias}: shared exponents up to {self.max_exponent} exceed float32; "
                f"use exponent_bias >= {2**exponent_width - 1 - 128}",
            )
        self.max_code = 2 ** (width - 1) - 1

    def quantize(self, x: Tensor, need_mask: bool) -> tuple[Tensor, Tensor | None]:
        blocks, pad = _blocks(_float_compute(x), self.block_size)
        amax, poison = _block_amax(blocks)
        # floor(log2 amax) + 1 is frexp's exponent (exact for subnormal amax too; per block, so cheap)
        shared = torch.frexp(amax).exponent.clamp_(self.min_exponent, self.max_exponent)
        step = _pow2(shared + (_F32_BIAS - self.width + 1), self.min_exponent + _F32_BIAS - self.width + 1)
        step = step.add_(poison)
        q = torch.div(blocks, step).round_().clamp_(-self.max_code, self.max_code).mul_(step)
        return _unblock(q, x, pad).to(x.dtype), None

    def bits_per_element(self, last_dim: int) -> float:
        return self.width + _shared_bits(self.exponent_width, self.block_size, last_dim)

    def extra_repr(self) -> str:
        return (
            f"width={self.width}, exponent_width={self.exponent_width}, exponent_bias={self.exponent_bias}, "
            f"block_size={self.block_size}"
        )


@register_format
class BlockMinifloatQuantizer(Quantizer):
    """Block minifloat: minifloat_ieee elements whose exponent bias is shared per block.

    Per block, bias ``B = clamp(2^e - 1 - floor(log2 max|x|), 0, 2^ebw - 1)`` (an unsigned
    ``exponent_bias_width``-bit number), so the block's largest element uses the top exponent code;
    the elements are then ``minifloat_ieee(width, exponent_width, B)``.

    MASE sets ``B = clamp(floor(log2 max|x|), 0, ...)``, which gives blocks with max < 1 (typical
    weights) bias 0, i.e. a range starting at 1, so small values collapse to 0; and its backward
    raises TypeError, so QAT crashes. Both are fixed here.
    """

    format_name = "block_minifloat"
    blocked = True
    search_space = {
        "params": {"width": [6, 8], "exponent_width": [3, 4], "exponent_bias_width": [8], "block_size": [16]}
    }

    def __init__(
        self, width: int, exponent_width: int, exponent_bias_width: int, block_size: Any = 16
    ) -> None:
        super().__init__()
        self.width = _int_param("width", width, 2, _MAX_WIDTH)
        self.exponent_width = _int_param(
            "exponent_width", exponent_width, 1, min(width - 1, 7), hint=f" (width={width}, 1 sign bit)"
        )
        self.exponent_bias_width = _int_param("exponent_bias_width", exponent_bias_width, 1, 16)
        self.block_size = _block_size_param(block_size)
        self.mantissa_bits = width - exponent_width - 1
        self.top_code = 2**exponent_width - 1
        # An unsigned exponent_bias_width-bit bias, also kept small enough that every step is a float32
        # normal (1 - B - m >= -126; binds only for blocks whose max is below 2^(2^e - 128 + m)).
        self.max_bias = min(2**exponent_bias_width - 1, 127 - self.mantissa_bits)

    def quantize(self, x: Tensor, need_mask: bool) -> tuple[Tensor, Tensor | None]:
        blocks, pad = _blocks(_float_compute(x), self.block_size)
        amax, poison = _block_amax(blocks)
        floor_log2 = torch.frexp(amax).exponent.sub_(1)
        bias = (self.top_code - floor_log2).clamp_(0, self.max_bias)
        max_value = (
            _pow2(self.top_code + _F32_BIAS - bias, 1).mul_(2.0 - 2.0**-self.mantissa_bits).add_(poison)
        )
        lowest_step = 1 - self.max_bias - self.mantissa_bits
        q = _round_to_float_grid(blocks.abs(), self.mantissa_bits + 1, 1 - bias, max_value, lowest_step)
        return _unblock(torch.copysign(q, blocks), x, pad).to(x.dtype), None

    def bits_per_element(self, last_dim: int) -> float:
        return self.width + _shared_bits(self.exponent_bias_width, self.block_size, last_dim)

    def extra_repr(self) -> str:
        return (
            f"width={self.width}, exponent_width={self.exponent_width}, "
            f"exponent_bias_width={self.exponent_bias_width}, block_size={self.block_size}"
        )


@register_format
class BlockLogQuantizer(Quantizer):
    """Block logarithmic: ``log`` elements whose exponent bias is shared per block.

    Per block, ``B = clamp(2^(w-1) - 1 - round(log2 max|x|), 0, 2^ebw - 1)`` so the block max uses the
    top exponent code when the bias allows; elements are ``log(width, B)`` (the lowest code is zero).
    """

    format_name = "block_log"
    blocked = True
    search_space = {"params": {"width": [6, 8], "exponent_bias_width": [8], "block_size": [16]}}

    def __init__(self, width: int, exponent_bias_width: int, block_size: Any = 16) -> None:
        super().__init__()
        self.width = _int_param("width", width, 2, _MAX_WIDTH)
        self.exponent_bias_width = _int_param("exponent_bias_width", exponent_bias_width, 1, 16)
        self.block_size = _block_size_param(block_size)
        self.top_code = 2 ** (width - 1) - 1
        # An unsigned exponent_bias_width-bit bias, also kept small enough that the top exponent is
        # >= -127 (binds only for blocks whose max is below float32's normal range).
        self.max_bias = min(2**exponent_bias_width - 1, self.top_code + 127)

    def quantize(self, x: Tensor, need_mask: bool) -> tuple[Tensor, Tensor | None]:
        blocks, pad = _blocks(_float_compute(x), self.block_size)
        amax, poison = _block_amax(blocks)
        log2_amax = _biased_exponent(_round_to_log_grid(amax, -_F32_BIAS - 1, 127)) - _F32_BIAS
        bias = (self.top_code - log2_amax).clamp_(0, self.max_bias)
        max_exponent = (self.top_code - bias).clamp_(max=127)
        q = _round_to_log_grid(blocks.abs().add_(poison), -bias, max_exponent)
        return _unblock(torch.copysign(q, blocks), x, pad).to(x.dtype), None

    def bits_per_element(self, last_dim: int) -> float:
        return self.width + _shared_bits(self.exponent_bias_width, self.block_size, last_dim)

    def extra_repr(self) -> str:
        return f"width={self.width}, exponent_bias_width={self.exponent_bias_width}, block_size={self.block_size}"


def _check_bipolar(bipolar: Any) -> None:
    if _bool_param("bipolar", bipolar) is not True:
        # MASE's non-bipolar path (BinaryZeroScaled) only runs on 4-D tensors; {0, 1} binarisation of
        # signed weights is not a useful format, so it is not offered.
        raise QuantizerParamError(
            "bipolar", "=False: only bipolar (+1/-1) binarisation is supported; use ternary for {-a, 0, a}"
        )


def _sign_codes(x: Tensor, stochastic: bool) -> Tensor:
    """+1/-1 per element by the sign bit (+0.0 -> +1, -0.0 -> -1), NaN stays NaN.

    Stochastic: +1 with probability ``clamp((x+1)/2, 0, 1)``.
    """
    if stochastic:
        p = ((x + 1) / 2).clamp_(0, 1)
        return (torch.rand_like(x) < p).to(x.dtype).mul_(2).sub_(1).add_(p - p)  # p - p: 0, NaN for NaN
    clipped = x.clamp(-1, 1)  # inf -> +-1, so 0 * clipped below is 0 or NaN (for NaN only)
    return torch.copysign(clipped.mul(0).add_(1), clipped)


class _SignQuantizer(Quantizer):
    """Shared parameters of the sign formats (binary, binary_scaling): weights only by default, no zero code."""

    slots = ("weight",)
    zero_representable = False
    search_space = {"params": {}, "slots": ["weight"]}

    def __init__(self, stochastic: bool = False, bipolar: bool = True, width: int = 1) -> None:
        super().__init__()
        self.stochastic = _bool_param("stochastic", stochastic)
        _check_bipolar(bipolar)
        _int_param("width", width, 1, 1, hint=" (binary values take 1 bit; MASE configs may name it)")

    def extra_repr(self) -> str:
        return f"stochastic={self.stochastic}"


@register_format
class BinaryQuantizer(_SignQuantizer):
    """Bipolar binary: the sign, ``+1`` or ``-1`` (0 cannot be represented: +0.0 becomes +1, -0.0 becomes -1).

    ``stochastic=True`` draws +1 with probability ``clamp((x+1)/2, 0, 1)`` while the module is in
    training mode and is deterministic in eval mode. Gradient: STE clipped to ``|x| <= 1`` (BinaryConnect).
    """

    format_name = "binary"

    def quantize(self, x: Tensor, need_mask: bool) -> tuple[Tensor, Tensor | None]:
        xf = _float_compute(x)
        codes = _sign_codes(xf, self.stochastic and self.training)
        return codes.to(x.dtype), (xf.abs() <= 1) if need_mask else None

    def bits_per_element(self, last_dim: int) -> float:
        return 1.0


@register_format
class BinaryScalingQuantizer(_SignQuantizer):
    """Binary with a per-row scale (XNOR-Net): ``q = a * sign(x)``, ``a = mean |x|`` over the last dim.

    For a weight ``[out, in]`` that is one scale per output channel. +0.0 becomes ``+a`` (-0.0:
    ``-a``); a row holding an inf or NaN becomes NaN (its scale is not finite). MASE's
    LinearBinaryScaling only runs on 4-D tensors, clamps the weight in place and has the scale
    commented out.
    """

    format_name = "binary_scaling"

    def quantize(self, x: Tensor, need_mask: bool) -> tuple[Tensor, Tensor | None]:
        xf = _float_compute(x)
        a = xf.abs()
        scale = a.mean(dim=-1, keepdim=True)
        scale = scale + (scale - scale)  # inf - inf: a row with inf (or NaN) becomes NaN
        q = _sign_codes(xf, self.stochastic and self.training).mul_(scale)
        return q.to(x.dtype), (a <= 1) if need_mask else None

    def bits_per_element(self, last_dim: int) -> float:
        return 1.0 + 32.0 / last_dim


class _ResidualSign(torch.autograd.Function):
    """Residual binarisation: level ``l`` adds ``|s_l| * sign(r_l)`` with ``r_{l+1} = r_l - |s_l| * sign(r_l)``.

    Backward: STE for ``x``; for the scales, ``d q / d s_l = sign(s_l) * sign(r_l)``.
    """

    @staticmethod
    def forward(ctx, x: Tensor, scales: Tensor, stochastic: bool) -> Tensor:
        magnitudes = scales.abs()
        residual = x.clone()
        q = torch.zeros_like(x)
        signs = []
        for level in range(scales.numel()):
            codes = _sign_codes(residual, stochastic)
            signs.append(codes)
            step = codes * magnitudes[level]
            q += step
            residual -= step
        ctx.save_for_backward(torch.stack(signs), torch.sign(scales))
        return q

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, Tensor, None]:
        signs, scale_signs = ctx.saved_tensors
        grad_scales = (grad.unsqueeze(0) * signs).flatten(1).nansum(1) * scale_signs
        return grad, grad_scales, None


@register_format
class BinaryResidualQuantizer(Quantizer):
    """Residual-sign binarisation with learned scales (ReBNet): ``levels`` bits per element.

    ``q = sum_l |s_l| * sign(r_l)``, ``r_0 = x``, ``r_{l+1} = r_l - |s_l| * sign(r_l)``. The scales
    ``s`` are an ``nn.Parameter`` (trained with the layer), initialised on the first call from the data
    greedily (``s_l = mean |r_l|``) and kept in the state dict. With one level this is a binary weight
    with a learned scale (MASE's ``binary_residual`` weight, ``W_b * |gamma|``). 0 cannot be represented.
    """

    format_name = "binary_residual"
    zero_representable = False
    search_space = {"params": {"levels": [1, 2, 3]}, "slots": ["data_in", "weight"]}

    def __init__(
        self,
        levels: int = 2,
        stochastic: bool = False,
        bipolar: bool = True,
        width: int | None = None,
        residual_sign: bool = True,
    ) -> None:
        super().__init__()
        self.levels = _int_param("levels", levels, 1, 8)
        self.stochastic = _bool_param("stochastic", stochastic)
        _check_bipolar(bipolar)
        if width is not None:  # MASE configs name it: the stored bits, one per level
            _int_param("width", width, levels, levels, hint=f" (one bit per level, levels={levels})")
        if _bool_param("residual_sign", residual_sign) is not True:
            raise QuantizerParamError(
                "residual_sign", "=False: only residual-sign binarisation is implemented"
            )
        self.scales = nn.Parameter(torch.ones(levels))
        self.register_buffer("initialized", torch.tensor(False))

    @torch.no_grad()
    def _init_scales(self, x: Tensor) -> None:
        residual = _float_compute(x).clone()
        finite = torch.isfinite(residual)
        residual[~finite] = 0.0
        for level in range(self.levels):
            scale = residual.abs().sum() / finite.sum().clamp(min=1)
            self.scales[level] = scale
            residual -= _sign_codes(residual, False) * scale
        self.initialized.fill_(True)

    def forward(self, x: Tensor) -> Tensor:
        if not bool(self.initialized):
            self._init_scales(x)
        stochastic = self.stochastic and self.training
        q = _ResidualSign.apply(_float_compute(x), self.scales, stochastic)
        return q.to(x.dtype)

    def quantize(self, x: Tensor, need_mask: bool) -> tuple[Tensor, Tensor | None]:
        with torch.no_grad():
            return self.forward(x), None

    def bits_per_element(self, last_dim: int) -> float:
        return float(self.levels)

    def extra_repr(self) -> str:
        return f"levels={self.levels}, stochastic={self.stochastic}"


@register_format
class TernaryQuantizer(Quantizer):
    """Ternary (TWN): ``q = a * sign(x)`` where ``|x| > delta``, else 0; per tensor.

    ``delta = threshold * mean |x|``; ``a = mean |x|`` over the kept elements when ``scaling_factor``
    (else 1). Zeros stay zero. A tensor holding an inf or NaN becomes all NaN (its statistics are
    not finite). Stored in 2 bits.
    MASE's Ternary ignores its threshold config and only runs on 4-D tensors.

    Args:
        threshold: ``delta`` as a fraction of ``mean |x|`` (TWN's 0.75).
        scaling_factor: scale the codes by ``a``.
        width: accepted for MASE configs; must be 2.
        mean, median, max: chop's precomputed statistics of ``|x|``; ``None``/``"NA"`` measures the tensor.
            Given as numbers, ``delta`` is fixed as chop's ternary quantizer sets it: ``threshold * mean``,
            else ``0.05 * max``, else ``threshold * median``.
    """

    format_name = "ternary"
    slots = ("weight",)
    search_space = {"params": {}, "slots": ["weight"]}

    def __init__(
        self,
        threshold: float = 0.75,
        scaling_factor: bool = True,
        width: int = 2,
        mean: Any = None,
        median: Any = None,
        max: Any = None,
    ) -> None:
        super().__init__()
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not threshold >= 0:
            raise QuantizerParamError(
                "threshold", f"={threshold!r}: must be a number >= 0 (a fraction of mean |x|)"
            )
        self.threshold = float(threshold)
        self.scaling_factor = _bool_param("scaling_factor", scaling_factor)
        _int_param("width", width, 2, 2, hint=" (ternary values take 2 bits)")
        stats = {}
        for key, value in (("mean", mean), ("median", median), ("max", max)):
            if value in (None, "NA"):
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
                raise QuantizerParamError(
                    key, f"={value!r}: must be a number >= 0 (a statistic of |x|), or 'NA' to measure it"
                )
            stats[key] = float(value)
        # chop's order: the mean's threshold, else 5% of the max, else the median's threshold
        self.delta: float | None = None
        if "mean" in stats:
            self.delta = self.threshold * stats["mean"]
        elif "max" in stats:
            self.delta = 0.05 * stats["max"]
        elif "median" in stats:
            self.delta = self.threshold * stats["median"]

    def quantize(self, x: Tensor, need_mask: bool) -> tuple[Tensor, Tensor | None]:
        xf = _float_compute(x)
        a = xf.abs()
        mean = a.mean()
        delta = self.threshold * mean if self.delta is None else self.delta
        keep = (a > delta).to(torch.float32)
        scale = (a * keep).sum() / keep.sum().clamp(min=1) if self.scaling_factor else 1.0
        q = torch.copysign(keep.mul_(scale + (mean - mean)), xf)  # mean - mean: NaN if x has inf/NaN
        return q.to(x.dtype), None

    def bits_per_element(self, last_dim: int) -> float:
        return 2.0

    def extra_repr(self) -> str:
        delta = "" if self.delta is None else f", delta={self.delta}"
        return f"threshold={self.threshold}, scaling_factor={self.scaling_factor}{delta}"


@register_format
class MXInt8Quantizer(Quantizer):
    """MXINT8 (OCP Microscaling): int8 elements with an implicit 2^-6 and one E8M0 scale per block.

    The format is defined once, in :mod:`adls_lightning.mxint8.format` (floor(log2 amax) scale,
    ties-to-even, symmetric clamp to +-127, NaN/inf make the whole group NaN); this quantizer runs its
    quantize/dequantize ops (native kernels when built) and adds the STE backward, so MX formats can
    be trained (MASE's MXInt layers are no-grad and quantize weights only in ``load_state_dict``).
    Blocks run along the last dimension and must divide it.

    Args:
        block_size: elements per shared scale (OCP: 32).
        width: element bits; only 8.
    """

    format_name = "mxint8"
    blocked = True
    search_space = {"params": {"block_size": [32]}, "slots": ["data_in", "weight"]}

    def __init__(self, block_size: Any = 32, width: int = 8) -> None:
        super().__init__()
        self.block_size = _block_size_param(block_size)
        _int_param("width", width, 8, 8, hint=" (MXINT8 elements are 8-bit)")

    def check_last_dim(self, size: int) -> str | None:
        if size % self.block_size:
            return f"does not divide the dimension of size {size} (MXINT8 blocks must tile it exactly)"
        return None

    def quantize(self, x: Tensor, need_mask: bool) -> tuple[Tensor, Tensor | None]:
        from adls_lightning.mxint8 import ops

        squeeze = x.dim() == 0
        xv = x.reshape(1) if squeeze else x
        out_dtype = x.dtype if x.dtype in (torch.float32, torch.bfloat16, torch.float16) else torch.float32
        mantissa, scale = ops.quantize(xv, self.block_size)
        q = ops.dequantize(mantissa, scale, self.block_size, out_dtype).to(x.dtype)
        return q.reshape(x.shape), None

    def bits_per_element(self, last_dim: int) -> float:
        return 8.0 + _shared_bits(8, self.block_size, last_dim)

    def extra_repr(self) -> str:
        return f"block_size={self.block_size}"


def quantizer_parameters(name: str) -> list[str]:
    """The parameter names a format accepts (its constructor's keyword arguments)."""
    return list(inspect.signature(QUANTIZERS[name].__init__).parameters)[1:]


def make_quantizer(name: str, **params: Any) -> Quantizer:
    """Build the fake quantizer of format ``name``.

    Example:
        >>> q = make_quantizer("integer", width=8, frac_width=4)
        >>> q(torch.tensor([0.03, 1.0, 100.0])).tolist()
        [0.0, 1.0, 7.9375]

    Raises:
        ConfigError: unknown format or parameter, or an invalid value (the message names the key).
    """
    if name not in QUANTIZERS:
        raise QuantizerParamError(
            "name", f"={name!r}: unknown quantization format (valid: {', '.join(QUANTIZERS)})"
        )
    allowed = quantizer_parameters(name)
    for key in params:
        if key not in allowed:
            raise QuantizerParamError(
                key, f": not a parameter of format {name!r} (valid: {', '.join(allowed)})"
            )
    required = [
        key
        for key, p in inspect.signature(QUANTIZERS[name].__init__).parameters.items()
        if p.default is inspect.Parameter.empty and key != "self"
    ]
    for key in required:
        if key not in params:
            raise QuantizerParamError(key, f": missing (format {name!r} needs {', '.join(required)})")
    return QUANTIZERS[name](**params)
