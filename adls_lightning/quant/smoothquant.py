"""SmoothQuant (Xiao et al. 2022): move activation outliers into the weights before W8A8 quantization.

For a linear layer ``y = x Wᵀ`` whose input channel ``j`` has activation range ``max|X_j|`` (over calibration batches)
and weight range ``max|W_{:,j}|``, the factor ``s_j = max|X_j|^α / max|W_{:,j}|^(1-α)`` leaves the float output
unchanged with ``x / s`` and ``W · s`` (columns) and flattens the channels that per-tensor activation quantization
handles worst. The layer then computes ``Q_a(x / s) · Q_w(W · s)ᵀ``: here each quantizer is wrapped
(:class:`Smoothed`) so that the input quantizer returns ``Q_a(x / s) · s`` and the weight quantizer
``Q_w(W · s) / s``, whose product is exactly that, while the stored weights stay the trained ones (a checkpoint
reloaded later is smoothed by the same wrappers). A W8A8 engine folds ``1 / s`` into the operation that produces
``x`` (the paper folds it into the LayerNorm; BERT's post-LN blocks also read that output on the residual path, so
there it is a separate per-channel scale of the linear's input branch).

Which layers (``quant.smoothquant.scope``): ``norm_fed``, the paper's, smooths only the layers whose input is a
normalisation layer's output (in BERT: query, key and value, and the feed-forward's first linear), and the layers
fed by one normalisation share one factor (the weight maximum taken over all of them), so ``1 / s`` can be folded
into that one operation; ``all`` gives every layer that quantizes input and weight its own factor.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, TypedDict

import torch
from torch import Tensor, nn

from adls_lightning.calibration import watch_inputs
from adls_lightning.errors import ConfigError
from adls_lightning.quant.linear import QuantLinear
from adls_lightning.quant.transform import find_linear_layers

#: floor of the factors' inputs and of the factors (channels that never fire, all-zero weight columns)
_EPSILON = 1e-5
#: ``quant.smoothquant.scope``: the layers a normalisation feeds (the paper's), or every layer on its own
SCOPES = ("norm_fed", "all")


class SmoothQuantSettings(TypedDict, total=False):
    """``quant.smoothquant`` as a config gives it: ``alpha`` null = off."""

    alpha: float | None
    scope: str


def check_alpha(alpha: Any) -> float:
    """``quant.smoothquant.alpha``: the migration strength in [0, 1]."""
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not 0 <= alpha <= 1:
        raise ConfigError(
            f"quant.smoothquant.alpha={alpha!r}: must be a number in [0, 1] (null = off), e.g. 0.5"
        )
    return float(alpha)


class Smoothed(nn.Module):
    """A quantizer applied in SmoothQuant's space: ``inner(x / s) · s`` for an input, ``inner(w · s) / s`` for a
    weight (``s`` along the last dimension, the layer's input features)."""

    def __init__(self, inner: nn.Module, scale: Tensor, weight: bool) -> None:
        super().__init__()
        self.inner = inner
        self.weight_side = weight
        self.register_buffer("scale", scale.detach().to(torch.float32).clone())

    def forward(self, x: Tensor) -> Tensor:
        scale = self.scale.to(x.dtype)
        if self.weight_side:
            return self.inner(x * scale) / scale
        return self.inner(x / scale) * scale

    def bits_per_element(self, last_dim: int) -> float:
        return self.inner.bits_per_element(last_dim)

    def check_last_dim(self, size: int) -> str | None:
        return self.inner.check_last_dim(size)

    def extra_repr(self) -> str:
        return f"{'weight' if self.weight_side else 'input'}, {self.scale.numel()} channels"


@torch.no_grad()
def input_ranges(
    layers: dict[str, QuantLinear],
    model: nn.Module,
    batches: Iterable[Any],
    forward: Callable[[Any], Any],
    count: int,
) -> tuple[dict[str, Tensor], int]:
    """Each layer's per-input-channel ``max|x|`` over ``count`` batches (model in eval mode, inputs before their
    quantizer), and the batches run."""
    amax: dict[str, Tensor] = {}

    def record(name: str, x: Tensor) -> None:
        channel = x.abs().reshape(-1, x.shape[-1]).amax(dim=0).float().cpu()
        amax[name] = channel if name not in amax else torch.maximum(amax[name], channel)

    run = watch_inputs(model, layers, record, batches, forward, count)
    return amax, run


def check_scope(scope: Any) -> str:
    """``quant.smoothquant.scope``: one of :data:`SCOPES`."""
    if scope not in SCOPES:
        raise ConfigError(
            f"quant.smoothquant.scope={scope!r}: must be one of {', '.join(SCOPES)} (norm_fed = the paper's: "
            "the layers a LayerNorm feeds, one factor per LayerNorm)"
        )
    return scope


def _is_norm(module: nn.Module) -> bool:
    # nn.LayerNorm / nn.RMSNorm and the families' own norm classes (T5LayerNorm, LlamaRMSNorm, ...)
    return isinstance(module, nn.LayerNorm | nn.RMSNorm) or type(module).__name__.endswith(
        ("LayerNorm", "RMSNorm")
    )


@torch.no_grad()
def norm_fed_groups(
    model: nn.Module, layers: dict[str, nn.Module], batches: Iterable[Any], forward: Callable[[Any], Any]
) -> list[list[str]]:
    """The layers of ``layers`` whose input is a normalisation layer's output, grouped by that output (one group per
    normalisation call), from one batch through ``forward`` in eval mode.

    A layer is fed by a normalisation when it receives the very tensor the normalisation returned (dropout is the
    identity in eval mode); a slice of it (BERT's pooler reads token 0) or anything computed from it does not count.
    """
    outputs: list[Tensor] = []  # kept alive for the batch, so no later tensor reuses their memory
    fed: dict[str, int] = {}

    def same(x: Tensor, y: Tensor) -> bool:
        return x is y or (x.data_ptr() == y.data_ptr() and x.shape == y.shape and x.stride() == y.stride())

    def norm_hook(module: nn.Module, args: tuple, output: Any) -> None:
        if isinstance(output, Tensor):
            outputs.append(output)

    def record(name: str, x: Tensor) -> None:
        source = next((i for i, out in enumerate(outputs) if same(x, out)), None)
        if source is not None and name not in fed:
            fed[name] = source

    hooks = [m.register_forward_hook(norm_hook) for m in model.modules() if _is_norm(m)]
    try:
        watch_inputs(model, layers, record, batches, forward, 1)
    finally:
        for hook in hooks:
            hook.remove()
    groups: dict[int, list[str]] = {}
    for name in layers:  # module order
        if name in fed:
            groups.setdefault(fed[name], []).append(name)
    return list(groups.values())


def smooth(
    model: nn.Module,
    batches: Iterable[Any],
    forward: Callable[[Any], Any],
    count: int,
    alpha: float,
    scope: str = "norm_fed",
) -> tuple[list[str], int]:
    """Wrap the input and weight quantizers of the layers of ``model`` that quantize both with SmoothQuant's
    factors from ``count`` calibration batches: with ``scope="norm_fed"`` the layers a normalisation feeds, one
    factor per normalisation; with ``"all"`` every such layer, one factor each. Returns the layers smoothed and the
    batches run."""
    layers = {
        layer.name: layer.module
        for layer in find_linear_layers(model)
        if isinstance(layer.module, QuantLinear)
        and layer.module.data_in_quantizer is not None
        and layer.module.weight_quantizer is not None
        and not isinstance(layer.module.data_in_quantizer, Smoothed)
    }
    if check_scope(scope) == "norm_fed":
        groups = norm_fed_groups(model, layers, batches, forward)
        layers = {name: layers[name] for group in groups for name in group}
    amax, run = input_ranges(layers, model, batches, forward, count)
    if scope == "all":
        groups = [[name] for name in layers]
    smoothed = []
    for group in groups:
        group = [
            name for name in group if name in amax
        ]  # a layer never called (a head the task does not use)
        if not group:
            continue
        act_max = torch.stack([amax[name] for name in group]).amax(dim=0)
        weight_max = torch.stack(
            [layers[name].linear.weight.detach().abs().amax(dim=0).float().cpu() for name in group]
        ).amax(dim=0)
        factor = act_max.clamp(min=_EPSILON).pow(alpha) / weight_max.clamp(min=_EPSILON).pow(1 - alpha)
        for name in group:
            layer = layers[name]
            scale = factor.clamp(min=_EPSILON).to(layer.linear.weight.device)
            layer.data_in_quantizer = Smoothed(layer.data_in_quantizer, scale, weight=False)
            layer.weight_quantizer = Smoothed(layer.weight_quantizer, scale, weight=True)
            smoothed.append(name)
    return smoothed, run
