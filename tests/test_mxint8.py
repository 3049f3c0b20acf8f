"""MXINT8 format, ops and kernels: hand-derived values, native == reference bit for bit, bounds, errors."""

from __future__ import annotations

import math
import platform
import sys

import pytest
import torch
from torch.library import opcheck

import adls_lightning  # noqa: F401  (registers torch.ops.adls.*)
from adls_lightning.mxint8 import (
    dequantize,
    dequantize_reference,
    native_cpu_isa,
    native_cuda_kernels_loaded,
    native_kernels_loaded,
    quantize,
    quantize_reference,
)
from adls_lightning.mxint8.ops import PORTABLE_CPU_ENV, env_flag
from tests.helpers import requires
from tests.mxint8_helpers import assert_passes_with_portable_kernels

NAN = float("nan")
INF = float("inf")
GROUP_SIZES = [8, 16, 32, 64, 128, 256, 512]

needs_native = pytest.mark.skipif(not native_kernels_loaded(), reason="native MXINT8 extension not built")


def bits(t: torch.Tensor) -> torch.Tensor:
    """Bit pattern of a float tensor, with every NaN mapped to one value (NaN payloads may differ)."""
    int_dtype = {4: torch.int32, 2: torch.int16}[t.element_size()]
    return t.masked_fill(t.isnan(), NAN).view(int_dtype).masked_fill(t.isnan(), -1)


def assert_bitwise_equal(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    if actual.is_floating_point():
        assert torch.equal(bits(actual), bits(expected))
    else:
        assert torch.equal(actual, expected)


def p2(exponent: int) -> float:
    return math.ldexp(1.0, exponent)


# ---------------------------------------------------------------------------------------------
# Hand-derived table. step = 2^(E-133) is the value of one mantissa unit.

QUANTIZE_TABLE = [
    # (group, expected scale byte, expected mantissas), worked out by hand in the comments.
    # amax 3 -> floor(log2 3) = 1 -> E = 128, step 2^-5: 1 -> 32, 0.75 -> 24, 1.984375 -> 63.5 -> 64
    # (tie to even), 2^-7 -> 0.25 -> 0, -2^-8 -> -0.125 -> 0.
    ([1.0, -0.5, 0.75, 1.984375, 3.0, 0.0, p2(-7), -p2(-8)], 128, [32, -16, 24, 64, 96, 0, 0, 0]),
    # E = 127, step 2^-6: 64.5 -> 64 and 65.5 -> 66 (ties to even), -64.5 -> -64.
    ([1 + 1 / 128, 1 + 3 / 128, -(1 + 1 / 128), 1.0], 127, [64, 66, -64, 64]),
    # amax 1.999 -> E = 127, 1.999 * 64 = 127.94 -> 128 -> clamped to 127 (symmetric clamp).
    ([1.999, -1.999, 0.5, 0.0], 127, [127, -127, 32, 0]),
    # An exact power of two is 64 steps: amax 2^10 -> E = 137, step 2^4.
    ([p2(10), -p2(4), 48.0, 8.0], 137, [64, -1, 3, 0]),
    # All zeros -> E = 0, mantissas 0.
    ([0.0, -0.0, 0.0, 0.0], 0, [0, 0, 0, 0]),
    # Subnormal amax (< 2^-126) -> E = 0, step 2^-133: 2^-130 -> 8, -2^-127 -> -64, 2^-140 -> 0.
    ([p2(-140), p2(-130), -p2(-127), 0.0], 0, [0, 8, -64, 0]),
    # amax 2^-124 -> E = 3 (the two-step scaling path for E < 6), step 2^-130.
    ([p2(-124), p2(-130), -3 * p2(-130), 0.0], 3, [64, 1, -3, 0]),
    # amax 2^127 -> E = 254, step 2^121: 2^120 -> 0.5 -> 0 (tie to even), 3 * 2^121 -> 3.
    ([p2(127), p2(120), 3 * p2(121), -p2(126)], 254, [64, 0, 3, -32]),
    # Float32 max (2 - 2^-23) * 2^127 -> E = 254, 127.99... -> 128 -> 127.
    ([torch.finfo(torch.float32).max, -torch.finfo(torch.float32).max, 0.0, 1.0], 254, [127, -127, 0, 0]),
    # Any inf/NaN -> scale 0xFF (NaN) and zero mantissas.
    ([1.0, INF, 0.0, 2.0], 255, [0, 0, 0, 0]),
    ([-INF, 1.0, 2.0, 3.0], 255, [0, 0, 0, 0]),
    ([NAN, 1.0, 2.0, 3.0], 255, [0, 0, 0, 0]),
]

DEQUANTIZE_TABLE = [
    # (scale byte, mantissa, expected value) with value = m * 2^(E-133)
    (127, 64, 1.0),
    (127, -1, -p2(-6)),
    (127, 127, 127 / 64),
    (127, -128, -2.0),  # two's-complement -128 decodes (quantization never emits it)
    (128, 96, 3.0),
    (7, 1, p2(-126)),  # smallest step that is a float32 normal
    (0, 1, p2(-133)),  # float32 subnormal step
    (0, -64, -p2(-127)),
    (254, 127, 127 * p2(121)),
    (255, 0, NAN),
    (255, 5, NAN),
]


def implementations():
    """(name, quantize fn, dequantize fn) for the reference and, when built, the native CPU kernels."""
    impls = [("reference", quantize_reference, dequantize_reference)]
    if native_kernels_loaded():
        impls.append(("native", quantize, dequantize))
    return impls


IMPLEMENTATIONS = implementations()
IMPL_IDS = [name for name, _, _ in IMPLEMENTATIONS]


@pytest.mark.parametrize(("_name", "quant", "_dequant"), IMPLEMENTATIONS, ids=IMPL_IDS)
@pytest.mark.parametrize(("group", "scale", "mantissa"), QUANTIZE_TABLE)
def test_quantize_matches_hand_derived_table(_name, quant, _dequant, group, scale, mantissa):
    m, s = quant(torch.tensor([group], dtype=torch.float32), len(group))
    assert s.tolist() == [[scale]]
    assert m.tolist() == [mantissa]


@pytest.mark.parametrize(("_name", "_quant", "dequant"), IMPLEMENTATIONS, ids=IMPL_IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantize_matches_hand_derived_table(_name, _quant, dequant, dtype):
    scales = torch.tensor([[row[0]] for row in DEQUANTIZE_TABLE], dtype=torch.uint8)
    mantissas = torch.tensor([[row[1]] for row in DEQUANTIZE_TABLE], dtype=torch.int8)
    out = dequant(mantissas, scales, 1, dtype)
    expected = torch.tensor([[row[2]] for row in DEQUANTIZE_TABLE], dtype=torch.float64)
    # Every value is exact in float32 and bfloat16 (at most 8 significant bits, >= 2^-133).
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), expected, rtol=0, atol=0, equal_nan=True)


def test_float16_output_rounds_the_exact_value():
    scales = torch.tensor([[127], [0], [160]], dtype=torch.uint8)
    mantissas = torch.tensor([[3], [64], [127]], dtype=torch.int8)
    out = dequantize(mantissas, scales, 1, torch.float16)
    # 3/64 is exact; 2^-127 underflows float16 to 0; 127 * 2^27 overflows to inf.
    assert out.flatten().tolist() == [3 / 64, 0.0, INF]


def test_scale_is_floor_log2_of_group_amax_computed_independently():
    torch.manual_seed(0)
    x = torch.randn(64, 256) * torch.exp2(torch.randint(-120, 120, (64, 1)).float())
    _, scale = quantize(x, 32)
    amax = x.reshape(64, 8, 32).abs().amax(-1).double()
    _, exponent = torch.frexp(amax)  # amax = f * 2^exponent with f in [0.5, 1)
    assert torch.equal(scale.long(), (exponent - 1 + 127).long())


# ---------------------------------------------------------------------------------------------
# Random tensors: native kernels == reference, bit for bit.


def random_mx_input(shape: tuple[int, ...], group_size: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Values over the whole float32 range, with zero groups, subnormals, ties, inf and NaN."""
    gen = torch.Generator().manual_seed(seed)
    groups = shape[-1] // group_size
    lead = shape[:-1]
    x = torch.randn(*lead, groups, group_size, generator=gen, dtype=torch.float64)
    # A per-group exponent from deep subnormal to near overflow.
    x = x * torch.exp2(torch.randint(-145, 126, (*lead, groups, 1), generator=gen).double())
    flat = x.view(-1, group_size)
    n = flat.shape[0]
    pick = torch.randint(0, 8, (n,), generator=gen)
    flat[pick == 0] = 0.0  # all-zero groups
    # Half-integers times 2^-20: a group with amax >= 64 * 2^-20 has step 2^-20, so these are exact
    # rounding ties, and +-127.5 steps round to 128 and saturate to 127.
    ties = (torch.randint(-255, 256, (n, group_size), generator=gen).double() / 2) * 2.0**-20
    flat[pick == 1] = ties[pick == 1]
    flat[pick == 2, 0] = 127.75 * 2.0**-30  # saturates when it is its group's amax
    specials = torch.tensor([INF, -INF, NAN], dtype=torch.float64)
    spot = torch.randint(0, group_size, (n,), generator=gen)
    special_rows = (pick == 3).nonzero().flatten()
    flat[special_rows, spot[special_rows]] = specials[
        torch.randint(0, 3, (len(special_rows),), generator=gen)
    ]
    return x.reshape(shape).to(dtype)


SHAPES = [(512,), (3, 512), (2, 3, 1024), (17, 2048), (5, 1, 1536)]


def assert_native_quantize_matches_reference(
    x: torch.Tensor, group_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Native ``quantize`` equals the reference bit for bit; returns the (mantissa, scale) pair."""
    m_native, s_native = quantize(x, group_size)
    m_ref, s_ref = quantize_reference(x, group_size)
    assert_bitwise_equal(s_native, s_ref)
    assert_bitwise_equal(m_native, m_ref)
    return m_native, s_native


@needs_native
@pytest.mark.parametrize("group_size", GROUP_SIZES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_native_quantize_is_bit_exact(group_size, dtype):
    for i, shape in enumerate(SHAPES):
        x = random_mx_input(shape, group_size, dtype, seed=1000 * group_size + i)
        assert_native_quantize_matches_reference(x, group_size)


@needs_native
@pytest.mark.parametrize("group_size", GROUP_SIZES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_native_dequantize_is_bit_exact(group_size, dtype):
    gen = torch.Generator().manual_seed(group_size)
    for shape in SHAPES:
        mantissa = torch.randint(-128, 128, shape, generator=gen, dtype=torch.int8)
        scale_shape = (*shape[:-1], shape[-1] // group_size)
        scale = torch.randint(0, 256, scale_shape, generator=gen, dtype=torch.uint8)  # includes 0 and 0xFF
        assert_bitwise_equal(
            dequantize(mantissa, scale, group_size, dtype),
            dequantize_reference(mantissa, scale, group_size, dtype),
        )


@needs_native
def test_native_handles_odd_group_sizes_and_strided_inputs():
    x = random_mx_input((6, 7 * 24), 24, torch.float32, seed=7)
    for group_size in (1, 3, 7, 24, 168):
        assert_bitwise_equal(quantize(x, group_size)[0], quantize_reference(x, group_size)[0])
    strided = random_mx_input((64, 96), 32, torch.float32, seed=8).t()  # non-contiguous
    assert_bitwise_equal(quantize(strided, 32)[1], quantize_reference(strided, 32)[1])
    mantissa = torch.randint(-128, 128, (64, 96), dtype=torch.int8).t()
    scale = torch.randint(0, 256, (2, 96), dtype=torch.uint8).t()
    assert_bitwise_equal(dequantize(mantissa, scale, 32), dequantize_reference(mantissa, scale, 32))


@needs_native
def test_native_is_bit_exact_across_parallel_tasks_and_vector_tails():
    """Tensors split over several threads' tasks; group sizes whose AVX2 loops end in an 8-wide tail."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for group_size in (8, 24, 40, 48, 32):
            x = random_mx_input((96, 40 * 48), group_size, torch.float32, seed=group_size)
            mantissa, scale = assert_native_quantize_matches_reference(x, group_size)
            for dtype in (torch.float32, torch.bfloat16):
                assert_bitwise_equal(
                    dequantize(mantissa, scale, group_size, dtype),
                    dequantize_reference(mantissa, scale, group_size, dtype),
                )
    finally:
        torch.set_num_threads(threads)


@needs_native
def test_native_is_bit_exact_on_views_with_unaligned_data():
    """Contiguous views that start mid-buffer: the kernels get pointers off any vector alignment."""
    x = random_mx_input((8 * 1001,), 8, torch.float32, seed=11)[8:]  # 32 bytes in
    assert_native_quantize_matches_reference(x, 8)
    gen = torch.Generator().manual_seed(12)
    mantissa = torch.randint(-128, 128, (3 + 16 * 1000,), generator=gen, dtype=torch.int8)[3:]  # 3 bytes in
    scale = torch.randint(0, 256, (1 + 1000,), generator=gen, dtype=torch.uint8)[1:]
    for dtype in (torch.float32, torch.bfloat16):
        assert_bitwise_equal(
            dequantize(mantissa, scale, 16, dtype), dequantize_reference(mantissa, scale, 16, dtype)
        )


def cpu_has_avx2() -> bool:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return any(line.startswith("flags") and " avx2" in line for line in cpuinfo)
    except OSError:
        return False


@needs_native
def test_cpu_kernel_isa_follows_the_cpu_and_the_switch():
    forced_portable = env_flag(PORTABLE_CPU_ENV)
    x86_linux = sys.platform.startswith("linux") and platform.machine() == "x86_64"
    expected = "avx2" if x86_linux and cpu_has_avx2() and not forced_portable else "portable"
    assert native_cpu_isa() == expected


@needs_native
@pytest.mark.skipif(native_cpu_isa() != "avx2", reason="the portable loops already serve every test here")
def test_portable_cpu_kernels_are_bit_exact_too():
    """CPUs without AVX2 run the portable loops: run the bit-exact tests again with them forced."""
    assert_passes_with_portable_kernels(__file__, "bit_exact or odd_group_sizes or cpu_kernel_isa")


def test_empty_tensors():
    m, s = quantize(torch.empty(0, 64), 32)
    assert m.shape == (0, 64) and s.shape == (0, 2)
    assert dequantize(m, s, 32).shape == (0, 64)


# ---------------------------------------------------------------------------------------------
# Round trip


@pytest.mark.parametrize("group_size", [8, 32, 512])
def test_round_trip_error_within_half_a_step(group_size):
    torch.manual_seed(group_size)
    x = torch.randn(32, 1024) * torch.exp2(torch.randint(-100, 100, (32, 1)).float())
    m, s = quantize(x, group_size)
    y = dequantize(m, s, group_size)
    groups = x.reshape(32, -1, group_size)
    _, exponent = torch.frexp(groups.abs().amax(-1, keepdim=True).double())
    step = torch.exp2(exponent - 1 - 6)  # 2^(floor(log2 amax) - 6), derived independently of the scale byte
    error = (y.reshape(groups.shape).double() - groups.double()).abs()
    saturated = groups.abs().double() >= 127.5 * step
    # Rounding error is at most half a step; only elements clamped from 128 to 127 exceed it (< 1 step).
    assert (error[~saturated] <= step.expand_as(error)[~saturated] / 2).all()
    assert (error < step).all()
    assert error.max() > 0  # the format is lossy for Gaussian data: the check is not vacuous


# ---------------------------------------------------------------------------------------------
# Op registration


def test_ops_are_registered_by_importing_the_package():
    m, s = torch.ops.adls.mxint8_quantize(torch.ones(2, 64), 32)
    assert m.shape == (2, 64) and s.shape == (2, 2) and m.dtype == torch.int8 and s.dtype == torch.uint8
    out = torch.ops.adls.mxint8_dequantize(m, s, 32, torch.bfloat16)
    assert out.dtype == torch.bfloat16 and torch.equal(out, torch.ones(2, 64, dtype=torch.bfloat16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_opcheck(dtype):
    x = torch.randn(4, 3, 64).to(dtype)
    opcheck(torch.ops.adls.mxint8_quantize.default, (x, 32))
    m, s = quantize(x, 16)
    opcheck(torch.ops.adls.mxint8_dequantize.default, (m, s, 16, dtype))
    opcheck(torch.ops.adls.mxint8_dequantize.default, (m, s, 16, torch.float32))


def test_native_flag_matches_dispatcher():
    has_cpu_kernel = torch._C._dispatch_has_kernel_for_dispatch_key("adls::mxint8_dequantize", "CPU")
    assert native_kernels_loaded() == has_cpu_kernel


# ---------------------------------------------------------------------------------------------
# Bad input: one clear error


def bad_inputs():
    m = torch.zeros(4, 64, dtype=torch.int8)
    s = torch.zeros(4, 2, dtype=torch.uint8)
    return [
        ("quantize", (torch.randn(4, 60), 32), "group_size=32 must divide the last dimension"),
        ("quantize", (torch.randn(4, 64), 0), "group_size must be positive"),
        (
            "quantize",
            (torch.ones(4, 64, dtype=torch.int32), 32),
            "x must be float32, bfloat16, float16 or float64",
        ),
        ("quantize", (torch.tensor(1.0), 1), "at least one dimension"),
        ("dequantize", (m.to(torch.int16), s, 32, torch.float32), "mantissa must be int8"),
        ("dequantize", (m, s.to(torch.int8), 32, torch.float32), "scale must be uint8"),
        ("dequantize", (m, s, 32, torch.float64), "dtype must be float32, bfloat16 or float16"),
        ("dequantize", (m, s, 16, torch.float32), "scale shape"),
        ("dequantize", (m, s[:3], 32, torch.float32), "does not match mantissa shape"),
        ("dequantize", (m[:, :48], s, 32, torch.float32), "must divide the last dimension"),
    ]


@pytest.mark.parametrize(("op", "args", "message"), bad_inputs())
@pytest.mark.parametrize("impl", ["op", "reference"])
def test_bad_inputs_raise_one_clear_error(op, args, message, impl):
    fn = {
        ("quantize", "op"): torch.ops.adls.mxint8_quantize,
        ("quantize", "reference"): quantize_reference,
        ("dequantize", "op"): torch.ops.adls.mxint8_dequantize,
        ("dequantize", "reference"): dequantize_reference,
    }[op, impl]
    with pytest.raises(RuntimeError, match=message):
        fn(*args)


# ---------------------------------------------------------------------------------------------
# CUDA (skipped without a GPU)


@pytest.mark.parametrize("group_size", GROUP_SIZES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@requires("gpu")
def test_cuda_is_bit_exact(group_size, dtype):
    for i, shape in enumerate(SHAPES):
        x = random_mx_input(shape, group_size, dtype, seed=i)
        m_ref, s_ref = quantize_reference(x, group_size)
        m_gpu, s_gpu = quantize(x.cuda(), group_size)
        assert_bitwise_equal(s_gpu.cpu(), s_ref)
        assert_bitwise_equal(m_gpu.cpu(), m_ref)
        out = dequantize(m_gpu, s_gpu, group_size, dtype)
        assert_bitwise_equal(out.cpu(), dequantize_reference(m_ref, s_ref, group_size, dtype))
    # A storage offset of one element is not 16-byte aligned: the generic (unvectorised) kernels run.
    x = random_mx_input((1, 4 * group_size + 1), 1, dtype, seed=99)[0, 1:]
    m_ref, s_ref = quantize_reference(x, group_size)
    m_gpu, s_gpu = quantize(x.cuda(), group_size)
    assert_bitwise_equal(m_gpu.cpu(), m_ref)
    assert_bitwise_equal(s_gpu.cpu(), s_ref)
    m_offset = torch.cat([m_ref.new_zeros(1), m_ref]).cuda()[1:]
    assert_bitwise_equal(
        dequantize(m_offset, s_gpu, group_size, dtype).cpu(),
        dequantize_reference(m_ref, s_ref, group_size, dtype),
    )


@requires("gpu")
def test_cuda_kernels_are_native_when_built_with_cuda():
    if torch.version.cuda is None:
        pytest.skip("torch without CUDA")
    assert native_cuda_kernels_loaded(), "the extension was built without its CUDA kernels"
    x = torch.randn(8, 256, device="cuda")
    opcheck(torch.ops.adls.mxint8_quantize.default, (x, 32))
    m, s = quantize(x, 32)
    opcheck(torch.ops.adls.mxint8_dequantize.default, (m, s, 32, torch.bfloat16))
