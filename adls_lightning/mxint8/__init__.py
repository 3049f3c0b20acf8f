"""MXINT8 (OCP Microscaling, 8-bit integer elements): format, ``torch.ops.adls`` ops, packed layers.

Importing this package registers ``torch.ops.adls.mxint8_quantize``,
``torch.ops.adls.mxint8_dequantize`` and ``torch.ops.adls.mxint8_linear`` and loads the compiled kernels when they were built.
"""

from adls_lightning.mxint8.format import dequantize_reference, linear_reference, quantize_reference
from adls_lightning.mxint8.ops import (
    dequantize,
    linear,
    native_cpu_isa,
    native_cuda_kernels_loaded,
    native_cuda_linear_loaded,
    native_kernels_loaded,
    native_linear_kernel_loaded,
    quantize,
)
from adls_lightning.mxint8.qembedding import QEmbeddingPacked
from adls_lightning.mxint8.qlinear import (
    FUSED_MAX_ROWS,
    PackedLayer,
    QLinearPacked,
    check_packable,
    module_bytes,
    pack_linear_layers,
    packable_linear_layers,
    restore_layers,
)

__all__ = [
    "FUSED_MAX_ROWS",
    "PackedLayer",
    "QEmbeddingPacked",
    "QLinearPacked",
    "check_packable",
    "dequantize",
    "dequantize_reference",
    "linear",
    "linear_reference",
    "module_bytes",
    "native_cpu_isa",
    "native_cuda_kernels_loaded",
    "native_cuda_linear_loaded",
    "native_kernels_loaded",
    "native_linear_kernel_loaded",
    "pack_linear_layers",
    "packable_linear_layers",
    "quantize",
    "quantize_reference",
    "restore_layers",
]
