"""Numerics of every quantization format against independent references.

References used here, none of which shares code with ``adls_lightning.quant``:

* hand-derived tables (ties, saturation, powers of two);
* a brute-force codebook: every representable value of the format is enumerated in float64 and each
  input is mapped to the nearest one (in the log domain for log formats);
* PyTorch's own float8/bfloat16/float16 casts for the IEEE-style minifloat.
"""

from __future__ import annotations

import math

import pytest
import torch

from adls_lightning.errors import ConfigError
from adls_lightning.quant import QUANTIZERS, make_quantizer
from tests.helpers import FORMAT_PARAMS

NAN, INF = float("nan"), float("inf")


# --------------------------------------------------------------------------------------------------
# Independent references
# --------------------------------------------------------------------------------------------------
def nearest_in(codebook: list[float], x: torch.Tensor) -> torch.Tensor:
    """Nearest codebook value for each element of ``x`` (float64 distances; inputs avoid exact ties)."""
    book = torch.tensor(sorted(set(codebook)), dtype=torch.float64)
    flat = x.double().reshape(-1)
    idx = torch.searchsorted(book, flat).clamp(1, len(book) - 1)
    lo, hi = book[idx - 1], book[idx]
    pick = torch.where((flat - lo).abs() <= (hi - flat).abs(), lo, hi)
    pick = torch.where(flat <= book[0], book[0], torch.where(flat >= book[-1], book[-1], pick))
    return pick.reshape(x.shape)


def integer_book(w: int, f: int) -> list[float]:
    return [k / 2**f for k in range(-(2 ** (w - 1)), 2 ** (w - 1))]


def minifloat_ieee_book(w: int, e: int, bias: int) -> list[float]:
    m = w - e - 1
    values = []
    for code in range(2**e):
        for k in range(2**m):
            v = 2.0 ** (1 - bias) * k / 2**m if code == 0 else 2.0 ** (code - bias) * (1 + k / 2**m)
            values += [v, -v]
    return values


def minifloat_denorm_book(w: int, e: int, bias: int) -> list[float]:
    m = w - e - 1
    values = []
    for exponent in range(-bias, 2**e - bias):
        for k in range(2**m):
            v = 2.0**exponent * k / 2**m
            values += [v, -v]
    return values


def log_reference(x: torch.Tensor, zero_exponent: int, max_exponent: int) -> torch.Tensor:
    """Nearest of {0} U {+-2^k : zero_exponent < k <= max_exponent} in the log domain (code zero_exponent = 0)."""
    out = []
    for v in x.double().reshape(-1).tolist():
        if v == 0:
            out.append(0.0)
            continue
        exps = range(zero_exponent, max_exponent + 1)
        k = min(exps, key=lambda k: abs(math.log2(abs(v)) - k))
        out.append(0.0 if k == zero_exponent else math.copysign(2.0**k, v))
    return torch.tensor(out, dtype=torch.float64).reshape(x.shape)


def block_reference(x: torch.Tensor, block: int, per_block) -> torch.Tensor:
    """Apply ``per_block(values: list[float]) -> list[float]`` to each block along the last dim."""
    rows = x.double().reshape(-1, x.shape[-1])
    out = torch.empty_like(rows)
    for r in range(rows.shape[0]):
        for start in range(0, rows.shape[1], block):
            chunk = rows[r, start : start + block]
            out[r, start : start + block] = torch.tensor(per_block(chunk.tolist()), dtype=torch.float64)
    return out.reshape(x.shape)


def floor_log2(v: float) -> int:
    return math.floor(math.log2(v))


def sample(n: int = 4000, seed: int = 0) -> torch.Tensor:
    """Values over many binades (signed, log-uniform magnitudes 2^-14 .. 2^10), plus exact zeros."""
    g = torch.Generator().manual_seed(seed)
    mags = torch.exp2(torch.empty(n).uniform_(-14, 10, generator=g))
    signs = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0)
    x = (mags * signs).float()
    x[::97] = 0.0
    return x


# --------------------------------------------------------------------------------------------------
# Hand tables (ties go to even; saturation; exact powers of two)
# --------------------------------------------------------------------------------------------------
HAND_TABLES = [
    # integer 8.4: step 1/16, range [-8, 7.9375]; 0.5 and 1.5 steps tie to the even step
    (("integer", {"width": 8, "frac_width": 4}), [1 / 32, 3 / 32, -1 / 32, 0.1, 7.96, 100.0, -8.03, -100.0],
     [0.0, 0.125, 0.0, 0.125, 7.9375, 7.9375, -8.0, -8.0]),
    # integer 4.2 (Lab 1's int4): step 0.25, range [-2, 1.75]
    (("integer", {"width": 4, "frac_width": 2}), [0.3, 0.375, 0.625, 1.9, -2.2, -0.125], [0.25, 0.5, 0.5, 1.75, -2.0, -0.0]),
    # floor mode rounds towards -inf
    (("integer", {"width": 8, "frac_width": 4, "floor": True}), [0.1, -0.1, 0.0625], [0.0625, -0.125, 0.0625]),
    # e4m3, bias 7: 1.0625 ties between 1.0 and 1.125 -> 1.0 (even mantissa); 100 -> 96 (tie at 100? no:
    # step 8 in [64, 128): 100/8 = 12.5 ties -> 12 -> 96); subnormal step 2^-9; max 480 (no NaN code)
    (("minifloat_ieee", {"width": 8, "exponent_width": 4, "exponent_bias": 7}),
     [1.0625, 1.1875, 100.0, 2.0**-9 * 1.5, 2.0**-10, 500.0, 2.0**-6],
     [1.0, 1.25, 96.0, 2.0**-8, 0.0, 480.0, 2.0**-6]),
    # denorm 8/4/7: 3 mantissa bits, no implicit 1; 1.0 is exact (MASE clamps it to 0.875); max 7 * 2^5 = 224;
    # the lowest exponent -7 gives the fixed step 2^-10 (2.5 steps tie to 2, half a step ties to 0)
    (("minifloat_denorm", {"width": 8, "exponent_width": 4, "exponent_bias": 7}),
     [1.0, 0.999, 3.0, 1000.0, 2.0**-10 * 2.5, 2.0**-11, 2.0**-10 * 3],
     [1.0, 1.0, 3.0, 224.0, 2.0**-10 * 2, 0.0, 2.0**-10 * 3]),
    # log 4-bit, bias 3: codes -3 (zero) .. 4; 2^1.4 -> 2, 2^1.6 -> 4, 2^-2.6 -> 0 (rounds to the zero code)
    (("log", {"width": 4, "exponent_bias": 3}),
     [2**1.4, 2**1.6, -(2**-1.2), 2**-2.4, 2**-2.6, 1e6, 0.0],
     [2.0, 4.0, -0.5, 0.25, 0.0, 16.0, 0.0]),
    # block fp, 4 bits (3 magnitude bits), blocks of 4: block max 1.0 -> exponent 1, step 1/4
    (("block_fp", {"width": 4, "exponent_width": 8, "block_size": 4}),
     [1.0, 0.3, -0.125, 0.2, 0.0, 0.0, 0.0, 0.0], [1.0, 0.25, -0.0, 0.25, 0.0, 0.0, 0.0, 0.0]),
    (("binary", {}), [0.3, -0.2, 0.0, -0.0, 5.0], [1.0, -1.0, 1.0, -1.0, 1.0]),
    # per-row scale = mean |x| = 0.5
    (("binary_scaling", {}), [0.25, -0.75, 0.5, -0.5], [0.5, -0.5, 0.5, -0.5]),
    # mean |x| = 0.5, delta = 0.375: kept 1.0 and -0.5 (mean 0.75); 0.25 and -0.25 -> 0
    (("ternary", {}), [1.0, -0.5, 0.25, -0.25], [0.75, -0.75, 0.0, -0.0]),
    # mxint8, groups of 4: amax 1.5 -> scale 2^0, step 2^-6
    (("mxint8", {"block_size": 4}), [1.5, 0.01, -0.3, 1 / 128], [1.5, 1 / 64, -0.296875, 0.0]),
]  # fmt: skip


@pytest.mark.parametrize(("spec", "inputs", "expected"), HAND_TABLES, ids=[t[0][0] for t in HAND_TABLES])
def test_hand_table(spec, inputs, expected):
    name, params = spec
    q = make_quantizer(name, **params)
    out = q(torch.tensor(inputs))
    assert out.tolist() == expected


# --------------------------------------------------------------------------------------------------
# Brute-force codebook references over many binades
# --------------------------------------------------------------------------------------------------
ELEMENTWISE_CASES = [
    ("integer", {"width": 4, "frac_width": 2}, lambda: integer_book(4, 2)),
    ("integer", {"width": 8, "frac_width": 4}, lambda: integer_book(8, 4)),
    ("integer", {"width": 12, "frac_width": 6}, lambda: integer_book(12, 6)),
    ("integer", {"width": 6, "frac_width": 0}, lambda: integer_book(6, 0)),
    ("minifloat_ieee", {"width": 8, "exponent_width": 4}, lambda: minifloat_ieee_book(8, 4, 7)),
    ("minifloat_ieee", {"width": 6, "exponent_width": 3, "exponent_bias": 1}, lambda: minifloat_ieee_book(6, 3, 1)),
    ("minifloat_ieee", {"width": 5, "exponent_width": 4, "exponent_bias": 12}, lambda: minifloat_ieee_book(5, 4, 12)),
    ("minifloat_denorm", {"width": 8, "exponent_width": 4}, lambda: minifloat_denorm_book(8, 4, 7)),
    ("minifloat_denorm", {"width": 7, "exponent_width": 3, "exponent_bias": 6}, lambda: minifloat_denorm_book(7, 3, 6)),
]  # fmt: skip


@pytest.mark.parametrize(("name", "params", "book"), ELEMENTWISE_CASES)
def test_elementwise_formats_match_brute_force_codebook(name, params, book):
    x = sample()
    expected = nearest_in(book(), x)
    assert torch.equal(make_quantizer(name, **params)(x).double(), expected)


@pytest.mark.parametrize(("width", "bias"), [(8, None), (5, 4), (4, 0), (8, 128)])
def test_log_matches_log_domain_nearest(width, bias):
    x = sample()
    b = 2 ** (width - 2) - 1 if bias is None else bias
    params = {"width": width} | ({} if bias is None else {"exponent_bias": bias})
    expected = log_reference(x, -b, 2 ** (width - 1) - 1 - b)
    if b > 126:  # powers of two below 2^-126 are float32 subnormals, documented to flush to 0
        expected = torch.where(expected.abs() < 2.0**-126, 0.0, expected)
    assert torch.equal(make_quantizer("log", **params)(x).double(), expected)


@pytest.mark.parametrize(
    ("width", "exponent_width", "bias"), [(8, 4, 7), (8, 5, 15), (16, 8, 127), (16, 5, 15)]
)
def test_minifloat_ieee_agrees_with_torch_casts(width, exponent_width, bias):
    """Within a torch dtype's finite range, the minifloat with its layout is that dtype (RNE, subnormals)."""
    dtype = {
        (8, 4): torch.float8_e4m3fn,
        (8, 5): torch.float8_e5m2,
        (16, 8): torch.bfloat16,
        (16, 5): torch.float16,
    }
    target = dtype[(width, exponent_width)]
    x = sample(20000, seed=3) * torch.exp2(torch.randint(-20, 6, (20000,))).float()
    x = x[x.abs() <= torch.finfo(target).max]
    q = make_quantizer("minifloat_ieee", width=width, exponent_width=exponent_width, exponent_bias=bias)
    assert torch.equal(q(x), x.to(target).float())


def _block_fp_block(width: int, exponent_width: int, bias: int):
    def per_block(values: list[float]) -> list[float]:
        amax = max(abs(v) for v in values)
        if amax == 0:
            return [0.0] * len(values)
        shared = min(max(floor_log2(amax) + 1, -bias), 2**exponent_width - 1 - bias)
        step = 2.0 ** (shared - width + 1)
        top = 2 ** (width - 1) - 1
        book = [k * step for k in range(-top, top + 1)]
        return nearest_in(book, torch.tensor(values, dtype=torch.float64)).tolist()

    return per_block


def _block_minifloat_block(width: int, exponent_width: int, bias_width: int):
    def per_block(values: list[float]) -> list[float]:
        amax = max(abs(v) for v in values)
        if amax == 0:
            return [0.0] * len(values)
        bias = min(max(2**exponent_width - 1 - floor_log2(amax), 0), 2**bias_width - 1)
        book = minifloat_ieee_book(width, exponent_width, bias)
        return nearest_in(book, torch.tensor(values, dtype=torch.float64)).tolist()

    return per_block


def _block_log_block(width: int, bias_width: int):
    def per_block(values: list[float]) -> list[float]:
        amax = max(abs(v) for v in values)
        if amax == 0:
            return [0.0] * len(values)
        top = 2 ** (width - 1) - 1
        bias = min(max(top - round(math.log2(amax)), 0), 2**bias_width - 1)
        return log_reference(torch.tensor(values), -bias, top - bias).tolist()

    return per_block


BLOCK_CASES = [
    ("block_fp", {"width": 7, "exponent_width": 8, "exponent_bias": 127, "block_size": 16}, _block_fp_block(7, 8, 127)),
    ("block_fp", {"width": 4, "exponent_width": 3, "block_size": 8}, _block_fp_block(4, 3, 3)),
    ("block_minifloat", {"width": 8, "exponent_width": 4, "exponent_bias_width": 8, "block_size": 16},
     _block_minifloat_block(8, 4, 8)),
    ("block_minifloat", {"width": 6, "exponent_width": 2, "exponent_bias_width": 4, "block_size": 8},
     _block_minifloat_block(6, 2, 4)),
    ("block_log", {"width": 8, "exponent_bias_width": 4, "block_size": 16}, _block_log_block(8, 4)),
    ("block_log", {"width": 4, "exponent_bias_width": 5, "block_size": 8}, _block_log_block(4, 5)),
]  # fmt: skip


@pytest.mark.parametrize(
    ("name", "params", "per_block"), BLOCK_CASES, ids=lambda v: v if isinstance(v, str) else ""
)
def test_block_formats_match_per_block_reference(name, params, per_block):
    g = torch.Generator().manual_seed(1)
    # rows at very different scales so the shared exponent and its clamps vary between blocks
    x = torch.randn(24, 48, generator=g) * torch.exp2(torch.arange(24) - 16.0).unsqueeze(1)
    x[3, :16] = 0.0  # an all-zero block
    expected = block_reference(x, params["block_size"], per_block)
    assert torch.equal(make_quantizer(name, **params)(x).double(), expected)


def test_block_formats_zero_pad_a_partial_last_block():
    x = torch.randn(5, 20)
    for name, params, _ in BLOCK_CASES[:1] + BLOCK_CASES[2:3] + BLOCK_CASES[4:5]:
        q = make_quantizer(name, **params)
        padded = torch.nn.functional.pad(x, (0, 12))
        assert torch.equal(q(x), q(padded)[:, :20]), name


@pytest.mark.parametrize("index", [0, 2, 4])
def test_block_formats_at_the_edges_of_float32(index):
    """Blocks of tiny (float32-subnormal) and huge values quantize to finite values, idempotently."""
    name, params, _ = BLOCK_CASES[index]
    q = make_quantizer(name, **params)
    x = torch.randn(3, 32)
    x[0] *= 2.0**-140
    x[1] *= 2.0**-120
    x[2] *= 2.0**120
    out = q(x)
    assert torch.isfinite(out).all() and torch.equal(q(out), out)
    assert torch.all((out == 0) | (torch.sign(out) == torch.sign(x)))
    amax = x[2].abs().max()
    if name == "block_minifloat":  # the shared bias is unsigned: ranges top out at 2^(2^e - 1) * (2 - 2^-m)
        assert out[2].abs().max() == 2.0**15 * 1.875
    else:  # huge blocks keep their scale (log rounding errs by up to ~41%)
        assert (out[2] - x[2]).abs().max() <= 0.5 * amax and out[2].abs().max() >= 0.5 * amax


def test_mxint8_is_the_projects_format_definition():
    from adls_lightning.mxint8.format import dequantize_reference, quantize_reference

    x = torch.randn(7, 64) * torch.exp2(torch.randint(-10, 10, (7, 1)).float())
    expected = dequantize_reference(*quantize_reference(x, 32), 32, torch.float32)
    assert torch.equal(make_quantizer("mxint8")(x), expected)
    # the floor(log2 amax) scale: amax 1.0 gives steps of 2^-6, 127 * 2^-6 is the largest element
    row = torch.tensor([[1.0] + [0.0] * 31])
    assert make_quantizer("mxint8")(row)[0, 0] == 1.0


# --------------------------------------------------------------------------------------------------
# Properties every format must have
# --------------------------------------------------------------------------------------------------
CANNOT_REPRESENT_ZERO = {name for name, cls in QUANTIZERS.items() if not cls.zero_representable}


def test_every_registered_format_is_tested():
    assert set(FORMAT_PARAMS) == set(QUANTIZERS)


def _quantizer(name):
    q = make_quantizer(name, **FORMAT_PARAMS[name])
    if name == "binary_residual":  # fixed, decreasing scales so idempotence is well defined
        q.scales.data = torch.tensor([0.5, 0.25])
        q.initialized.fill_(True)
    return q


@pytest.mark.parametrize("name", sorted(FORMAT_PARAMS))
def test_idempotent(name):
    q = _quantizer(name)
    x = torch.randn(6, 64) * 3
    once = q(x)
    if name in ("binary_scaling", "ternary", "scaled_integer"):
        # the scale is a float32 mean (scaled_integer: a running range the second call updates) of equal magnitudes, which can differ from them in the last bit
        torch.testing.assert_close(q(once), once, rtol=1e-6, atol=0)
    else:
        assert torch.equal(q(once), once)


@pytest.mark.parametrize("name", sorted(FORMAT_PARAMS))
def test_any_rank_and_shape(name):
    """1-D, 2-D and 3-D inputs quantize like their rows (blocks run along the last dimension)."""
    q = _quantizer(name)
    x3 = torch.randn(2, 3, 64)
    out3 = q(x3)
    assert out3.shape == x3.shape
    if name in (
        "ternary",
        "scaled_integer",
    ):  # per-tensor statistics: compare the same tensor reshaped instead
        assert torch.equal(q(x3.reshape(6, 64)).reshape(2, 3, 64), out3)
        return
    rows = torch.stack([q(row) for row in x3.reshape(6, 64)]).reshape(2, 3, 64)
    assert torch.equal(rows, out3)


@pytest.mark.parametrize("name", sorted(FORMAT_PARAMS))
def test_zero_maps_to_zero_where_representable(name):
    q = _quantizer(name)
    x = torch.randn(4, 64)
    x[:, ::3] = 0.0  # pruned weights: exact zeros scattered among nonzero values
    x[1] = 0.0  # and an all-zero row (all-zero blocks)
    out = q(x)
    if name in CANNOT_REPRESENT_ZERO:
        if name == "binary_scaling":  # an all-zero row has scale mean|x| = 0
            assert torch.all(out[1] == 0)
            x, out = x[[0, 2, 3]], out[[0, 2, 3]]
        assert torch.count_nonzero(out[x == 0]) == int((x == 0).sum()), "documented: no zero code"
    else:
        assert torch.all(out[x == 0] == 0)
        assert torch.all(out[1] == 0)


@pytest.mark.parametrize("name", sorted(FORMAT_PARAMS))
def test_nan_and_inf(name):
    """Documented rules: NaN stays NaN; elementwise formats saturate inf to their max; block and
    statistics-based formats turn the block (row, tensor) holding a non-finite value into NaN."""
    q = _quantizer(name)
    clean = torch.randn(3, 32)
    x = clean.clone()
    x[0, 5] = NAN
    x[1, 7] = INF
    x[2, 9] = -INF
    out = q(x)
    assert torch.isnan(out[0, 5])
    if name in ("block_fp", "block_minifloat", "block_log", "mxint8"):
        block = FORMAT_PARAMS[name].get("block_size", 32)
        for row, col in ((0, 5), (1, 7), (2, 9)) if name == "mxint8" else ((0, 5),):
            start = col // block * block
            assert torch.isnan(out[row, start : start + block]).all()
        if name != "mxint8":  # an inf saturates: the block's exponent is the largest, others round to ~0
            assert out[1, 7] > 0 and out[2, 9] < 0 and torch.isfinite(out[1:]).all()
    elif name in ("ternary", "scaled_integer"):  # a per-tensor statistic that is not finite
        assert torch.isnan(out).all()
    elif name == "binary_scaling":
        assert torch.isnan(out).all()  # every row holds a non-finite value
    else:
        big = q(torch.tensor([1e30, -1e30]))
        assert out[1, 7] == big[0] and out[2, 9] == big[1]
        assert torch.isfinite(out[1:]).all()
        others = torch.ones_like(out, dtype=torch.bool)
        others[0, 5] = False
        assert not torch.isnan(out[others]).any()


def test_integer_range_limits():
    q = make_quantizer("integer", width=8, frac_width=4)
    assert q(torch.tensor([1e9, -1e9])).tolist() == [127 / 16, -8.0]
    q32 = make_quantizer("integer", width=32, frac_width=16)
    x = torch.randn(1000) * 100
    assert torch.equal(q32(x), torch.round(x * 65536) / 65536)  # everything in range, float32 exact


def test_minifloat_and_log_range_limits():
    e4m3 = make_quantizer("minifloat_ieee", width=8, exponent_width=4, exponent_bias=7)
    assert e4m3(torch.tensor([1e9, 2.0**-9, 2.0**-9 * 0.49])).tolist() == [480.0, 2.0**-9, 0.0]
    log8 = make_quantizer("log", width=8)  # bias 63: codes 2^-62 .. 2^64, 2^-63 is zero
    assert log8(torch.tensor([1e30, 2.0**-62, 2.0**-62.6])).tolist() == [2.0**64, 2.0**-62, 0.0]


# --------------------------------------------------------------------------------------------------
# Gradients (straight-through estimators)
# --------------------------------------------------------------------------------------------------
CLIPPING = {
    # name -> (input beyond the range, input inside it)
    "integer": (20.0, 3.0),
    "minifloat_ieee": (1000.0, 3.0),
    "minifloat_denorm": (1000.0, 3.0),
    "log": (2.0**70, 3.0),
    "binary": (2.0, 0.5),
    "binary_scaling": (2.0, 0.5),
}


@pytest.mark.parametrize("name", sorted(FORMAT_PARAMS))
def test_gradient_flows(name):
    q = _quantizer(name)
    x = (torch.randn(4, 64) * 0.5).requires_grad_(True)
    upstream = torch.randn(4, 64)
    q(x).backward(upstream)
    assert x.grad is not None and torch.isfinite(x.grad).all()
    if name not in CLIPPING:  # plain STE: identity
        assert torch.equal(x.grad, upstream)
    if name == "binary_residual":
        assert q.scales.grad is not None and torch.count_nonzero(q.scales.grad) == 2


@pytest.mark.parametrize("name", sorted(CLIPPING))
def test_clipping_aware_gradient(name):
    outside, inside = CLIPPING[name]
    q = _quantizer(name)
    x = torch.tensor([inside, -inside, outside, -outside] * 8, requires_grad=True)
    q(x).sum().backward()
    assert x.grad.tolist() == [1.0, 1.0, 0.0, 0.0] * 8


def test_integer_gradient_mask_matches_torch_fused_fake_quant():
    x = (torch.randn(5000) * 6).requires_grad_(True)
    ref = x.detach().clone().requires_grad_(True)
    upstream = torch.randn(5000)
    make_quantizer("integer", width=6, frac_width=3)(x).backward(upstream)
    torch.fake_quantize_per_tensor_affine(ref, 2.0**-3, 0, -32, 31).backward(upstream)
    assert torch.equal(x.grad, ref.grad)
    assert torch.equal(
        make_quantizer("integer", width=6, frac_width=3)(x.detach()),
        torch.fake_quantize_per_tensor_affine(x.detach(), 2.0**-3, 0, -32, 31),
    )


def test_stochastic_binary_is_random_in_training_and_deterministic_in_eval():
    q = make_quantizer("binary", stochastic=True)
    x = torch.full((20000,), 0.5)  # P(+1) = 0.75
    torch.manual_seed(0)
    frac_pos = (q.train()(x) > 0).float().mean().item()
    assert 0.73 < frac_pos < 0.77
    assert torch.equal(q.eval()(x), torch.ones(20000))


def test_binary_residual_scales_are_learned_and_initialised_from_data():
    q = make_quantizer("binary_residual", levels=2)
    x = torch.randn(8, 64)
    q(x)
    assert bool(q.initialized)
    first = x.abs().mean()
    assert torch.isclose(q.scales[0], first)
    residual = x - torch.where(x >= 0, first, -first)
    assert torch.isclose(q.scales[1], residual.abs().mean())
    state = q.state_dict()
    fresh = make_quantizer("binary_residual", levels=2)
    fresh.load_state_dict(state)
    assert torch.equal(fresh(x), q(x))  # restored scales are used, not re-initialised


def test_low_precision_inputs_keep_their_dtype():
    x = torch.randn(4, 64)
    for name in FORMAT_PARAMS:
        q = _quantizer(name)
        out = q(x.bfloat16())
        assert out.dtype == torch.bfloat16, name
        assert torch.equal(out, q(x.bfloat16().float()).bfloat16()), name


# --------------------------------------------------------------------------------------------------
# Bad parameters: one ConfigError naming the parameter
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("name", "params", "message"),
    [
        ("integer", {"width": 0}, "width=0: must be an integer in [1, 32]"),
        ("integer", {"width": 8, "frac_width": 65}, "frac_width=65: must be an integer in [0, 8]"),
        ("integer", {"width": 8.5}, "width=8.5"),
        ("integer", {"frac_width": 2}, "width: missing"),
        ("integer", {"width": 8, "widht": 8}, "widht: not a parameter of format 'integer'"),
        ("nonsense", {}, "name='nonsense': unknown quantization format"),
        ("minifloat_ieee", {"width": 4, "exponent_width": 4}, "exponent_width=4"),
        ("minifloat_ieee", {"width": 8, "exponent_width": 4, "exponent_bias": -130}, "exponent_bias=-130"),
        ("log", {"width": 8, "exponent_bias": 300}, "exponent_bias=300"),
        ("block_fp", {"width": 8, "exponent_width": 8, "block_size": 0}, "block_size=0"),
        ("block_fp", {"width": 8, "exponent_width": 8, "block_size": [4, 16]}, "block_size=[4, 16]"),
        ("binary", {"bipolar": False}, "bipolar=False: only bipolar"),
        ("ternary", {"mean": -0.3}, "mean=-0.3: must be a number >= 0"),
        ("ternary", {"max": "big"}, "max='big': must be a number >= 0"),
        ("mxint8", {"width": 4}, "width=4: must be an integer in [8, 8]"),
    ],
)
def test_bad_parameters_raise_config_error_naming_the_key(name, params, message):
    with pytest.raises(ConfigError) as info:
        make_quantizer(name, **params)
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_mase_block_size_lists_are_accepted():
    assert make_quantizer("block_fp", width=8, exponent_width=8, block_size=[1, 16]).block_size == 16
    assert make_quantizer("mxint8", block_size=[32]).block_size == 32


def test_block_fp_8_8_127_32_is_mxint8():
    """Two implementations of one format: MXINT8 (int8 elements x 2^-6, E8M0 scale floor(log2 amax)) is block
    floating point with 8-bit elements, an 8-bit shared exponent of bias 127 and blocks of 32
    (step 2^(floor(log2 amax) + 1 - 7) in both)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 256, generator=gen)
    x *= (
        torch.exp2(torch.randint(-60, 61, (64, 8, 1), generator=gen).float())
        .repeat_interleave(32, 1)
        .view(64, 256)
    )
    x[0, :32] = 0.0  # an all-zero block
    x[1, 5] = float("nan")  # a NaN block
    x[2, :32] = torch.exp2(torch.arange(32.0) - 16)  # exact powers of two, block max one of them
    block_fp = make_quantizer("block_fp", width=8, exponent_width=8, exponent_bias=127, block_size=32)
    mxint8 = make_quantizer("mxint8", block_size=32)
    torch.testing.assert_close(block_fp(x), mxint8(x), rtol=0, atol=0, equal_nan=True)
    assert block_fp.bits_per_element(256) == mxint8.bits_per_element(256) == 8.25
