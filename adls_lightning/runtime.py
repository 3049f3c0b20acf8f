"""Process-level settings for CPU runs."""

from __future__ import annotations

import ctypes
import sys

# From glibc's <malloc.h>.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_KEEP_BYTES = 1 << 30

#: ``runtime.gemm``'s values (here, not in :mod:`adls_lightning.gemm`, so the pre-flight check needs no torch).
GEMM_BACKENDS = ("auto", "aten", "onednn")
#: ``model.eval_precision``'s values (:func:`adls_lightning.precision.eval_precision`): ``auto`` = bfloat16 weights
#: where the run's resolved ``trainer.precision`` is a bfloat16 one on a CPU (which ``trainer.precision=auto`` takes
#: only where the CPU measures bf16 faster), else as the trainer computes; ``bf16`` = bfloat16 weights whatever the
#: trainer; ``32-true`` = fp32, autocast off.
EVAL_PRECISIONS = ("auto", "bf16", "32-true")


def keep_freed_memory() -> bool:
    """Make glibc malloc serve large blocks from its heap and keep freed ones for reuse.

    By default every CPU tensor above 32 MB is a fresh ``mmap`` that is returned on free, so each
    training step page-faults its activations in again; on small VMs those page faults cost more than
    the copies themselves. Keeping freed blocks (what PyTorch's caching allocator does on CUDA)
    makes a MiniLM LoRA training step 15-25 % faster on this project's 2-core machine. The price is
    that the process's resident memory stays at its peak. Returns False where malloc is not glibc's.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, _KEEP_BYTES)) and bool(
        libc.mallopt(_M_TRIM_THRESHOLD, _KEEP_BYTES)
    )
