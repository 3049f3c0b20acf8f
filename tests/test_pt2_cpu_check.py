"""A ``.pt2`` package is machine code for the CPU that exported it (``-march=native`` and its vector ISA's options):
it records that CPU, runs where the CPU has those instructions, and is refused in one line, before its code is
loaded, where it would stop the process with an illegal instruction (a package from a Zen 4 or an AMX Xeon on an
AVX2 machine). The refusals use packages whose metadata is another CPU's and machines whose /proc/cpuinfo is
replaced, so every branch runs on any machine; a real package is compiled here once (float, no torchao)."""

from __future__ import annotations

import json
import platform
import zipfile
from pathlib import Path

import pytest
import torch

from adls_lightning import gemm
from adls_lightning.export import onnx as onnx_export
from adls_lightning.export import pt2e
from adls_lightning.tools.export import main as export_main
from adls_lightning.tools.predict import main as predict_main
from tests.helpers import (
    AMX_CPUINFO,
    TINY,
    ZEN3_CPUINFO,
    ZEN4_CPUINFO,
    call,
    merged_model,
    on_cpu,
    trained_checkpoint,
)

OLD_CPUINFO = "model name\t: Old CPU\ncpu family\t: 6\nmodel\t\t: 15\nflags\t\t: fpu sse sse2 pni ssse3\n"


def flags_of(cpuinfo: str) -> str:
    return next(line.partition(":")[2].strip() for line in cpuinfo.splitlines() if line.startswith("flags"))


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny run exported as ONNX, with the merged model compiled here into the folder's PT2E package."""
    work = tmp_path_factory.mktemp("pt2_cpu")
    ckpt = work / "tiny.ckpt"
    trained_checkpoint(ckpt, TINY)
    out = work / "out"
    code, _, stderr = call(export_main, f"ckpt={ckpt}", f"out={out}", "format=onnx", "check=none", *TINY)
    assert code == 0, stderr[-3000:]
    model = merged_model(ckpt, TINY)
    inputs = onnx_export.sample_inputs(model, rows=2, tokens=8)
    example = (inputs["input_ids"], inputs["attention_mask"])
    pt2e.compile_package(
        onnx_export.LogitsOnly(model), example, pt2e._dynamic_shapes(model), out / pt2e.PT2E_FILE
    )
    return ckpt, out / pt2e.PT2E_FILE


def package_from(path: Path, metadata: dict[str, str]) -> Path:
    """An archive holding only a package's metadata (all the check reads: it refuses before loading any code)."""
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("model/data/aotinductor/model/abc.wrapper_metadata.json", json.dumps(metadata))
    return path


def test_a_package_records_the_cpu_that_compiled_it_and_runs_here(exported):
    ckpt, path = exported
    meta = pt2e.package_metadata(path)
    here = set(flags_of(gemm.CPUINFO.read_text()).split()) if gemm.CPUINFO.exists() else set()
    assert meta[pt2e.CPU_KEY] == gemm.cpu_name()
    recorded = set(meta[pt2e.CPU_FLAGS_KEY].split())
    assert recorded <= here and "fpu" not in recorded  # instruction sets only, each one this CPU's
    if platform.machine() == "x86_64" and here:
        assert {"sse2", "avx2"} & here <= recorded and meta["AOTI_CPU_ISA"]
    assert pt2e.package_cpu_problem(path) is None
    model = merged_model(ckpt, TINY)
    inputs = onnx_export.sample_inputs(model, rows=3, tokens=11, seed=1)
    with torch.inference_mode():
        expected = model(**inputs).logits
    assert torch.allclose(pt2e.Pt2Classifier(path)(**inputs).logits, expected, atol=1e-4)


def test_a_package_this_cpu_cannot_run_is_refused_in_one_line_before_loading(exported, tmp_path, monkeypatch):
    _, path = exported

    def never_loaded(*_args, **_kwargs):
        raise AssertionError("the package's code was loaded")

    monkeypatch.setattr(torch._inductor, "aoti_load_package", never_loaded)
    on_cpu(monkeypatch, tmp_path, OLD_CPUINFO, "old")
    code, stdout, stderr = call(predict_main, str(path), "a good film")
    assert code == 2 and not stdout
    [line] = stderr.strip().splitlines()
    exporter = pt2e.package_metadata(path)[pt2e.CPU_KEY]
    assert line.startswith(
        f"error: {path}: compiled on {exporter} for its instruction set; this CPU (Old CPU"
    )
    missing = sorted(
        set(pt2e.package_metadata(path)[pt2e.CPU_FLAGS_KEY].split()) - set(flags_of(OLD_CPUINFO).split())
    )
    assert missing and f"lacks {', '.join(missing[:8])}" in line and "illegal instruction" in line


ZEN4_PACKAGE = {
    pt2e.CPU_KEY: "AMD EPYC (family 25, model 17)",
    pt2e.CPU_FLAGS_KEY: " ".join(pt2e.isa_flags(flags_of(ZEN4_CPUINFO))),
    "AOTI_MACHINE": "x86_64",
    "AOTI_CPU_ISA": "AVX512 AVX512_VNNI",
}


@pytest.mark.parametrize(
    ("metadata", "cpuinfo", "missing"),
    [
        # exported on a Zen 4, deployed on a Zen 3 (both "AMD EPYC"): the AVX-512 sets are missing
        (
            ZEN4_PACKAGE,
            ZEN3_CPUINFO,
            "avx512_bf16, avx512_vnni, avx512bw, avx512cd, avx512dq, avx512f, avx512vl",
        ),
        # a package exported before the CPU was recorded: torch's AOTI_CPU_ISA alone still tells
        (
            {"AOTI_MACHINE": "x86_64", "AOTI_CPU_ISA": "AVX512"},
            ZEN3_CPUINFO,
            "avx512bw, avx512dq, avx512f, avx512vl",
        ),
        # exported on an AMX Xeon, deployed on a Zen 4: the AMX tiles are missing
        (
            {"AOTI_MACHINE": "x86_64", "AOTI_CPU_ISA": "AVX512 AVX512_VNNI AMX_TILE"},
            ZEN4_CPUINFO,
            "amx_bf16, amx_int8, amx_tile",
        ),
        # the same kind runs it, and so does a CPU with more instructions than the exporter's
        (ZEN4_PACKAGE, ZEN4_CPUINFO, None),
        ({**ZEN4_PACKAGE, pt2e.CPU_FLAGS_KEY: "sse2 avx2 fma", "AOTI_CPU_ISA": "AVX2"}, AMX_CPUINFO, None),
    ],
    ids=["zen4-on-zen3", "unrecorded-avx512-on-zen3", "amx-on-zen4", "zen4-on-zen4", "avx2-on-amx"],
)
def test_which_cpus_a_package_runs_on(metadata, cpuinfo, missing, tmp_path, monkeypatch):
    on_cpu(monkeypatch, tmp_path, cpuinfo, "here")
    problem = pt2e.package_cpu_problem(package_from(tmp_path / "model.pt2", metadata))
    if missing is None:
        assert problem is None
    else:
        assert problem is not None and f"lacks {missing}," in problem and gemm.cpu_name() in problem


def test_a_package_for_another_machine_is_refused(tmp_path):
    other = "aarch64" if platform.machine() != "aarch64" else "x86_64"
    problem = pt2e.package_cpu_problem(package_from(tmp_path / "model.pt2", {"AOTI_MACHINE": other}))
    assert problem == f"compiled for {other}, this machine is {platform.machine()}"


@pytest.mark.parametrize(
    ("metadata", "name", "int8"),
    [
        ({pt2e.CPU_KEY: "x", pt2e.INT8_KEY: "uint8 x int8"}, "model.pt2", True),
        ({pt2e.CPU_KEY: "x"}, pt2e.PT2E_FILE, False),  # recorded as float: the name does not decide
        ({}, pt2e.RUN_CODES_FILE, True),  # from before packages recorded anything: known by the export's name
        ({}, "model.pt2", False),
    ],
)
def test_an_int8_package_on_a_cpu_whose_int8_kernels_saturate_is_refused(
    metadata, name, int8, tmp_path, monkeypatch
):
    """oneDNN's uint8 x int8 kernels add pairs of products in saturating int16 on x86 without VNNI: an int8 package
    there would compute other numbers than the run's, so it is refused in one line before loading; a float package,
    or any package on a VNNI CPU, is not."""
    path = package_from(tmp_path / name, {**metadata, "AOTI_CPU_ISA": "AVX2"})
    assert pt2e.is_int8_package(path) is int8
    loaded = []
    monkeypatch.setattr(torch._inductor, "aoti_load_package", lambda p: loaded.append(p))
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    on_cpu(monkeypatch, tmp_path, ZEN3_CPUINFO, "zen3")
    if int8:
        with pytest.raises(pt2e.ConfigError) as refused:
            pt2e.Pt2Classifier(path)
        message = str(refused.value)
        assert "\n" not in message and message.startswith(f"{path}: an int8 package, and this CPU (AMD EPYC")
        assert "no int8 dot product" in message and "model_int8_scaled.onnx" in message
        assert not loaded
    else:
        pt2e.Pt2Classifier(path)
        assert loaded == [str(path)]
    on_cpu(monkeypatch, tmp_path, ZEN4_CPUINFO, "zen4")  # VNNI: every package of AVX2 code runs
    pt2e.Pt2Classifier(path)
    assert loaded[-1] == str(path)
