#!/usr/bin/env bash
# Syntax-checks the C++ CPU kernels as a build without the AVX2 kernels compiles them (non-x86
# CPUs, or -DMXINT8_NO_AVX2_KERNELS). On x86 the tests run the portable loops
# (ADLS_MXINT8_PORTABLE_CPU=1) but the extension is always compiled with the AVX2 branch, so this
# check is what keeps the other branch of the preprocessor compiling. CI calls it.
#
# Usage: scripts/check_portable_cpu.sh [python]   (python defaults to .venv/bin/python, then python3)
set -euo pipefail

cd "$(dirname "$0")/.."
PYTHON="${1:-}"
if [[ -z "$PYTHON" ]]; then
  if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
TORCH_INCLUDES="$("$PYTHON" -c 'from torch.utils.cpp_extension import include_paths; print(" ".join(include_paths()))')"
PYTHON_INCLUDE="$("$PYTHON" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')"
include_flags=(-Icsrc -I"$PYTHON_INCLUDE")
for dir in $TORCH_INCLUDES; do include_flags+=(-I"$dir"); done
for source in csrc/*.cpp; do
  "${CXX:-c++}" -std=c++20 -fsyntax-only -Wall -Werror -DMXINT8_NO_AVX2_KERNELS "${include_flags[@]}" "$source"
  echo "check_portable_cpu: syntax check of $source without the AVX2 kernels: ok"
done
