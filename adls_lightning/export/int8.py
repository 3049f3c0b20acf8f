"""``format=onnx int8=scaled``: a ``quant=int8_scaled`` run as an int8 ONNX graph with the run's own scales.

Each linear layer the run quantized becomes ``QuantizeLinear -> DequantizeLinear`` on its input (the run's
calibrated static per-tensor scale, zero point 0) and ``DequantizeLinear`` on an int8 initializer holding the
run's weight codes (one scale per output channel): the QDQ form, which ONNX Runtime's graph optimizer fuses into
integer kernels (``MatMulIntegerToFloat`` / ``QGemm``: int8 x int8 products summed in int32, scaled to float
once). What the run kept float stays float: embeddings, LayerNorm, attention's two matmuls and softmax, biases
(added in float, as the fake quantizer adds them), and any layer the run did not quantize. A run that also
quantizes those encoder points (``quant=int8_scaled_all``) keeps their rounding, on their calibrated steps, as float
operations of the graph (:func:`~adls_lightning.quant.scaled.fix_calibrated_grids` makes them traceable).

Exactness against the fake-quantized model (what the run evaluated): the weight codes are the fake quantizer's
``clamp(round(w / s), -127, 127)`` (checked on export: ``codes * s`` equals the quantizer's output bit for bit),
and each input goes through ``Clip(±127 s)`` before ``QuantizeLinear``, so its codes are the quantizer's too
(``QuantizeLinear`` alone saturates to -128, one code below the fake quantizer's symmetric grid). What remains
is arithmetic order: the fake model sums float products, the engine exact int32 sums; a float difference that
crosses a rounding boundary moves an activation code by one in the next layer, as running the fake-quantized
model with float64 sums does. :func:`check_int8` bounds the resulting logit difference (:data:`INT8_ATOL`).

A PTQ run keeps no activation ranges in its checkpoint (it calibrates at evaluation, after the checkpoint was
written): the export calibrates as the run did (``quant.calibration.batches`` training batches of the run's data,
seeded with the run's seed; the batches drawn can differ from the run's, whose ranges were never saved) and
says so; a QAT checkpoint carries its ranges and they are used as saved.
"""

from __future__ import annotations

import copy
import math
import tempfile
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from adls_lightning.data.inputs import model_inputs
from adls_lightning.errors import ConfigError
from adls_lightning.layers import swap_module
from adls_lightning.quant.linear import QuantLinear
from adls_lightning.quant.scaled import (
    ScaledIntegerQuantizer,
    calibrate,
    fix_calibrated_grids,
    scaled_quantizers,
)
from adls_lightning.quant.smoothquant import Smoothed
from adls_lightning.quant.transform import find_linear_layers

INT8_SCALED_FILE = "model_int8_scaled.onnx"
#: the symmetric int8 grid of ``scaled_integer`` width 8 (restricted range: -128 is never a code)
QMAX = 127
#: int8 logits vs the fake-quantized PyTorch model: |Δ| <= INT8_ATOL + INT8_RTOL·|logit|. Both compute on the same
#: integer grid and differ only in float summation order (float products vs exact int32 sums, ONNX Runtime's fused
#: LayerNorm and attention), but an activation within float rounding of a rounding boundary takes the other code,
#: and over 12 layers those flips add up: on the make-train MiniLM (96 test reviews) the int8 graph differs from
#: the fake-quantized model by median 0.031 / max 0.15 logits, and the fake-quantized model from itself run with
#: float64 sums by median 0.030 / max 0.15, the same (docs/inference.md). The bound is a few times that; a wrong
#: scale or code moves logits by the int8 error itself or more. The tiny test models stay within 1e-5
#: (tests/test_export_int8.py).
INT8_ATOL = 0.25
INT8_RTOL = 0.1


@dataclass
class ScaledInt8Layer:
    """One linear layer on the int8 grid: ``y = (x_codes · s_in) @ (codes · s_w)ᵀ + bias``."""

    name: str
    #: int8 codes of the weight, ``[out, in]``: the fake quantizer's integers
    codes: torch.Tensor
    #: one float32 step per output channel (a per-tensor weight scale repeated)
    weight_scale: torch.Tensor
    #: the static per-tensor step of the input
    input_scale: float
    #: SmoothQuant's per-input-channel factors ``s``: the graph divides the input by them and ``codes`` are those
    #: of ``w · s`` (the run's ``inner(x / s) · s @ (inner(w · s) / s)ᵀ``, the factors cancelling in the sum)
    smooth: torch.Tensor | None = None


def _int8_symmetric(quantizer: Any, operand: str, name: str, granularities: tuple[str, ...]) -> str | None:
    """Why ``quantizer`` is not a symmetric 8-bit ``scaled_integer`` of one of ``granularities`` (None: it is)."""
    if quantizer is None:
        return f"layer {name} leaves its {operand} float"
    if not isinstance(quantizer, ScaledIntegerQuantizer):
        return f"layer {name} quantizes its {operand} as {getattr(quantizer, 'format_name', type(quantizer).__name__)}"
    if quantizer.width != 8 or not quantizer.symmetric or quantizer.granularity not in granularities:
        return (
            f"layer {name} quantizes its {operand} as scaled_integer width {quantizer.width}, "
            f"{'symmetric' if quantizer.symmetric else 'asymmetric'}, granularity {quantizer.granularity}"
        )
    if getattr(quantizer, "lsq", False) and not _learned(quantizer):
        return f"layer {name} has LSQ {operand} steps that never started (no calibration)"
    return None


def _learned(quantizer: ScaledIntegerQuantizer) -> bool:
    return quantizer.step is not None and bool(quantizer.learned_ready)


def _weight_steps(
    quantizer: ScaledIntegerQuantizer, weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The steps and zero points ``quantizer`` multiplies ``weight``'s codes with: LSQ's learned steps (as its
    forward computes them, gradient scaling included, which leaves the value within a rounding), GPTQ's fixed
    ones, or the observer's."""
    if _learned(quantizer):
        g = 1.0 / math.sqrt(quantizer._rows(weight).shape[1] * quantizer.qmax)  # as _learned scales it
        step = quantizer.step.detach().abs().clamp(min=torch.finfo(torch.float32).tiny).float()
        step = (step - step * g) + step * g
        return step, torch.zeros_like(step)
    if quantizer.fixed_scale.numel():
        return quantizer.fixed_scale, quantizer.fixed_zero
    return quantizer.grid(weight)


def _input_step(quantizer: ScaledIntegerQuantizer) -> tuple[float, float]:
    if _learned(quantizer):
        return float(quantizer.step.detach().abs().reshape(-1)[0]), 0.0
    scale, zero = quantizer.grid(quantizer.min_val.new_zeros(1))
    return float(scale.reshape(-1)[0]), float(zero.reshape(-1)[0])


def _unsmoothed(module: QuantLinear, name: str) -> tuple[Any, Any, torch.Tensor | None]:
    """The layer's weight and input quantizers and SmoothQuant's factors (None: not smoothed)."""
    weight, data_in = module.weight_quantizer, module.data_in_quantizer
    if not isinstance(weight, Smoothed) and not isinstance(data_in, Smoothed):
        return weight, data_in, None
    if not (isinstance(weight, Smoothed) and isinstance(data_in, Smoothed)) or not torch.equal(
        weight.scale, data_in.scale
    ):
        raise ConfigError(
            f"int8=scaled: layer {name}: SmoothQuant wraps its input and weight with other factors"
        )
    return weight.inner, data_in.inner, data_in.scale.detach().float()


@torch.no_grad()
def scaled_int8_layers(model: nn.Module) -> dict[str, ScaledInt8Layer]:
    """The int8 codes and scales of every :class:`QuantLinear` of ``model`` (a fake-quantized model, calibrated).

    Raises:
        ConfigError: a layer whose quantization is not int8 weights (per channel or tensor, symmetric) with a
            calibrated static per-tensor symmetric int8 input, or that also quantizes its bias or output.
    """
    layers: dict[str, ScaledInt8Layer] = {}
    for layer in find_linear_layers(model):
        module = layer.module
        if not isinstance(module, QuantLinear):
            continue  # the run kept it float: so does the graph
        name = layer.name
        weight_quantizer, data_in, smooth = _unsmoothed(module, name)
        why = _int8_symmetric(weight_quantizer, "weight", name, ("channel", "tensor")) or _int8_symmetric(
            data_in, "input", name, ("tensor",)
        )
        for operand in ("bias", "data_out"):
            if why is None and module.quantizer(operand) is not None:
                why = f"layer {name} quantizes its {operand}"
        if why is not None:
            raise ConfigError(
                f"int8=scaled: {why}; the int8 graph carries symmetric 8-bit scaled_integer weights (per channel or "
                "tensor) with a static per-tensor input scale (quant=int8_scaled)"
            )
        if not data_in.is_static and not _learned(data_in):
            raise ConfigError(
                f"int8=scaled: layer {name}'s input scale was never calibrated (quant.calibration.batches=0 and "
                "no ranges in the checkpoint); give the run's quant.calibration.batches=N"
            )
        quantizer: ScaledIntegerQuantizer = weight_quantizer
        weight = module.linear.weight.detach().float()  # through a pruning mask, as the forward reads it
        if smooth is not None:
            weight = weight * smooth.to(weight.device)  # as Smoothed hands it to its quantizer
        scale, zero = _weight_steps(quantizer, weight)
        scale = scale.reshape(-1).to(torch.float32)
        if zero.abs().max() != 0:
            raise ConfigError(f"int8=scaled: layer {name}'s weight grid has a zero point")
        scale = scale.expand(weight.shape[0]).contiguous() if scale.numel() == 1 else scale
        codes = torch.round(weight / scale[:, None]).clamp(-QMAX, QMAX)
        # the safety net: these must be the very integers the run multiplied with
        if not torch.equal(codes * scale[:, None], quantizer(weight)):
            raise ConfigError(
                f"int8=scaled: layer {name}: the weight codes do not reproduce its fake quantizer"
            )
        input_scale, input_zero = _input_step(data_in)
        if input_zero != 0:
            raise ConfigError(f"int8=scaled: layer {name}'s input grid has a zero point")
        layers[name] = ScaledInt8Layer(name, codes.to(torch.int8), scale, input_scale, smooth)
    return layers


def uncalibrated(model: nn.Module) -> list[ScaledIntegerQuantizer]:
    """The static (``tensor``) scaled-integer quantizers of ``model`` that never observed a range."""
    return [q for q in scaled_quantizers(model) if q.granularity == "tensor" and not q.is_static]


def training_batches(cfg: Any) -> Iterator[dict[str, torch.Tensor]]:
    """The run's training batches (its data, shuffled with its seed, as its quantization callback calibrates on
    them), each as the model's inputs."""
    import lightning as L

    from adls_lightning.build import build

    L.seed_everything(cfg.get("seed"), verbose=False)
    data = build(cfg.data, "data")
    data.setup("fit")
    for batch in data.train_dataloader():
        yield model_inputs(batch)


def calibrate_as_run(model: nn.Module, cfg: Any) -> int:
    """Calibrate ``model``'s static scales as the run's quantization callback does: ``quant.calibration.batches``
    training batches of the run's data (seeded with its seed); returns the batches run (0: none configured)."""
    count = int(((cfg.get("quant") or {}).get("calibration") or {}).get("batches") or 0)
    if not count:
        return 0
    return calibrate(model, training_batches(cfg), lambda batch: model(**batch), count)


# ------------------------------------------------------------------------------------------------ the graph
def _weight_keys(model: nn.Module, option: str) -> dict[bytes, tuple[str, bool]]:
    """Every linear weight of ``model`` by its bytes: as stored ``[out, in]`` (a ``Gemm`` with ``transB``) and
    transposed (the exporter's ``MatMul`` initializer) → (layer name, transposed)."""
    keys: dict[bytes, tuple[str, bool]] = {}
    for layer in find_linear_layers(model):
        weight = layer.module.weight.detach().float().numpy()
        for transposed, array in ((False, weight), (True, np.ascontiguousarray(weight.T))):
            key = array.tobytes()
            if key in keys:
                raise ConfigError(f"{option}: layers {keys[key][0]} and {layer.name} have identical weights")
            keys[key] = (layer.name, transposed)
    return keys


def rewrite_linear_nodes(
    fp32_path: Path,
    float_model: nn.Module,
    layers: Collection[str],
    option: str,
    rewrite: Callable[..., list],
):
    """The fp32 graph of ``float_model`` (weights as the run quantized them) with every ``MatMul`` / ``Gemm``
    whose weight is one of ``layers``' replaced by ``rewrite(name, node, transposed, graph)``'s nodes (which add
    their initializers to ``graph``); the float weights no node reads any more go. Shared by the int8 (QDQ) and
    the 4-bit (``MatMulNBits``) exports: the layer is found by its weight's bytes, its layout checked."""
    import onnx
    from onnx import helper, numpy_helper

    graph_model = onnx.load(str(fp32_path))
    graph = graph_model.graph
    initializers = {init.name: init for init in graph.initializer}
    keys = _weight_keys(float_model, option)
    nodes, done = [], set()
    for node in graph.node:
        weight = node.input[1] if node.op_type in ("MatMul", "Gemm") and len(node.input) > 1 else None
        found = (
            keys.get(numpy_helper.to_array(initializers[weight]).tobytes())
            if weight in initializers
            else None
        )
        if found is None or found[0] not in layers:
            nodes.append(node)
            continue
        name, transposed = found
        attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        # the graph's B must be the weight as the layer applies it: MatMul(x, Wᵀ) or Gemm(x, W, transB=1)
        gemm_ok = attributes.get("transB", 0) == 1 and not attributes.get("transA", 0)
        gemm_ok = gemm_ok and attributes.get("alpha", 1.0) == 1.0 and attributes.get("beta", 1.0) == 1.0
        if transposed != (node.op_type == "MatMul") or (node.op_type == "Gemm" and not gemm_ok):
            raise ConfigError(f"{option}: layer {name}: unexpected {node.op_type} layout {attributes}")
        nodes += rewrite(name, node, transposed, graph)
        done.add(name)
    missing = sorted(set(layers) - done)
    if missing:
        raise ConfigError(
            f"{option}: layer {missing[0]}: no MatMul or Gemm with its weight in the exported graph"
        )
    del graph.node[:]
    graph.node.extend(nodes)
    used = {name for node in graph.node for name in node.input}
    kept = [init for init in graph.initializer if init.name in used]  # the float weights the codes replace go
    del graph.initializer[:]
    graph.initializer.extend(kept)
    return graph_model


def qdq_graph(
    fp32_path: Path, out_path: Path, float_model: nn.Module, layers: dict[str, ScaledInt8Layer]
) -> None:
    """Rewrite the fp32 graph of ``float_model`` (weights as the run quantized them) into the QDQ graph of
    ``layers``: every ``MatMul`` / ``Gemm`` whose weight is one of those layers' takes int8 codes and the run's
    scales; the rest of the graph is unchanged."""
    import onnx
    from onnx import helper, numpy_helper

    def quantized(name: str, node, transposed: bool, graph) -> list:
        layer = layers[name]
        prefix = f"int8.{name}."
        codes = layer.codes.numpy()
        step = np.float32(layer.input_scale)
        graph.initializer.extend(
            [
                numpy_helper.from_array(np.ascontiguousarray(codes.T) if transposed else codes, prefix + "w"),
                numpy_helper.from_array(layer.weight_scale.numpy().astype(np.float32), prefix + "w_scale"),
                numpy_helper.from_array(np.zeros(codes.shape[0], np.int8), prefix + "w_zero"),
                numpy_helper.from_array(np.array(step, np.float32), prefix + "x_scale"),
                numpy_helper.from_array(np.array(0, np.int8), prefix + "x_zero"),
                numpy_helper.from_array(np.array(-QMAX * step, np.float32), prefix + "x_min"),
                numpy_helper.from_array(np.array(QMAX * step, np.float32), prefix + "x_max"),
            ]
        )
        x, q = prefix + "x", prefix
        source, nodes = node.input[0], []
        if layer.smooth is not None:
            graph.initializer.append(
                numpy_helper.from_array(layer.smooth.numpy().astype(np.float32), q + "smooth")
            )
            nodes.append(helper.make_node("Div", [source, q + "smooth"], [x + "_smoothed"]))
            source = x + "_smoothed"
        nodes += [
            # the fake quantizer's clamp to ±127 codes (QuantizeLinear alone would give -128 below -127.5 s)
            helper.make_node("Clip", [source, q + "x_min", q + "x_max"], [x + "_clipped"]),
            helper.make_node("QuantizeLinear", [x + "_clipped", q + "x_scale", q + "x_zero"], [x + "_q"]),
            helper.make_node("DequantizeLinear", [x + "_q", q + "x_scale", q + "x_zero"], [x + "_dq"]),
            # per output channel: axis 1 of MatMul's [in, out], axis 0 of Gemm's [out, in]
            helper.make_node(
                "DequantizeLinear",
                [q + "w", q + "w_scale", q + "w_zero"],
                [q + "w_dq"],
                axis=1 if transposed else 0,
            ),
        ]
        node.input[0], node.input[1] = x + "_dq", q + "w_dq"
        return [*nodes, node]

    graph_model = rewrite_linear_nodes(fp32_path, float_model, layers, "int8=scaled", quantized)
    onnx.checker.check_model(graph_model)
    onnx.save(graph_model, str(out_path))


@torch.no_grad()
def bake_weights(model: nn.Module) -> nn.Module:
    """``model`` with each :class:`QuantLinear` replaced by a plain ``nn.Linear`` holding the weight its quantizer
    computes (inputs left float), in place: the float graph whose weights :func:`qdq_graph` finds and replaces."""
    for layer in find_linear_layers(model):
        module = layer.module
        if isinstance(module, QuantLinear):
            weight = module.linear.weight
            plain = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None)
            plain.weight.copy_(weight if module.weight_quantizer is None else module.weight_quantizer(weight))
            if module.bias is not None:
                plain.bias.copy_(module.linear.bias)
            swap_module(model, layer.path, plain)
    return model


def export_int8_graph(fake_model: nn.Module, out_path: Path) -> dict[str, ScaledInt8Layer]:
    """``out_path``: the QDQ graph of ``fake_model`` (a fake-quantized Hugging Face classifier, calibrated, eval
    mode); returns the layers written on the int8 grid."""
    from adls_lightning.export.onnx import export_onnx

    layers = scaled_int8_layers(fake_model)
    if not layers:
        raise ConfigError(
            "int8=scaled: the run quantizes no linear layer; export it with quant=int8_scaled overrides, or "
            "int8=true (ONNX Runtime's dynamic int8 of the float model)"
        )
    float_model = bake_weights(copy.deepcopy(fake_model))
    # the encoder points' grids (quant=int8_scaled_all), in a form torch.export can trace
    fix_calibrated_grids(float_model)
    with tempfile.TemporaryDirectory() as tmp:
        fp32_path = Path(tmp) / "model.onnx"
        export_onnx(float_model, fp32_path)
        qdq_graph(fp32_path, out_path, float_model, layers)
    return layers


def check_int8(path: Path, fake_model: nn.Module):
    """The logits of ``path`` (ONNX Runtime's, or a ``.pt2`` package's) vs ``fake_model``'s on the export's
    sample batch.

    Raises:
        ExportCheckError: a logit off by more than ``INT8_ATOL + INT8_RTOL·|logit|`` (the argmax agreement is
            reported, not required: a near tie may legitimately fall either way, as between float orders).
    """
    from adls_lightning.export import onnx as onnx_export

    inputs = onnx_export.sample_inputs(fake_model)
    with torch.inference_mode():
        expected = onnx_export.LogitsOnly(fake_model)(**inputs).numpy()
    if path.suffix == ".pt2":
        from adls_lightning.export.pt2e import Pt2Classifier

        engine = "the AOTInductor package's"
        with torch.inference_mode():
            actual = Pt2Classifier(path)(**inputs).logits.numpy()
    else:
        engine = "ONNX Runtime"
        actual = onnx_export.onnx_logits(onnx_export.onnx_session(path), inputs)
    check = onnx_export.OnnxCheck(
        max_abs_diff=float(np.abs(actual - expected).max()),
        argmax_agree=int((actual.argmax(-1) == expected.argmax(-1)).sum()),
        rows=len(expected),
    )
    if not np.allclose(actual, expected, rtol=INT8_RTOL, atol=INT8_ATOL):
        raise onnx_export.ExportCheckError(
            f"{path}: {engine} int8 logits differ from the fake-quantized PyTorch model's by up to "
            f"{check.max_abs_diff:.3g} (tolerance {INT8_ATOL:g} + {INT8_RTOL:g}·|logit|), argmax agrees "
            f"{check.argmax_agree}/{check.rows}; the file is left for inspection"
        )
    return check


__all__ = [
    "INT8_ATOL",
    "INT8_RTOL",
    "INT8_SCALED_FILE",
    "ScaledInt8Layer",
    "calibrate_as_run",
    "check_int8",
    "export_int8_graph",
    "qdq_graph",
    "scaled_int8_layers",
    "uncalibrated",
]
