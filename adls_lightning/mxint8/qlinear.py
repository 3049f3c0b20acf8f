"""``QLinearPacked``: a linear layer whose weight is stored packed in MXINT8, and the verb that swaps a
model's linear layers for it.

Storage per layer: ``weight_mantissa`` (``int8``, ``out x in``) and ``weight_scale`` (``uint8``,
``out x in/group_size``) buffers, i.e. 8 + 8/group_size bits per weight (8.25 for groups of 32), plus
the bias as an ordinary floating-point parameter. Groups run along ``in_features``, the reduction
dimension of the matmul, as the MX spec requires.

The bias stays in floating point (MASE's lab packs it too): it is ``out_features`` values per layer
(0.26 % of a 384x384 layer's weights), so packing it saves almost nothing, while a bias is added
unscaled to every output and one 2^-6-relative error per channel is a systematic shift of that
channel rather than noise that averages out in a dot product. A bias vector is also not a
reduction-dimension block, so MX's "block along the GEMM reduction axis" rule does not apply to it.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from adls_lightning.layers import name_filter, target_layers
from adls_lightning.mxint8.format import DEQUANTIZE_OUTPUT_DTYPES
from adls_lightning.mxint8.ops import dequantize, linear, native_cuda_linear_loaded
from adls_lightning.mxint8.packed_weight import (
    packed_weight_bytes,
    register_packed_weight,
    store_packed_weight,
    tensor_bytes,
)

log = logging.getLogger(__name__)

#: Largest number of input rows (batch x tokens) for which ``QLinearPacked.forward`` calls the fused kernel
#: ``torch.ops.adls.mxint8_linear`` on CPU; above it, dequantize + a BLAS matmul is faster. Measured with
#: ``benchmarks/bench_mxint8_linear.py`` (768->3072 and 3072->768, 1 and 2 threads): the fused kernel wins
#: up to 64 rows (1.06-1.35x at 64, with the exact-decode tiles that serve every 8 rows) and loses at 512
#: (0.8-0.9x); see docs/mxint8.md.
FUSED_MAX_ROWS = 64


class QLinearPacked(nn.Module):
    """``y = x W^T + b`` with ``W`` held as MXINT8 buffers.

    On CPU, for float32 inputs of at most :data:`FUSED_MAX_ROWS` rows (batch x tokens), the forward runs
    the fused kernel ``torch.ops.adls.mxint8_linear``, which reads the int8 mantissas directly and never
    builds the float weight; otherwise it dequantizes the whole weight (native kernel when loaded) into
    the input's dtype and calls ``F.linear`` (the dequantized weight is transient). Gradients flow to the
    input and the bias on both routes; the packed weight is a buffer and is not trained.

    Args:
        in_features: input size; must be divisible by ``group_size``.
        out_features: output size.
        bias: whether the layer has a (floating-point) bias.
        group_size: consecutive input features sharing one scale.
        device: device of the buffers and bias.
        dtype: dtype of the bias (default: torch's default dtype).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        group_size: int = 32,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        register_packed_weight(self, out_features, in_features, group_size, "in_features", device)
        self.in_features = in_features
        self.out_features = out_features
        self.bias = nn.Parameter(torch.zeros(out_features, device=device, dtype=dtype)) if bias else None

    @classmethod
    @torch.no_grad()
    def from_linear(cls, linear: nn.Linear, group_size: int = 32) -> QLinearPacked:
        """Pack ``linear``'s weight (on its device); the bias is copied as is."""
        weight = linear.weight.detach()
        packed = cls(
            linear.in_features,
            linear.out_features,
            bias=linear.bias is not None,
            group_size=group_size,
            device=weight.device,
            dtype=linear.bias.dtype if linear.bias is not None else weight.dtype,
        )
        store_packed_weight(packed, weight)
        if linear.bias is not None:
            packed.bias.copy_(linear.bias.detach())
        packed.train(linear.training)
        return packed

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight as ``dtype`` (float32, bfloat16 or float16)."""
        return dequantize(self.weight_mantissa, self.weight_scale, self.group_size, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.uses_fused_kernel(x):
            return linear(x, self.weight_mantissa, self.weight_scale, self.bias, self.group_size)
        if x.dtype in DEQUANTIZE_OUTPUT_DTYPES:
            weight = self.dequantized_weight(x.dtype)
        else:
            weight = self.dequantized_weight().to(x.dtype)
        bias = self.bias.to(x.dtype) if self.bias is not None else None
        return F.linear(x, weight, bias)

    def uses_fused_kernel(self, x: torch.Tensor) -> bool:
        """Whether :meth:`forward` calls ``torch.ops.adls.mxint8_linear`` for ``x``: on CPU for float32 and at most
        :data:`FUSED_MAX_ROWS` rows; on CUDA for every float32/bfloat16/float16 input when the CUDA kernel is
        built, since the op itself picks the fused kernel or dequantize + cuBLAS by rows, in C++."""
        if x.device.type == "cuda":
            return x.dtype in DEQUANTIZE_OUTPUT_DTYPES and native_cuda_linear_loaded()
        rows = x.numel() // self.in_features if self.in_features else 0
        return x.device.type == "cpu" and x.dtype == torch.float32 and rows <= FUSED_MAX_ROWS

    @torch.no_grad()
    def to_linear(self) -> nn.Linear:
        """An ``nn.Linear`` holding the dequantized weight (in the bias dtype, float32 without bias)."""
        dtype = self.bias.dtype if self.bias is not None else torch.float32
        linear = nn.Linear(
            self.in_features,
            self.out_features,
            bias=self.bias is not None,
            device=self.weight_mantissa.device,
            dtype=dtype,
        )
        linear.weight.copy_(self.dequantized_weight().to(dtype))
        if self.bias is not None:
            linear.bias.copy_(self.bias)
        linear.train(self.training)
        return linear

    def packed_weight_bytes(self) -> int:
        """Bytes of the packed weight: the mantissa and scale buffers."""
        return packed_weight_bytes(self)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, group_size={self.group_size}"
        )


def module_bytes(module: nn.Module) -> int:
    """Bytes of all parameters and buffers of ``module`` (each tensor counted once)."""
    tensors = {id(t): t for t in (*module.parameters(), *module.buffers())}
    return sum(tensor_bytes(t) for t in tensors.values())


@dataclass
class PackedLayer:
    """One swap made by :func:`pack_linear_layers`; :func:`restore_layers` undoes it."""

    name: str
    parent: nn.Module
    attribute: str
    original: nn.Module
    packed: QLinearPacked
    #: Bytes of the original's weight in its own dtype (with merged LoRA: of the base weight).
    original_weight_bytes: int


def _lora_layer_class() -> type | None:
    try:
        from peft.tuners.lora import LoraLayer
    except ImportError:  # peft is optional for the packing itself
        return None
    return LoraLayer


def _packable(model: nn.Module, exclude: Iterable[str]) -> Iterator[tuple[str, str, nn.Module]]:
    """``(canonical name, path, module)`` of each layer :func:`pack_linear_layers` swaps (one walker and naming
    for quantization, pruning and packing: :mod:`adls_lightning.layers`)."""
    lora_layer = _lora_layer_class()
    for layer in target_layers(model, name_filter(exclude=tuple(exclude)), unused_copies=True):
        if lora_layer is not None and isinstance(layer.module, lora_layer):
            if isinstance(layer.module.get_base_layer(), nn.Linear):
                yield layer.name, layer.path, layer.module
        elif isinstance(layer.module, nn.Linear):
            yield layer.name, layer.path, layer.module
        else:  # another wrapper (a QuantLinear): pack the linear it calls
            yield layer.name, layer.linear_path, layer.linear


def packable_linear_layers(
    model: nn.Module, exclude: Iterable[str] = ("classifier",)
) -> Iterator[tuple[str, nn.Module]]:
    """Yield ``(name, module)`` for each layer :func:`pack_linear_layers` would swap.

    These are every ``nn.Linear`` and every PEFT LoRA layer wrapping an ``nn.Linear`` (whose
    ``lora_A``/``lora_B`` adapters are merged, not packed themselves), except layers whose canonical
    name (:mod:`adls_lightning.layers`: ``bert.encoder.layer.0.attention.self.query`` with or without
    LoRA) matches a regex in ``exclude`` (``re.search``).
    """
    for name, _, module in _packable(model, exclude):
        yield name, module


def check_packable(model: nn.Module, group_size: int = 32, exclude: Iterable[str] = ("classifier",)) -> int:
    """Raise ``ValueError`` naming the first layer whose ``in_features`` ``group_size`` does not divide.

    Returns:
        The number of layers that would be packed.
    """
    count = 0
    for name, module in packable_linear_layers(model, exclude):
        in_features = _as_linear(module, merge=False).in_features
        if in_features % group_size:
            raise ValueError(
                f"group_size={group_size} does not divide in_features={in_features} of layer '{name}'; "
                f"choose a divisor of it or add the layer to exclude"
            )
        count += 1
    return count


def _as_linear(module: nn.Module, merge: bool) -> nn.Linear:
    """``module`` itself, or for a LoRA layer its base ``nn.Linear`` (a merged copy when ``merge``)."""
    if isinstance(module, nn.Linear):
        return module
    if not merge:
        return module.get_base_layer()
    merged = copy.deepcopy(module)
    if not merged.disable_adapters:
        merged.merge(safe_merge=True)  # PEFT's own merge: handles scaling, DoRA, lora_bias
    return merged.get_base_layer()


def _parent_and_attribute(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    parent_name, _, attribute = name.rpartition(".")
    return (model.get_submodule(parent_name) if parent_name else model), attribute


@torch.no_grad()
def pack_linear_layers(
    model: nn.Module, group_size: int = 32, exclude: Iterable[str] = ("classifier",)
) -> list[PackedLayer]:
    """Swap the model's linear layers for :class:`QLinearPacked`, in place.

    Every ``nn.Linear`` is packed except those whose canonical name matches a regex in ``exclude`` (by
    default the classification head). A PEFT LoRA layer is replaced as a whole by one packed layer holding
    ``MXINT8(W + scaling * B A)`` (merged with PEFT's ``merge`` on a copy, so the model's own LoRA
    modules are untouched), which is the weight a deployed model would carry.

    Args:
        model: the model to modify.
        group_size: elements per MXINT8 group along ``in_features``.
        exclude: regexes on canonical layer names (e.g. ``"classifier"``) to leave in floating point.

    Returns:
        The swaps made; keep them to undo with :func:`restore_layers`, or drop them to free the
        original weights.

    Raises:
        ValueError: a selected layer's ``in_features`` is not divisible by ``group_size`` (nothing is
            swapped then).
    """
    check_packable(model, group_size, exclude)
    swaps = []
    for name, path, module in list(_packable(model, exclude)):
        linear = _as_linear(module, merge=True)
        packed = QLinearPacked.from_linear(linear, group_size)
        parent, attribute = _parent_and_attribute(model, path)
        setattr(parent, attribute, packed)
        original_weight = _as_linear(module, merge=False).weight
        swaps.append(PackedLayer(name, parent, attribute, module, packed, tensor_bytes(original_weight)))
    log.info("MXINT8: packed %d linear layers (group_size=%d)", len(swaps), group_size)
    return swaps


def restore_layers(swaps: Iterable[PackedLayer]) -> None:
    """Put back the original modules replaced by :func:`pack_linear_layers`."""
    for swap in swaps:
        setattr(swap.parent, swap.attribute, swap.original)
