"""GPTQ (Frantar et al. 2022): one-shot weight quantization that corrects each column's rounding error on the columns
still to come, weighted by the inverse Hessian of the layer's squared output error, ``H = 2 X Xᵀ / n``.

For a layer ``W`` (out × in) and calibration inputs ``X`` (in × n tokens), columns are quantized in order (``act_order``:
largest ``diag(H)`` first); after column ``i`` is rounded, its error divided by ``[H⁻¹]ᵢᵢ`` is spread over the
remaining columns along row ``i`` of the upper Cholesky factor of ``H⁻¹`` (the paper's Algorithm 1, with its lazy
block updates of ``block_size`` columns and its damping ``λ = damp · mean(diag H)``). Inputs that never fire
(``Hᵢᵢ = 0``) get zero weights.

The rounding is the layer's own weight quantizer, used column by column: a ``scaled_integer`` quantizer's steps are
fixed first from the layer's weights (one per tensor, output channel or group: AutoGPTQ's "static groups", which
keeps act_order and groups compatible) and installed in it afterwards (``fix``), so the model computes with exactly
the codes GPTQ chose; any other format whose rounding is elementwise (``integer``, minifloats, ``log``) rounds each
column as it rounds a tensor. Block formats with shared exponents are refused.

The Hessians come from one pass of the calibration batches through the model as it is (every layer's input as the
full-precision model computes it), not from re-running each block on the already quantized ones as the paper does.
The Hessians, the inverse's Cholesky factor and the column sweep are :mod:`adls_lightning.obs`'s, shared with
SparseGPT.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from adls_lightning.errors import ConfigError
from adls_lightning.obs import dead_inputs_removed, input_statistics, inverse_cholesky, obs_sweep
from adls_lightning.quant.linear import QuantLinear
from adls_lightning.quant.scaled import ScaledIntegerQuantizer
from adls_lightning.quant.transform import find_linear_layers

#: formats whose rounding is elementwise: a column rounds as it would inside the whole tensor
ELEMENTWISE_FORMATS = ("integer", "minifloat_ieee", "minifloat_denorm", "log")


@dataclass(frozen=True)
class GPTQConfig:
    """``quant.gptq``: calibration ``batches``, ``damp`` (fraction of the mean Hessian diagonal added), ``act_order``,
    ``block_size`` (columns per lazy update)."""

    batches: int = 16
    damp: float = 0.01
    act_order: bool = True
    block_size: int = 128

    def __post_init__(self) -> None:
        for name, low in (("batches", 1), ("block_size", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ConfigError(f"quant.gptq.{name}={value!r}: must be an integer >= {low}")
        if isinstance(self.damp, bool) or not isinstance(self.damp, int | float) or not 0 < self.damp < 1:
            raise ConfigError(f"quant.gptq.damp={self.damp!r}: must be a number in (0, 1), e.g. 0.01")
        if not isinstance(self.act_order, bool):
            raise ConfigError(f"quant.gptq.act_order={self.act_order!r}: must be true or false")


def column_rounding(quantizer: nn.Module, weight: Tensor) -> Callable[[Tensor, int], Tensor]:
    """``round(column, index)``: the quantizer's rounding of one weight column (its steps fixed from ``weight``)."""
    if isinstance(quantizer, ScaledIntegerQuantizer):
        scale, zero = quantizer.grid(weight)
        quantizer.fix(scale, zero)
        out = weight.shape[0]
        if quantizer.granularity == "group":
            scale, zero = scale.view(out, -1), zero.view(out, -1)
            group = quantizer.group_size
        elif quantizer.granularity in ("channel", "token"):
            scale, zero, group = scale.view(out, 1), zero.view(out, 1), weight.shape[1]
        else:
            scale, zero, group = (
                scale.expand(out).view(out, 1),
                zero.expand(out).view(out, 1),
                weight.shape[1],
            )

        def round_scaled(column: Tensor, index: int) -> Tensor:
            s, z = scale[:, index // group], zero[:, index // group]
            codes = (torch.round(column / s) + z).clamp(quantizer.qmin, quantizer.qmax)
            return (codes - z) * s

        return round_scaled
    if getattr(quantizer, "format_name", None) in ELEMENTWISE_FORMATS:
        return lambda column, index: quantizer.quantize(column, need_mask=False)[0]
    raise ConfigError(
        f"quant.gptq: format {getattr(quantizer, 'format_name', type(quantizer).__name__)!r} does not round "
        f"elementwise; GPTQ takes scaled_integer or {', '.join(ELEMENTWISE_FORMATS)}"
    )


@torch.no_grad()
def gptq_weight(
    weight: Tensor, hessian: Tensor, round_column: Callable[[Tensor, int], Tensor], config: GPTQConfig
) -> Tensor:
    """The GPTQ-quantized ``weight`` (out × in) for ``hessian`` (in × in, ``2 X Xᵀ / n``)."""
    w, h = dead_inputs_removed(weight, hessian)
    columns = w.shape[1]
    order = torch.argsort(h.diagonal(), descending=True) if config.act_order else torch.arange(columns)
    w, h = w[:, order], h[order][:, order]
    upper = inverse_cholesky(h, config.damp)

    def rounded(block: Tensor, u: Tensor, i: int, start: int) -> Tensor:
        return round_column(block[:, i], int(order[start + i]))

    q = obs_sweep(w, upper, config.block_size, rounded)
    return q[:, torch.argsort(order)].to(weight.dtype)


def gptq_quantize(
    model: nn.Module, batches: Iterable[Any], forward: Callable[[Any], Any], config: GPTQConfig
) -> tuple[dict[str, Tensor], int]:
    """Replace the weight of every quantized layer of ``model`` that has a weight quantizer by its GPTQ solution,
    in place (the quantizer then reproduces it exactly); returns the solutions by layer name (for
    :func:`put_weights` after a reload) and the calibration batches.

    Raises:
        ConfigError: a weight format GPTQ cannot round, or a pruned layer (its weight is a masked view).
    """
    from torch.nn.utils import parametrize

    layers = {
        layer.name: layer.module
        for layer in find_linear_layers(model)
        if isinstance(layer.module, QuantLinear) and layer.module.weight_quantizer is not None
    }
    for name, layer in layers.items():
        if parametrize.is_parametrized(layer.linear, "weight"):
            raise ConfigError(
                f"quant.gptq: layer {name} is pruned; GPTQ here quantizes dense weights (prune after)"
            )
    # the Hessians of the full-precision model: weight quantizers off while the calibration batches run
    quantizers = {name: layer.weight_quantizer for name, layer in layers.items()}
    for layer in layers.values():
        layer.weight_quantizer = None
    try:
        inputs, run = input_statistics(model, layers, batches, forward, config.batches)
    finally:
        for name, layer in layers.items():
            layer.weight_quantizer = quantizers[name]
    solutions = {}
    for name, layer in layers.items():
        weight = layer.linear.weight
        solutions[name] = gptq_weight(
            weight, inputs[name].hessian(), column_rounding(layer.weight_quantizer, weight), config
        )
    put_weights(model, solutions)
    return solutions, run


@torch.no_grad()
def put_weights(model: nn.Module, weights: dict[str, Tensor]) -> None:
    """Copy ``weights`` (layer name → tensor) into the model's linear layers of those names."""
    modules = {layer.name: layer.module for layer in find_linear_layers(model)}
    for name, weight in weights.items():
        layer = modules[name]
        target = (layer.linear if isinstance(layer, QuantLinear) else layer).weight
        target.copy_(weight.to(device=target.device, dtype=target.dtype))
