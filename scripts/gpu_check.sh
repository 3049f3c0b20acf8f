#!/usr/bin/env bash
# The MXINT8 GPU checks in one command, for a machine with a CUDA GPU (`make gpu-check`):
#
#  1. build the extension with its CUDA kernels (torch with CUDA and nvcc needed: install torch's CUDA
#     build first, e.g. `make install TORCH_INDEX=https://download.pytorch.org/whl/cu128`);
#  2. the CUDA tests (`pytest -m gpu`: quantize/dequantize vs the reference bit for bit, the packed linear,
#     pruning masks on CUDA);
#  3. dequantize/quantize throughput in TB/s at 64M, 256M and 1G elements;
#  4. the fused packed linear (benchmarks/bench_mxint8_cuda.py): device time per call against nn.Linear in fp32
#     and bf16 at 1-64 rows on BERT-base's and MiniLM's FFN shapes, the op's host time per call, and a MiniLM
#     batch-1 forward with packed vs bf16 weights, written to one JSON file ($GPU_RESULTS, default
#     gpu_results/mxint8_cuda.json: the device name and date are in it);
#  5. the memory report's peak-allocated measurement (Lab 4 3d) for BERT-base and DeBERTa-v2-xlarge shapes
#     built from config (random weights, nothing downloaded);
#  6. a pruning schedule's mask step for MiniLM's 37 linears on the GPU (one sort per layer vs kthvalue); its
#     gpu test (masks on CUDA equal the CPU's) runs in step 2.
#
# Usage: scripts/gpu_check.sh [--dry-run] [python]
#   --dry-run: no GPU needed; prints each step and runs the Python steps' own --dry-run (argument checks) and
#   a syntax check of this script, which is what CI exercises (tests/test_mxint8_gpu_check.py).
set -euo pipefail
cd "$(dirname "$0")/.."

DRY_RUN=0
if [[ "${1:-}" == "--dry-run" ]]; then DRY_RUN=1; shift; fi
# a mistyped flag (--dryrun) was taken for the python and replaced by python3: the whole GPU run started
[[ "${1:-}" != -* ]] || { echo "error: $1: unknown option (usage: scripts/gpu_check.sh [--dry-run] [python])" >&2; exit 2; }
[[ $# -le 1 ]] || { echo "error: $2: unexpected argument (usage: scripts/gpu_check.sh [--dry-run] [python])" >&2; exit 2; }
if [[ -n "${1:-}" ]]; then
  PY=$1
  command -v "$PY" >/dev/null || { echo "error: python=$PY: no such interpreter" >&2; exit 2; }
else
  PY=.venv/bin/python
  [[ -x "$PY" ]] || PY=python3
fi

RESULTS_FILE="${GPU_RESULTS:-gpu_results/mxint8_cuda.json}"

step() { echo; echo "== gpu_check: $*"; }
run() {
  echo "+ $*"
  if [[ "$DRY_RUN" == 0 ]]; then "$@"; fi
}
# Python steps: run for real, or with --dry-run appended (they parse their arguments and stop).
run_py() {
  echo "+ $*"
  if [[ "$DRY_RUN" == 0 ]]; then "$@"; else "$@" --dry-run; fi
}

if [[ "$DRY_RUN" == 0 ]]; then
  if ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu_check: torch sees no CUDA device (torch $("$PY" -c 'import torch; print(torch.__version__)')); run" \
      "it on a GPU machine, or pass --dry-run to check the steps" >&2
    exit 1
  fi
  arch="$("$PY" -c "import torch; print('%d.%d' % torch.cuda.get_device_capability())")"
  export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-$arch}"
fi

step "1. build the extension with CUDA kernels (TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-<this GPU>})"
run env ADLS_USE_CUDA=1 "$PY" setup.py build_ext --inplace
run "$PY" -c "import adls_lightning.mxint8 as m; assert m.native_cuda_kernels_loaded(), 'no CUDA kernels'; print('CUDA kernels loaded')"

step "2. CUDA tests (bit-exact MXINT8, packed linear, pruning masks)"
run "$PY" -m pytest -m gpu -q -p no:cacheprovider tests/test_mxint8.py tests/test_mxint8_linear.py tests/test_prune.py

step "3. dequantize / quantize throughput (TB/s), 64M-1G elements"
run_py "$PY" benchmarks/bench_mxint8.py --gpu-only --sizes 64M 256M 1G

step "4. the fused packed linear vs nn.Linear fp32/bf16 (rows 1-64, BERT-base and MiniLM shapes), its host time per call, a MiniLM batch-1 forward; results in ${RESULTS_FILE}"
run_py "$PY" benchmarks/bench_mxint8_cuda.py --rows 1 8 16 64 --out "$RESULTS_FILE"

step "5. memory report: peak allocated, fp32 vs packed"
run_py "$PY" scripts/mxint8_memory_report.py --from-config bert-base
run_py "$PY" scripts/mxint8_memory_report.py --from-config deberta-v2-xlarge

step "6. pruning masks on the GPU: one schedule step for MiniLM's 37 linears, sort vs kthvalue"
run_py "$PY" benchmarks/bench_masks.py --device cuda

if [[ "$DRY_RUN" == 1 ]]; then
  bash -n "$0"
  echo; echo "gpu_check: dry run ok (nothing measured)"
fi
