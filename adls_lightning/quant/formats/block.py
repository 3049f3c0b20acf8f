"""Block formats: ``block_fp``, ``block_minifloat`` and ``block_log``.

Consecutive elements along the last dimension form blocks of ``block_size`` (a partial last block is
zero-padded) that share one value: an exponent (``block_fp``) or an exponent bias (``block_minifloat``,
``block_log``) set by the block's largest magnitude. The elements are then integers, minifloats or powers of two,
rounded with :mod:`~adls_lightning.quant.formats.float32_grid`. A block holding a NaN becomes NaN.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from adls_lightning.quant.formats.float32_grid import (
    _F32_BIAS,
    _F32_MAX,
    _biased_exponent,
    _pow2,
    _round_to_float_grid,
    _round_to_log_grid,
)
from adls_lightning.quant.quantizers import (
    _MAX_WIDTH,
    Quantizer,
    QuantizerParamError,
    _block_size_param,
    _float_compute,
    _int_param,
    _shared_bits,
    register_format,
)


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
