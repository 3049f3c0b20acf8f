"""``QuantLinear``: a fake-quantized view of an existing ``nn.Linear``."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from adls_lightning.quant.quantizers import Quantizer

#: The three operands of a linear layer, in MASE's key prefixes (``data_in_width``, ``weight_width``, ...).
SLOTS = ("data_in", "weight", "bias")


class QuantLinear(nn.Module):
    """Wraps an ``nn.Linear`` (kept as the child ``linear``, not copied) with input, weight and bias quantizers.

    ``forward(x) = F.linear(q_in(x), q_w(linear.weight), q_b(linear.bias))``; a missing quantizer
    passes its operand through. Because the layer is wrapped, parametrizations registered on
    ``linear.weight`` (pruning masks via ``torch.nn.utils.parametrize``) keep applying, whether they
    were registered before or after wrapping, and the bias is kept.

    ``weight``, ``bias``, ``in_features`` and ``out_features`` read through to the wrapped layer, so
    code that inspects a linear layer (PEFT's LoRA wrapper does) still works. State dicts saved from
    the plain layer load into this one: the linear's keys are moved under ``linear.`` and quantizer
    state missing from the checkpoint keeps its current value (so a full-precision checkpoint can be
    evaluated after post-training quantization).

    Args:
        linear: the layer to quantize.
        data_in_quantizer: quantizer for the input activations, or None.
        weight_quantizer: quantizer for the weight, or None.
        bias_quantizer: quantizer for the bias, or None.
    """

    def __init__(
        self,
        linear: nn.Linear,
        data_in_quantizer: Quantizer | None = None,
        weight_quantizer: Quantizer | None = None,
        bias_quantizer: Quantizer | None = None,
    ) -> None:
        super().__init__()
        self.linear = linear
        self.data_in_quantizer = data_in_quantizer
        self.weight_quantizer = weight_quantizer
        self.bias_quantizer = bias_quantizer
        self.register_load_state_dict_pre_hook(_accept_plain_linear_state)

    @property
    def weight(self) -> Tensor:
        return self.linear.weight

    @property
    def bias(self) -> Tensor | None:
        return self.linear.bias

    @property
    def in_features(self) -> int:
        return self.linear.in_features

    @property
    def out_features(self) -> int:
        return self.linear.out_features

    def quantizer(self, slot: str) -> Quantizer | None:
        """The quantizer of ``slot`` (one of :data:`SLOTS`)."""
        return getattr(self, f"{slot}_quantizer")

    def forward(self, x: Tensor) -> Tensor:
        if self.data_in_quantizer is not None:
            x = self.data_in_quantizer(x)
        weight = self.linear.weight
        if self.weight_quantizer is not None:
            weight = self.weight_quantizer(weight)
        bias = self.linear.bias
        if bias is not None and self.bias_quantizer is not None:
            bias = self.bias_quantizer(bias)
        return F.linear(x, weight, bias)

    def slot_bits(self, slot: str) -> float:
        """Storage bits per element of ``slot``; the parameter dtype's width when it is not quantized."""
        quantizer = self.quantizer(slot)
        if quantizer is None:
            return dtype_bits(self.linear)
        last_dim = self.out_features if slot == "bias" else self.in_features
        return quantizer.bits_per_element(last_dim)


def dtype_bits(linear: nn.Linear) -> float:
    """Bit width of a linear layer's stored weight dtype (read from the parameter, not a parametrized view)."""
    return float(torch.finfo(next(linear.parameters()).dtype).bits)


def _accept_plain_linear_state(
    module: QuantLinear, state_dict: dict[str, Any], prefix: str, *args: Any, **kwargs: Any
) -> None:
    """Load-state-dict pre-hook: accept the keys of the unwrapped layer (``weight`` -> ``linear.weight``)."""
    own = module.state_dict(keep_vars=True)
    for key, value in own.items():
        full = prefix + key
        if full in state_dict:
            continue
        if key.startswith("linear."):
            inner = key.removeprefix("linear.")
            # a pruned inner linear keeps its weight as parametrizations.weight.original; the plain layer's
            # state names it weight (its mask, if missing, is filled in by the pruning hook of the inner linear)
            for plain in (
                prefix + inner,
                prefix + inner.replace("parametrizations.weight.original", "weight"),
            ):
                if plain in state_dict:
                    state_dict[full] = state_dict.pop(plain)
                    break
        elif "_quantizer." in key:
            state_dict[full] = value.detach()
