"""MXINT8 (OCP Microscaling, 8-bit integer elements): format, ``torch.ops.adls`` ops, packed layers.

Importing this package registers ``torch.ops.adls.mxint8_quantize`` and
``torch.ops.adls.mxint8_dequantize`` and loads the compiled kernels when they were built.
"""

from adls_lightning.mxint8.format import dequantize_reference, quantize_reference
from adls_lightning.mxint8.ops import (
    dequantize,
    native_cpu_isa,
    native_cuda_kernels_loaded,
    native_kernels_loaded,
    quantize,
)
from adls_lightning.mxint8.qlinear import (
    PackedLayer,
    QLinearPacked,
    check_packable,
    module_bytes,
    pack_linear_layers,
    packable_linear_layers,
    restore_layers,
)

__all__ = [
    "PackedLayer",
    "QLinearPacked",
    "check_packable",
    "dequantize",
    "dequantize_reference",
    "module_bytes",
    "native_cpu_isa",
    "native_cuda_kernels_loaded",
    "native_kernels_loaded",
    "pack_linear_layers",
    "packable_linear_layers",
    "quantize",
    "quantize_reference",
    "restore_layers",
]
