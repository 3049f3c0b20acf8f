"""The paper-style table: tasks x compression methods, each cell the task's main metric on its test split (GLUE:
the dev file), from the ``metrics.json`` files of ``scripts/glue_table.sh``'s multiruns.

One row per method (fp, int8 QAT, L1 50 % + fine-tune, MXINT8 packed), one column per task, an average column and
the model's size in MB (weights as stored: fp32; int8 = the quantized linear layers at their widths; MXINT8 =
the packed model; L1 50 % is counted dense, its zeros stored). The task and the method of a run come from its
saved config (``data.task``, ``method``); the main metric from the task table (``adls_lightning.data.tasks``).

A run whose main metric is not a number (``nan``: a diverged fine-tune, a regression's constant prediction) is shown
as missing (``–``), named in a footnote and on stderr, and left out of its row's average, which then says how many
tasks it is over (``71.2 (2/3)``); an average is never a ``nan``, nor over fewer tasks without saying so. Both
outputs are checked before anything is written, and a damaged ``metrics.json`` is refused in one line naming it.

Usage::

    python scripts/glue_table.py outputs/glue_table --out docs/figures/glue_table.png --md docs/glue_table.md
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from adls_lightning.data.tasks import GLUE_TASKS
from adls_lightning.errors import ConfigError
from adls_lightning.runs.record import iter_run_records
from adls_lightning.script_args import FIGURE_SUFFIXES, Parser, check_output_file

METHODS = {
    "fp": "full precision",
    "int8_qat": "int8 QAT",
    "l1_ft": "L1 50 % + fine-tune",
    "mxint8": "MXINT8 packed",
}
MB = 1e6
MISSING = "–"


def model_mb(method: str, metrics: dict) -> float | None:
    """Stored size of the evaluated model: see the module docstring."""
    if method == "int8_qat" and "quant/weight_bytes" in metrics:
        return metrics["quant/weight_bytes"] / MB
    if method == "mxint8" and "mxint8/model_bytes_packed" in metrics:
        return metrics["mxint8/model_bytes_packed"] / MB
    if "params/total" in metrics:  # fp32, LoRA adapters merged (or counted once merged)
        return 4 * (metrics["params/total"] - metrics.get("model/lora_params", 0)) / MB
    return None


def read_cells(
    roots: list[Path],
) -> tuple[dict[tuple[str, str], float], dict[str, float], dict[tuple[str, str], str]]:
    """``{(method, task): main metric}`` and ``{method: size in MB}`` from the runs under ``roots``, and
    ``{(method, task): why}`` for the runs whose main metric is not a number (left out of the cells).

    Raises:
        ValueError: a ``metrics.json`` or saved config that cannot be read (naming the file).
    """
    cells, sizes, missing = {}, {}, {}
    for run_dir, metrics, config in iter_run_records(roots, "time/total_s"):
        task = (config.get("data") or {}).get("task")
        method = config.get("method")
        if task not in GLUE_TASKS or method not in METHODS:
            print(f"skipping {run_dir}: no GLUE data.task or table method in its config", file=sys.stderr)
            continue
        key = f"test/{GLUE_TASKS[task].main_metric}"
        if key not in metrics:
            print(f"skipping {run_dir}: no {key}", file=sys.stderr)
            continue
        value = metrics[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            why = f"{run_dir} has {key} = {value}"
            print(f"warning: {why}: shown as missing ({MISSING}), left out of the average", file=sys.stderr)
            missing[(method, task)] = why
            cells.pop((method, task), None)
        else:
            cells[(method, task)] = float(value)
            missing.pop((method, task), None)
        size = model_mb(method, metrics)
        if size is not None:
            sizes.setdefault(method, size)
    return cells, sizes, missing


def markdown(
    cells: dict[tuple[str, str], float],
    sizes: dict[str, float],
    missing: dict[tuple[str, str], str] | None = None,
) -> str:
    """The table; a ``missing`` cell is ``–`` with a numbered footnote, and an average over fewer than all the
    table's tasks says over how many (``(n/N)``), with a footnote saying what it leaves out."""
    missing = missing or {}
    keys = [*cells, *missing]
    tasks = [t for t in GLUE_TASKS if any(task == t for _, task in keys)]
    methods = [m for m in METHODS if any(method == m for method, _ in keys)]
    head = [f"{t} ({GLUE_TASKS[t].main_metric})" for t in tasks]
    lines = [f"| method | {' | '.join(head)} | average | size (MB) |", "|---" * (len(tasks) + 3) + "|"]
    notes: list[str] = []
    partial = False
    for method in methods:
        shown = []
        for task in tasks:
            if (method, task) in cells:
                shown.append(f"{100 * cells[(method, task)]:.1f}")
            elif (method, task) in missing:
                notes.append(missing[(method, task)])
                shown.append(f"{MISSING} [{len(notes)}]")
            else:
                shown.append("")
        done = [cells[(method, t)] for t in tasks if (method, t) in cells]
        average = f"{100 * sum(done) / len(done):.1f}" if done else ""
        if done and len(done) < len(tasks):
            average += f" ({len(done)}/{len(tasks)})"
            partial = True
        size = f"{sizes[method]:.1f}" if method in sizes else ""
        lines.append(f"| {METHODS[method]} | {' | '.join(shown)} | {average} | {size} |")
    if notes or partial:
        lines.append("")
    for number, note in enumerate(notes, 1):
        lines.append(f"[{number}] not a number: {note}; left out of the average.")
    if partial:
        lines.append(
            "(n/N): the average over the n of the N tasks with a number; "
            "not comparable with an average over all N."
        )
    return "\n".join(lines)


def plot(cells: dict[tuple[str, str], float], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = [t for t in GLUE_TASKS if any(task == t for _, task in cells)]
    methods = [m for m in METHODS if any(method == m for method, _ in cells)]
    width = 0.8 / max(len(methods), 1)
    fig, ax = plt.subplots(figsize=(1.8 + 1.6 * len(tasks), 3.6))
    for i, method in enumerate(methods):
        xs = [j + (i - (len(methods) - 1) / 2) * width for j in range(len(tasks))]
        ax.bar(xs, [100 * cells.get((method, t), float("nan")) for t in tasks], width, label=METHODS[method])
    ax.set_xticks(range(len(tasks)), [f"{t}\n({GLUE_TASKS[t].main_metric})" for t in tasks])
    ax.set_ylabel("main metric on dev (x100)")
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = Parser(description=__doc__.split("\n\n")[0])
    parser.add_argument("roots", nargs="*", type=Path, help="folders holding the runs (searched recursively)")
    parser.add_argument("--out", type=Path, required=True, help="figure file (.png, .svg, .pdf)")
    parser.add_argument("--md", type=Path, help="also write the markdown table to this file")
    parser.add_argument(
        "--check-outputs",
        action="store_true",
        help="only check that --out and --md can be written, read no run (scripts/glue_table.sh, before its runs)",
    )
    args = parser.parse_args(argv)
    if not args.roots and not args.check_outputs:
        parser.error("the following arguments are required: roots")
    try:
        return _main(args)
    except (ConfigError, ValueError) as error:
        print(f"error: {' '.join(str(error).split())}", file=sys.stderr)
        return 2


def _main(args: argparse.Namespace) -> int:
    missing_roots = [str(root) for root in args.roots if not root.is_dir()]
    if missing_roots:
        raise ConfigError(f"roots: no such folder {missing_roots[0]}")
    # every output checked before any is written: a table written and then a failing figure left half a result
    check_output_file(args.out, "--out", FIGURE_SUFFIXES)
    if args.md is not None:
        check_output_file(args.md, "--md")
    if args.check_outputs:
        return 0
    cells, sizes, missing = read_cells(args.roots)
    if not cells and not missing:
        raise ConfigError(f"roots: no finished GLUE table run under {', '.join(map(str, args.roots))}")
    table = markdown(cells, sizes, missing)
    print(table)
    if args.md is not None:
        args.md.parent.mkdir(parents=True, exist_ok=True)
        args.md.write_text(table + "\n")
    plot(cells, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
