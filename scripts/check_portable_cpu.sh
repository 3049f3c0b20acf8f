#!/usr/bin/env bash
# Syntax-checks the C++ CPU kernels as a build without the AVX2 kernels compiles them (non-x86
# CPUs, or -DMXINT8_NO_AVX2_KERNELS). On x86 the tests run the portable loops
# (ADLS_MXINT8_PORTABLE_CPU=1) but the extension is always compiled with the AVX2 branch, so this
# check is what keeps the other branch of the preprocessor compiling. CI calls it.
#
# Usage: scripts/check_portable_cpu.sh [python]   (python defaults to .venv/bin/python, then python3)
set -euo pipefail

cd "$(dirname "$0")/.."
source scripts/torch_includes.sh "${1:-}"
for source in csrc/*.cpp; do
  "${CXX:-c++}" -std=c++20 -fsyntax-only -Wall -Werror -DMXINT8_NO_AVX2_KERNELS -Icsrc "${TORCH_INCLUDE_FLAGS[@]}" "$source"
  echo "check_portable_cpu: syntax check of $source without the AVX2 kernels: ok"
done
