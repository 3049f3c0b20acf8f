"""``format=onnx``: the merged float model as an ONNX graph, checked in ONNX Runtime before the command returns.

The graph takes ``input_ids`` and ``attention_mask`` (int64, ``[batch, sequence]``, both axes dynamic) and returns
``logits`` (float32, ``[batch, num_labels]``). It is written by ``torch.onnx.export`` (the ``torch.export``-based
exporter) at opset :data:`ONNX_OPSET`. ``token_type_ids`` is left out on purpose: every family here accepts
``input_ids`` + ``attention_mask`` (DistilBERT has no token types), and single-segment classification uses
type 0 everywhere, which is what the model substitutes when it is not given.

:func:`check_against_torch` runs the written file in ONNX Runtime on a sample batch (one row half padding, so the
mask is exercised) and compares with the PyTorch logits; :func:`quantize_int8` writes ONNX Runtime's dynamic int8
model beside it (int8 weights, activations quantized per batch at run time).
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from transformers import PreTrainedModel

from adls_lightning.errors import ConfigError
from adls_lightning.export.settings import ExportCheckError
from adls_lightning.gemm import u8s8_saturates

ONNX_FILE = "model.onnx"
ONNX_INT8_FILE = "model_int8.onnx"
#: 18 is the exporter's own default and what ONNX Runtime >= 1.14 runs; every op a BERT-class encoder needs
#: (LayerNormalization since 17) is in it.
ONNX_OPSET = 18
INPUT_NAMES = ("input_ids", "attention_mask")
OUTPUT_NAMES = ("logits",)
DYNAMIC_AXES = ("batch", "sequence")
#: ONNX Runtime fp32 vs PyTorch: |ort - torch| <= FP32_ATOL + FP32_RTOL * |torch|, elementwise. Only the order of
#: floating-point sums differs (ORT fuses LayerNorm, GELU, attention); 1e-4 leaves room for 24-layer models
#: while any real export bug (a lost mask, a wrong weight) is off by orders of magnitude more.
FP32_ATOL = 1e-4
FP32_RTOL = 1e-4
#: the check's sample batch: rows x tokens (batch != sequence and both > 1, so neither axis specialises)
SAMPLE_ROWS = 4
SAMPLE_TOKENS = 16
# Models above this size go to external data (protobuf's 2 GiB limit); below it one self-contained file.
EXTERNAL_DATA_BYTES = 1_500_000_000


@dataclass
class OnnxCheck:
    """One comparison of an ONNX file's logits with the PyTorch model's on the same batch."""

    max_abs_diff: float
    argmax_agree: int
    rows: int

    def describe(self) -> str:
        return f"max |Δlogit| {self.max_abs_diff:.1e}, argmax agrees {self.argmax_agree}/{self.rows}"


def _require_onnx_runtime() -> None:
    try:
        import onnx  # noqa: F401
        import onnxruntime  # noqa: F401
        import onnxscript  # noqa: F401  # torch.onnx's exporter builds the graph with it
    except ImportError as error:
        raise ConfigError(
            f"format=onnx: needs onnx, onnxruntime and onnxscript ({error}); pip install -e . installs them"
        ) from None


class LogitsOnly(nn.Module):
    """The classifier as ``(input_ids, attention_mask) -> logits``: the graph's whole interface, no model output
    dataclass and no optional inputs."""

    def __init__(self, model: PreTrainedModel) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, attention_mask=attention_mask).logits


def sample_inputs(
    model: PreTrainedModel, rows: int = SAMPLE_ROWS, tokens: int = SAMPLE_TOKENS, seed: int = 0
) -> dict[str, torch.Tensor]:
    """Random token ids (deterministic per ``seed``) and a mask whose odd rows keep only their first half."""
    tokens = min(tokens, model.config.max_position_embeddings)
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, model.config.vocab_size, (rows, tokens), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1::2, max(1, tokens // 2) :] = 0
    return {"input_ids": input_ids, "attention_mask": attention_mask}


def export_onnx(model: PreTrainedModel, path: Path) -> None:
    """Write ``model`` (a float Hugging Face sequence classifier, eval mode) to ``path`` as ONNX."""
    _require_onnx_runtime()
    wrapper = LogitsOnly(model).eval()
    inputs = sample_inputs(model)
    batch, sequence = (torch.export.Dim(name) for name in DYNAMIC_AXES)
    dynamic_shapes = {name: {0: batch, 1: sequence} for name in INPUT_NAMES}
    weight_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    exporter_log = logging.getLogger("torch.onnx")
    level = exporter_log.level
    exporter_log.setLevel(logging.ERROR)  # "torchvision is not installed" and similar: not the user's concern
    try:
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")
            torch.onnx.export(
                wrapper,
                (),
                str(path),
                kwargs=inputs,
                input_names=list(INPUT_NAMES),
                output_names=list(OUTPUT_NAMES),
                dynamic_shapes=dynamic_shapes,
                opset_version=ONNX_OPSET,
                dynamo=True,
                external_data=weight_bytes > EXTERNAL_DATA_BYTES,
                verbose=False,
            )
    finally:
        exporter_log.setLevel(level)


#: ONNX Runtime graph rewrites every session here leaves out. ``SkipLayerNormFusion`` folds each residual ``Add`` and
#: the ``LayerNormalization`` after it into one ``SkipLayerNormalization``, whose CPU kernel (ORT 1.32) is 5.7x slower
#: than the two ops it replaces: 2.08 against 0.36 ms for 8 x 128 x 384, one thread, the AMD EPYC of 2026-11-29;
#: without the fusion the int8 graph of the structured + int8 MiniLM runs 1.28x faster at batch 1 and 1.26x at batch
#: 8 x 128 (benchmarks/bench_deploy.py; docs/inference.md, "Structured + int8"). Any other ONNX Runtime user gets the
#: same with ``InferenceSession(..., disabled_optimizers=["SkipLayerNormFusion"])``.
DISABLED_OPTIMIZERS = ("SkipLayerNormFusion",)


#: ONNX's int8 element type (``TensorProto.INT8``)
_INT8 = 3
#: the offset from an int8 code to the same value's uint8 code
_U8_OFFSET = 128


def unsigned_int8_weights(graph_model) -> int:
    """Rewrite, in place, the int8 weights of ``graph_model``'s integer matrix products as the same values in
    uint8 (codes and zero points + 128), so ONNX Runtime multiplies them with its exact u8 x u8 kernel instead of
    the u8 x s8 one that saturates where :func:`~adls_lightning.gemm.u8s8_saturates`; returns how many weights it
    rewrote.

    The weights are the int8 initializers a ``DequantizeLinear`` reads (the QDQ graphs of ``int8=scaled``) or that
    are ``MatMulInteger``'s B (ONNX Runtime's dynamic int8 graph, ``int8=true``); ``(q - z) * s`` is unchanged, so
    the graph computes the same numbers."""
    from onnx import numpy_helper

    graph = graph_model.graph
    initializers = {init.name: init for init in graph.initializer}
    consumers: dict[str, int] = {}
    for node in graph.node:
        for name in node.input:
            consumers[name] = consumers.get(name, 0) + 1

    def int8_initializer(name: str):
        init = initializers.get(name)
        return init if init is not None and init.data_type == _INT8 else None

    def as_uint8(init, name: str) -> str:
        values = numpy_helper.to_array(init).astype(np.int16) + _U8_OFFSET
        graph.initializer.append(numpy_helper.from_array(values.astype(np.uint8), name))
        return name

    rewritten = 0
    for node in graph.node:
        if node.op_type == "DequantizeLinear" and not node.domain:
            weight_at, zero_at, scale_at = 0, 2, 1
        elif node.op_type == "MatMulInteger" and not node.domain:
            weight_at, zero_at, scale_at = 1, 3, None
        else:
            continue
        weight = int8_initializer(node.input[weight_at])
        zero_name = node.input[zero_at] if len(node.input) > zero_at else ""
        zero = int8_initializer(zero_name) if zero_name else None
        if weight is None or (zero_name and zero is None):
            continue  # an activation, or already unsigned
        prefix = f"{node.input[weight_at]}.u8.{rewritten}"
        inputs = list(node.input) + [""] * (zero_at + 1 - len(node.input))
        inputs[weight_at] = as_uint8(weight, prefix)
        if zero is not None:
            inputs[zero_at] = as_uint8(zero, prefix + ".zero")
        else:  # an absent zero point is 0 of the weight's type: 128 in uint8, shaped as the scale
            shape = list(initializers[node.input[scale_at]].dims) if scale_at is not None else []
            graph.initializer.append(
                numpy_helper.from_array(np.full(shape, _U8_OFFSET, np.uint8), prefix + ".zero")
            )
            inputs[zero_at] = prefix + ".zero"
        del node.input[:]
        node.input.extend(inputs)
        rewritten += 1
    if rewritten:
        used = {name for node in graph.node for name in node.input}
        kept = [init for init in graph.initializer if init.name in used or init.name not in consumers]
        del graph.initializer[:]
        graph.initializer.extend(kept)
    return rewritten


def onnx_session(path: Path, optimized_path: Path | None = None, exact_int8: bool = True):
    """An ONNX Runtime CPU session of ``path`` with torch's thread count (the comparison's fair setting), full
    graph optimization less :data:`DISABLED_OPTIMIZERS`; ``optimized_path``: also write the graph ONNX Runtime
    runs there (to inspect which kernels it chose).

    Where ONNX Runtime's u8 x s8 GEMM saturates (:func:`~adls_lightning.gemm.u8s8_saturates`), the session runs
    the graph with its int8 weights made uint8 (:func:`unsigned_int8_weights`, in memory; the file is unchanged):
    the same values, summed exactly. ``exact_int8=False`` runs the file as written (to measure what the repair
    costs)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = torch.get_num_threads()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    if optimized_path is not None:
        options.optimized_model_filepath = str(optimized_path)
    options.log_severity_level = 3  # errors only: ORT warns about initializers it folds, harmless
    model: str | bytes = str(path)
    if exact_int8 and u8s8_saturates():
        import onnx

        graph_model = onnx.load(str(path))
        if unsigned_int8_weights(graph_model):
            model = graph_model.SerializeToString()
    return ort.InferenceSession(
        model,
        options,
        providers=["CPUExecutionProvider"],
        disabled_optimizers=list(DISABLED_OPTIMIZERS),
    )


def onnx_logits(session, inputs: dict[str, torch.Tensor]) -> np.ndarray:
    return session.run(list(OUTPUT_NAMES), {name: inputs[name].numpy() for name in INPUT_NAMES})[0]


def compare(path: Path, model: PreTrainedModel, inputs: dict[str, torch.Tensor]) -> tuple[OnnxCheck, bool]:
    """ONNX Runtime's logits of ``path`` vs ``model``'s on ``inputs``; and whether they are within the fp32
    tolerance."""
    with torch.inference_mode():
        expected = LogitsOnly(model)(**inputs).numpy()
    actual = onnx_logits(onnx_session(path), inputs)
    if actual.shape != expected.shape:
        raise ExportCheckError(
            f"{path}: ONNX Runtime returned logits of shape {actual.shape}, expected {expected.shape}"
        )
    check = OnnxCheck(
        max_abs_diff=float(np.abs(actual - expected).max()),
        argmax_agree=int((actual.argmax(-1) == expected.argmax(-1)).sum()),
        rows=len(expected),
    )
    return check, bool(np.allclose(actual, expected, rtol=FP32_RTOL, atol=FP32_ATOL))


def check_against_torch(path: Path, model: PreTrainedModel) -> OnnxCheck:
    """Run ``path`` in ONNX Runtime on :func:`sample_inputs` and compare with ``model``.

    Raises:
        ExportCheckError: any logit off by more than ``FP32_ATOL + FP32_RTOL * |logit|``.
    """
    check, close = compare(path, model, sample_inputs(model))
    if not close:
        raise ExportCheckError(
            f"{path}: ONNX Runtime logits differ from PyTorch's by up to {check.max_abs_diff:.3g} "
            f"(tolerance {FP32_ATOL:g} + {FP32_RTOL:g}·|logit|); the file is left for inspection"
        )
    return check


def quantize_int8(fp32_path: Path, int8_path: Path) -> None:
    """ONNX Runtime's dynamic quantization of ``fp32_path``: int8 weights (per tensor) for MatMul and Gemm, uint8
    activations quantized per batch at run time (ORT's defaults besides the weight type)."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    # ORT logs (root logger) a recommendation to run quant_pre_process first; its symbolic shape inference does
    # not complete on the exporter's graph ("Incomplete symbolic shape inference"), so there is nothing to act on.
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)
    try:
        quantize_dynamic(str(fp32_path), str(int8_path), weight_type=QuantType.QInt8)
    finally:
        root.setLevel(level)


class OnnxClassifier(nn.Module):
    """An ONNX export's graph in ONNX Runtime (CPU), called as a Hugging Face classifier is:
    ``model(input_ids=..., attention_mask=...).logits``; inputs the graph does not take (``token_type_ids``:
    the export leaves them out, docs/inference.md) are not passed."""

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.path = path
        self.session = onnx_session(path)
        self.input_names = [i.name for i in self.session.get_inputs()]

    def forward(self, **inputs: torch.Tensor) -> Any:
        from transformers.modeling_outputs import SequenceClassifierOutput

        feed = {name: inputs[name].detach().cpu().numpy() for name in self.input_names if name in inputs}
        missing = [name for name in self.input_names if name not in feed]
        if missing:
            raise ConfigError(f"{self.path}: the graph takes {missing[0]}, which the inputs lack")
        logits = self.session.run(None, feed)[0]
        return SequenceClassifierOutput(logits=torch.from_numpy(logits))


__all__ = [
    "DISABLED_OPTIMIZERS",
    "DYNAMIC_AXES",
    "FP32_ATOL",
    "FP32_RTOL",
    "INPUT_NAMES",
    "ONNX_FILE",
    "ONNX_INT8_FILE",
    "ONNX_OPSET",
    "ExportCheckError",
    "OnnxCheck",
    "OnnxClassifier",
    "check_against_torch",
    "compare",
    "export_onnx",
    "onnx_session",
    "quantize_int8",
    "sample_inputs",
    "unsigned_int8_weights",
]
