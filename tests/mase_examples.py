"""The labs' (MASE's) quantize configs of ``tests/test_mase_configs.py`` and ``tests/test_chop_spelling.py``: TOML
texts written from the key lists of chop's quantize pass, and for each format a check that computes its values
another way (closed formulas, ``torch.float8_e4m3fn``, brute-force nearest grid points)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

HEADER = """# basics
model = "toy"
dataset = "toy-tiny"

[passes.quantize]
by = "type"
report = true

[passes.quantize.default.config]
"""


OPERANDS = ("data_in", "weight", "bias")


def toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    return repr(value)


def lab_toml(keys: dict | str) -> str:
    """A MASE quantize config file: the shared header, then the default layer config's keys (a dict or TOML)."""
    body = keys if isinstance(keys, str) else "\n".join(f"{k} = {toml_value(v)}" for k, v in keys.items())
    return HEADER + body.strip() + "\n"


def per_operand(operands=OPERANDS, **params) -> dict:
    """chop's per-operand keys: ``{operand}_{param}`` for each operand."""
    return {f"{operand}_{param}": value for operand in operands for param, value in params.items()}


# chop's example quantize configs, from its key list (QUANT_ARITH_ENTRIES) and example values
EXAMPLES = {
    "integer": {"name": "integer", **per_operand(width=8, frac_width=3)},
    "fixed": {"name": "fixed", **per_operand((*OPERANDS, "data_out"), width=8, frac_width=3), "floor": True},
    "block_fp": {
        "name": "block_fp",
        **per_operand(width=7, exponent_width=8, exponent_bias=127, block_size=[1, 16]),
        "data_in_skip_first_dim": True,
        "bias_block_size": [16],
    },
    "block_log": {"name": "block_log", **per_operand(width=8, exponent_bias_width=4, block_size=[16])},
    "block_minifloat": {
        "name": "block_minifloat",
        **per_operand(width=8, exponent_width=4, exponent_bias_width=8, block_size=[1, 16]),
        "bias_block_size": [16],
    },
    "log": {"name": "log", **per_operand(width=8, exponent_bias=128)},
    "minifloat_ieee": {"name": "minifloat_ieee", **per_operand(width=8, exponent_width=4, exponent_bias=7)},
    "minifloat_denorm": {
        "name": "minifloat_denorm",
        **per_operand(width=8, exponent_width=4, exponent_bias=7),
    },
    "ternary": {
        "name": "ternary",
        **per_operand(width=2, mean="NA", median="NA", max="NA"),
        "data_in_scaling_factor": True,
        "weight_scaling_factor": False,
        "bias_scaling_factor": False,
    },
    "binary": {"name": "binary", "weight_width": 1, "weight_stochastic": False, "weight_bipolar": True},
    # chop's TOML writes these booleans as 0/1 (to keep its arrays homogeneous)
    "binary_training": {
        "name": "binary",
        "binary_training": 1,
        **per_operand(stochastic=0, bipolar=1),
        "weight_width": 1,
    },
}


# --------------------------------------------------------------------------------------------------
# Expected values, computed without the project's quantizers
# --------------------------------------------------------------------------------------------------
def fixed_point(t: torch.Tensor, width: int, frac: int, floor: bool = False) -> torch.Tensor:
    scaled = t * 2.0**frac
    scaled = scaled.floor() if floor else scaled.round()
    return scaled.clamp(-(2 ** (width - 1)), 2 ** (width - 1) - 1) / 2.0**frac


def nearest_on_grid(t: torch.Tensor, magnitudes: torch.Tensor) -> torch.Tensor:
    """Distance from each element to the nearest signed grid point (brute force over every grid value)."""
    grid = torch.cat([-magnitudes, magnitudes])
    return (t.unsqueeze(-1) - grid).abs().min(dim=-1).values


def signs(t: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.signbit(t), -1.0, 1.0)


def check_integer(layer, x):
    expected = F.linear(fixed_point(x, 8, 3), fixed_point(layer.weight, 8, 3), fixed_point(layer.bias, 8, 3))
    assert torch.allclose(layer(x), expected, atol=1e-6)


def check_fixed(layer, x):
    inner = F.linear(
        fixed_point(x, 8, 3, True), fixed_point(layer.weight, 8, 3, True), fixed_point(layer.bias, 8, 3, True)
    )
    assert torch.allclose(layer(x), fixed_point(inner, 8, 3, True), atol=1e-6)  # data_out: output quantized


def check_minifloat_ieee(layer, x):
    # e4m3 with bias 7 is float8_e4m3fn below its 448 limit (the inputs here stay far below it)
    e4m3 = [t.to(torch.float8_e4m3fn).float() for t in (x, layer.weight, layer.bias)]
    assert torch.allclose(layer(x), F.linear(*e4m3), atol=1e-5)


def check_minifloat_denorm(layer, x):
    # no implicit leading 1: magnitudes k/8 * 2^E, k = 0..7, E = -7..8; each value goes to the nearest one
    grid = torch.tensor([k / 8 * 2.0**e for k in range(8) for e in range(-7, 9)])
    w, q = layer.weight, layer.weight_quantizer(layer.weight)
    assert torch.equal(nearest_on_grid(q, grid), torch.zeros_like(q))
    assert torch.allclose((w - q).abs(), nearest_on_grid(w, grid), atol=1e-9)


def check_log(layer, x):
    # sign + 7 exponent bits, bias 128: magnitudes 2^k for -128 < k <= -1, rounded in the log domain
    q = layer.weight_quantizer(layer.weight)
    nonzero = q != 0
    exponents = torch.log2(q[nonzero].abs())
    assert torch.equal(exponents, exponents.round()) and exponents.max() <= -1
    w = layer.weight[nonzero].abs()
    in_range = w <= 0.5
    assert (exponents - torch.log2(w))[in_range].abs().max() <= 0.5 + 1e-6
    assert torch.equal(exponents[~in_range], torch.full_like(exponents[~in_range], -1.0))  # saturates at 2^-1


def check_block_fp(layer, x):
    # per 16 consecutive weights of a row: one step 2^(floor(log2 max)+1-6), codes |k| <= 63, nearest
    w = layer.weight.reshape(-1, 16)
    q = layer.weight_quantizer(layer.weight).reshape(-1, 16)
    step = 2.0 ** (torch.floor(torch.log2(w.abs().amax(dim=1, keepdim=True))) + 1 - 6)
    codes = q / step
    assert torch.equal(codes, codes.round()) and codes.abs().max() <= 63
    assert ((w - q).abs() <= step / 2 + 1e-9).all()


def check_block_minifloat(layer, x):
    # 3 mantissa bits: relative error <= 2^-4 for values in the block's normal range
    w, q = layer.weight, layer.weight_quantizer(layer.weight)
    big = w.abs() >= 2.0**-19
    assert ((w - q).abs()[big] <= w.abs()[big] * 2.0**-4 + 1e-12).all()
    assert not torch.equal(w, q)


def check_block_log(layer, x):
    q = layer.weight_quantizer(layer.weight)
    exponents = torch.log2(q[q != 0].abs())
    assert torch.equal(exponents, exponents.round())  # powers of two only
    assert (exponents - torch.log2(layer.weight[q != 0].abs())).abs().max() <= 0.5 + 1e-6


def check_ternary(layer, x):
    w, q = layer.weight, layer.weight_quantizer(layer.weight)
    kept = w.abs() > 0.75 * w.abs().mean()  # TWN threshold; no scaling factor for weights: codes -1, 0, 1
    assert torch.equal(q, torch.where(kept, signs(w), torch.zeros_like(w)))
    # chop's ternary layer quantizes only the weight: the data_in/bias keys chop's file gives are ignored (noted)
    assert layer.data_in_quantizer is None and layer.bias_quantizer is None


def check_binary(layer, x):
    assert (
        layer.data_in_quantizer is None and layer.bias_quantizer is None
    )  # MASE's LinearBinary: weight only
    assert torch.allclose(layer(x), F.linear(x, signs(layer.weight), layer.bias), atol=1e-6)


def check_binary_training(layer, x):
    expected = F.linear(signs(x), signs(layer.weight), signs(layer.bias))  # binary_training: every operand
    assert torch.allclose(layer(x), expected, atol=1e-6)


CHECKS = {
    "integer": check_integer,
    "fixed": check_fixed,
    "block_fp": check_block_fp,
    "block_log": check_block_log,
    "block_minifloat": check_block_minifloat,
    "log": check_log,
    "minifloat_ieee": check_minifloat_ieee,
    "minifloat_denorm": check_minifloat_denorm,
    "ternary": check_ternary,
    "binary": check_binary,
    "binary_training": check_binary_training,
}
