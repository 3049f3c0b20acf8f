"""``adls-export format=onnx int8=auto`` (issue 59): the int8 file is the runtime this CPU kind's cache (or a
measurement) names fastest among those a file holds; torch's dynamic int8 has no file format and PT2E needs
torchao; a PT2E package (``.pt2``) computes the merged model's labels at shapes other than the one it was
captured at, and loads in ``adls-evaluate`` / ``adls-predict``; a damaged package is refused in one line."""

from __future__ import annotations

import json
import platform
from pathlib import Path

import numpy as np
import pytest
import torch

from adls_lightning import int8_runtime
from adls_lightning.export import onnx as onnx_export
from adls_lightning.export import pt2e
from adls_lightning.export.folder import check_folder, load_folder
from adls_lightning.search.cost import torch_threads
from adls_lightning.tools.export import main
from adls_lightning.tools.predict import main as predict_main
from tests.helpers import (
    ENV,
    TINY,
    ZEN3_CPUINFO,
    call,
    merged_model,
    on_cpu,
    run_export,
    trained_checkpoint,
)

CHECK = ["check=agreement", "check_rows=16"]


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory) -> Path:
    ckpt = tmp_path_factory.mktemp("int8_auto") / "tiny.ckpt"
    trained_checkpoint(ckpt, TINY)
    return ckpt


def record_times(cache: Path, times: dict[str, float]) -> None:
    """This CPU kind's answer at the export's default check (batch 8 x 128 tokens, 1 thread), as a benchmark
    (benchmarks/bench_int8_runtimes.py) records it."""
    with torch_threads(1):
        int8_runtime.record(cache, 8, 128, times)


def export_auto(ckpt: Path, out: Path, cache: Path) -> tuple[int, str, str]:
    return call(
        main,
        f"ckpt={ckpt}",
        f"out={out}",
        "format=onnx",
        "int8=auto",
        *CHECK,
        *TINY,
        f"paths.cache_dir={cache}",
    )


def test_the_cached_fastest_writable_runtime_is_written(tiny_ckpt, tmp_path):
    cache = tmp_path / "cache"
    record_times(cache, {"ort-dynamic": 0.010, "torch-dynamic": 0.020})
    code, stdout, stderr = export_auto(tiny_ckpt, tmp_path / "out", cache)
    assert code == 0, stderr[-3000:]
    out = tmp_path / "out"
    assert (out / onnx_export.ONNX_INT8_FILE).is_file() and not (out / pt2e.PT2E_FILE).exists()
    [line] = [line for line in stdout.splitlines() if line.startswith("int8=auto:")]
    assert line.startswith(
        "int8=auto: ort-dynamic (ort-dynamic 10.0 ms, torch-dynamic 20.0 ms at batch 8 x 128"
    )
    assert json.loads((out / "export.json").read_text())["artifact"] == onnx_export.ONNX_INT8_FILE


def test_torch_dynamic_fastest_has_no_file_so_the_next_is_written(tiny_ckpt, tmp_path):
    cache = tmp_path / "cache"
    times = {"torch-dynamic": 0.005, "ort-dynamic": 0.010}
    if pt2e.pt2e_unusable() is None:
        times["pt2e-x86-inductor"] = 0.020  # slower than ORT: ORT's file is still the one written
    record_times(cache, times)
    code, stdout, stderr = export_auto(tiny_ckpt, tmp_path / "out", cache)
    assert code == 0, stderr[-3000:]
    [line] = [line for line in stdout.splitlines() if line.startswith("int8=auto:")]
    assert line.startswith("int8=auto: ort-dynamic (torch-dynamic 5.0 ms, ort-dynamic 10.0 ms")
    assert "torch-dynamic measured faster but has no file format" in line
    assert (tmp_path / "out" / onnx_export.ONNX_INT8_FILE).is_file()


def test_without_torchao_pt2e_is_not_chosen_even_when_cached_fastest(tiny_ckpt, tmp_path):
    """The command in a process without torchao on its path: it runs in `make test-int8` too, where it is."""
    cache = tmp_path / "cache"
    record_times(cache, {"pt2e-x86-inductor": 0.001, "ort-dynamic": 0.010})
    args = [f"ckpt={tiny_ckpt}", f"out={tmp_path / 'out'}", "format=onnx", "int8=auto", *CHECK, *TINY]
    env = {name: value for name, value in ENV.items() if name != "PYTHONPATH"}
    proc = run_export(*args, f"paths.cache_dir={cache}", env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    [line] = [line for line in proc.stdout.splitlines() if line.startswith("int8=auto:")]
    assert line.startswith("int8=auto: ort-dynamic") and "pt2e-x86-inductor not measured: torchao" in line
    assert (tmp_path / "out" / onnx_export.ONNX_INT8_FILE).is_file()


@pytest.mark.skipif(pt2e.pt2e_available() is not None, reason="torchao is not installed")
def test_where_int8_kernels_saturate_pt2e_is_not_chosen_even_when_cached_fastest(
    tiny_ckpt, tmp_path, monkeypatch
):
    """On an x86 CPU without VNNI (an AVX2 Zen 3's cpuinfo here) oneDNN's int8 kernels saturate: the PT2E package
    is not written, whatever a cache says, and the line says why."""
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    on_cpu(monkeypatch, tmp_path, ZEN3_CPUINFO, "zen3")
    cache = tmp_path / "cache"
    record_times(cache, {"pt2e-x86-inductor": 0.001, "ort-dynamic": 0.010})
    code, stdout, stderr = export_auto(tiny_ckpt, tmp_path / "out", cache)
    assert code == 0, stderr[-3000:]
    [line] = [line for line in stdout.splitlines() if line.startswith("int8=auto:")]
    assert line.startswith("int8=auto: ort-dynamic"), line
    assert (
        "pt2e-x86-inductor not measured: this CPU (AMD EPYC (family 25, model 1)) has no int8 dot product"
        in line
    )
    assert (tmp_path / "out" / onnx_export.ONNX_INT8_FILE).is_file()
    assert not (tmp_path / "out" / pt2e.PT2E_FILE).exists()


def test_best_runtime_among_those_usable(tmp_path):
    record_times(tmp_path, {"torch-dynamic": 0.001, "ort-dynamic": 0.010, "pt2e-x86-inductor": 0.005})
    with torch_threads(1):
        assert int8_runtime.best_int8_runtime(tmp_path, None, 8, 128) == "torch-dynamic"
        assert int8_runtime.best_int8_runtime(tmp_path, None, 8, 128, among=["ort-dynamic"]) == "ort-dynamic"
        among = ["ort-dynamic", "pt2e-x86-inductor"]
        assert int8_runtime.best_int8_runtime(tmp_path, None, 8, 128, among=among) == "pt2e-x86-inductor"
        assert int8_runtime.best_int8_runtime(tmp_path, None, 8, 128, among=["other"]) is None
        assert int8_runtime.runtime_times(tmp_path, None, 8, 128)[0]["ort-dynamic"] == 0.010
        assert int8_runtime.runtime_times(tmp_path, None, 1, 128)[0] == {}


@pytest.fixture(scope="module")
def pt2e_export(tiny_ckpt, tmp_path_factory) -> tuple[Path, str]:
    if (why := pt2e.pt2e_unusable()) is not None:
        pytest.skip(why)
    folder = tmp_path_factory.mktemp("pt2e")
    record_times(folder / "cache", {"pt2e-x86-inductor": 0.001, "ort-dynamic": 0.010})
    code, stdout, stderr = export_auto(tiny_ckpt, folder / "out", folder / "cache")
    assert code == 0, stderr[-3000:]
    return folder / "out", stdout


def test_pt2e_package_computes_the_merged_models_labels_at_other_shapes(tiny_ckpt, pt2e_export):
    out, stdout = pt2e_export
    path = out / pt2e.PT2E_FILE
    assert "int8=auto: pt2e-x86-inductor" in stdout and "AOTInductor package" in stdout
    model = merged_model(tiny_ckpt, TINY)
    package = pt2e.Pt2Classifier(path)
    for rows, tokens in [(1, 7), (5, 3), (3, 40)]:
        inputs = onnx_export.sample_inputs(model, rows=rows, tokens=tokens, seed=rows)
        with torch.inference_mode():
            expected = model(**inputs).logits.numpy()
        actual = package(**inputs).logits.numpy()
        # int8 activations and weights: close to the float logits, not equal to them
        assert np.abs(actual - expected).max() < 0.05 * max(1.0, np.abs(expected).max()), (rows, tokens)
        assert np.abs(actual - expected).max() > 0
    report = json.loads((out / "export.json").read_text())
    assert report["artifact"] == pt2e.PT2E_FILE and report["agreement"] >= 0.9


def test_pt2e_package_loads_where_folders_load_and_damage_is_one_line(tmp_path, pt2e_export):
    out, _ = pt2e_export
    export = check_folder(out / pt2e.PT2E_FILE)
    assert export.kind == "pt2" and export.graph_file == out / pt2e.PT2E_FILE
    assert check_folder(out).kind == "onnx"  # the folder's default graph is model.onnx, beside the package
    assert isinstance(load_folder(out / pt2e.PT2E_FILE), pt2e.Pt2Classifier)
    code, stdout, stderr = call(predict_main, str(out / pt2e.PT2E_FILE), "a good film", "a bad film")
    assert code == 0, stderr
    assert [set(json.loads(line)) for line in stdout.splitlines()] == [{"label", "scores"}] * 2
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (damaged / name).write_bytes((out / name).read_bytes())
    (damaged / pt2e.PT2E_FILE).write_bytes((out / pt2e.PT2E_FILE).read_bytes()[:1000])
    code, _, stderr = call(predict_main, str(damaged / pt2e.PT2E_FILE), "a good film")
    assert code == 2
    [line] = stderr.strip().splitlines()[-1:]
    assert line.startswith(f"error: {damaged / pt2e.PT2E_FILE}: its files do not load as a model")
