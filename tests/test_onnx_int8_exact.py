"""ONNX Runtime's int8 graphs sum exactly on every CPU: on x86 without VNNI (where its u8 x s8 kernel adds pairs of
products in saturating int16) the session runs the int8 weights as uint8, the same values.

The inputs are the saturating kernel's worst case: codes of full magnitude whose pairs of products share a sign, so
each pair sums to 2 * 255 * 127 > 32767. The expected outputs are integer matrix products computed in numpy.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from adls_lightning import gemm
from adls_lightning.export import onnx as onnx_export
from tests.helpers import AMX_CPUINFO, X86_BASE_FLAGS, ZEN3_CPUINFO, ZEN4_CPUINFO, cpuinfo_lines, on_cpu

IN, OUT, ROWS = 96, 40, 6
STEP = np.float32(0.05)  # the activations' step
WEIGHT_STEP = np.float32(0.01)


def _worst_case(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Activations of ±127 codes and int8 weights of ±127 with the activations' signs along each column: every
    product is +127 * 127, the largest a pair of them can add up to."""
    signs = np.where(rng.random((ROWS, IN)) < 0.5, 1, -1)
    signs[:, ::2] = signs[0, ::2]  # every row the first row's signs at even columns
    weights = (127 * np.tile(signs[0][:, None], (1, OUT))).astype(np.int8)
    weights[1::2] = rng.integers(-127, 128, (IN // 2, OUT)).astype(np.int8)  # odd inputs: any codes
    return (signs * 127 * STEP).astype(np.float32), weights


def _model(nodes, initializers, opset: int = 18) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes,
        "int8",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, IN])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, OUT])],
        initializers,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def _qdq(weights: np.ndarray, zero_point: bool) -> onnx.ModelProto:
    """``int8=scaled``'s form: QuantizeLinear -> DequantizeLinear on the input, DequantizeLinear on int8 weight
    codes (per output channel), MatMul."""
    initializers = [
        numpy_helper.from_array(weights, "w"),
        numpy_helper.from_array(np.full(OUT, WEIGHT_STEP, np.float32), "w_scale"),
        numpy_helper.from_array(np.array(STEP, np.float32), "x_scale"),
        numpy_helper.from_array(np.array(0, np.int8), "x_zero"),
    ]
    weight_inputs = ["w", "w_scale"]
    if zero_point:
        initializers.append(numpy_helper.from_array(np.zeros(OUT, np.int8), "w_zero"))
        weight_inputs.append("w_zero")
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "x_scale", "x_zero"], ["x_q"]),
        helper.make_node("DequantizeLinear", ["x_q", "x_scale", "x_zero"], ["x_dq"]),
        helper.make_node("DequantizeLinear", weight_inputs, ["w_dq"], axis=1),
        helper.make_node("MatMul", ["x_dq", "w_dq"], ["y"]),
    ]
    return _model(nodes, initializers)


def _dynamic(weights: np.ndarray) -> onnx.ModelProto:
    """``int8=true``'s form (ONNX Runtime's ``quantize_dynamic``): DynamicQuantizeLinear on the input, MatMulInteger
    with the int8 weight and its zero point, the product scaled back to float."""
    initializers = [
        numpy_helper.from_array(weights, "w"),
        numpy_helper.from_array(np.array(0, np.int8), "w_zero"),
        numpy_helper.from_array(np.array(WEIGHT_STEP, np.float32), "w_scale"),
    ]
    nodes = [
        helper.make_node("DynamicQuantizeLinear", ["x"], ["x_q", "x_scale", "x_zero"]),
        helper.make_node("MatMulInteger", ["x_q", "w", "x_zero", "w_zero"], ["acc"]),
        helper.make_node("Cast", ["acc"], ["acc_f"], to=TensorProto.FLOAT),
        helper.make_node("Mul", ["x_scale", "w_scale"], ["scale"]),
        helper.make_node("Mul", ["acc_f", "scale"], ["y"]),
    ]
    return _model(nodes, initializers)


def _dynamic_expected(x: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """ONNX's DynamicQuantizeLinear (uint8, range widened to hold 0) then the integer product, in int64."""
    low, high = min(0.0, float(x.min())), max(0.0, float(x.max()))
    scale = np.float32((high - low) / 255)
    zero = int(np.clip(np.rint(-low / scale), 0, 255))
    codes = np.clip(np.rint(x / scale) + zero, 0, 255).astype(np.int64)
    return ((codes - zero) @ weights.astype(np.int64)) * (scale * WEIGHT_STEP)


@pytest.mark.parametrize(
    ("cpuinfo", "machine", "saturates"),
    [
        (ZEN3_CPUINFO, "x86_64", True),  # AVX2 only
        (
            cpuinfo_lines("GenuineIntel", 6, 85, "Xeon", 2000, f"{X86_BASE_FLAGS} avx512f avx512bw"),
            "x86_64",
            True,
        ),
        (ZEN4_CPUINFO, "x86_64", False),  # AVX-512 VNNI
        (AMX_CPUINFO, "x86_64", False),
        (ZEN3_CPUINFO, "aarch64", False),  # another architecture's kernels
        ("processor\t: 0\n", "x86_64", False),  # flags unread: the graph is run as written
    ],
)
def test_which_cpus_saturate(cpuinfo, machine, saturates, monkeypatch, tmp_path):
    on_cpu(monkeypatch, tmp_path, cpuinfo, "cpu")
    assert gemm.u8s8_saturates(machine=machine) is saturates


@pytest.mark.parametrize("zero_point", [True, False])
def test_rewrite_keeps_every_weight_value(zero_point):
    weights = np.random.default_rng(1).integers(-128, 128, (IN, OUT)).astype(np.int8)
    model = _qdq(weights, zero_point)
    assert onnx_export.unsigned_int8_weights(model) == 1
    stored = {init.name: numpy_helper.to_array(init) for init in model.graph.initializer}
    node = next(n for n in model.graph.node if n.op_type == "DequantizeLinear" and n.input[1] == "w_scale")
    codes, zero = stored[node.input[0]], stored[node.input[2]]
    assert codes.dtype == np.uint8 and zero.dtype == np.uint8 and zero.shape == (OUT,)
    # (q - z) is the int8 code itself, so (q - z) * s is each weight as written
    assert np.array_equal(codes.astype(np.int16) - zero.astype(np.int16), weights.astype(np.int16))
    # the int8 weight is gone; the activation's int8 zero point (a QuantizeLinear output's) stays
    assert "w" not in stored and stored["x_zero"].dtype == np.int8
    onnx.checker.check_model(model)
    assert onnx_export.unsigned_int8_weights(model) == 0  # nothing int8 is left to rewrite


@pytest.mark.parametrize("form", ["qdq", "dynamic"])
def test_session_sums_exactly_where_the_kernel_saturates(form, tmp_path, monkeypatch):
    """Through :func:`onnx_session` on a CPU it takes for one that saturates (this one, or any other: the
    rewrite is the same), the worst-case product is the integer one, and the fused int8 kernel still runs."""
    monkeypatch.setattr(onnx_export, "u8s8_saturates", lambda *args: True)
    x, weights = _worst_case(np.random.default_rng(0))
    path = tmp_path / f"{form}.onnx"
    if form == "qdq":
        onnx.save(_qdq(weights, zero_point=True), str(path))
        expected = (np.rint(x / STEP).astype(np.int64) @ weights.astype(np.int64)) * (STEP * WEIGHT_STEP)
    else:
        onnx.save(_dynamic(weights), str(path))
        expected = _dynamic_expected(x, weights)
    optimized = tmp_path / "optimized.onnx"
    actual = onnx_export.onnx_session(path, optimized).run(None, {"x": x})[0]
    np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-4 * float(np.abs(expected).max()))
    ops = [node.op_type for node in onnx.load(str(optimized)).graph.node]
    assert {"MatMulIntegerToFloat", "DynamicQuantizeMatMul", "MatMulInteger"} & set(ops), ops
    assert "MatMul" not in ops  # no float product of dequantized weights
    assert onnx.load(str(path)).graph.initializer[0].data_type == TensorProto.INT8  # the file is unchanged


def test_saturating_kernel_is_what_the_rewrite_avoids(tmp_path):
    """On this machine, if its kernel saturates: the file run as written misses the integer product by far more
    than float rounding, which is why :func:`onnx_session` rewrites it."""
    if not gemm.u8s8_saturates():
        pytest.skip("this CPU's int8 kernel sums u8 x s8 exactly (VNNI, AMX or not x86)")
    import onnxruntime as ort

    x, weights = _worst_case(np.random.default_rng(0))
    path = tmp_path / "qdq.onnx"
    onnx.save(_qdq(weights, zero_point=True), str(path))
    expected = (np.rint(x / STEP).astype(np.int64) @ weights.astype(np.int64)) * (STEP * WEIGHT_STEP)
    as_written = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    assert np.abs(as_written - expected).max() > 0.05 * np.abs(expected).max()
