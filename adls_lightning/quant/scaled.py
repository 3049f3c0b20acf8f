"""Scaled integers: the baseline format of every quantization toolkit and paper (``scaled_integer``).

``q = clamp(round(x / s) + z, qmin, qmax)``, dequantized as ``(q - z) * s``: a ``width``-bit integer grid whose
step ``s`` (and zero point ``z``, asymmetric only) comes from the data instead of the format. Where the scale comes
from is the *granularity* and the *observer*:

Symmetric grids are the restricted range ``[-(2^(w-1) - 1), 2^(w-1) - 1]`` (``max|x|`` on its last code).

* ``granularity``: ``tensor`` (one scale), ``channel`` (one per row: a weight's output channel), ``group`` (one per
  ``group_size`` consecutive elements along the last dimension), ``token`` (one per row of an activation,
  computed on the fly: dynamic quantization), ``embedding`` (one per element of the last dimension: an
  activation's hidden channels, static and calibrated like ``tensor``; Bondarenko et al. 2021, "Understanding and
  overcoming the challenges of efficient transformer quantization", give BERT's residual stream these
  per-embedding scales because a few of its channels carry values 20-40x the others', which one per-tensor step
  would round coarsely together with every other channel).
* ``observer``: how a range is read from values. ``minmax`` (the extremes), ``percentile`` (the ``percentile``-th
  percentile of ``|x|``, or both tails when asymmetric: outliers clipped), ``mse`` (the clipping of the extremes,
  among 20 from 50 % to 100 %, that gives the least squared error; per row for rows and groups), and
  ``moving_average`` (as minmax per batch, averaged over batches with ``averaging_constant``: QAT's running range).

Row, group and token scales are measured on every call (a weight's rows are the weight's own; a token's are its
own). A ``tensor`` or ``embedding`` scale on an activation is *static* (:data:`STATIC_GRANULARITIES`): measured
over calibration batches (:func:`calibrating`, which ``quant.calibration.batches=N`` runs) or, in training,
updated from each batch (QAT), and kept in the quantizer's state (``min_val``, ``max_val``: one value, or one per
hidden channel for ``embedding``; saved in checkpoints, restored on resume). Until a range has been observed, the
scale is measured on the tensor itself (dynamic), so an uncalibrated model still computes.

Gradients: straight-through inside the grid's range, zero outside (clipped values), as PyTorch's own
``fake_quantize_*``. A tensor (row, group) holding inf or NaN becomes NaN: its statistic is not finite.

**LSQ** (``lsq: true``, Esser et al. 2019, "Learned Step Size Quantization"): the step of each row is a parameter
(``step``, one per row of a weight's channels or groups, or one for a ``tensor`` scale) that QAT trains with the
rest. Its gradient is the paper's: ``round(x/s) - x/s`` inside the grid, ``qmin`` or ``qmax`` outside, scaled by
``g = 1 / sqrt(n * qmax)`` with ``n`` the elements that share the step (a weight row's or group's size; an
activation tensor's elements per batch), which the paper found keeps the step's updates in proportion to the
weights'. The steps start from calibration (:func:`init_learned_steps`: the observer's step on the weight, and on
the ranges the calibration batches recorded for a ``tensor`` activation scale), so they are sized when the layer
is built (:meth:`ScaledIntegerQuantizer.bind`: the optimizer must see them) and set before training starts.
Symmetric grids only (the paper learns a step, not a zero point).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import Tensor, nn

from adls_lightning.calibration import run_batches
from adls_lightning.quant.quantizers import (
    Quantizer,
    QuantizerParamError,
    _bool_param,
    _float_compute,
    _int_param,
    register_format,
)

GRANULARITIES = ("tensor", "channel", "group", "token", "embedding")
#: granularities whose range is static: recorded over calibration batches (QAT: a running range), kept in the state
STATIC_GRANULARITIES = ("tensor", "embedding")
OBSERVERS = ("minmax", "percentile", "mse", "moving_average")
#: the clipping ratios the ``mse`` observer tries, as fractions of the extremes
MSE_CLIP_RATIOS = torch.linspace(0.5, 1.0, 20)
#: bits of one stored scale (float32) and of a zero point (the integer's width), for bits per element
SCALE_BITS = 32


@register_format
class ScaledIntegerQuantizer(Quantizer):
    """Scaled integer of ``width`` bits (see the module docstring).

    Args:
        width: bits per element, 2..16.
        symmetric: zero point 0 and ``s = max|x| / (2^(w-1) - 1)``, else ``s = (max - min) / (2^w - 1)`` with a
            zero point (the range always includes 0, so 0 stays exactly 0).
        granularity: ``tensor``, ``channel``, ``group``, ``token`` or ``embedding`` (activations: one static
            scale per hidden channel, the last dimension).
        group_size: elements per scale along the last dimension (``granularity=group``).
        observer: ``minmax``, ``percentile``, ``mse`` or ``moving_average``.
        percentile: for ``observer=percentile``, in (50, 100].
        averaging_constant: weight of a new batch's range in a running one (``moving_average``, and QAT's
            training updates of a tensor scale), in (0, 1].
        lsq: learn the steps in QAT (LSQ, see the module docstring); symmetric, and ``tensor`` granularity for
            activations.
    """

    format_name = "scaled_integer"
    search_space = {"params": {"width": [4, 8]}, "slots": ["data_in", "weight"]}

    def __init__(
        self,
        width: int = 8,
        symmetric: bool = True,
        granularity: str = "tensor",
        group_size: int = 32,
        observer: str = "minmax",
        percentile: float = 99.99,
        averaging_constant: float = 0.01,
        lsq: bool = False,
    ) -> None:
        super().__init__()
        self.width = _int_param("width", width, 2, 16)
        self.symmetric = _bool_param("symmetric", symmetric)
        if granularity not in GRANULARITIES:
            raise QuantizerParamError(
                "granularity", f"={granularity!r}: must be one of {', '.join(GRANULARITIES)}"
            )
        if observer not in OBSERVERS:
            raise QuantizerParamError("observer", f"={observer!r}: must be one of {', '.join(OBSERVERS)}")
        self.granularity = granularity
        self.group_size = _int_param("group_size", group_size, 1)
        self.observer = observer
        if (
            isinstance(percentile, bool)
            or not isinstance(percentile, int | float)
            or not 50 < percentile <= 100
        ):
            raise QuantizerParamError("percentile", f"={percentile!r}: must be a number in (50, 100]")
        self.percentile = float(percentile)
        if (
            isinstance(averaging_constant, bool)
            or not isinstance(averaging_constant, int | float)
            or not 0 < averaging_constant <= 1
        ):
            raise QuantizerParamError("averaging_constant", f"={averaging_constant!r}: must be in (0, 1]")
        self.averaging_constant = float(averaging_constant)
        self.lsq = _bool_param("lsq", lsq)
        if self.lsq and not self.symmetric:
            raise QuantizerParamError(
                "lsq", "=true: needs symmetric=true (LSQ learns a step, not a zero point)"
            )
        if self.lsq and granularity in ("token", "embedding"):
            raise QuantizerParamError(
                "lsq",
                f"=true: granularity {granularity} has no learned steps (token measures each row on the fly; "
                "embedding's steps are calibrated); learned steps need tensor, channel or group",
            )
        if self.symmetric:
            # the restricted range [-(2^(w-1) - 1), 2^(w-1) - 1]: symmetric about 0, as int8 engines take weights
            self.qmin, self.qmax = -(2 ** (self.width - 1) - 1), 2 ** (self.width - 1) - 1
        else:
            self.qmin, self.qmax = 0, 2**self.width - 1
        # the static range of a tensor scale, or per hidden channel for embedding (unobserved: min > max, one value:
        # the first observation sizes it); in the state dict, so checkpoints keep it
        self.register_buffer("min_val", torch.tensor(float("inf")))
        self.register_buffer("max_val", torch.tensor(float("-inf")))
        self.register_buffer("batches_observed", torch.tensor(0))
        # steps and zero points fixed from outside (GPTQ chose its codes on them), one per row of _rows(); empty:
        # measured as above. Their shape is the layer's, so loading resizes them (_load_from_state_dict).
        self.register_buffer("fixed_scale", torch.empty(0))
        self.register_buffer("fixed_zero", torch.empty(0))
        #: set by :func:`calibrating`: record ranges, pass values through unquantized
        self.observing = False
        # LSQ: one learned step per row (sized by bind), used once learned_ready is set (init_learned_steps)
        self.step = nn.Parameter(torch.empty(0)) if self.lsq else None
        if self.lsq:
            self.register_buffer("learned_ready", torch.tensor(False))

    # ----------------------------------------------------------------------------------------------- ranges
    def _rows(self, x: Tensor) -> Tensor:
        """``x`` as the rows that share a scale (a single row for ``tensor``); for ``embedding``, the rows of ``x``
        (tokens), each column of which has its own scale."""
        if self.granularity == "tensor":
            return x.reshape(1, -1)
        if self.granularity == "group":
            return x.reshape(-1, self.group_size)
        return x.reshape(-1, x.shape[-1]) if x.dim() else x.reshape(1, 1)

    @property
    def _per_column(self) -> bool:
        return self.granularity == "embedding"

    def _sharing(self, rows: Tensor) -> Tensor:
        """``rows`` (:meth:`_rows`) as one row per scale: the columns for ``embedding``."""
        return rows.t() if self._per_column else rows

    def _along(self, values: Tensor) -> Tensor:
        """Per-scale values (steps, zero points, one per row of :meth:`_sharing`) shaped to broadcast over rows."""
        return values[None, :] if self._per_column else values[:, None]

    def _static_grid(self, channels: int | None = None) -> tuple[Tensor, Tensor]:
        """Steps and zero points of the recorded range (checked against a tensor's ``channels`` for ``embedding``)."""
        low, high = self.min_val.reshape(-1), self.max_val.reshape(-1)
        if channels is not None and self._per_column and low.numel() != channels:
            raise ValueError(
                f"granularity embedding: the recorded range has {low.numel()} channels, the tensor has "
                f"{channels} (last dimension)"
            )
        return self._scale(low, high)

    def _known_grid(self, values: Tensor) -> tuple[Tensor, Tensor]:
        """The fixed or recorded steps and zero points of a ``tensor`` / ``embedding`` scale, shaped to broadcast
        over ``values`` (per channel: along the last dimension)."""
        if self.fixed_scale.numel():
            scale, zero = self.fixed_scale.to(values.device), self.fixed_zero.to(values.device)
            expected = values.shape[-1] if self._per_column and values.dim() else 1
            if scale.numel() != expected:
                raise ValueError(f"fixed scales for {scale.numel()} rows, the tensor has {expected}")
        else:
            scale, zero = self._static_grid(values.shape[-1] if values.dim() else 1)
        shape = (-1,) if self._per_column else ()
        return scale.reshape(shape), zero.reshape(shape)

    def _range(self, rows: Tensor) -> tuple[Tensor, Tensor]:
        """Per row (min, max) by the observer (``moving_average`` reads one batch as ``minmax``)."""
        if self.observer == "percentile":
            magnitude = rows.abs() if self.symmetric else rows
            high = _quantile(magnitude, self.percentile / 100)
            low = -high if self.symmetric else _quantile(rows, 1 - self.percentile / 100)
        else:
            low, high = rows.amin(dim=1), rows.amax(dim=1)
        if self.observer == "mse":
            low, high = self._mse_clip(rows, low, high)
        return low, high

    def _mse_clip(self, rows: Tensor, low: Tensor, high: Tensor) -> tuple[Tensor, Tensor]:
        """The clipping of ``(low, high)`` among :data:`MSE_CLIP_RATIOS` with the least squared error per row."""
        best_error = best_ratio = None
        for ratio in MSE_CLIP_RATIOS.tolist():
            scale, zero = self._scale(low * ratio, high * ratio)
            error = (self._round(rows, scale[:, None], zero[:, None])[0] - rows).square_().sum(dim=1)
            if best_error is None:
                best_error, best_ratio = error, torch.full_like(error, ratio)
            else:
                better = error < best_error
                best_error = torch.where(better, error, best_error)
                best_ratio = torch.where(better, ratio, best_ratio)
        return low * best_ratio, high * best_ratio

    def _scale(self, low: Tensor, high: Tensor) -> tuple[Tensor, Tensor]:
        """Step and zero point of ranges ``[low, high]`` (widened to include 0)."""
        low, high = low.clamp(max=0.0), high.clamp(min=0.0)
        tiny = torch.finfo(torch.float32).tiny
        if self.symmetric:
            scale = torch.maximum(-low, high) / self.qmax
            zero = torch.zeros_like(scale)
        else:
            scale = (high - low) / (self.qmax - self.qmin)
            zero = torch.round(-low / scale.clamp(min=tiny)).clamp(self.qmin, self.qmax)
        # an all-zero row: any step gives zeros, 1 avoids 0/0 (a NaN step stays: the row's values were not finite)
        return torch.where((scale > 0) | scale.isnan(), scale, torch.ones_like(scale)), zero

    def _round(self, rows: Tensor, scale: Tensor, zero: Tensor) -> tuple[Tensor, Tensor]:
        codes = torch.round(rows / scale) + zero
        return (codes.clamp(self.qmin, self.qmax) - zero) * scale, codes

    @torch.no_grad()
    def observe(self, x: Tensor) -> None:
        """Fold ``x``'s range into the static range of a ``tensor`` scale (calibration, or a QAT step)."""
        low, high = self._range(self._sharing(self._rows(_float_compute(x).detach())))
        if not self._per_column:
            low, high = low[0], high[0]
        if not (torch.isfinite(low).all() and torch.isfinite(high).all()):
            return  # a batch with inf/NaN says nothing about the range
        first = int(self.batches_observed) == 0
        if first and self.min_val.shape != low.shape:  # embedding: sized by the first batch's channels
            self.min_val = torch.full_like(low, float("inf"))
            self.max_val = torch.full_like(high, float("-inf"))
        elif self.min_val.shape != low.shape:
            raise ValueError(
                f"granularity embedding: the recorded range has {self.min_val.numel()} channels, the tensor has "
                f"{low.numel()} (last dimension)"
            )
        if self.observer == "minmax" and self.observing:
            low, high = torch.minimum(self.min_val, low), torch.maximum(self.max_val, high)
        elif not first:  # a running average: moving_average always, other observers across training batches
            c = self.averaging_constant if (self.observer == "moving_average" or not self.observing) else None
            if c is None:  # calibration with percentile / mse: the mean over calibration batches
                c = 1.0 / (int(self.batches_observed) + 1)
            low = self.min_val + c * (low - self.min_val)
            high = self.max_val + c * (high - self.max_val)
        self.min_val.copy_(low)
        self.max_val.copy_(high)
        self.batches_observed += 1

    def grid(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """The steps and zero points this quantizer would use for ``x``, one per row of :meth:`_rows` (per column
        for ``embedding``)."""
        rows = self._rows(_float_compute(x).detach())
        if self.is_static:
            return self._static_grid(rows.shape[1])
        return self._scale(*self._range(self._sharing(rows)))

    def fix(self, scale: Tensor, zero: Tensor) -> None:
        """Quantize with these steps and zero points from now on (one per row of :meth:`_rows`)."""
        self.fixed_scale = scale.detach().to(torch.float32).clone()
        self.fixed_zero = zero.detach().to(torch.float32).clone()

    def reset_range(self) -> None:
        """Forget the recorded range (calibration starts from scratch; ``embedding``'s channels are sized again)."""
        device = self.min_val.device
        self.min_val = torch.tensor(float("inf"), device=device)
        self.max_val = torch.tensor(float("-inf"), device=device)
        self.batches_observed.zero_()

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs) -> None:
        for name in ("fixed_scale", "fixed_zero", "min_val", "max_val"):
            # take the saved shape (a GPTQ layer's scales, or empty; embedding's recorded channels)
            if prefix + name in state_dict:
                setattr(
                    self, name, torch.empty_like(state_dict[prefix + name], device=getattr(self, name).device)
                )
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    @property
    def is_static(self) -> bool:
        """A ``tensor`` or ``embedding`` scale that has observed a range: it no longer depends on the values
        quantized."""
        return self.granularity in STATIC_GRANULARITIES and int(self.batches_observed) > 0

    # ------------------------------------------------------------------------------------------------- LSQ
    def bind(self, shape: tuple[int, ...] | None) -> None:
        """LSQ: one step per row of an operand of ``shape`` (``None``: an activation)."""
        if not self.lsq:
            return
        if self.granularity == "tensor":
            rows = 1
        elif shape is None:
            raise QuantizerParamError(
                "lsq",
                f"=true with granularity {self.granularity}: an activation's rows vary with the batch; use "
                "granularity tensor for data_in",
            )
        else:
            rows = self._rows(torch.empty(shape, device="meta")).shape[0]
        self.step = nn.Parameter(torch.ones(rows))

    def init_step(self, x: Tensor | None) -> None:
        """Start the learned steps from the observer: on ``x`` (a weight), or on the calibrated range (``None``)."""
        with torch.no_grad():
            if x is None:
                scale = self._scale(self.min_val[None], self.max_val[None])[0]
            else:
                rows = self._rows(_float_compute(x).detach())
                scale = self._scale(*self._range(rows))[0]
            self.step.copy_(scale.to(self.step))
            self.learned_ready.fill_(True)

    def _learned(self, x: Tensor) -> Tensor:
        values = _float_compute(x)
        rows = self._rows(values)
        # LSQ's gradient scale: the step's value unchanged, its gradient times g
        g = 1.0 / math.sqrt(rows.shape[1] * self.qmax)
        step = self.step.abs().clamp(min=torch.finfo(torch.float32).tiny)
        step = (step - step * g).detach() + step * g
        # clamp before rounding (the same codes): the paper's gradient switches at x/s = qmax, not at its rounding
        scaled = (rows / step[:, None]).clamp(self.qmin, self.qmax)
        codes = (scaled.round() - scaled).detach() + scaled  # round with a straight-through gradient
        out = codes * step[:, None]
        return out.view_as(values).to(x.dtype)

    # -------------------------------------------------------------------------------------------- quantizer
    def forward(self, x: Tensor) -> Tensor:
        learned = self.step is not None and bool(self.learned_ready)
        if self.granularity in STATIC_GRANULARITIES and (self.observing or (self.training and not learned)):
            self.observe(x)
            if self.observing:
                return x
        if learned:
            return self._learned(x)
        return super().forward(x)

    def quantize(self, x: Tensor, need_mask: bool) -> tuple[Tensor, Tensor | None]:
        values = _float_compute(x)
        if self.granularity == "group" and values.shape[-1] % self.group_size:
            raise ValueError(self.check_last_dim(values.shape[-1]))
        if self.granularity in STATIC_GRANULARITIES and (self.fixed_scale.numel() or self.is_static):
            # a grid known before x: one step, or one per channel of the last dimension, broadcast over x as it
            # is. Reshaped into rows instead, a PT2E export of quant=int8_scaled_all ran each layer's fused
            # softmax-and-rounding kernel as a scalar loop (0.45x fp32 eager; docs/inference.md)
            scale, zero = self._known_grid(values)
            out, codes = self._round(values, scale, zero)
            mask = ((codes >= self.qmin) & (codes <= self.qmax)) if need_mask else None
            return out.to(x.dtype), mask
        rows = self._rows(values)
        sharing = self._sharing(rows)
        if self.fixed_scale.numel():
            if self.fixed_scale.numel() != sharing.shape[0]:
                raise ValueError(
                    f"fixed scales for {self.fixed_scale.numel()} rows, the tensor has {sharing.shape[0]}"
                )
            scale, zero = self.fixed_scale.to(rows.device), self.fixed_zero.to(rows.device)
        else:
            scale, zero = self._scale(*self._range(sharing))
            # a row holding inf or NaN has no finite statistic (percentile would clip it silently): NaN
            scale = torch.where(torch.isfinite(sharing).all(dim=1), scale, torch.nan)
        out, codes = self._round(rows, self._along(scale), self._along(zero))
        mask = ((codes >= self.qmin) & (codes <= self.qmax)).view_as(values) if need_mask else None
        return out.view_as(values).to(x.dtype), mask

    def bits_per_element(self, last_dim: int) -> float:
        per_scale = SCALE_BITS + (0 if self.symmetric else self.width)
        if self.granularity == "group":
            return self.width + per_scale / self.group_size
        if self.granularity in ("channel", "token"):
            return self.width + per_scale / last_dim
        if (
            self.granularity == "embedding"
        ):  # one scale per channel, shared by every token: negligible per element
            return float(self.width)
        return float(self.width)

    def check_last_dim(self, size: int) -> str | None:
        if self.granularity == "group" and size % self.group_size:
            return f"does not divide the dimension of size {size}"
        return None

    def extra_repr(self) -> str:
        kind = "symmetric" if self.symmetric else "asymmetric"
        group = f", group_size={self.group_size}" if self.granularity == "group" else ""
        lsq = ", lsq" if self.lsq else ""
        return f"width={self.width}, {kind}, granularity={self.granularity}{group}, observer={self.observer}{lsq}"


def _quantile(rows: Tensor, q: float) -> Tensor:
    """Per-row ``q``-quantile, nearest rank (the ``ceil(q n)``-th smallest), by ``kthvalue`` (``torch.quantile``
    refuses inputs above 16 M elements)."""
    k = min(rows.shape[1], max(1, math.ceil(q * rows.shape[1] - 1e-9)))
    return rows.kthvalue(k, dim=1).values


def scaled_quantizers(model: nn.Module) -> list[ScaledIntegerQuantizer]:
    return [m for m in model.modules() if isinstance(m, ScaledIntegerQuantizer)]


def static_quantizers(model: nn.Module) -> list[ScaledIntegerQuantizer]:
    """The scaled-integer quantizers of ``model`` whose ranges calibration records (:data:`STATIC_GRANULARITIES`)."""
    return [q for q in scaled_quantizers(model) if q.granularity in STATIC_GRANULARITIES]


def init_learned_steps(model: nn.Module) -> int:
    """Start every LSQ step of ``model``'s quantized layers that has not started (a resumed run's have) from
    calibration: a weight's from its observer on the weight, an activation's from its calibrated range. Returns
    the quantizers started. Raises ``ValueError`` for an activation step without a calibrated range."""
    from adls_lightning.quant.linear import QuantLinear

    started = 0
    for name, layer in model.named_modules():
        if not isinstance(layer, QuantLinear):
            continue
        operands = {"data_in": None, "weight": layer.linear.weight, "bias": layer.linear.bias}
        for slot, operand in operands.items():
            quantizer = layer.quantizer(slot)
            if not isinstance(quantizer, ScaledIntegerQuantizer) or quantizer.step is None:
                continue
            if bool(quantizer.learned_ready) or (slot == "bias" and operand is None):
                continue
            if operand is None and int(quantizer.batches_observed) == 0:
                raise ValueError(
                    f"{name}: an LSQ {slot} step starts from calibrated ranges; give quant.calibration.batches=N"
                )
            quantizer.init_step(operand)
            started += 1
    return started


@contextlib.contextmanager
def calibrating(model: nn.Module) -> Iterator[list[ScaledIntegerQuantizer]]:
    """Within: every static (``tensor``, ``embedding``) scaled-integer quantizer of ``model`` records the ranges it
    sees, from scratch, and passes its input through unquantized; after: they quantize with what they recorded."""
    quantizers = static_quantizers(model)
    for quantizer in quantizers:
        quantizer.reset_range()
        quantizer.observing = True
    try:
        yield quantizers
    finally:
        for quantizer in quantizers:
            quantizer.observing = False


@torch.no_grad()
def fix_calibrated_grids(model: nn.Module) -> int:
    """Fix every calibrated static quantizer of ``model`` on the grid its recorded range gives
    (:meth:`ScaledIntegerQuantizer.fix`): the same steps and zero points, now read without asking whether a range
    was recorded, a question ``torch.export`` cannot trace (it reads a buffer's value). For a copy about to be
    exported; returns the quantizers fixed."""
    fixed = 0
    for quantizer in static_quantizers(model):
        if quantizer.is_static and not quantizer.fixed_scale.numel():
            quantizer.fix(*quantizer._static_grid())
            fixed += 1
    return fixed


@torch.no_grad()
def calibrate(model: nn.Module, batches: Iterable[Any], forward: Callable[[Any], Any], count: int) -> int:
    """Run up to ``count`` of ``batches`` through ``forward`` (the model in eval mode) inside :func:`calibrating`;
    returns the batches run (0 when ``model`` has no static scaled-integer quantizer: nothing to calibrate)."""
    with calibrating(model) as quantizers:
        if not quantizers:
            return 0
        return run_batches(model, batches, forward, count)
