"""MXINT8, defined once for the whole project, in pure PyTorch.

This module is the specification every other MXINT8 implementation in the project (the C++ CPU
kernel, the CUDA kernel, the differentiable fake quantizer) must match bit for bit.

Format (OCP Microscaling MXINT8, the "minimally supported" conversion of OCP MX v1.0 §6.3):

* ``group_size`` (default 32) consecutive elements along the **last** dimension form a group.
* Each group shares one E8M0 scale byte ``E`` (``uint8``, bias 127): scale = 2^(E-127).
  ``E = 0xFF`` means NaN (E8M0 has no Inf and no zero).
* Each element is an ``int8`` two's-complement mantissa ``m`` with an implicit 2^-6
  (sign, one integer bit, six fraction bits): value = m * 2^-6 * 2^(E-127) = m * 2^(E-133).

Quantization of one group (all arithmetic in float32; bfloat16/float16 inputs convert exactly,
float64 inputs are first rounded to float32):

1. ``amax = max |x_i|``. ``E = floor(log2(amax)) + 127``, clamped below at 0. This equals the
   float32 biased-exponent field of ``amax``, which is how it is computed (no ``log2``).
   All-zero groups and groups whose ``amax`` is a float32 subnormal (< 2^-126) get ``E = 0``.
2. ``m_i = clamp(round_half_to_even(x_i * 2^(133-E)), -127, 127)``. The product is exact (a
   power-of-two scaling whose result is below 128 in magnitude), so there is a single rounding.
   The clamp is symmetric: the code -128 is never produced (it is only hit by values that round
   up to 128, i.e. ``|x| >= 127.5 * 2^(E-133)``, which saturate to +-127). Subnormal inputs are
   quantized like any other value, not flushed to zero.
3. Any ``+-inf`` or ``NaN`` in a group makes its ``amax`` exponent field 0xFF, so the group's scale
   is the NaN code 0xFF and its mantissas are 0; the whole group dequantizes to NaN (the sign of
   an infinity is not kept: the format cannot represent Inf).

Dequantization: ``m * 2^(E-133)`` computed in float32 (exact, including float32 subnormals down to
2^-133), then converted to the requested dtype (exact for bfloat16; float16 rounds to nearest even
and may overflow to inf). ``E = 0xFF`` gives NaN for the whole group. Mantissa code -128 decodes
to -2 * 2^(E-127) as two's complement says, although quantization never produces it.

Reference: microxcaling (``mx/mx_ops.py``) uses the same floor scale but rounds ties away from zero
by default; mase-cuda flushes bfloat16 subnormals and never emits NaN scales. See ``docs/mxint8.md``.
"""

from __future__ import annotations

import torch

#: Scale byte that encodes NaN in E8M0.
NAN_SCALE = 0xFF
#: Largest mantissa magnitude produced by quantization (symmetric clamp).
MAX_MANTISSA = 127
#: value = mantissa * 2^(E - SCALE_BIAS - MANTISSA_FRACTION_BITS).
SCALE_BIAS = 127
MANTISSA_FRACTION_BITS = 6

#: Input dtypes accepted by quantization; outputs accepted by dequantization.
QUANTIZE_INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
DEQUANTIZE_OUTPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

_F32_EXP_SHIFT = 23
_F32_BIAS = 127
_F32_QUIET_NAN_BITS = 0x7FC00000


def _check_groups(op: str, name: str, t: torch.Tensor, group_size: int) -> None:
    """``group_size`` is positive and tiles the last dimension of ``t`` (argument ``name`` of ``op``)."""
    torch._check(t.dim() >= 1, lambda: f"{op}: {name} must have at least one dimension")
    torch._check(group_size > 0, lambda: f"{op}: group_size must be positive, got {group_size}")
    torch._check(
        t.shape[-1] % group_size == 0,
        lambda: (
            f"{op}: group_size={group_size} must divide the last dimension "
            f"(size {t.shape[-1]}) of {name} with shape {tuple(t.shape)}"
        ),
    )


def check_quantize_args(x: torch.Tensor, group_size: int) -> None:
    """Raise a one-line ``RuntimeError`` for arguments that quantization cannot accept.

    The C++ and CUDA kernels raise the same messages through ``TORCH_CHECK``.
    """
    torch._check(
        x.dtype in QUANTIZE_INPUT_DTYPES,
        lambda: f"mxint8_quantize: x must be float32, bfloat16, float16 or float64, got {x.dtype}",
    )
    _check_groups("mxint8_quantize", "x", x, group_size)


def check_dequantize_args(
    mantissa: torch.Tensor, scale: torch.Tensor, group_size: int, dtype: torch.dtype
) -> None:
    """Raise a one-line ``RuntimeError`` for arguments that dequantization cannot accept."""
    torch._check(
        mantissa.dtype == torch.int8,
        lambda: f"mxint8_dequantize: mantissa must be int8, got {mantissa.dtype}",
    )
    torch._check(
        scale.dtype == torch.uint8, lambda: f"mxint8_dequantize: scale must be uint8, got {scale.dtype}"
    )
    torch._check(
        dtype in DEQUANTIZE_OUTPUT_DTYPES,
        lambda: f"mxint8_dequantize: dtype must be float32, bfloat16 or float16, got {dtype}",
    )
    _check_groups("mxint8_dequantize", "mantissa", mantissa, group_size)
    expected = (*mantissa.shape[:-1], mantissa.shape[-1] // group_size)
    torch._check(
        tuple(scale.shape) == expected,
        lambda: (
            f"mxint8_dequantize: scale shape {tuple(scale.shape)} does not match mantissa shape "
            f"{tuple(mantissa.shape)} with group_size={group_size}; expected {expected}"
        ),
    )
    torch._check(
        mantissa.device == scale.device,
        lambda: (
            f"mxint8_dequantize: mantissa ({mantissa.device}) and scale ({scale.device}) must be on one device"
        ),
    )


def _float32_from_biased_exponent(biased: torch.Tensor) -> torch.Tensor:
    """2^(biased - 127) as float32, for integer ``biased`` in [1, 254] (normal numbers only)."""
    return (biased.to(torch.int32) << _F32_EXP_SHIFT).view(torch.float32)


def _grouped(t: torch.Tensor, group_size: int) -> torch.Tensor:
    return t.reshape(*t.shape[:-1], t.shape[-1] // group_size, group_size)


def quantize_reference(x: torch.Tensor, group_size: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x`` to MXINT8 along its last dimension (the format's definition, see module doc).

    Args:
        x: float32, bfloat16, float16 or float64 tensor with at least one dimension whose last
            dimension is divisible by ``group_size``.
        group_size: number of consecutive elements sharing one scale.

    Returns:
        ``(mantissa, scale)``: ``int8`` with ``x``'s shape, and ``uint8`` with shape
        ``x.shape[:-1] + (x.shape[-1] // group_size,)``.
    """
    check_quantize_args(x, group_size)
    groups = _grouped(x.to(torch.float32).contiguous(), group_size)
    # For non-negative floats the int32 bit patterns order like the values, and NaN patterns sort
    # above +inf, so an integer max of |x|'s bits is amax with NaN propagation.
    amax_bits = (groups.view(torch.int32) & 0x7FFFFFFF).amax(dim=-1)
    exponent = amax_bits >> _F32_EXP_SHIFT  # biased floor(log2 amax), 0 for zero/subnormal, 255 inf/NaN
    # x * 2^(133-E) needs 2^(133-E), which overflows float32 for E < 6; those groups are scaled in
    # two exact steps (x * 2^64) * 2^(69-E). Both steps are plain float32 multiplies, as in C++.
    small = exponent < 6
    pre_scale = torch.where(small, 2.0**64, 1.0).to(torch.float32)
    post_exponent = 133 - exponent - torch.where(small, 64, 0)  # in [-122, 127]
    post_scale = _float32_from_biased_exponent(post_exponent + _F32_BIAS)
    scaled = (groups * pre_scale.unsqueeze(-1)) * post_scale.unsqueeze(-1)
    mantissa = torch.round(scaled).clamp_(-MAX_MANTISSA, MAX_MANTISSA)  # torch.round: half to even
    mantissa = torch.where((exponent == NAN_SCALE).unsqueeze(-1), 0.0, mantissa)
    return mantissa.to(torch.int8).reshape(x.shape), exponent.to(torch.uint8)


def element_scale_reference(scale: torch.Tensor) -> torch.Tensor:
    """float32 2^(E-133) per scale byte E (NaN for 0xFF): the value of one mantissa step."""
    exponent = scale.to(torch.int32)
    # 2^(E-133) is a float32 normal for E >= 7 (biased exponent E-6) and a subnormal with the single
    # bit 2^(E+16) set for E < 7.
    bits = torch.where(exponent >= 7, (exponent - 6) << _F32_EXP_SHIFT, 1 << (exponent + 16).clamp(max=22))
    bits = torch.where(exponent == NAN_SCALE, _F32_QUIET_NAN_BITS, bits)
    return bits.view(torch.float32)


def dequantize_reference(
    mantissa: torch.Tensor, scale: torch.Tensor, group_size: int, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Dequantize MXINT8 ``(mantissa, scale)`` to ``dtype`` (the format's definition, see module doc).

    Args:
        mantissa: ``int8`` tensor, groups along the last dimension.
        scale: ``uint8`` tensor with shape ``mantissa.shape[:-1] + (mantissa.shape[-1] // group_size,)``.
        group_size: number of consecutive elements sharing one scale.
        dtype: float32, bfloat16 or float16.

    Returns:
        Tensor of ``dtype`` with ``mantissa``'s shape.
    """
    check_dequantize_args(mantissa, scale, group_size, dtype)
    values = _grouped(mantissa.to(torch.float32), group_size) * element_scale_reference(scale).unsqueeze(-1)
    return values.reshape(mantissa.shape).to(dtype)


def check_linear_args(
    x: torch.Tensor,
    mantissa: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None,
    group_size: int,
) -> None:
    """Raise a one-line ``RuntimeError`` for arguments the packed linear cannot accept (C++ says the same)."""
    torch._check(
        x.dtype in QUANTIZE_INPUT_DTYPES,
        lambda: f"mxint8_linear: x must be float32, bfloat16, float16 or float64, got {x.dtype}",
    )
    torch._check(
        mantissa.dim() == 2,
        lambda: (
            f"mxint8_linear: mantissa must be 2-D (out_features, in_features), got shape {tuple(mantissa.shape)}"
        ),
    )
    check_dequantize_args(mantissa, scale, group_size, torch.float32)
    torch._check(
        x.dim() >= 1 and x.shape[-1] == mantissa.shape[1],
        lambda: f"mxint8_linear: x with shape {tuple(x.shape)} must end in in_features={mantissa.shape[1]}",
    )
    torch._check(
        x.device == mantissa.device,
        lambda: f"mxint8_linear: x ({x.device}) and mantissa ({mantissa.device}) must be on one device",
    )
    if bias is not None:
        torch._check(
            bias.dim() == 1 and bias.shape[0] == mantissa.shape[0],
            lambda: (
                f"mxint8_linear: bias with shape {tuple(bias.shape)} must be (out_features={mantissa.shape[0]},)"
            ),
        )
        torch._check(
            bias.device == x.device,
            lambda: f"mxint8_linear: bias ({bias.device}) and x ({x.device}) must be on one device",
        )


def linear_reference(
    x: torch.Tensor,
    mantissa: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None,
    group_size: int,
    dequantize_fn=dequantize_reference,
) -> torch.Tensor:
    """``x @ dequantize(mantissa, scale).T + bias``: the weight dequantized in ``x``'s dtype (float64 ``x``:
    the exact float32 weight, converted), then a float matmul.

    Args:
        x: ``(..., in_features)``, float32/bfloat16/float16/float64.
        mantissa: ``int8`` ``(out_features, in_features)``.
        scale: ``uint8`` ``(out_features, in_features // group_size)``.
        bias: ``(out_features,)`` or None; used in ``x``'s dtype.
        group_size: input features per scale.
        dequantize_fn: ``(mantissa, scale, group_size, dtype) -> weight``; the registered op passes the
            dispatcher's dequantize, so a CUDA tensor gets the CUDA dequantize kernel.
    """
    check_linear_args(x, mantissa, scale, bias, group_size)
    weight_dtype = torch.float32 if x.dtype == torch.float64 else x.dtype
    weight = dequantize_fn(mantissa, scale, group_size, weight_dtype).to(x.dtype)
    return torch.nn.functional.linear(x, weight, bias.to(x.dtype) if bias is not None else None)
