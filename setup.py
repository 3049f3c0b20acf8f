"""Builds the optional native extension ``adls_lightning._C`` (MXINT8 kernels from ``csrc/``).

Package metadata lives in ``pyproject.toml``; this file only adds the extension. Build with torch
already installed and no build isolation (so pip does not fetch another torch)::

    pip install --no-build-isolation -e .

Environment switches:

* ``ADLS_NO_EXTENSION=1``: build no extension at all (torch is not even imported); the pure-PyTorch
  reference kernels then serve ``torch.ops.adls.*``.
* ``ADLS_USE_CUDA=0``: build only the CPU kernels even when CUDA could be built. CUDA kernels are
  built when torch has CUDA (``torch.version.cuda``) and nvcc is found (``CUDA_HOME``); no GPU
  is needed at build time. ``TORCH_CUDA_ARCH_LIST`` (e.g. ``"8.0 9.0"``) picks the architectures.
* ``DEBUG=1``: ``-O0 -g`` instead of ``-O3 -g0`` (no debug info).
"""

from __future__ import annotations

import os
import sys
from glob import glob
from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).resolve().parent
CSRC = ROOT / "csrc"


def _env_flag(name: str, default: str = "0") -> bool:
    return os.environ.get(name, default).strip().lower() not in ("", "0", "false", "no")


def get_extensions() -> tuple[list, dict]:
    """The extension modules and the ``cmdclass`` to build them with (both empty when disabled)."""
    if _env_flag("ADLS_NO_EXTENSION"):
        print("adls-lightning: ADLS_NO_EXTENSION set, building no native extension")
        return [], {}

    import torch
    from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension

    use_cuda = _env_flag("ADLS_USE_CUDA", "1") and torch.version.cuda is not None and CUDA_HOME is not None
    if not use_cuda:
        reason = (
            "ADLS_USE_CUDA=0"
            if not _env_flag("ADLS_USE_CUDA", "1")
            else "torch has no CUDA"
            if torch.version.cuda is None
            else "nvcc/CUDA_HOME not found"
        )
        print(f"adls-lightning: building the CPU kernels only ({reason})")

    debug = _env_flag("DEBUG")
    optimisation = ["-O0", "-g"] if debug else ["-O3", "-DNDEBUG"]
    # No FMA contraction: the kernels must round exactly like the PyTorch reference. -g0 (host compiler only):
    # Python's own CFLAGS, which come first, carry -g, and debug info for torch's headers is half of each file's
    # compile (a .cpp with torch/extension.h: 53 CPU-s with -g, 23 s without); the generated code is the same.
    cxx_flags = [*optimisation, *([] if debug else ["-g0"]), "-ffp-contract=off"]
    # at::parallel_for is an inline OpenMP region in ATen's headers: without -fopenmp it silently
    # runs on one thread. The Linux torch wheel ships libgomp.so.1, which the loader then shares
    # with the extension (one thread pool). Apple's clang has no -fopenmp, so macOS stays serial.
    link_args: list[str] = []
    if sys.platform.startswith("linux"):
        cxx_flags.append("-fopenmp")
        link_args.append("-fopenmp")
    sources = sorted(glob("csrc/*.cpp", root_dir=ROOT))
    extension_class = CppExtension
    extra_compile_args: dict[str, list[str]] = {"cxx": cxx_flags}
    if use_cuda:
        sources += sorted(glob("csrc/cuda/*.cu", root_dir=ROOT)) + sorted(
            glob("csrc/cuda/*.cpp", root_dir=ROOT)
        )
        extension_class = CUDAExtension
        extra_compile_args["nvcc"] = [*optimisation]
    extension = extension_class(
        "adls_lightning._C",
        sources,
        include_dirs=[str(CSRC)],
        extra_compile_args=extra_compile_args,
        extra_link_args=link_args,
        # Only the dispatcher API and an empty module init are used, so one abi3 build serves every
        # Python >= 3.10 (torch defines Py_LIMITED_API for it), as pytorch/extension-cpp does.
        py_limited_api=True,
    )

    class BuildExtensionInTree(BuildExtension):
        """Object files in ``build/ext-temp`` for every build. pip's editable install would compile them in a new
        temporary folder each time; here ninja recompiles only the sources (or the compile command) that changed,
        so reinstalling after one edit, or building a wheel after ``pip install -e .`` with the same Python, does
        not compile every kernel again (tests/test_packaging.py builds one)."""

        def finalize_options(self) -> None:
            super().finalize_options()
            self.build_temp = str(ROOT / "build" / "ext-temp")

    return [extension], {"build_ext": BuildExtensionInTree}


ext_modules, cmdclass = get_extensions()

setup(
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    options={"bdist_wheel": {"py_limited_api": "cp310"}} if ext_modules else {},
)
