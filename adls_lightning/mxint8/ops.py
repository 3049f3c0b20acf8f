"""The ``torch.ops.adls.mxint8_*`` operators.

Schemas and fake (meta) kernels are defined here, once. The pure-PyTorch reference
(:mod:`adls_lightning.mxint8.format`) is registered as the ``CompositeExplicitAutograd`` kernel, so
the ops work on every device with no compiler. The compiled extension ``adls_lightning._C``
(built by ``setup.py`` from ``csrc/``) adds faster CPU and CUDA kernels for the same schemas; a
backend kernel takes precedence over the composite one, so loading it is all that is needed.

Quantize and dequantize are not differentiable (their outputs are integers, or come from integers);
``mxint8_linear`` is differentiable w.r.t. ``x`` and ``bias`` (the packed weight is a constant).
"""

from __future__ import annotations

import importlib
import logging
import os
from types import ModuleType

import torch

from adls_lightning.mxint8.format import (
    check_dequantize_args,
    check_linear_args,
    check_quantize_args,
    dequantize_reference,
    linear_reference,
    quantize_reference,
)

log = logging.getLogger(__name__)

#: Set to 1 to ignore a built extension and run the reference kernels everywhere.
DISABLE_NATIVE_ENV = "ADLS_DISABLE_NATIVE_KERNELS"
#: Set to 1 to keep the C++ CPU kernels on their portable loops even where AVX2 is available.
PORTABLE_CPU_ENV = "ADLS_MXINT8_PORTABLE_CPU"


def env_flag(name: str) -> bool:
    """True when the switch ``name`` is set to anything but empty or ``0`` (the C++ side reads it alike)."""
    return os.environ.get(name, "0") not in ("", "0")


QUANTIZE_OP = "adls::mxint8_quantize"
DEQUANTIZE_OP = "adls::mxint8_dequantize"
LINEAR_OP = "adls::mxint8_linear"

_lib = torch.library.Library("adls", "FRAGMENT")  # kept alive for the life of the process
_lib.define("mxint8_quantize(Tensor x, int group_size) -> (Tensor, Tensor)")
_lib.define("mxint8_dequantize(Tensor mantissa, Tensor scale, int group_size, ScalarType dtype) -> Tensor")
_lib.define("mxint8_linear(Tensor x, Tensor mantissa, Tensor scale, Tensor? bias, int group_size) -> Tensor")


@torch.library.register_fake(QUANTIZE_OP, lib=_lib)
def _quantize_fake(x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    check_quantize_args(x, group_size)
    scale_shape = (*x.shape[:-1], x.shape[-1] // group_size)
    return x.new_empty(x.shape, dtype=torch.int8), x.new_empty(scale_shape, dtype=torch.uint8)


@torch.library.register_fake(DEQUANTIZE_OP, lib=_lib)
def _dequantize_fake(
    mantissa: torch.Tensor, scale: torch.Tensor, group_size: int, dtype: torch.dtype
) -> torch.Tensor:
    check_dequantize_args(mantissa, scale, group_size, dtype)
    return mantissa.new_empty(mantissa.shape, dtype=dtype)


@torch.library.register_fake(LINEAR_OP, lib=_lib)
def _linear_fake(
    x: torch.Tensor, mantissa: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, group_size: int
) -> torch.Tensor:
    check_linear_args(x, mantissa, scale, bias, group_size)
    return x.new_empty((*x.shape[:-1], mantissa.shape[0]))


@torch.library.impl(_lib, "mxint8_quantize", "CompositeExplicitAutograd")
def _quantize_default(x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    return quantize_reference(x, group_size)


@torch.library.impl(_lib, "mxint8_dequantize", "CompositeExplicitAutograd")
def _dequantize_default(
    mantissa: torch.Tensor, scale: torch.Tensor, group_size: int, dtype: torch.dtype
) -> torch.Tensor:
    return dequantize_reference(mantissa, scale, group_size, dtype)


@torch.library.impl(_lib, "mxint8_linear", "CompositeExplicitAutograd")
def _linear_default(
    x: torch.Tensor, mantissa: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, group_size: int
) -> torch.Tensor:
    # Dequantize through the dispatcher: the native CPU/CUDA dequantize kernels serve when loaded.
    return linear_reference(x, mantissa, scale, bias, group_size, torch.ops.adls.mxint8_dequantize)


def _linear_setup_context(ctx, inputs, output) -> None:
    x, mantissa, scale, bias, group_size = inputs
    ctx.save_for_backward(mantissa, scale)
    ctx.group_size = group_size
    ctx.x_dtype = x.dtype
    ctx.has_bias = bias is not None


def _linear_backward(ctx, grad_output: torch.Tensor):
    """d/dx = grad_output @ W (the dequantized weight, transient); d/dbias = grad_output summed over rows."""
    mantissa, scale = ctx.saved_tensors
    grad_x = grad_bias = None
    if ctx.needs_input_grad[0]:
        weight_dtype = torch.float32 if ctx.x_dtype == torch.float64 else ctx.x_dtype
        weight = dequantize(mantissa, scale, ctx.group_size, weight_dtype).to(ctx.x_dtype)
        grad_x = grad_output.to(ctx.x_dtype) @ weight
    if ctx.has_bias and ctx.needs_input_grad[3]:
        grad_bias = grad_output.reshape(-1, grad_output.shape[-1]).sum(0)
    return grad_x, None, None, grad_bias, None


torch.library.register_autograd(LINEAR_OP, _linear_backward, setup_context=_linear_setup_context, lib=_lib)


def _load_native_extension() -> ModuleType | None:
    """Import ``adls_lightning._C`` (registers the CPU/CUDA kernels); None when absent or disabled.

    Logged at DEBUG: this runs on import, inside a run's checks, where a record would open the run's log file
    before the run is accepted; ``native_kernels_loaded()`` / ``native_cpu_isa()`` say the same on demand.
    """
    if env_flag(DISABLE_NATIVE_ENV):
        log.debug("MXINT8: %s set, using the PyTorch reference kernels", DISABLE_NATIVE_ENV)
        return None
    try:
        extension = importlib.import_module("adls_lightning._C")
    except ImportError as error:
        log.debug("MXINT8: native kernels not available (%s); using the PyTorch reference kernels", error)
        return None
    log.debug(
        "MXINT8: native kernels loaded (CPU %s%s)",
        extension.cpu_isa,
        ", CUDA" if native_cuda_kernels_loaded() else "",
    )
    return extension


def _has_kernel(op: str, dispatch_key: str) -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key(op, dispatch_key)


def native_kernels_loaded() -> bool:
    """True when the compiled C++ CPU kernels serve ``torch.ops.adls.mxint8_*`` on CPU tensors."""
    return _NATIVE is not None and _has_kernel(QUANTIZE_OP, "CPU") and _has_kernel(DEQUANTIZE_OP, "CPU")


def native_linear_kernel_loaded() -> bool:
    """True when the compiled fused CPU kernel serves ``torch.ops.adls.mxint8_linear`` on CPU tensors."""
    return _NATIVE is not None and _has_kernel(LINEAR_OP, "CPU")


def native_cpu_isa() -> str | None:
    """Instruction set of the C++ CPU group kernels: ``"avx2"`` or ``"portable"`` (None: not loaded).

    The AVX2 kernels serve group sizes that are a multiple of 8 on CPUs with AVX2 (unless
    ``ADLS_MXINT8_PORTABLE_CPU=1``); the portable loops serve everything else.
    """
    return _NATIVE.cpu_isa if native_kernels_loaded() else None


def native_cuda_kernels_loaded() -> bool:
    """True when the extension was built with its CUDA kernels (torch with CUDA and nvcc at build time)."""
    return _has_kernel(QUANTIZE_OP, "CUDA") and _has_kernel(DEQUANTIZE_OP, "CUDA")


def native_cuda_linear_loaded() -> bool:
    """True when the fused CUDA kernel serves ``torch.ops.adls.mxint8_linear`` on CUDA tensors (it then picks its
    own route by rows in C++: fused for few rows, dequantize + cuBLAS above)."""
    return _has_kernel(LINEAR_OP, "CUDA")


def quantize(x: torch.Tensor, group_size: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """MXINT8-quantize ``x`` along its last dimension: ``(int8 mantissa, uint8 scale)``."""
    return torch.ops.adls.mxint8_quantize(x, group_size)


def dequantize(
    mantissa: torch.Tensor, scale: torch.Tensor, group_size: int = 32, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Dequantize MXINT8 ``(mantissa, scale)`` to ``dtype`` (float32, bfloat16 or float16)."""
    return torch.ops.adls.mxint8_dequantize(mantissa, scale, group_size, dtype)


def linear(
    x: torch.Tensor,
    mantissa: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    group_size: int = 32,
) -> torch.Tensor:
    """``x @ dequantize(mantissa, scale).T + bias`` without materialising the float weight (fused kernel)."""
    return torch.ops.adls.mxint8_linear(x, mantissa, scale, bias, group_size)


_NATIVE = _load_native_extension()
