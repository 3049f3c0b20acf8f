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

    ``forward(x) = q_out(F.linear(q_in(x), q_w(linear.weight), q_b(linear.bias)))``; a missing quantizer
    passes its operand through (``q_out`` is MASE's ``data_out``, rarely used). Because the layer is wrapped,
    parametrizations registered on ``linear.weight`` (pruning masks via ``torch.nn.utils.parametrize``) keep
    applying, whether they were registered before or after wrapping, and the bias is kept.

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
        data_out_quantizer: quantizer for the output, or None.
    """

    #: The child through which this wrapper calls the layer it wraps (read by :mod:`adls_lightning.layers`).
    wrapped_child = "linear"

    def __init__(
        self,
        linear: nn.Linear,
        data_in_quantizer: Quantizer | None = None,
        weight_quantizer: Quantizer | None = None,
        bias_quantizer: Quantizer | None = None,
        data_out_quantizer: Quantizer | None = None,
    ) -> None:
        super().__init__()
        self.linear = linear
        self.data_in_quantizer = data_in_quantizer
        self.weight_quantizer = weight_quantizer
        self.bias_quantizer = bias_quantizer
        self.data_out_quantizer = data_out_quantizer
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
        """The quantizer of ``slot`` (one of :data:`SLOTS`, or ``data_out``)."""
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
        out = F.linear(x, weight, bias)
        return out if self.data_out_quantizer is None else self.data_out_quantizer(out)

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


# first components of an nn.Linear's state keys (plain, or pruned through torch.nn.utils.parametrize)
_LINEAR_STATE_ROOTS = frozenset({"weight", "bias", "parametrizations"})


def _accept_plain_linear_state(
    module: QuantLinear, state_dict: dict[str, Any], prefix: str, *args: Any, **kwargs: Any
) -> None:
    """Load-state-dict pre-hook: a state saved from the unwrapped layer loads into the wrapper.

    The unwrapped layer's keys (``weight``, ``bias``, and ``parametrizations.*`` when it was pruned) move under
    ``linear.``; from there the inner linear's own hooks take over (e.g. the pruning hook that accepts an unpruned
    weight). Quantizer state missing from the checkpoint keeps the current values.
    """
    for key in [k for k in state_dict if k.startswith(prefix)]:
        rest = key.removeprefix(prefix)
        if rest.split(".", 1)[0] in _LINEAR_STATE_ROOTS and prefix + "linear." + rest not in state_dict:
            state_dict[prefix + "linear." + rest] = state_dict.pop(key)
    for key, value in module.state_dict(keep_vars=True).items():
        if "_quantizer." in key:
            state_dict.setdefault(prefix + key, value.detach())
