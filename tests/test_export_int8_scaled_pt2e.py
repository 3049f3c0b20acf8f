"""``format=onnx int8=scaled`` in PT2E (issue 59): the run's own int8 grid as an AOTInductor package, beside ONNX
Runtime's QDQ graph, whichever measures faster on this CPU kind (``int8_runtime=auto``) or the one named.

The converted graph must hold the run's integers: its weight codes and steps are read from the graph and compared
with the codes the fake quantizer rounds to (computed here from the layer's weight and its quantizer), its input
steps with the quantizers' calibrated ranges; the graph computes the fake-quantized model's logits, and the
compiled package those within the int8 tolerance at shapes other than the captured one. Without torchao,
``int8_runtime=pt2e`` is refused in one line and ``auto`` writes ONNX Runtime's graph, saying why."""

from __future__ import annotations

import json
import platform
from pathlib import Path

import pytest
import torch

from adls_lightning import int8_runtime
from adls_lightning.export import int8 as int8_export
from adls_lightning.export import pt2e
from adls_lightning.export.folder import load_folder
from adls_lightning.quant.linear import QuantLinear
from adls_lightning.quant.scaled import calibrate
from adls_lightning.quant.smoothquant import smooth
from adls_lightning.search.cost import torch_threads
from adls_lightning.tools.export import main
from tests.helpers import TINY, ZEN3_CPUINFO, call, on_cpu, trained_checkpoint
from tests.int8_helpers import (
    CALIBRATION_BATCHES,
    PTQ,
    SMALL_DATA,
    TINY_LINEARS,
    int8_scaled_model,
    record_input_ranges,
)

needs_torchao = pytest.mark.skipif(pt2e.pt2e_available() is not None, reason="torchao is not installed")
#: a package written by the export and run here: torchao, and int8 kernels that sum exactly (pt2e.saturation_problem)
needs_exact_pt2e = pytest.mark.skipif(pt2e.pt2e_unusable() is not None, reason=str(pt2e.pt2e_unusable()))
CHECK = ["check=agreement", "check_rows=16"]


@pytest.fixture(scope="module")
def converted(tiny_bert):
    model, batches = int8_scaled_model(tiny_bert)
    calibrate(model, batches, lambda ids: model(input_ids=ids), CALIBRATION_BATCHES)
    ranges = record_input_ranges(model, batches[:CALIBRATION_BATCHES])
    graph, _ = pt2e.quantize_run_codes(model, int8_export.scaled_int8_layers(model), int8_export.QMAX)
    return model, graph, ranges


def expected_codes(module: QuantLinear) -> tuple[torch.Tensor, torch.Tensor]:
    """The run's integers and per-channel steps, recomputed: min-max symmetric, ``step = max|w| / 127`` per output
    channel; ``codes · step`` must be what the fake quantizer computes."""
    weight = module.linear.weight.detach().float()
    step = weight.abs().amax(dim=1) / 127
    codes = torch.round(weight / step[:, None]).clamp(-127, 127)
    assert torch.equal(codes * step[:, None], module.weight_quantizer(weight))
    return codes.to(torch.int8), step


@needs_torchao
def test_graph_holds_the_runs_codes_and_steps(converted):
    model, graph, ranges = converted
    modules = {name: m for name, m in model.named_modules() if isinstance(m, QuantLinear)}
    linears = [node for node in graph.graph.nodes if node.target == torch.ops.aten.linear.default]
    assert len(modules) == len(linears) == TINY_LINEARS
    seen = set()
    for linear in linears:
        dequantize_input, dequantize_weight = linear.args[0], linear.args[1]
        assert dequantize_weight.target == torch.ops.quantized_decomposed.dequantize_per_channel.default
        codes = getattr(graph, dequantize_weight.args[0].target)
        steps = getattr(graph, dequantize_weight.args[1].target)
        [name] = [
            name
            for name, module in modules.items()
            if codes.shape == module.linear.weight.shape and torch.equal(codes, expected_codes(module)[0])
        ]
        seen.add(name)
        assert codes.dtype == torch.int8
        assert torch.allclose(steps.float(), expected_codes(modules[name])[1], rtol=1e-6, atol=0)
        assert dequantize_weight.args[4:6] == (-127, 127)
        # the input: uint8 codes ``x / step + 128`` in [1, 255], i.e. the run's symmetric [-127, 127]
        assert dequantize_input.target == torch.ops.quantized_decomposed.dequantize_per_tensor.default
        step, zero, low, high = dequantize_input.args[1:5]
        assert step == pytest.approx(ranges[name] / 127, rel=1e-6)
        assert (zero, low, high) == (
            pt2e.ACTIVATION_ZERO,
            pt2e.ACTIVATION_ZERO - 127,
            pt2e.ACTIVATION_ZERO + 127,
        )
    assert seen == set(modules)


@needs_torchao
def test_graph_computes_the_fake_quantized_models_logits(converted):
    model, graph, _ = converted
    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(0, model.config.vocab_size, (5, 9), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, 5:] = 0
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=mask).logits
        actual = graph(ids, mask)
        # inputs beyond the calibrated range clamp at the run's ±127 codes, as the fake quantizer clamps them
        expected_far = model(input_ids=ids[:, :1].repeat(1, 9), attention_mask=mask).logits
        actual_far = graph(ids[:, :1].repeat(1, 9), mask)
    assert torch.allclose(actual, expected, atol=1e-5, rtol=0), (actual - expected).abs().max()
    assert torch.allclose(actual_far, expected_far, atol=1e-5, rtol=0)


@needs_torchao
def test_layers_reading_one_input_keep_their_own_steps(tiny_bert):
    """Query, key and value read the same tensor; with steps of their own (LSQ learns one per layer) each linear
    node must dequantize its input on its own step, not one shared with its neighbours."""
    import dataclasses

    model, batches = int8_scaled_model(tiny_bert, seed=2)
    calibrate(model, batches, lambda ids: model(input_ids=ids), CALIBRATION_BATCHES)
    layers = {
        name: dataclasses.replace(layer, input_scale=layer.input_scale * (1 + 0.01 * index))
        for index, (name, layer) in enumerate(int8_export.scaled_int8_layers(model).items())
    }
    graph, _ = pt2e.quantize_run_codes(model, layers, int8_export.QMAX)
    steps = {}
    for linear in (node for node in graph.graph.nodes if node.target == torch.ops.aten.linear.default):
        codes = getattr(graph, linear.args[1].args[0].target)
        [name] = [name for name, layer in layers.items() if torch.equal(layer.codes, codes)]
        steps[name] = linear.args[0].args[1]
    assert steps == pytest.approx({name: layer.input_scale for name, layer in layers.items()}, rel=1e-7)


@needs_torchao
def test_smoothquant_layers_divide_their_input_before_the_runs_codes(tiny_bert):
    """SmoothQuant's layers: the input divided by the factors, then quantized on the run's step, times the codes
    of ``w · s``: the graph computes the smoothed fake-quantized model's logits."""
    model, batches = int8_scaled_model(tiny_bert, seed=1)
    smoothed, _ = smooth(model, batches, lambda ids: model(input_ids=ids), CALIBRATION_BATCHES, alpha=0.5)
    assert smoothed
    calibrate(model, batches, lambda ids: model(input_ids=ids), CALIBRATION_BATCHES)
    layers = int8_export.scaled_int8_layers(model)
    assert sorted(name for name, layer in layers.items() if layer.smooth is not None) == sorted(smoothed)
    graph, _ = pt2e.quantize_run_codes(model, layers, int8_export.QMAX)
    ids = torch.randint(0, model.config.vocab_size, (4, 11), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
        actual = graph(ids, torch.ones_like(ids))
    assert torch.allclose(actual, expected, atol=1e-5, rtol=0), (actual - expected).abs().max()


@pytest.fixture(scope="module")
def float_checkpoint(tmp_path_factory) -> Path:
    ckpt = tmp_path_factory.mktemp("ckpt") / "float.ckpt"
    trained_checkpoint(ckpt, TINY)
    return ckpt


def export_scaled(ckpt: Path, out: Path, data: list[str], *options: str) -> tuple[int, str, str]:
    return call(
        main, f"ckpt={ckpt}", f"out={out}", "format=onnx", "int8=scaled", *options, *CHECK, *TINY, *data, *PTQ
    )


def tiny_data(tiny_imdb_dir: Path, cache_dir: Path) -> list[str]:
    return [f"data.data_dir={tiny_imdb_dir}", f"paths.cache_dir={cache_dir}", *SMALL_DATA]


@needs_exact_pt2e
def test_pt2e_package_is_written_checked_and_loads(float_checkpoint, tmp_path, tiny_imdb_dir, cache_dir):
    out = tmp_path / "out"
    code, stdout, stderr = export_scaled(
        float_checkpoint, out, tiny_data(tiny_imdb_dir, cache_dir), "int8_runtime=pt2e"
    )
    assert code == 0, stderr[-3000:]
    assert sorted(p.name for p in out.glob("model*")) == [pt2e.RUN_CODES_FILE]
    assert f"{TINY_LINEARS} linear layers on the run's int8 grid" in stdout
    assert "the AOTInductor package vs the fake-quantized PyTorch model" in stdout
    assert json.loads((out / "export.json").read_text())["artifact"] == pt2e.RUN_CODES_FILE
    # the folder's model is the package, and it gives the ONNX Runtime graph's labels at another shape
    onnx_out = tmp_path / "onnx"
    code, _, stderr = export_scaled(
        float_checkpoint, onnx_out, tiny_data(tiny_imdb_dir, cache_dir), "int8_runtime=onnx"
    )
    assert code == 0, stderr[-3000:]
    assert sorted(p.name for p in onnx_out.glob("model*")) == [int8_export.INT8_SCALED_FILE]
    ids = torch.randint(0, 1000, (3, 21), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    package, graph = load_folder(out), load_folder(onnx_out)
    with torch.no_grad():
        from_package = package(input_ids=ids, attention_mask=mask).logits
        from_graph = graph(input_ids=ids, attention_mask=mask).logits
    assert torch.allclose(from_package.float(), from_graph.float(), atol=int8_export.INT8_ATOL, rtol=0)
    assert torch.equal(from_package.argmax(-1), from_graph.argmax(-1))


def record_run_code_times(cache: Path, times: dict[str, float]) -> None:
    """This CPU kind's answer at the self-check's default batch 8 x 128 tokens, 1 thread, as a measurement
    records it."""
    with torch_threads(1):
        int8_runtime.runtime_times(
            cache, object(), 8, 128, lambda *_: times, runtimes=int8_runtime.RUN_CODE_RUNTIMES
        )


@needs_exact_pt2e
@pytest.mark.parametrize(
    ("times", "written"),
    [
        ({"ort-qdq": 0.02, "pt2e-run-codes": 0.01}, pt2e.RUN_CODES_FILE),
        ({"ort-qdq": 0.01, "pt2e-run-codes": 0.02}, int8_export.INT8_SCALED_FILE),
    ],
)
def test_auto_writes_the_runtime_cached_as_faster(
    float_checkpoint, tmp_path, tiny_imdb_dir, cache_dir, times, written
):
    cache = tmp_path / "runtime_cache"
    record_run_code_times(cache, times)
    out = tmp_path / "out"
    out.mkdir()
    for stale in (pt2e.RUN_CODES_FILE, int8_export.INT8_SCALED_FILE):  # an earlier export's files
        (out / stale).write_bytes(b"stale")
    data = [f"data.data_dir={tiny_imdb_dir}", f"paths.cache_dir={cache}", *SMALL_DATA]
    code, stdout, stderr = export_scaled(float_checkpoint, out, data, "overwrite=true")
    assert code == 0, stderr[-3000:]
    assert sorted(p.name for p in out.glob("model*")) == [written]
    assert (out / written).stat().st_size > 1000  # written by this export, not the stale one
    [line] = [line for line in stdout.splitlines() if line.startswith("int8_runtime=auto:")]
    fastest = min(times, key=times.get)
    assert line.startswith(f"int8_runtime=auto: {fastest} (cached: {fastest} 10.0 ms"), line


@needs_exact_pt2e
def test_auto_measures_both_files_and_keeps_the_faster(float_checkpoint, tmp_path, tiny_imdb_dir):
    cache = tmp_path / "runtime_cache"
    out = tmp_path / "out"
    data = [
        f"data.data_dir={tiny_imdb_dir}",
        f"paths.cache_dir={cache}",
        *SMALL_DATA,
        "check_batches=2",
        "check_tokens=16",
    ]
    code, stdout, stderr = export_scaled(float_checkpoint, out, data)
    assert code == 0, stderr[-3000:]
    [line] = [line for line in stdout.splitlines() if line.startswith("int8_runtime=auto:")]
    assert "(measured: " in line and "at batch 2 x 16 tokens" in line, line
    cached = json.loads((cache / int8_runtime.CACHE_FILE).read_text())
    [times] = [
        value for key, value in cached.items() if key.endswith(",".join(int8_runtime.RUN_CODE_RUNTIMES))
    ]
    assert set(times) == set(int8_runtime.RUN_CODE_RUNTIMES)
    files = {"ort-qdq": int8_export.INT8_SCALED_FILE, "pt2e-run-codes": pt2e.RUN_CODES_FILE}
    assert sorted(p.name for p in out.glob("model*")) == [files[min(times, key=times.get)]]


@needs_torchao
def test_a_package_of_the_run_codes_records_that_it_is_int8_and_is_refused_where_kernels_saturate(
    converted, tmp_path, monkeypatch
):
    """The package :func:`write_run_codes_package` compiles says in its metadata that it runs int8 kernels, under
    any name; on an AVX2 CPU without VNNI (a Zen 3's cpuinfo) it is refused in one line before its code loads."""
    model, _, _ = converted
    path = tmp_path / "renamed.pt2"  # not an export's file name: the metadata decides
    pt2e.write_run_codes_package(model, int8_export.scaled_int8_layers(model), int8_export.QMAX, path)
    assert pt2e.package_metadata(path)[pt2e.INT8_KEY] == "uint8 x int8" and pt2e.is_int8_package(path)
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    on_cpu(monkeypatch, tmp_path, ZEN3_CPUINFO, "zen3")
    monkeypatch.setattr(
        pt2e, "package_cpu_problem", lambda *_: None
    )  # the exporting CPU's flags are not the test's
    loaded = []
    monkeypatch.setattr(torch._inductor, "aoti_load_package", lambda p: loaded.append(p))
    with pytest.raises(
        pt2e.ConfigError, match=r"an int8 package, and this CPU \(AMD EPYC .* no int8 dot product"
    ):
        pt2e.Pt2Classifier(path)
    assert not loaded


def refused_and_auto_writes_onnx(float_checkpoint: Path, tmp_path: Path, data: list[str], why: str) -> None:
    """``int8_runtime=pt2e`` is refused in one line (exit 2, nothing written) with ``why``, and ``int8_runtime=auto``
    writes ONNX Runtime's graph and says ``why``."""
    out = tmp_path / "refused"
    code, stdout, stderr = export_scaled(float_checkpoint, out, data, "int8_runtime=pt2e")
    assert code == 2 and stdout == ""
    assert stderr.count("\n") == 1 and stderr.startswith(f"error: int8_runtime=pt2e: {why}"), stderr
    assert not out.exists()
    out = tmp_path / "auto"
    code, stdout, stderr = export_scaled(float_checkpoint, out, data)
    assert code == 0, stderr[-3000:]
    assert sorted(p.name for p in out.glob("model*")) == [int8_export.INT8_SCALED_FILE]
    [line] = [line for line in stdout.splitlines() if line.startswith("int8_runtime=auto:")]
    assert line.startswith(f"int8_runtime=auto: ort-qdq (pt2e-run-codes not measured: {why}"), line


@needs_torchao
def test_where_int8_kernels_saturate_pt2e_is_refused_and_auto_writes_onnx(
    float_checkpoint, tmp_path, tiny_imdb_dir, cache_dir, monkeypatch
):
    """On an x86 CPU without VNNI (an AVX2 Zen 3's cpuinfo here) oneDNN's uint8 x int8 kernels add pairs of
    products in saturating int16: the package would not compute the run's integers, so it is not written."""
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    on_cpu(monkeypatch, tmp_path, ZEN3_CPUINFO, "zen3")
    why = "this CPU (AMD EPYC (family 25, model 1)) has no int8 dot product (VNNI or AMX-INT8)"
    refused_and_auto_writes_onnx(float_checkpoint, tmp_path, tiny_data(tiny_imdb_dir, cache_dir), why)


@pytest.mark.skipif(pt2e.pt2e_available() is None, reason="torchao is installed here")
def test_without_torchao_pt2e_is_refused_and_auto_writes_onnx(
    float_checkpoint, tmp_path, tiny_imdb_dir, cache_dir
):
    data = tiny_data(tiny_imdb_dir, cache_dir)
    refused_and_auto_writes_onnx(float_checkpoint, tmp_path, data, "torchao's PT2E")
