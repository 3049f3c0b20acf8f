"""The fused packed linear ``torch.ops.adls.mxint8_linear`` and ``QLinearPacked``'s choice of route."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.library import opcheck

from adls_lightning.mxint8 import (
    FUSED_MAX_ROWS,
    QLinearPacked,
    dequantize,
    linear,
    linear_reference,
    native_cpu_isa,
    native_linear_kernel_loaded,
    quantize,
)
from adls_lightning.mxint8.format import element_scale_reference
from adls_lightning.mxint8.ops import DISABLE_NATIVE_ENV
from tests.helpers import requires
from tests.mxint8_helpers import assert_passes_with_env, assert_passes_with_portable_kernels

GROUP_SIZES = [8, 16, 24, 32, 40, 64, 128, 256, 512]
ROWS = [1, 2, 3, 4, 5, 7, 8, 13, 64]

IMPLEMENTATIONS = {"op": linear, "reference": linear_reference}


def packed_weight(out_features: int, in_features: int, group_size: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    # Rows of very different magnitudes, so the groups get different scales.
    magnitude = 2.0 ** torch.randint(-8, 8, (out_features, 1), generator=generator).float()
    weight = torch.randn(out_features, in_features, generator=generator) * magnitude
    return quantize(weight, group_size)


def exact_linear(x, mantissa, scale, bias, group_size):
    """``x W^T + b`` in float64 from the exact weight ``m * 2^(E-133)``, and a bound on float32's error.

    The bound is the classic one for a float32 dot product of length ``K`` summed in any order,
    ``(K + 2) * 2^-24 * sum_k |x_k w_k|`` (plus the bias's share), doubled for safety.
    """
    step = element_scale_reference(scale).double().repeat_interleave(group_size, dim=1)
    weight = mantissa.double() * step
    x64 = x.double()
    expected = x64 @ weight.T
    magnitude = x64.abs() @ weight.abs().T
    if bias is not None:
        expected = expected + bias.double()
        magnitude = magnitude + bias.double().abs()
    bound = 2 * (mantissa.shape[1] + 2) * 2.0**-24 * magnitude + 1e-30
    return expected, bound


@pytest.mark.parametrize("group_size", GROUP_SIZES)
def test_fused_equals_dequantize_then_matmul_within_reassociation(group_size):
    for i, rows in enumerate(ROWS):
        in_features = group_size * (1 + i % 3)
        out_features = [1, 7, 8, 9, 17, 33][i % 6]
        mantissa, scale = packed_weight(out_features, in_features, group_size, seed=i)
        x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(100 + i))
        bias = torch.randn(out_features) if i % 2 else None
        expected, bound = exact_linear(x, mantissa, scale, bias, group_size)
        fused = linear(x, mantissa, scale, bias, group_size)
        unfused = F.linear(x, dequantize(mantissa, scale, group_size), bias)
        assert fused.dtype == torch.float32 and fused.shape == (rows, out_features)
        assert ((fused.double() - expected).abs() <= bound).all(), (rows, in_features, out_features)
        assert ((unfused.double() - expected).abs() <= bound).all()
        assert ((fused - unfused).double().abs() <= 2 * bound).all()


def test_fused_kernel_over_parallel_tasks_and_leading_dimensions():
    """A layer big enough to be split over threads' tasks, with x of shape (batch, tokens, in)."""
    mantissa, scale = packed_weight(3072 + 5, 768, 32, seed=7)  # 5 features beyond the 8-wide blocks
    bias = torch.randn(3077)
    x = torch.randn(2, 3, 768)
    fused = linear(x, mantissa, scale, bias, 32)
    expected, bound = exact_linear(x.reshape(6, 768), mantissa, scale, bias, 32)
    assert fused.shape == (2, 3, 3077)
    assert ((fused.reshape(6, -1).double() - expected).abs() <= bound).all()


@pytest.mark.parametrize("group_size", [8, 24, 32, 512, 1024])
def test_long_rows_many_rows_and_odd_feature_counts(group_size):
    """Long rows (more than 4 096 input features: several input chunks of the 8-row exact-decode tiles),
    row counts around the 4-row and 8-row tiles and past 64 rows, output features around the 8-wide blocks,
    and a group longer than a chunk (1 024: the 4x2 tiles serve every row): the exact result within the
    bound."""
    in_features = group_size * (4608 // group_size + 1)
    for i, (rows, out_features) in enumerate(
        [(4, 16), (7, 17), (8, 33), (9, 15), (31, 1), (33, 20), (70, 3)]
    ):
        mantissa, scale = packed_weight(out_features, in_features, group_size, seed=20 + i)
        x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(200 + i))
        bias = torch.randn(out_features) if i % 2 else None
        expected, bound = exact_linear(x, mantissa, scale, bias, group_size)
        fused = linear(x, mantissa, scale, bias, group_size)
        assert ((fused.double() - expected).abs() <= bound).all(), (rows, out_features)


@pytest.mark.parametrize("group_size", [8, 32])
def test_every_scale_code_decodes_exactly(group_size):
    """x = the identity picks out dequant(W)^T exactly (one product per output): every finite scale code,
    the subnormal steps (E < 7) and the largest ones included."""
    generator = torch.Generator().manual_seed(9)
    in_features, out_features = 4 * group_size, 64
    mantissa = torch.randint(-128, 128, (out_features, in_features), generator=generator, dtype=torch.int8)
    scale = torch.randint(0, 255, (out_features, 4), generator=generator).to(torch.uint8)
    scale.view(-1)[:8] = torch.tensor([0, 6, 7, 8, 236, 237, 238, 254], dtype=torch.uint8)
    weight = dequantize(mantissa, scale, group_size)
    result = linear(torch.eye(in_features), mantissa, scale, None, group_size)
    assert torch.equal(result, weight.T)


@pytest.mark.parametrize("rows", [3, 9])
def test_nan_group_gives_nan_outputs_of_that_feature_only(rows):
    mantissa, scale = packed_weight(4, 64, 32, seed=1)
    scale[2, 1] = 0xFF
    y = linear(torch.randn(rows, 64), mantissa, scale, None, 32)
    assert y[:, 2].isnan().all() and not y[:, [0, 1, 3]].isnan().any()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_other_dtypes_follow_the_reference(dtype):
    mantissa, scale = packed_weight(12, 64, 16, seed=3)
    x = torch.randn(5, 64).to(dtype)
    bias = torch.randn(12)
    result = linear(x, mantissa, scale, bias, 16)
    assert result.dtype == dtype
    torch.testing.assert_close(result, linear_reference(x, mantissa, scale, bias, 16))


def test_empty_rows():
    mantissa, scale = packed_weight(6, 32, 32, seed=0)
    assert linear(torch.empty(0, 32), mantissa, scale, None, 32).shape == (0, 6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("with_bias", [True, False])
def test_opcheck(dtype, with_bias):
    mantissa, scale = packed_weight(9, 48, 16, seed=2)
    x = torch.randn(3, 48, dtype=dtype, requires_grad=True)
    bias = torch.randn(9, dtype=dtype, requires_grad=True) if with_bias else None
    opcheck(torch.ops.adls.mxint8_linear.default, (x, mantissa, scale, bias, 16))


def test_gradcheck_wrt_input_and_bias():
    mantissa, scale = packed_weight(5, 32, 8, seed=4)
    x = torch.randn(3, 32, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: linear(a, mantissa, scale, b, 8), (x, bias))


def test_float32_gradient_is_grad_output_times_the_weight():
    mantissa, scale = packed_weight(7, 64, 32, seed=5)
    x = torch.randn(4, 64, requires_grad=True)
    grad_output = torch.randn(4, 7)
    linear(x, mantissa, scale, None, 32).backward(grad_output)
    torch.testing.assert_close(x.grad, grad_output @ dequantize(mantissa, scale, 32))


@pytest.mark.parametrize("name", IMPLEMENTATIONS)
@pytest.mark.parametrize(
    "x_shape, bias_shape, message",
    [
        ((2, 48), None, "must end in in_features=64"),
        ((2, 64), (5,), r"bias with shape \S+ must be \(out_features=6,\)"),
    ],
)
def test_bad_inputs_raise_one_clear_error(name, x_shape, bias_shape, message):
    mantissa, scale = packed_weight(6, 64, 32, seed=6)
    bias = torch.zeros(bias_shape) if bias_shape else None
    with pytest.raises(RuntimeError, match=message):
        IMPLEMENTATIONS[name](torch.zeros(x_shape), mantissa, scale, bias, 32)


def test_integer_input_is_rejected():
    mantissa, scale = packed_weight(6, 64, 32, seed=6)
    with pytest.raises(RuntimeError, match="x must be float32, bfloat16, float16 or float64"):
        linear(torch.zeros(2, 64, dtype=torch.int32), mantissa, scale, None, 32)


def test_qlinear_packed_takes_the_fused_route_for_few_rows_only():
    layer = QLinearPacked.from_linear(torch.nn.Linear(64, 10), group_size=32)
    few = torch.randn(2, FUSED_MAX_ROWS // 2, 64)
    many = torch.randn(FUSED_MAX_ROWS + 1, 64)
    assert layer.uses_fused_kernel(few) and not layer.uses_fused_kernel(many)
    assert not layer.uses_fused_kernel(few.bfloat16())
    weight = layer.dequantized_weight()
    for x in (few, many):
        expected, bound = exact_linear(
            x.reshape(-1, 64), layer.weight_mantissa, layer.weight_scale, layer.bias, 32
        )
        assert ((layer(x).reshape(-1, 10).double() - expected).abs() <= bound).all()
        torch.testing.assert_close(layer(x), F.linear(x, weight, layer.bias))


def test_qlinear_packed_trains_lora_style_on_the_fused_route():
    """Gradients reach the input and the bias through the fused op (a trainable pipeline over a packed base)."""
    layer = QLinearPacked.from_linear(torch.nn.Linear(64, 10), group_size=32)
    x = torch.randn(3, 64, requires_grad=True)
    assert layer.uses_fused_kernel(x)
    layer(x).sum().backward()
    torch.testing.assert_close(x.grad, layer.dequantized_weight().sum(0).expand(3, 64))
    torch.testing.assert_close(layer.bias.grad, torch.full((10,), 3.0))


def test_torch_compile_fullgraph():
    layer = QLinearPacked.from_linear(torch.nn.Linear(64, 16), group_size=32).eval()
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    x = torch.randn(4, 64)
    torch.testing.assert_close(compiled(x), layer(x), rtol=0, atol=0)


@pytest.mark.skipif(not native_linear_kernel_loaded(), reason="needs the compiled extension")
def test_native_kernel_serves_cpu():
    assert torch._C._dispatch_has_kernel_for_dispatch_key("adls::mxint8_linear", "CPU")


@pytest.mark.skipif(not native_linear_kernel_loaded(), reason="needs the compiled extension")
def test_native_autograd_serves_cpu_without_python():
    """The backward is registered in C++ for AutogradCPU/AutogradCUDA: the graph node is a C++ one, not the
    Python wrapper of torch.library.register_autograd (whose per-call cost this removes)."""
    mantissa, scale = packed_weight(6, 32, 16, seed=9)
    for key in ("AutogradCPU", "AutogradCUDA"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key("adls::mxint8_linear", key)
    y = linear(torch.randn(2, 32, requires_grad=True), mantissa, scale, None, 16)
    assert "PackedLinearFunction" in y.grad_fn.name()


@pytest.mark.skipif(
    not native_linear_kernel_loaded(), reason="the Python autograd already serves every test here"
)
def test_python_autograd_gives_the_same_gradients_without_the_extension():
    assert_passes_with_env(
        __file__, "gradcheck or gradient or opcheck or lora_style", {DISABLE_NATIVE_ENV: "1"}
    )


@pytest.mark.skipif(native_cpu_isa() != "avx2", reason="the portable loops already serve every test here")
def test_portable_fused_kernel_is_correct_too():
    assert_passes_with_portable_kernels(
        __file__, "reassociation or parallel_tasks or nan_group or long_rows or scale_code"
    )


@requires("gpu")
def test_cuda_linear_matches_the_exact_result():
    mantissa, scale = packed_weight(300, 512, 32, seed=8)
    x, bias = torch.randn(17, 512), torch.randn(300)
    expected, bound = exact_linear(x, mantissa, scale, bias, 32)
    result = linear(x.cuda(), mantissa.cuda(), scale.cuda(), bias.cuda(), 32).cpu()
    assert ((result.double() - expected).abs() <= bound).all()


CUDA_ROWS = [1, 2, 3, 4, 5, 8, 9, 16, 17, 64]


@requires("gpu")
@pytest.mark.parametrize("rows", CUDA_ROWS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cuda_fused_linear_every_row_tile_and_dtype(rows, dtype):
    """1-16 rows take the fused kernel (each row tile size), 17 and 64 the dequantize + cuBLAS route; both agree
    with the exact float64 result within float32 reassociation, then one rounding to ``dtype``."""
    mantissa, scale = packed_weight(203, 768, 32, seed=rows)
    x = torch.randn(rows, 768).to(dtype)
    bias = torch.randn(203)
    expected, bound = exact_linear(x.float(), mantissa, scale, bias, 32)
    result = linear(x.cuda(), mantissa.cuda(), scale.cuda(), bias.to(dtype).cuda(), 32).cpu()
    assert result.dtype == dtype
    # one rounding to dtype of the result, and (cuBLAS's route, with reduced-precision split-K reductions allowed by
    # default for 16-bit types) of partial sums, each at most half an ulp of the sum of magnitudes
    weight = dequantize(mantissa, scale, 32).double()  # exact in float32
    magnitude = x.double().abs() @ weight.abs().T + bias.double().abs()
    ulp = {torch.float32: 0.0, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}[dtype]
    bias_rounding = (bias.double() - bias.to(dtype).double()).abs()  # the bias is given in dtype
    assert ((result.double() - expected).abs() <= bound + 2 * ulp * magnitude + bias_rounding).all()


@requires("gpu")
@pytest.mark.parametrize(("in_features", "group_size"), [(40, 8), (24, 24), (100, 4), (64, 64)])
def test_cuda_fused_linear_odd_shapes_take_the_elementwise_kernel(in_features, group_size):
    mantissa, scale = packed_weight(7, in_features, group_size, seed=in_features)
    x = torch.randn(2, 3, in_features)
    expected, bound = exact_linear(x.reshape(6, -1), mantissa, scale, None, group_size)
    result = linear(x.cuda(), mantissa.cuda(), scale.cuda(), None, group_size).cpu()
    assert result.shape == (2, 3, 7)
    assert ((result.reshape(6, -1).double() - expected).abs() <= bound).all()


@requires("gpu")
def test_cuda_fused_linear_nan_group_empty_rows_and_misaligned_input():
    mantissa, scale = packed_weight(9, 64, 16, seed=3)
    scale[4, 2] = 0xFF  # a NaN group: feature 4 is NaN in every row, the others are not
    result = linear(torch.randn(3, 64).cuda(), mantissa.cuda(), scale.cuda(), None, 16).cpu()
    assert result[:, 4].isnan().all() and not result[:, [0, 1, 2, 3, 5, 6, 7, 8]].isnan().any()
    empty = linear(torch.randn(0, 64).cuda(), mantissa.cuda(), scale.cuda(), None, 16)
    assert empty.shape == (0, 9)
    # a view starting one float in: not 16-byte aligned, so the elementwise kernel serves it
    buffer = torch.randn(2 * 64 + 1)
    x = buffer[1:].view(2, 64)
    scale[4, 2] = 0
    expected, bound = exact_linear(x, mantissa, scale, None, 16)
    result = linear(buffer.cuda()[1:].view(2, 64), mantissa.cuda(), scale.cuda(), None, 16).cpu()
    assert ((result.double() - expected).abs() <= bound).all()


@requires("gpu")
@pytest.mark.parametrize("rows", [1, 8, 32])
def test_cuda_opcheck_and_gradients(rows):
    mantissa, scale = packed_weight(12, 64, 32, seed=rows)
    x = torch.randn(rows, 64, device="cuda", requires_grad=True)
    bias = torch.randn(12, device="cuda", requires_grad=True)
    opcheck(torch.ops.adls.mxint8_linear.default, (x, mantissa.cuda(), scale.cuda(), bias, 32))
    grad_output = torch.randn(rows, 12, device="cuda")
    linear(x, mantissa.cuda(), scale.cuda(), bias, 32).backward(grad_output)
    torch.testing.assert_close(x.grad, grad_output @ dequantize(mantissa.cuda(), scale.cuda(), 32))
    torch.testing.assert_close(bias.grad, grad_output.sum(0))
