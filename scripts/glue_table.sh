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
# Every setting checked before the first fine-tune: the table's outputs were checked only after all the runs.
source scripts/checks.sh
need_no_arguments glue_table.sh "$@"
need_flag PLOT_ONLY
need_python
[ ${#TASKS[@]} -gt 0 ] || refuse "TASKS must not be empty (e.g. TASKS=\"rte mrpc stsb\")"
glue_tasks=$("$PY" -c 'from adls_lightning.data.tasks import GLUE_TASKS; print(*GLUE_TASKS)')
for task in "${TASKS[@]}"; do
  [[ " $glue_tasks " == *" $task "* ]] || refuse "TASKS: $task is not a GLUE task (valid: $glue_tasks)"
done
need_writable_dir OUT
if ! why=$("$PY" scripts/glue_table.py --check-outputs --out "$FIG" --md "$MD" 2>&1 >/dev/null); then
  why=$(tail -n 1 <<< "$why")  # glue_table.py's own line, its options renamed to this script's variables
  refuse "$(sed 's/^error: //; s/^--out=/FIG=/; s/^--md=/MD=/; s/ (see glue_table.py --help)$//' <<< "$why")"
fi
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
