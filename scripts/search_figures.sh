#!/usr/bin/env bash
# The search figures of docs/search.md (Labs 2 and 3) on the CPU search preset: the studies, then their PNGs.
#
#   bash scripts/search_figures.sh                  # every figure below (many hours on a 2-core CPU)
#   bash scripts/search_figures.sh lab3             # one figure: lab2-samplers | lab2-compression | lab3 | lab3-minilm | pareto
#   SEEDS="0 1 2 3" SAMPLER_TRIALS=20 bash scripts/search_figures.sh lab2-samplers
#   WORKERS=1 bash scripts/search_figures.sh lab3   # processes sharing each study (default 2, one thread each)
#   PLOT_ONLY=1 bash scripts/search_figures.sh lab3 # redraw from the stored studies (SEARCH_DIR, into OUT)
#   bash scripts/search_figures.sh lab3-minilm      # Lab 3 from the fine-tuned MiniLM (after scripts/lab1_figures.sh)
#
# Every study lives in outputs/search/<study>/<study>.db, so re-running resumes the unfinished studies and skips
# the finished ones (their trials are not repeated). A figure is redrawn from whatever the studies hold.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
WORKERS=${WORKERS:-2}
SEEDS=${SEEDS:-0 1 2}                     # the sampler comparison: one study per sampler and seed
SAMPLER_TRIALS=${SAMPLER_TRIALS:-16}      # trials per sampler study (the preset's 8 do not separate the curves)
LAB3_TRIALS=${LAB3_TRIALS:-8}             # trials per precision study of lab3
FP_CKPT=${FP_CKPT:-}                      # lab3-minilm: the fine-tuned MiniLM (default: outputs/lab1/fp's best)
FORMATS="integer log block_fp block_log block_minifloat minifloat_ieee minifloat_denorm binary binary_scaling
binary_residual ternary mxint8"           # the 12 formats of quant= (adls_lightning/quant/formats/)
PLOT_ONLY=${PLOT_ONLY:-0}                 # 1: run no study, draw the figures from what is stored
SEARCH_DIR=${SEARCH_DIR:-outputs/search}  # where the figures read the studies (search.py's default sweep dirs)
OUT=${OUT:-docs/figures}
PARTS="lab2-samplers lab2-compression lab3 lab3-minilm pareto"
# Everything is checked before any study starts: a part is hours of trials, and a setting read only when its part
# comes (PLOT_ONLY, a later part's name, lab3-minilm's checkpoint) was a refusal after the earlier parts ran.
source scripts/checks.sh
for var in WORKERS SAMPLER_TRIALS LAB3_TRIALS; do need_positive_int "$var"; done
need_flag PLOT_ONLY
[ -n "${SEEDS// /}" ] || refuse "SEEDS: must name at least one seed, e.g. SEEDS=\"0 1 2\""
for seed in $SEEDS; do [[ $seed =~ ^[0-9]+$ ]] || refuse "SEEDS: $seed is not a seed (integers >= 0, e.g. SEEDS=\"0 1 2\")"; done
[ -f "conf/search/preset/${PRESET:-cpu}.yaml" ] ||
  refuse "PRESET=${PRESET:-cpu}: no search/preset=${PRESET:-cpu} (valid: $(cd conf/search/preset && ls *.yaml | sed 's/\.yaml$//' | paste -sd' '))"
[ -z "$FP_CKPT" ] || [ -f "$FP_CKPT" ] || refuse "FP_CKPT=$FP_CKPT: no such checkpoint file"
[ -z "${OMP_NUM_THREADS:-}" ] || need_positive_int OMP_NUM_THREADS
requested=$(echo ${@:-lab2-samplers lab2-compression lab3 pareto})
for one in $requested; do
  [[ " $PARTS " == *" $one "* ]] || refuse "$one: unknown part (valid: ${PARTS// /, })"
done
if [[ " $requested " == *" lab3-minilm "* ]] && [ "$PLOT_ONLY" != 1 ] && [ -z "$FP_CKPT" ] &&
  ! ls outputs/lab1/fp/checkpoints/best-*.ckpt >/dev/null 2>&1; then
  refuse "lab3-minilm: no fine-tuned checkpoint in outputs/lab1/fp; run scripts/lab1_figures.sh or set FP_CKPT"
fi
[ "$PLOT_ONLY" != 1 ] || [ -d "$SEARCH_DIR" ] || refuse "SEARCH_DIR=$SEARCH_DIR: no such folder to draw the studies from (PLOT_ONLY=1)"
need_python
need_writable_dir OUT
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}  # one thread per worker: oversubscribed OpenMP threads spin
mkdir -p "$OUT"

# One study, run by $WORKERS processes on its storage; together they run exactly n_trials.
study() {
  [ "$PLOT_ONLY" = 1 ] && return
  local pids=()
  for _ in $(seq "$WORKERS"); do
    "$PY" search.py search/preset="${PRESET:-cpu}" logger=none "$@" &
    pids+=($!)
    sleep 2  # the first worker creates the study's tables
  done
  for pid in "${pids[@]}"; do wait "$pid"; done
}

# Lab 2 task 1: random vs TPE vs grid, each over $SEEDS (study nas-acc-<sampler>-seed<N>; the figure draws each
# sampler's mean best-so-far with the min-max spread over its seeds). The grid has 18 points (3 depths x 3 widths x
# 2 head counts), so it is not used up before $SAMPLER_TRIALS.
GRID='{num_hidden_layers:[1,2,4],hidden_size:[32,64,128],num_attention_heads:[2,4]}'
samplers() {
  for seed in $SEEDS; do
    for sampler in random tpe grid; do
      local extra=()
      [ "$sampler" = grid ] && extra=("hydra.sweeper.grid=$GRID")
      study search=nas hydra/sweeper/sampler=$sampler seed="$seed" hydra.sweeper.n_trials="$SAMPLER_TRIALS" \
        hydra.sweeper.study_name="nas-acc-$sampler-seed$seed" "${extra[@]}"
    done
  done
  "$PY" scripts/plot_search.py best-so-far $SEARCH_DIR/nas-acc-*-seed*/*.db --out "$OUT/lab2_samplers.png"
}

part() {
  case $1 in
    lab2-samplers) samplers ;;
    lab2-compression)  # no compression vs compression-aware NAS without and with post-compression training
      study search=nas hydra/sweeper/sampler=tpe
      for post in 0 1; do study search=nas_compression compress.post_epochs=$post hydra.sweeper.n_trials=8; done
      "$PY" scripts/plot_search.py best-so-far $SEARCH_DIR/nas-acc-tpe/*.db \
        $SEARCH_DIR/nas_compression-post*-acc-tpe/*.db --out "$OUT/lab2_compression.png" ;;
    lab3)  # one study per precision (QAT of a NAS-BERT with a format per linear layer): 12 curves
      for precision in $FORMATS; do
        study search=mixed_precision model=nas_bert search.precision="$precision" hydra.sweeper.n_trials="$LAB3_TRIALS"
      done
      "$PY" scripts/plot_search.py best-so-far $(for p in $FORMATS; do
        echo $SEARCH_DIR/mixed_precision-$p-acc-tpe/mixed_precision-$p-acc-tpe.db; done) \
        --out "$OUT/lab3_precisions.png" ;;
    lab3-minilm)  # integer mixed precision from the fine-tuned pretrained MiniLM (search/preset=cpu_minilm)
      local ckpt=${FP_CKPT:-$(ls outputs/lab1/fp/checkpoints/best-*.ckpt 2>/dev/null | head -1)}
      [ -n "$ckpt" ] || [ "$PLOT_ONLY" = 1 ] || { echo "lab3-minilm: no fine-tuned checkpoint; run scripts/lab1_figures.sh or set FP_CKPT" >&2; exit 2; }
      PRESET=cpu_minilm study search=mixed_precision init_ckpt="$ckpt"
      "$PY" scripts/plot_search.py best-so-far $SEARCH_DIR/mixed_precision-integer-minilm-acc-tpe/*.db \
        --out "$OUT/lab3_minilm.png" ;;
    pareto)  # accuracy vs average weight bits over every trial of the Lab 3 studies
      "$PY" scripts/plot_search.py pareto $(for p in $FORMATS; do
        echo $SEARCH_DIR/mixed_precision-$p-acc-tpe/mixed_precision-$p-acc-tpe.db; done) \
        --out "$OUT/pareto_acc_bits.png" ;;
    *) echo "unknown part $1 (lab2-samplers, lab2-compression, lab3, lab3-minilm, pareto)" >&2; exit 2 ;;
  esac
}

for one in $requested; do part "$one"; done
