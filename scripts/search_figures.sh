#!/usr/bin/env bash
# The four search figures of docs/search.md (Labs 2 and 3) on the CPU search preset, then their PNGs.
#
#   bash scripts/search_figures.sh            # WORKERS=2 processes share each study (one thread each)
#   WORKERS=1 bash scripts/search_figures.sh
#
# Every study lives in outputs/search/<study>/<study>.db, so re-running resumes the unfinished studies and skips
# the finished ones (their trials are not repeated).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
WORKERS=${WORKERS:-2}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}  # one thread per worker: oversubscribed OpenMP threads spin

# One study, run by $WORKERS processes on its storage; together they run exactly n_trials.
study() {
  local pids=()
  for _ in $(seq "$WORKERS"); do
    "$PY" search.py search/preset=cpu logger=none "$@" &
    pids+=($!)
    sleep 2  # the first worker creates the study's tables
  done
  for pid in "${pids[@]}"; do wait "$pid"; done
}

# Lab 2 task 1: one study per sampler
for sampler in tpe random; do study search=nas hydra/sweeper/sampler=$sampler; done
study search=nas hydra/sweeper/sampler=grid 'hydra.sweeper.grid={num_hidden_layers:[1,2,4],hidden_size:[32,64,128]}'
# Lab 2 task 2: compression-aware NAS without and with post-compression training
for post in 0 1; do study search=nas_compression compress.post_epochs=$post hydra.sweeper.n_trials=8; done
# Lab 3: one study per precision (QAT of a NAS-BERT with a format per linear layer)
for precision in integer minifloat_ieee block_fp; do
  study search=mixed_precision model=nas_bert search.precision=$precision hydra.sweeper.n_trials=8
done

mkdir -p docs/figures
"$PY" scripts/plot_search.py best-so-far outputs/search/nas-acc-*/*.db --out docs/figures/lab2_samplers.png
"$PY" scripts/plot_search.py best-so-far outputs/search/nas-acc-tpe/*.db \
  outputs/search/nas_compression-post*-acc-tpe/*.db --out docs/figures/lab2_compression.png
"$PY" scripts/plot_search.py best-so-far outputs/search/mixed_precision-*-acc-tpe/*.db \
  --out docs/figures/lab3_precisions.png
"$PY" scripts/plot_search.py pareto outputs/search/mixed_precision-*/*.db --out docs/figures/pareto_acc_bits.png
