"""``benchmarks/bench_gemm.py``'s peak estimates per CPU kind, from the CPU's /proc/cpuinfo lines: the arithmetic of
each vector unit (FMA lanes x pipes x 2 per cycle, AVX-512 BF16's two products per fp32 lane, VNNI's four, AMX's
tiles) at the nominal clock, written out here by hand for three machines this project ran on."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from tests.helpers import AMX_CPUINFO, ZEN3_CPUINFO, ZEN4_CPUINFO, on_cpu

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def bench_gemm():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        spec = importlib.util.spec_from_file_location("bench_gemm", ROOT / "benchmarks" / "bench_gemm.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


@pytest.mark.parametrize(
    ("cpuinfo", "fp32", "bf16", "int8"),
    [
        # Zen 3: AVX2 + FMA, 2 pipes x 8 lanes x 2 = 32 FLOP/cycle at 2.45 GHz; no bf16 unit; int8 through
        # vpmaddubsw + vpmaddwd, half VNNI's rate: 2x fp32
        (ZEN3_CPUINFO, 32 * 2.45, None, 2 * 32 * 2.45),
        # Zen 4: AVX-512 on 256-bit units (32 FLOP/cycle) at 2.6 GHz; vdpbf16ps 2x, VNNI 4x fp32
        (ZEN4_CPUINFO, 32 * 2.6, 2 * 32 * 2.6, 4 * 32 * 2.6),
        # Sapphire Rapids: AVX-512 at 64 FLOP/cycle, AMX-BF16 1,024 and AMX-INT8 2,048 per cycle, at 2.7 GHz
        (AMX_CPUINFO, 64 * 2.7, 1024 * 2.7, 2048 * 2.7),
    ],
    ids=["zen3-avx2", "zen4-avx512-bf16", "xeon-amx"],
)
def test_peak_estimates_per_cpu_kind(bench_gemm, cpuinfo, fp32, bf16, int8, monkeypatch, tmp_path):
    on_cpu(monkeypatch, tmp_path, cpuinfo, "cpu")
    per_core, how = bench_gemm.peak(None)
    assert per_core == pytest.approx(fp32) and "nominal" in how
    peaks = bench_gemm.matrix_peaks(per_core)
    for fmt, expected in (("fp32", fp32), ("bf16", bf16), ("int8", int8)):
        rate, why = peaks[fmt]
        assert (rate is None) == (expected is None), (fmt, why)
        if expected is not None:
            assert rate == pytest.approx(expected), (fmt, why)
