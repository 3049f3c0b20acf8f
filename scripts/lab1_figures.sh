#!/usr/bin/env bash
# Lab 1 on the CPU preset, in the labs' order, then its two figures:
#   1. fine-tune MiniLM + LoRA at full precision (the `make train` run, experiment=cpu);
#   2. width sweep 4..32 (frac = width/2): PTQ of that checkpoint (evaluation only) and QAT started from it
#      (experiment=lab1: 500 training reviews of QAT), plus the full-precision checkpoint on the same test subset;
#   3. sparsity sweep 0.1..0.9 x {l1, random} from the best QAT model (highest val/acc, then lowest width), each
#      pruned and fine-tuned on 500 reviews with the same quantization, plus the unpruned model fine-tuned alike;
#   4. docs/figures/lab1_width.png and docs/figures/lab1_sparsity.png, and their tables on stdout.
#
#   bash scripts/lab1_figures.sh                 # everything (about 1.5-2 hours on 2 cores)
#   STREAMS=2 bash scripts/lab1_figures.sh       # the sparsity sweep as two one-thread processes (default)
#   WIDTHS="4 8 12 16" SPARSITIES="0.3 0.5 0.7 0.9" bash scripts/lab1_figures.sh   # fewer points (docs/results.md's)
#
# A finished step is skipped when the script is run again (its folder holds all its metrics.json files); an
# unfinished one is moved aside to outputs/lab1-partial/ and run again.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-outputs/lab1}
STREAMS=${STREAMS:-2}
read -r -a WIDTHS <<< "${WIDTHS:-4 8 12 16 20 24 28 32}"
read -r -a SPARSITIES <<< "${SPARSITIES:-0.1 0.2 0.3 0.4 0.5 0.6 0.7 0.8 0.9}"
COMMON=(logger=csv)
source scripts/checks.sh
need_no_arguments lab1_figures.sh "$@"
# STREAMS was read only at the sparsity sweep, an hour in, where a non-number fell silently to one stream
need_positive_int STREAMS
need_python
need_writable_dir OUT

# Every point must be a shipped preset (quant=int<W>, prune=l1_<S> and random_<S>): checked before anything runs,
# so a typo does not surface after an hour of sweeps.
# The widths are the int<bits> presets alone (int8_scaled is a calibrated format, not a width).
presets_of() { (cd "conf/$1" && ls $2*.yaml | sed "s/^$2//; s/\.yaml$//" | grep -E "$3" | sort -g | paste -sd' '); }
for w in "${WIDTHS[@]}"; do
  [[ $w =~ ^[0-9]+$ ]] && [ -f "conf/quant/int$w.yaml" ] || { echo "error: WIDTHS: no preset quant=int$w (valid: $(presets_of quant int "^[0-9]+$"))" >&2; exit 2; }
done
for s in "${SPARSITIES[@]}"; do
  [ -f "conf/prune/l1_$s.yaml" ] && [ -f "conf/prune/random_$s.yaml" ] ||
    { echo "error: SPARSITIES: no presets prune=l1_$s / random_$s (valid: $(presets_of prune l1_ "^[0-9.]+$"))" >&2; exit 2; }
done
[ ${#WIDTHS[@]} -gt 0 ] && [ ${#SPARSITIES[@]} -gt 0 ] || { echo "error: WIDTHS and SPARSITIES must not be empty" >&2; exit 2; }
n_widths=${#WIDTHS[@]}
n_sparsities=${#SPARSITIES[@]}

# done_runs DIR N: DIR holds N finished runs. Otherwise a partial DIR (an interrupted sweep) is moved aside, not
# deleted, because a fresh run refuses job folders that already hold results.
done_runs() {
  [ "$(find "$1" -name metrics.json 2>/dev/null | wc -l)" -ge "$2" ] && return 0
  if [ -e "$1" ]; then
    local aside="$OUT-partial/${1#"$OUT"/}-$(date +%Y%m%d-%H%M%S)"  # outside $OUT: the plots read all of it
    mkdir -p "$(dirname "$aside")"
    echo "moving the unfinished $1 to $aside" >&2
    mv "$1" "$aside"
  fi
  return 1
}
join() { local IFS=,; echo "$*"; }
presets=$(join "${WIDTHS[@]/#/int}")

# 1. full precision
done_runs "$OUT/fp" 1 || "$PY" train.py experiment=cpu hydra.run.dir="$OUT/fp" "${COMMON[@]}"
FP_CKPT=$(ls "$OUT"/fp/checkpoints/best-*.ckpt | head -1)

# 2. widths: PTQ (plus quant=none: the full-precision line on the same test subset), then QAT
done_runs "$OUT/width/ptq" $((n_widths + 1)) || "$PY" train.py -m experiment=lab1 train=false ckpt_path="$FP_CKPT" \
  quant=none,"$presets" ++quant.mode=ptq hydra.sweep.dir="$OUT/width/ptq" "${COMMON[@]}"
done_runs "$OUT/width/qat" "$n_widths" || "$PY" train.py -m experiment=lab1 init_ckpt="$FP_CKPT" \
  quant="$presets" ++quant.mode=qat hydra.sweep.dir="$OUT/width/qat" "${COMMON[@]}"
"$PY" scripts/plot_lab1_width.py "$OUT/width" --out docs/figures/lab1_width.png

# 3. sparsity, from the best QAT model
read -r QAT_DIR QAT_WIDTH < <("$PY" scripts/plot_lab1_width.py "$OUT/width/qat" --best-run)
QAT_CKPT=$(ls "$QAT_DIR"/checkpoints/best-*.ckpt | head -1)
echo "sparsity sweep from $QAT_CKPT (int$QAT_WIDTH QAT)"
sweep_sparsity() {  # one stream: $1 = sweep folder, $2 = comma-separated prune presets
  OMP_NUM_THREADS=$(( $(nproc) / STREAMS > 0 ? $(nproc) / STREAMS : 1 )) "$PY" train.py -m experiment=lab1 init_ckpt="$QAT_CKPT" \
    quant="int$QAT_WIDTH" ++quant.mode=qat prune="$2" hydra.sweep.dir="$1" "${COMMON[@]}"
}
l1=$(join none "${SPARSITIES[@]/#/l1_}")
random=$(join "${SPARSITIES[@]/#/random_}")
if [ "$STREAMS" -ge 2 ]; then
  pids=()
  done_runs "$OUT/sparsity/l1" $((n_sparsities + 1)) || { sweep_sparsity "$OUT/sparsity/l1" "$l1" & pids+=($!); }
  done_runs "$OUT/sparsity/random" "$n_sparsities" || { sweep_sparsity "$OUT/sparsity/random" "$random" & pids+=($!); }
  for pid in "${pids[@]}"; do wait "$pid"; done
else
  done_runs "$OUT/sparsity/l1" $((n_sparsities + 1)) || sweep_sparsity "$OUT/sparsity/l1" "$l1"
  done_runs "$OUT/sparsity/random" "$n_sparsities" || sweep_sparsity "$OUT/sparsity/random" "$random"
fi
"$PY" scripts/plot_lab1_sparsity.py "$OUT/sparsity" --out docs/figures/lab1_sparsity.png \
  --title "Lab 1: accuracy vs sparsity (int$QAT_WIDTH QAT model, pruned, fine-tuned)"
