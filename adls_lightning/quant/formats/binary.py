"""The one- and two-bit formats of MASE's binary family: ``binary``, ``binary_scaling``, ``binary_residual`` and
``ternary``.

Signs of the elements, scaled by a statistic of the row or tensor (``binary_scaling``, ``ternary``) or by learned
scales (``binary_residual``); ``ternary`` adds a zero code. They quantize weights only by default (their
``slots``), as MASE's layers do.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

from adls_lightning.quant.quantizers import (
    Quantizer,
    QuantizerParamError,
    _bool_param,
    _float_compute,
    _int_param,
    register_format,
)


def _check_bipolar(bipolar: Any) -> None:
    if _bool_param("bipolar", bipolar) is not True:
        # MASE's non-bipolar path (BinaryZeroScaled) only runs on 4-D tensors; {0, 1} binarisation of
        # signed weights is not a useful format, so it is not offered.
        raise QuantizerParamError(
            "bipolar", "=False: only bipolar (+1/-1) binarisation is supported; use ternary for {-a, 0, a}"
        )


def _sign_codes(x: Tensor, stochastic: bool) -> Tensor:
    """+1/-1 per element by the sign bit (+0.0 -> +1, -0.0 -> -1), NaN stays NaN.

    Stochastic: +1 with probability ``clamp((x+1)/2, 0, 1)``.
    """
    if stochastic:
        p = ((x + 1) / 2).clamp_(0, 1)
        return (torch.rand_like(x) < p).to(x.dtype).mul_(2).sub_(1).add_(p - p)  # p - p: 0, NaN for NaN
    clipped = x.clamp(-1, 1)  # inf -> +-1, so 0 * clipped below is 0 or NaN (for NaN only)
    return torch.copysign(clipped.mul(0).add_(1), clipped)


class _SignQuantizer(Quantizer):
    """Shared parameters of the sign formats (binary, binary_scaling): weights only by default, no zero code."""

    slots = ("weight",)
    zero_representable = False
    search_space = {"params": {}, "slots": ["weight"]}

    def __init__(self, stochastic: bool = False, bipolar: bool = True, width: int = 1) -> None:
        super().__init__()
        self.stochastic = _bool_param("stochastic", stochastic)
        _check_bipolar(bipolar)
        _int_param("width", width, 1, 1, hint=" (binary values take 1 bit; MASE configs may name it)")

    def extra_repr(self) -> str:
        return f"stochastic={self.stochastic}"


@register_format
class BinaryQuantizer(_SignQuantizer):
    """Bipolar binary: the sign, ``+1`` or ``-1`` (0 cannot be represented: +0.0 becomes +1, -0.0 becomes -1).

    ``stochastic=True`` draws +1 with probability ``clamp((x+1)/2, 0, 1)`` while the module is in
    training mode and is deterministic in eval mode. Gradient: STE clipped to ``|x| <= 1`` (BinaryConnect).
    """

    format_name = "binary"

    def quantize(self, x: Tensor, need_mask: bool) -> tuple[Tensor, Tensor | None]:
        xf = _float_compute(x)
        codes = _sign_codes(xf, self.stochastic and self.training)
        return codes.to(x.dtype), (xf.abs() <= 1) if need_mask else None

    def bits_per_element(self, last_dim: int) -> float:
        return 1.0


@register_format
class BinaryScalingQuantizer(_SignQuantizer):
    """Binary with a per-row scale (XNOR-Net): ``q = a * sign(x)``, ``a = mean |x|`` over the last dim.

    For a weight ``[out, in]`` that is one scale per output channel. +0.0 becomes ``+a`` (-0.0:
    ``-a``); a row holding an inf or NaN becomes NaN (its scale is not finite). MASE's
    LinearBinaryScaling only runs on 4-D tensors, clamps the weight in place and has the scale
    commented out.
    """

    format_name = "binary_scaling"

    def quantize(self, x: Tensor, need_mask: bool) -> tuple[Tensor, Tensor | None]:
        xf = _float_compute(x)
        a = xf.abs()
        scale = a.mean(dim=-1, keepdim=True)
        scale = scale + (scale - scale)  # inf - inf: a row with inf (or NaN) becomes NaN
        q = _sign_codes(xf, self.stochastic and self.training).mul_(scale)
        return q.to(x.dtype), (a <= 1) if need_mask else None

    def bits_per_element(self, last_dim: int) -> float:
        return 1.0 + 32.0 / last_dim


class _ResidualSign(torch.autograd.Function):
    """Residual binarisation: level ``l`` adds ``|s_l| * sign(r_l)`` with ``r_{l+1} = r_l - |s_l| * sign(r_l)``.

    Backward: STE for ``x``; for the scales, ``d q / d s_l = sign(s_l) * sign(r_l)``.
    """

    @staticmethod
    def forward(ctx, x: Tensor, scales: Tensor, stochastic: bool) -> Tensor:
        magnitudes = scales.abs()
        residual = x.clone()
        q = torch.zeros_like(x)
        signs = []
        for level in range(scales.numel()):
            codes = _sign_codes(residual, stochastic)
            signs.append(codes)
            step = codes * magnitudes[level]
            q += step
            residual -= step
        ctx.save_for_backward(torch.stack(signs), torch.sign(scales))
        return q

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, Tensor, None]:
        signs, scale_signs = ctx.saved_tensors
        grad_scales = (grad.unsqueeze(0) * signs).flatten(1).nansum(1) * scale_signs
        return grad, grad_scales, None


@register_format
class BinaryResidualQuantizer(Quantizer):
    """Residual-sign binarisation with learned scales (ReBNet): ``levels`` bits per element.

    ``q = sum_l |s_l| * sign(r_l)``, ``r_0 = x``, ``r_{l+1} = r_l - |s_l| * sign(r_l)``. The scales
    ``s`` are an ``nn.Parameter`` (trained with the layer), initialised on the first call from the data
    greedily (``s_l = mean |r_l|``) and kept in the state dict. With one level this is a binary weight
    with a learned scale (MASE's ``binary_residual`` weight, ``W_b * |gamma|``). 0 cannot be represented.
    """

    format_name = "binary_residual"
    zero_representable = False
    search_space = {"params": {"levels": [1, 2, 3]}, "slots": ["data_in", "weight"]}

    def __init__(
        self,
        levels: int = 2,
        stochastic: bool = False,
        bipolar: bool = True,
        width: int | None = None,
        residual_sign: bool = True,
    ) -> None:
        super().__init__()
        self.levels = _int_param("levels", levels, 1, 8)
        self.stochastic = _bool_param("stochastic", stochastic)
        _check_bipolar(bipolar)
        if width is not None:  # MASE configs name it: the stored bits, one per level
            _int_param("width", width, levels, levels, hint=f" (one bit per level, levels={levels})")
        if _bool_param("residual_sign", residual_sign) is not True:
            raise QuantizerParamError(
                "residual_sign", "=False: only residual-sign binarisation is implemented"
            )
        self.scales = nn.Parameter(torch.ones(levels))
        self.register_buffer("initialized", torch.tensor(False))

    @torch.no_grad()
    def _init_scales(self, x: Tensor) -> None:
        residual = _float_compute(x).clone()
        finite = torch.isfinite(residual)
        residual[~finite] = 0.0
        for level in range(self.levels):
            scale = residual.abs().sum() / finite.sum().clamp(min=1)
            self.scales[level] = scale
            residual -= _sign_codes(residual, False) * scale
        self.initialized.fill_(True)

    def forward(self, x: Tensor) -> Tensor:
        if not bool(self.initialized):
            self._init_scales(x)
        stochastic = self.stochastic and self.training
        q = _ResidualSign.apply(_float_compute(x), self.scales, stochastic)
        return q.to(x.dtype)

    def quantize(self, x: Tensor, need_mask: bool) -> tuple[Tensor, Tensor | None]:
        with torch.no_grad():
            return self.forward(x), None

    def bits_per_element(self, last_dim: int) -> float:
        return float(self.levels)

    def extra_repr(self) -> str:
        return f"levels={self.levels}, stochastic={self.stochastic}"


@register_format
class TernaryQuantizer(Quantizer):
    """Ternary (TWN): ``q = a * sign(x)`` where ``|x| > delta``, else 0; per tensor.

    ``delta = threshold * mean |x|``; ``a = mean |x|`` over the kept elements when ``scaling_factor``
    (else 1). Zeros stay zero. A tensor holding an inf or NaN becomes all NaN (its statistics are
    not finite). Stored in 2 bits.
    MASE's Ternary ignores its threshold config and only runs on 4-D tensors.

    Args:
        threshold: ``delta`` as a fraction of ``mean |x|`` (TWN's 0.75).
        scaling_factor: scale the codes by ``a``.
        width: accepted for MASE configs; must be 2.
        mean, median, max: chop's precomputed statistics of ``|x|``; ``None``/``"NA"`` measures the tensor.
            Given as numbers, ``delta`` is fixed as chop's ternary quantizer sets it: ``threshold * mean``,
            else ``0.05 * max``, else ``threshold * median``.
    """

    format_name = "ternary"
    slots = ("weight",)
    search_space = {"params": {}, "slots": ["weight"]}

    def __init__(
        self,
        threshold: float = 0.75,
        scaling_factor: bool = True,
        width: int = 2,
        mean: Any = None,
        median: Any = None,
        max: Any = None,
    ) -> None:
        super().__init__()
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not threshold >= 0:
            raise QuantizerParamError(
                "threshold", f"={threshold!r}: must be a number >= 0 (a fraction of mean |x|)"
            )
        self.threshold = float(threshold)
        self.scaling_factor = _bool_param("scaling_factor", scaling_factor)
        _int_param("width", width, 2, 2, hint=" (ternary values take 2 bits)")
        stats = {}
        for key, value in (("mean", mean), ("median", median), ("max", max)):
            if value in (None, "NA"):
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
                raise QuantizerParamError(
                    key, f"={value!r}: must be a number >= 0 (a statistic of |x|), or 'NA' to measure it"
                )
            stats[key] = float(value)
        # chop's order: the mean's threshold, else 5% of the max, else the median's threshold
        self.delta: float | None = None
        if "mean" in stats:
            self.delta = self.threshold * stats["mean"]
        elif "max" in stats:
            self.delta = 0.05 * stats["max"]
        elif "median" in stats:
            self.delta = self.threshold * stats["median"]

    def quantize(self, x: Tensor, need_mask: bool) -> tuple[Tensor, Tensor | None]:
        xf = _float_compute(x)
        a = xf.abs()
        mean = a.mean()
        delta = self.threshold * mean if self.delta is None else self.delta
        keep = (a > delta).to(torch.float32)
        scale = (a * keep).sum() / keep.sum().clamp(min=1) if self.scaling_factor else 1.0
        q = torch.copysign(keep.mul_(scale + (mean - mean)), xf)  # mean - mean: NaN if x has inf/NaN
        return q.to(x.dtype), None

    def bits_per_element(self, last_dim: int) -> float:
        return 2.0

    def extra_repr(self) -> str:
        delta = "" if self.delta is None else f", delta={self.delta}"
        return f"threshold={self.threshold}, scaling_factor={self.scaling_factor}{delta}"
