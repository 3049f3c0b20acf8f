"""``format=onnx int4=true``: a 4-bit weight run (``quant=w4_gptq``, or round to nearest on the same grid) as an
ONNX graph whose linear layers are ONNX Runtime's weight-only 4-bit kernel, ``com.microsoft.MatMulNBits``.

Each layer the run quantized to symmetric 4-bit ``scaled_integer`` weights with one step per group of
``group_size`` input features becomes one ``MatMulNBits`` node (``bits=4``, ``block_size`` = the group size, ``K``
= input features, ``N`` = output features) holding the run's own codes and steps: GPTQ's fixed steps
(``fixed_scale``, installed by :func:`adls_lightning.quant.gptq.gptq_quantize`) or, for round to nearest, the
observer's steps on the layer's weight. The layout is ONNX Runtime's (its contrib-op schema):

* ``B``: uint8 ``[N, K / block_size, block_size / 2]``, two codes per byte along ``K``, the first in the low
  nibble; the stored value is ``code + 8`` (codes are ``-7..7`` on the symmetric grid), since without a
  ``zero_points`` input the kernel subtracts its default zero point ``2^(bits-1) = 8``;
* ``scales``: float32 ``[N, K / block_size]``, in the order the fake quantizer's groups have (row-major over the
  ``[out, in]`` weight);
* ``bias``: the layer's float bias (input 5), added after the product.

``y = x @ ((B - 8) · scales)ᵀ + bias`` is then what the fake-quantized layer computes,
``x @ (codes · s)ᵀ + bias``, with the same float weights: :func:`nbits_layers` checks ``codes · s`` against the
layer's quantizer bit for bit. Inputs stay float (GPTQ quantizes weights only), and so does everything the run kept
float (embeddings, LayerNorm, attention, any layer not quantized). ``accuracy_level=0`` (the default, and what the
export writes) multiplies in float32: the graph differs from the fake-quantized model only in summation order.
"""

from __future__ import annotations

import copy
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from adls_lightning.errors import ConfigError
from adls_lightning.export.int8 import bake_weights, rewrite_linear_nodes
from adls_lightning.quant.linear import QuantLinear
from adls_lightning.quant.scaled import ScaledIntegerQuantizer
from adls_lightning.quant.transform import find_linear_layers

INT4_FILE = "model_int4.onnx"
BITS = 4
#: the value ``MatMulNBits`` subtracts from every stored code when no ``zero_points`` input is given
DEFAULT_ZERO = 2 ** (BITS - 1)
#: int4 graph vs the fake-quantized model: the same float weights, summed in another order (ORT's blocked kernel),
#: so the fp32 export's tolerance (:data:`adls_lightning.export.onnx.FP32_ATOL`, ``FP32_RTOL``) holds
INT4_ATOL = 1e-4
INT4_RTOL = 1e-4
CONTRIB_DOMAIN = "com.microsoft"
#: ``MatMulNBits``'s ``accuracy_level`` of ``int4=int8_inputs``: each block of inputs quantized to int8 by the kernel
#: (integer dot products, an approximation of the run's float inputs); ``int4=true`` writes 0, float inputs
INT8_INPUTS = 4
#: the int8-input graph vs the fake-quantized model: an input rounding per block and layer, of the order of the
#: int8 graph's own (``adls_lightning.export.int8.INT8_ATOL``); the self-check's agreement says what it costs
INT8_INPUTS_ATOL = 0.25
INT8_INPUTS_RTOL = 0.1


@dataclass
class NBitsLayer:
    """One linear layer on a 4-bit grid: ``y = x @ (codes · scales)ᵀ + bias``, one step per ``block_size`` inputs."""

    name: str
    #: integer codes ``[out, in]`` in ``-7..7``
    codes: torch.Tensor
    #: float32 steps ``[out, in / block_size]``
    scales: torch.Tensor
    block_size: int


def why_not_4bit(module: QuantLinear) -> str | None:
    """Why a quantized layer is not a weight-only symmetric 4-bit group grid ``MatMulNBits`` takes (None: it is)."""
    quantizer = module.weight_quantizer
    if quantizer is None:
        return "leaves its weight float"
    if not isinstance(quantizer, ScaledIntegerQuantizer):
        return f"quantizes its weight as {getattr(quantizer, 'format_name', type(quantizer).__name__)}"
    if quantizer.width != BITS or not quantizer.symmetric or quantizer.granularity != "group":
        kind = "symmetric" if quantizer.symmetric else "asymmetric"
        return (
            f"quantizes its weight as scaled_integer width {quantizer.width}, {kind}, {quantizer.granularity}"
        )
    size = quantizer.group_size
    if size < 16 or size & (size - 1):
        return f"has groups of {size} inputs; MatMulNBits takes a power of two >= 16 (e.g. group_size=32)"
    if quantizer.lsq:
        return "learns its steps (LSQ)"
    for operand in ("data_in", "bias", "data_out"):
        if module.quantizer(operand) is not None:
            return f"quantizes its {operand} (MatMulNBits multiplies float inputs)"
    return None


@torch.no_grad()
def nbits_layers(model: nn.Module) -> dict[str, NBitsLayer]:
    """The 4-bit codes and steps of every :class:`QuantLinear` of ``model`` (a fake-quantized model).

    Raises:
        ConfigError: a quantized layer that is not weight-only symmetric 4-bit with power-of-two groups, or whose
            codes do not reproduce its fake quantizer.
    """
    layers: dict[str, NBitsLayer] = {}
    for layer in find_linear_layers(model):
        module = layer.module
        if not isinstance(module, QuantLinear):
            continue  # the run kept it float: so does the graph
        why = why_not_4bit(module)
        if why is not None:
            raise ConfigError(
                f"int4=true: layer {layer.name} {why}; the int4 graph carries symmetric 4-bit scaled_integer weights "
                "in groups with float inputs (quant=w4_gptq)"
            )
        quantizer: ScaledIntegerQuantizer = module.weight_quantizer
        weight = module.linear.weight.detach().float()
        out, inputs = weight.shape
        block = quantizer.group_size
        if inputs % block:
            raise ConfigError(f"int4=true: layer {layer.name}: {inputs} inputs are not a multiple of {block}")
        scale, zero = (
            (quantizer.fixed_scale, quantizer.fixed_zero)
            if quantizer.fixed_scale.numel()
            else quantizer.grid(weight)
        )
        if zero.abs().max() != 0:
            raise ConfigError(f"int4=true: layer {layer.name}'s weight grid has a zero point")
        scale = scale.reshape(out, inputs // block).to(torch.float32)
        steps = scale.repeat_interleave(block, dim=1)
        codes = torch.round(weight / steps).clamp(quantizer.qmin, quantizer.qmax)
        # the safety net: these must be the very integers the run multiplied with
        if not torch.equal(codes * steps, quantizer(weight)):
            raise ConfigError(
                f"int4=true: layer {layer.name}: the 4-bit codes do not reproduce its fake quantizer"
            )
        layers[layer.name] = NBitsLayer(layer.name, codes.to(torch.int8), scale.contiguous(), block)
    return layers


def pack_4bit(codes: np.ndarray, block_size: int) -> np.ndarray:
    """``MatMulNBits``'s ``B`` of integer ``codes`` ``[N, K]`` in ``-8..7``: uint8 ``[N, K / block_size,
    block_size / 2]``, ``code + 8`` per nibble, the even ``K`` index in the low nibble."""
    n, k = codes.shape
    stored = (codes.astype(np.int16) + DEFAULT_ZERO).astype(np.uint8).reshape(n, k // block_size, block_size)
    return np.ascontiguousarray(stored[..., 0::2] | (stored[..., 1::2] << 4))


def matmul_nbits_node(
    name: str, source: str, output: str, layer: NBitsLayer, bias: str | None, graph, accuracy_level: int = 0
) -> object:
    """The ``MatMulNBits`` node of ``layer`` reading ``source`` and writing ``output``; its initializers are added
    to ``graph``. ``accuracy_level``: 0 multiplies float inputs, :data:`INT8_INPUTS` lets the kernel quantize
    each block of inputs to int8."""
    from onnx import helper, numpy_helper

    codes = layer.codes.numpy()
    n, k = codes.shape
    prefix = f"int4.{name}."
    graph.initializer.extend(
        [
            numpy_helper.from_array(pack_4bit(codes, layer.block_size), prefix + "B"),
            numpy_helper.from_array(layer.scales.numpy().astype(np.float32), prefix + "scales"),
        ]
    )
    # inputs: A, B, scales, zero_points (default 8), g_idx (deprecated), bias
    inputs = [source, prefix + "B", prefix + "scales"] + (["", "", bias] if bias else [])
    return helper.make_node(
        "MatMulNBits",
        inputs,
        [output],
        name=prefix + "MatMulNBits",
        domain=CONTRIB_DOMAIN,
        K=k,
        N=n,
        bits=BITS,
        block_size=layer.block_size,
        accuracy_level=accuracy_level,
    )


def nbits_graph(
    fp32_path: Path,
    out_path: Path,
    float_model: nn.Module,
    layers: dict[str, NBitsLayer],
    accuracy_level: int = 0,
) -> None:
    """Rewrite the fp32 graph of ``float_model`` (weights as the run quantized them): every ``MatMul`` / ``Gemm``
    whose weight is one of ``layers``' becomes their ``MatMulNBits``; the rest of the graph is unchanged."""
    import onnx
    from onnx import helper

    def nbits(name: str, node, transposed: bool, graph) -> list:
        bias = node.input[2] if node.op_type == "Gemm" and len(node.input) > 2 and node.input[2] else None
        return [
            matmul_nbits_node(name, node.input[0], node.output[0], layers[name], bias, graph, accuracy_level)
        ]

    graph_model = rewrite_linear_nodes(fp32_path, float_model, layers, "int4=true", nbits)
    if not any(opset.domain == CONTRIB_DOMAIN for opset in graph_model.opset_import):
        graph_model.opset_import.append(helper.make_opsetid(CONTRIB_DOMAIN, 1))
    onnx.save(graph_model, str(out_path))


def baked_copy(fake_model: nn.Module) -> nn.Module:
    """A copy of ``fake_model`` with each :class:`QuantLinear` a plain ``nn.Linear`` holding the weight its quantizer
    computes: the float graph whose weights :func:`nbits_graph` finds and replaces."""
    return bake_weights(copy.deepcopy(fake_model))


def export_int4_graph(
    fake_model: nn.Module, out_path: Path, accuracy_level: int = 0
) -> dict[str, NBitsLayer]:
    """``out_path``: the ``MatMulNBits`` graph of ``fake_model`` (a fake-quantized Hugging Face classifier, eval
    mode); returns the layers written on the 4-bit grid."""
    from adls_lightning.export.onnx import export_onnx

    layers = nbits_layers(fake_model)
    if not layers:
        raise ConfigError(
            "int4=true: the run quantizes no linear layer; export a quant=w4_gptq run (a float checkpoint: "
            "quant=w4_gptq quant.gptq=null for round to nearest)"
        )
    float_model = baked_copy(fake_model)
    with tempfile.TemporaryDirectory() as tmp:
        fp32_path = Path(tmp) / "model.onnx"
        export_onnx(float_model, fp32_path)
        nbits_graph(fp32_path, out_path, float_model, layers, accuracy_level)
    return layers


def check_int4(path: Path, fake_model: nn.Module, accuracy_level: int = 0):
    """ONNX Runtime's logits of ``path`` vs ``fake_model``'s on the export's sample batch.

    Raises:
        ExportCheckError: a logit off by more than ``INT4_ATOL + INT4_RTOL·|logit|`` (with int8 inputs, the int8
            graph's bound: :data:`INT8_INPUTS_ATOL`).
    """
    from adls_lightning.export import onnx as onnx_export

    inputs = onnx_export.sample_inputs(fake_model)
    check, close = onnx_export.compare(path, fake_model, inputs)
    if accuracy_level == INT8_INPUTS:
        with torch.inference_mode():
            expected = onnx_export.LogitsOnly(fake_model)(**inputs).numpy()
        actual = onnx_export.onnx_logits(onnx_export.onnx_session(path), inputs)
        close = bool(np.allclose(actual, expected, rtol=INT8_INPUTS_RTOL, atol=INT8_INPUTS_ATOL))
    if not close:
        raise onnx_export.ExportCheckError(
            f"{path}: ONNX Runtime MatMulNBits logits differ from the fake-quantized PyTorch model's by up to "
            f"{check.max_abs_diff:.3g} (tolerance {INT4_ATOL:g} + {INT4_RTOL:g}·|logit|); the file is left for "
            "inspection"
        )
    return check


__all__ = [
    "INT4_FILE",
    "NBitsLayer",
    "check_int4",
    "export_int4_graph",
    "nbits_graph",
    "nbits_layers",
    "pack_4bit",
]
