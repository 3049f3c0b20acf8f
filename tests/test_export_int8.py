"""``format=onnx int8=scaled``: the int8 graph of a ``quant=int8_scaled`` model carries the run's own integers and
scales (checked against ranges and weights read here, not by the export), computes the fake-quantized model's
logits in ONNX Runtime's integer kernels, and the command refuses what it cannot carry in one line, writing
nothing."""

from __future__ import annotations

import contextlib
import copy
import io
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import numpy_helper

from adls_lightning.export import int8 as int8_export
from adls_lightning.export import onnx as onnx_export
from adls_lightning.quant.linear import QuantLinear
from adls_lightning.quant.scaled import calibrate
from adls_lightning.tools.export import main
from tests.helpers import TINY, trained_checkpoint
from tests.int8_helpers import (
    CALIBRATION_BATCHES,
    PTQ,
    SMALL_DATA,
    TINY_LINEARS,
    calibrated_run_checkpoint,
    int8_scaled_model,
    record_input_ranges,
)

# The int8 graph and the fake-quantized model compute on the same integer grid; only the order of float sums
# differs (fake quantization sums float products, the engine exact int32 sums scaled once), a few float32 ulps per
# layer. A code moves only where a value lies within that much of a rounding boundary, which on these tiny models
# measured never (|Δ| ~1e-9). 1e-5 is far above that and far below one code step (s_in·s_w ~1e-4 here).
TIGHT = 1e-5


@pytest.fixture(scope="module")
def exported(tmp_path_factory, tiny_bert):
    model, batches = int8_scaled_model(tiny_bert)
    ranges = record_input_ranges(model, batches)
    run = calibrate(model, batches, lambda ids: model(input_ids=ids), CALIBRATION_BATCHES)
    assert run == CALIBRATION_BATCHES
    path = tmp_path_factory.mktemp("int8") / int8_export.INT8_SCALED_FILE
    layers = int8_export.export_int8_graph(model, path)
    calibrated_ranges = record_input_ranges(model, batches[:CALIBRATION_BATCHES])
    return model, path, layers, ranges, calibrated_ranges


def initializers(path: Path) -> dict[str, np.ndarray]:
    return {init.name: numpy_helper.to_array(init) for init in onnx.load(str(path)).graph.initializer}


def test_codes_and_scales_are_the_runs(exported):
    model, path, layers, _, ranges = exported
    stored = initializers(path)
    axes = {
        node.input[0]: onnx.helper.get_attribute_value(node.attribute[0])
        for node in onnx.load(str(path)).graph.node
        if node.op_type == "DequantizeLinear" and node.input[0].endswith(".w")
    }
    quantized = {name: m for name, m in model.named_modules() if isinstance(m, QuantLinear)}
    assert len(layers) == len(quantized) == TINY_LINEARS
    for name, layer in quantized.items():
        prefix = f"int8.{name}."
        weight = layer.linear.weight.detach()
        # per output channel, symmetric: s = max|w_row| / 127 and codes round(w / s) clamped to ±127
        scale = weight.abs().amax(dim=1) / 127
        codes = torch.clamp(torch.round(weight / scale[:, None]), -127, 127)
        np.testing.assert_array_equal(stored[prefix + "w_scale"], scale.numpy(), err_msg=name)
        on_graph = stored[prefix + "w"]
        assert on_graph.dtype == np.int8
        # MatMul keeps the weight as [in, out] (its scales on axis 1), Gemm (pooler, classifier) as [out, in]
        on_graph = on_graph.T if axes[prefix + "w"] == 1 else on_graph
        np.testing.assert_array_equal(on_graph, codes.numpy().astype(np.int8), err_msg=name)
        # and these are exactly the fake quantizer's values
        assert torch.equal(codes * scale[:, None], layer.weight_quantizer(weight)), name
        assert np.all(stored[prefix + "w_zero"] == 0) and stored[prefix + "x_zero"] == 0
        # the static input scale: the calibration batches' max |x| / 127 (not the later batches')
        assert stored[prefix + "x_scale"] == pytest.approx(ranges[name] / 127, rel=1e-6), name
        assert stored[prefix + "x_max"] == pytest.approx(ranges[name], rel=1e-6)


def test_graph_runs_integer_kernels(exported, tmp_path):
    _, path, _, _, _ = exported
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    options.log_severity_level = 3
    ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    ops = [node.op_type for node in onnx.load(str(tmp_path / "optimized.onnx")).graph.node]
    # every quantized linear became an int8 kernel; no float MatMul / Gemm reads a dequantized weight
    assert ops.count("MatMulIntegerToFloat") + ops.count("QGemm") == TINY_LINEARS
    assert "DequantizeLinear" not in ops and "Gemm" not in ops
    assert ops.count("MatMul") + ops.count("FusedMatMul") == 4  # attention's Q·Kᵀ and P·V, float, in 2 layers


def test_logits_match_the_fake_quantized_model(exported):
    model, path, _, _, _ = exported
    session = onnx_export.onnx_session(path)
    generator = torch.Generator().manual_seed(3)
    for rows, tokens in [(1, 7), (8, 24), (5, 40)]:
        ids = torch.randint(0, model.config.vocab_size, (rows, tokens), generator=generator)
        mask = torch.ones_like(ids)
        mask[1:, tokens // 2 :] = 0  # padding: the mask reaches the graph's attention as in the model
        inputs = {"input_ids": ids, "attention_mask": mask}
        with torch.inference_mode():
            expected = model(**inputs).logits.numpy()
        actual = onnx_export.onnx_logits(session, inputs)
        np.testing.assert_allclose(actual, expected, rtol=0, atol=TIGHT, err_msg=f"{rows}x{tokens}")
        assert (actual.argmax(-1) == expected.argmax(-1)).all()
    # the grid matters: the float model with the quantized weights but float inputs is measurably elsewhere
    baked = int8_export.bake_weights(copy.deepcopy(model))
    with torch.inference_mode():
        unquantized_inputs = baked(**inputs).logits.numpy()
    assert np.abs(unquantized_inputs - actual).max() > 100 * TIGHT


def test_inputs_beyond_the_calibrated_range_clamp_as_the_fake_quantizer(exported, tmp_path):
    """Ranges shrunk to a third: many inputs fall outside, on both sides. The fake quantizer clamps them to ±127
    codes; QuantizeLinear alone would give -128 below -127.5 s, the graph's Clip keeps them equal."""
    model = copy.deepcopy(exported[0])
    for layer in (m for m in model.modules() if isinstance(m, QuantLinear)):
        layer.data_in_quantizer.min_val.mul_(1 / 3)
        layer.data_in_quantizer.max_val.mul_(1 / 3)
    path = tmp_path / "shrunk.onnx"
    int8_export.export_int8_graph(model, path)
    ids = torch.randint(0, model.config.vocab_size, (4, 16), generator=torch.Generator().manual_seed(5))
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    with torch.inference_mode():
        expected = model(**inputs).logits.numpy()
    actual = onnx_export.onnx_logits(onnx_export.onnx_session(path), inputs)
    np.testing.assert_allclose(actual, expected, rtol=0, atol=TIGHT)
    # without the Clip (codes -128 where the fake quantizer has -127) the logits leave the tolerance
    graph = onnx.load(str(path))
    clipped = {node.output[0]: node.input[0] for node in graph.graph.node if node.op_type == "Clip"}
    for node in graph.graph.node:
        if node.op_type == "QuantizeLinear":
            node.input[0] = clipped[node.input[0]]
    unclipped = tmp_path / "unclipped.onnx"
    onnx.save(graph, str(unclipped))
    loose = onnx_export.onnx_logits(onnx_export.onnx_session(unclipped), inputs)
    assert np.abs(loose - expected).max() > 10 * TIGHT


def call(*args: str) -> tuple[int, str, str]:
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        code = main(list(args))
    return code, stdout.getvalue(), stderr.getvalue()


@pytest.fixture(scope="module")
def float_checkpoint(tmp_path_factory) -> Path:
    ckpt = tmp_path_factory.mktemp("ckpt") / "float.ckpt"
    trained_checkpoint(ckpt, TINY)
    return ckpt


def test_cli_exports_a_ptq_run(float_checkpoint, tmp_path, tiny_imdb_dir, cache_dir):
    out = tmp_path / "out"
    data = [f"data.data_dir={tiny_imdb_dir}", f"paths.cache_dir={cache_dir}", *SMALL_DATA]
    code, stdout, stderr = call(
        f"ckpt={float_checkpoint}", f"out={out}", "format=onnx", "int8=scaled", *TINY, *data, *PTQ
    )
    assert code == 0, stderr[-3000:]
    assert (out / int8_export.INT8_SCALED_FILE).is_file() and not (out / onnx_export.ONNX_FILE).exists()
    assert f"{TINY_LINEARS} linear layers on the run's int8 grid" in stdout
    # 64 training reviews in batches of 32: the preset's 16 calibration batches find 2
    assert "input scales calibrated here on 2 training batches" in stdout
    assert "argmax agrees 4/4" in stdout
    stored = initializers(out / int8_export.INT8_SCALED_FILE)
    assert sum(key.endswith(".x_scale") for key in stored) == TINY_LINEARS


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["format=onnx", "int8=maybe"], "int8=maybe: must be true, false, scaled or auto"),
        (["format=hf", "int8=scaled", *PTQ], "int8=scaled: only with format=onnx"),
        (["format=mxint8", "int8=auto"], "int8=auto: only with format=onnx"),
        (
            ["format=onnx", "int8=scaled", "int8_runtime=fast"],
            "int8_runtime=fast: must be one of auto, onnx, pt2e",
        ),
        (["format=onnx", "int8=true", "int8_runtime=onnx"], "int8_runtime=onnx: only with int8=scaled"),
        (["format=onnx", "int8=auto", "quant=int8_scaled"], "format=onnx: layer"),
        (["format=onnx", "int8=scaled"], "int8=scaled: the run quantizes no linear layer"),
        (
            ["format=onnx", "int8=scaled", "quant=int8", "quant.mode=ptq"],
            "int8=scaled: layer bert.encoder.layer.0.attention.self.query quantizes its weight as integer",
        ),
        (
            ["format=onnx", "int8=scaled", *PTQ, "quant.calibration.batches=0"],
            "int8=scaled: layer bert.encoder.layer.0.attention.self.query's input scale was never calibrated",
        ),
    ],
)
def test_cli_refuses_in_one_line_and_writes_nothing(float_checkpoint, tmp_path, options, message):
    out = tmp_path / "out"
    code, stdout, stderr = call(f"ckpt={float_checkpoint}", f"out={out}", *TINY, *options)
    assert code == 2, stderr
    assert stderr.count("\n") == 1 and stderr.startswith("error: ") and message in stderr, stderr
    assert not out.exists()


def test_self_check_fails_a_wrong_scale(exported, tmp_path):
    model, path, _, _, _ = exported
    assert int8_export.check_int8(path, model).argmax_agree == onnx_export.SAMPLE_ROWS
    graph = onnx.load(str(path))
    for init in graph.graph.initializer:
        if init.name == "int8.classifier.w_scale":  # the head's scales tripled: logits x3
            init.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(init) * 3, init.name))
    wrong = tmp_path / "wrong.onnx"
    onnx.save(graph, str(wrong))
    with pytest.raises(onnx_export.ExportCheckError, match="differ from the fake-quantized PyTorch model's"):
        int8_export.check_int8(wrong, model)


def test_cli_uses_the_ranges_a_qat_checkpoint_saved(tmp_path):
    """A checkpoint holding calibrated quantizer state (a QAT run's): its ranges are the graph's scales as saved,
    nothing is recalibrated (no data is even configured)."""
    ckpt, module = calibrated_run_checkpoint(tmp_path / "run", "int8_scaled")
    saved = {
        name: float(torch.maximum(-m.data_in_quantizer.min_val, m.data_in_quantizer.max_val)) / 127
        for name, m in module.model.named_modules()
        if isinstance(m, QuantLinear)
    }

    out = tmp_path / "out"
    code, stdout, stderr = call(f"ckpt={ckpt}", f"out={out}", "format=onnx", "int8=scaled")
    assert code == 0, stderr[-3000:]
    assert "calibrated here" not in stdout
    stored = initializers(out / int8_export.INT8_SCALED_FILE)
    assert len(saved) == TINY_LINEARS
    for name, scale in saved.items():
        # named as in the model (``bert.…``); the LightningModule's ``model.`` prefix is not part of it
        assert stored[f"int8.{name}.x_scale"] == pytest.approx(scale, rel=1e-6), name
