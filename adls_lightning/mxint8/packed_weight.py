"""The packed weight shared by ``QLinearPacked`` and ``QEmbeddingPacked``: a ``rows x cols`` table held as
``weight_mantissa`` (int8, ``rows x cols``) and ``weight_scale`` (uint8, ``rows x cols/group_size``) buffers,
groups along ``cols``."""

from __future__ import annotations

import torch
from torch import nn

from adls_lightning.mxint8.ops import quantize


def register_packed_weight(
    module: nn.Module,
    rows: int,
    cols: int,
    group_size: int,
    cols_name: str,
    device: torch.device | str | None = None,
) -> None:
    """Give ``module`` zeroed ``weight_mantissa``/``weight_scale`` buffers and its ``group_size``.

    Raises ``ValueError`` naming the module's class and ``cols_name`` when ``group_size`` does not divide
    ``cols``.
    """
    if group_size <= 0 or cols % group_size:
        raise ValueError(
            f"{type(module).__name__}: group_size={group_size} must be a positive divisor of {cols_name}={cols}"
        )
    module.group_size = group_size
    module.register_buffer("weight_mantissa", torch.zeros(rows, cols, dtype=torch.int8, device=device))
    module.register_buffer(
        "weight_scale", torch.zeros(rows, cols // group_size, dtype=torch.uint8, device=device)
    )


@torch.no_grad()
def store_packed_weight(module: nn.Module, weight: torch.Tensor) -> None:
    """Quantize the float ``weight`` into ``module``'s buffers (made by :func:`register_packed_weight`)."""
    mantissa, scale = quantize(weight.detach(), module.group_size)
    module.weight_mantissa.copy_(mantissa)
    module.weight_scale.copy_(scale)


def tensor_bytes(tensor: torch.Tensor) -> int:
    """Bytes of ``tensor``'s elements."""
    return tensor.numel() * tensor.element_size()


def packed_weight_bytes(module: nn.Module) -> int:
    """Bytes of ``module``'s packed weight as stored (made by :func:`register_packed_weight`): its mantissa and scale
    buffers, 8 + 8/group_size bits per weight."""
    return tensor_bytes(module.weight_mantissa) + tensor_bytes(module.weight_scale)
