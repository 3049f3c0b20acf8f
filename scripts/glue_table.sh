#!/usr/bin/env bash
# The paper-style table: GLUE tasks x methods (full precision, int8 QAT of the fine-tuned model, L1 50 % +
# fine-tune, MXINT8 packed) for one model, as two Hydra multiruns, then a markdown table and a figure:
#   1. fine-tune each task (method=fp): train.py -m experiment=glue_cpu data.task=rte,mrpc,stsb +method=fp
#   2. the methods from each task's checkpoint: ... +method=int8_qat,l1_ft,mxint8 fp_dir=$OUT/fp
#   3. scripts/glue_table.py -> $FIG and $MD (and the table on stdout)
#
#   bash scripts/glue_table.sh                         # rte, mrpc, stsb from ../shared/data/glue on the CPU preset
#   TASKS="rte stsb" EXTRA="data.train_size=500" bash scripts/glue_table.sh
#   PLOT_ONLY=1 bash scripts/glue_table.sh            # redraw the table and figure from $OUT, run nothing
#
# A finished step is skipped when run again (its folder holds one metrics.json per job).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-outputs/glue_table}
FIG=${FIG:-docs/figures/glue_table.png}
MD=${MD:-docs/glue_table.md}
PLOT_ONLY=${PLOT_ONLY:-0}
read -r -a TASKS <<< "${TASKS:-rte mrpc stsb}"
read -r -a EXTRA <<< "${EXTRA:-}"
METHODS=(int8_qat l1_ft mxint8)
[ ${#TASKS[@]} -gt 0 ] || { echo "error: TASKS must not be empty" >&2; exit 2; }
tasks=$(IFS=,; echo "${TASKS[*]}")
methods=$(IFS=,; echo "${METHODS[*]}")

finished() { [ "$(find "$1" -name metrics.json 2>/dev/null | wc -l)" -ge "$2" ]; }
if [ "$PLOT_ONLY" != 1 ]; then
  common=(experiment=glue_cpu "data.task=$tasks" logger=csv "${EXTRA[@]}")
  finished "$OUT/fp" "${#TASKS[@]}" || "$PY" train.py -m "${common[@]}" +method=fp \
    hydra.sweep.dir="$OUT/fp" 'hydra.sweep.subdir=${data.task}'
  finished "$OUT/methods" $(( ${#TASKS[@]} * ${#METHODS[@]} )) || "$PY" train.py -m "${common[@]}" \
    "+method=$methods" ++fp_dir="$(realpath "$OUT/fp")" hydra.sweep.dir="$OUT/methods" 'hydra.sweep.subdir=${data.task}-${oc.select:method,method}'
fi
"$PY" scripts/glue_table.py "$OUT" --out "$FIG" --md "$MD"
