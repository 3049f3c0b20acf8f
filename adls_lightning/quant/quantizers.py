"""The quantizer base: :class:`Quantizer`, the registry of formats (:data:`QUANTIZERS`, :func:`register_format`) and
:func:`make_quantizer`, which builds a format by the name a config uses.

A quantizer maps a float tensor to the nearest value of its format and returns it as a float
tensor of the same shape and dtype ("fake quantization"), so a quantized layer still runs a float
``F.linear``. Every quantizer:

* works on tensors of any rank, on any device; block formats group consecutive elements along the
  **last** dimension (the reduction dimension of ``F.linear`` for both the input and the weight);
* is differentiable with a straight-through estimator (STE): the backward pass treats rounding as
  the identity. Formats that saturate (``integer``, minifloats, ``log``, ``binary*``) are
  clipping-aware: inputs outside the representable range get zero gradient, as PyTorch's own
  ``fake_quantize_*`` ops do;
* rounds to nearest with ties to even (``torch.round``), unless documented otherwise;
* maps 0 to 0 when the format can represent zero, so pruned weights stay exactly zero
  (``binary``, ``binary_scaling`` and ``binary_residual`` cannot: ``+0.0`` becomes the positive
  code and ``-0.0`` the negative one);
* saturates ``+-inf`` to the largest finite value of the format and keeps ``NaN`` as ``NaN``;
  block formats turn a whole block into ``NaN`` when it holds a ``NaN`` (as OCP MX does), and
  formats scaled by a statistic (``binary_scaling`` per row, ``ternary`` per tensor) turn the
  row/tensor holding an inf or NaN into ``NaN``.

Non-integer formats compute in float32 (the result is cast back to the input dtype). Grids finer
than float32's smallest subnormal (2^-149) are limited by float32.

This module holds only what every format shares: the base class and its STE, the registry, the parameter
validators (and the bits of a per-block shared value, which the block formats and ``mxint8`` count alike). The
formats themselves live one module per family, beside it, and register themselves with
:func:`register_format` when imported: :mod:`adls_lightning.quant.formats` (``integer``, the minifloats and
``log``, the block formats, the binary family and ``ternary``, ``mxint8``) and :mod:`adls_lightning.quant.scaled`
(``scaled_integer``). Importing anything of :mod:`adls_lightning.quant` (this module included) runs the package's
``__init__``, which imports them in that order, so :data:`QUANTIZERS` always holds every built-in format, in the
same order; this module imports none of them (they import it).

Build one with :func:`make_quantizer`; the format names and parameters are in :data:`QUANTIZERS`
and in ``docs/quantization.md``.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Mapping
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from adls_lightning.errors import ConfigError
from adls_lightning.registry import Registry

#: The widest element (bits) of the integer, minifloat, log and block formats.
_MAX_WIDTH = 32


class QuantizerParamError(ConfigError):
    """A bad quantizer parameter. ``str(err)`` is ``param + detail``, e.g. ``width=0: must be ...``.

    Config parsers re-raise it under the full config key (``quant.config.linear.config.weight_width``).
    """

    def __init__(self, param: str, detail: str) -> None:
        super().__init__(f"{param}{detail}")
        self.param = param
        self.detail = detail


#: Format name -> quantizer class, filled by :func:`register_format` (in definition order).
QUANTIZERS: Registry[type[Quantizer]] = Registry("quantization format")


def register_format(cls: type[Quantizer]) -> type[Quantizer]:
    """Class decorator: make ``cls`` available in configs as ``name: <cls.format_name>``.

    Everything else reads the class: its constructor's keyword arguments are the format's parameters
    (with their defaults), and :attr:`Quantizer.slots`, :attr:`~Quantizer.zero_representable`,
    :attr:`~Quantizer.blocked`, :attr:`~Quantizer.search_space` and :meth:`~Quantizer.bits_per_element`
    describe it to ``quantize_model``, the mixed-precision search and the tests (``docs/extending.md``).
    """
    if not cls.format_name:
        raise ValueError(f"{cls.__name__}: set format_name (the name configs use)")
    return QUANTIZERS.register(cls.format_name, cls)


def _int_param(name: str, value: Any, low: int, high: int | None = None, hint: str = "") -> int:
    """Validate an integer parameter in ``[low, high]``; raise ConfigError naming it otherwise."""
    if (
        isinstance(value, bool)
        or not isinstance(value, int)
        or value < low
        or (high is not None and value > high)
    ):
        bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise QuantizerParamError(name, f"={value!r}: must be an integer {bound}{hint}")
    return value


def _bool_param(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise QuantizerParamError(name, f"={value!r}: must be true or false")
    return value


def _block_size_param(value: Any) -> int:
    """MASE writes block sizes as lists right-aligned to the tensor shape ([1, 16] = 16 along the last dim).

    Only 1-D blocks along the last dimension exist here, so leading entries must be 1.
    """
    if isinstance(value, (list, tuple)) and value and all(v == 1 for v in value[:-1]):
        value = value[-1]
    return _int_param(
        "block_size", value, 1, hint=" (or a list [1, ..., n]: blocks run along the last dimension)"
    )


class _StraightThrough(torch.autograd.Function):
    """Forward: the quantizer. Backward: identity, times the quantizer's in-range mask when it has one."""

    @staticmethod
    def forward(ctx, x: Tensor, quantizer: Quantizer) -> Tensor:
        q, mask = quantizer.quantize(x, need_mask=True)
        ctx.has_mask = mask is not None
        if mask is not None:
            # Multiplying by a uint8 view of the bool mask is about twice as fast as by the bool.
            ctx.save_for_backward(mask.view(torch.uint8))
        return q

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        if ctx.has_mask:
            (mask,) = ctx.saved_tensors
            grad = grad * mask
        return grad, None


class Quantizer(nn.Module):
    """Base class: ``forward(x)`` returns fake-quantized ``x`` (same shape and dtype) with an STE backward.

    Subclasses implement :meth:`quantize` and :meth:`bits_per_element`.
    """

    #: Name used in configs (``name: integer``).
    format_name: ClassVar[str] = ""
    #: Operands a layer config naming only the format quantizes (MASE: weight only for the binary family).
    slots: ClassVar[tuple[str, ...]] = ("data_in", "weight")
    #: Whether 0 maps to exactly 0 (pruned weights stay pruned).
    zero_representable: ClassVar[bool] = True
    #: Whether elements share a scale per block of ``block_size`` along the last dimension.
    blocked: ClassVar[bool] = False
    #: Default mixed-precision search space ``{"params": {parameter: [choices]}, "slots": [operands]}``
    #: (``conf/search/mixed_precision.yaml``); None = not searched unless a config lists it.
    search_space: ClassVar[Mapping[str, Any] | None] = None
    #: Parameters also accepted once per layer (MASE's ``floor``), applied to every operand in this format.
    layer_params: ClassVar[tuple[str, ...]] = ()

    def forward(self, x: Tensor) -> Tensor:
        if torch.is_grad_enabled() and x.requires_grad:
            return _StraightThrough.apply(x, self)
        return self.quantize(x, need_mask=False)[0]

    def quantize(self, x: Tensor, need_mask: bool) -> tuple[Tensor, Tensor | None]:
        """Quantized values and, when ``need_mask``, a bool mask of the elements whose gradient passes.

        A ``None`` mask means every gradient passes (plain STE). Not differentiable itself.
        """
        raise NotImplementedError

    def bits_per_element(self, last_dim: int) -> float:
        """Average storage bits per element of a tensor whose last dimension has ``last_dim`` elements.

        Counts shared per-block or per-row scales; per-tensor scalars (ternary's or binary_residual's
        scale) are negligible and not counted.
        """
        raise NotImplementedError

    def check_last_dim(self, size: int) -> str | None:
        """A reason why tensors with last dimension ``size`` cannot be quantized, or None when they can."""
        return None

    def bind(self, shape: tuple[int, ...] | None) -> None:
        """Told, when its layer is built, the shape of the operand it quantizes (``None`` for an activation,
        whose leading dimensions vary): formats with learned per-row state size it here, before an optimizer
        is made. Raises :class:`QuantizerParamError` for an operand it cannot learn on."""


def _float_compute(x: Tensor) -> Tensor:
    return x if x.dtype == torch.float32 else x.to(torch.float32)


def _shared_bits(bits: int, block_size: int, last_dim: int) -> float:
    """Bits per element of a ``bits``-bit value shared by each (zero-padded) block of the last dimension."""
    return bits * math.ceil(last_dim / block_size) / last_dim


def quantizer_parameters(name: str) -> list[str]:
    """The parameter names a format accepts (its constructor's keyword arguments)."""
    return list(inspect.signature(QUANTIZERS[name].__init__).parameters)[1:]


def make_quantizer(name: str, **params: Any) -> Quantizer:
    """Build the fake quantizer of format ``name``.

    Example:
        >>> q = make_quantizer("integer", width=8, frac_width=4)
        >>> q(torch.tensor([0.03, 1.0, 100.0])).tolist()
        [0.0, 1.0, 7.9375]

    Raises:
        ConfigError: unknown format or parameter, or an invalid value (the message names the key).
    """
    if name not in QUANTIZERS:
        raise QuantizerParamError(
            "name", f"={name!r}: unknown quantization format (valid: {', '.join(QUANTIZERS)})"
        )
    allowed = quantizer_parameters(name)
    for key in params:
        if key not in allowed:
            raise QuantizerParamError(
                key, f": not a parameter of format {name!r} (valid: {', '.join(allowed)})"
            )
    required = [
        key
        for key, p in inspect.signature(QUANTIZERS[name].__init__).parameters.items()
        if p.default is inspect.Parameter.empty and key != "self"
    ]
    for key in required:
        if key not in params:
            raise QuantizerParamError(key, f": missing (format {name!r} needs {', '.join(required)})")
    return QUANTIZERS[name](**params)
