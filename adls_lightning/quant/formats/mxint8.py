"""MXINT8 (OCP Microscaling) as a fake quantizer: ``mxint8``.

The format itself (its quantize and dequantize ops, native kernels when built) is defined once, in
:mod:`adls_lightning.mxint8`; this module makes it a trainable :class:`~adls_lightning.quant.quantizers.Quantizer`
(STE backward) that configs name like every other format.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from adls_lightning.quant.quantizers import (
    Quantizer,
    _block_size_param,
    _int_param,
    _shared_bits,
    register_format,
)


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
