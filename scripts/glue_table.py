"""The paper-style table: tasks x compression methods, each cell the task's main metric on its test split (GLUE:
the dev file), from the ``metrics.json`` files of ``scripts/glue_table.sh``'s multiruns.

One row per method (fp, int8 QAT, L1 50 % + fine-tune, MXINT8 packed), one column per task, an average column and
the model's size in MB (weights as stored: fp32; int8 = the quantized linear layers at their widths; MXINT8 =
the packed model; L1 50 % is counted dense, its zeros stored). The task and the method of a run come from its
saved config (``data.task``, ``method``); the main metric from the task table (``adls_lightning.data.tasks``).

Usage::

    python scripts/glue_table.py outputs/glue_table --out docs/figures/glue_table.png --md docs/glue_table.md
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from adls_lightning.data.tasks import GLUE_TASKS
from adls_lightning.run_records import iter_run_records

METHODS = {
    "fp": "full precision",
    "int8_qat": "int8 QAT",
    "l1_ft": "L1 50 % + fine-tune",
    "mxint8": "MXINT8 packed",
}
MB = 1e6


def model_mb(method: str, metrics: dict) -> float | None:
    """Stored size of the evaluated model: see the module docstring."""
    if method == "int8_qat" and "quant/weight_bytes" in metrics:
        return metrics["quant/weight_bytes"] / MB
    if method == "mxint8" and "mxint8/model_bytes_packed" in metrics:
        return metrics["mxint8/model_bytes_packed"] / MB
    if "params/total" in metrics:  # fp32, LoRA adapters merged (or counted once merged)
        return 4 * (metrics["params/total"] - metrics.get("model/lora_params", 0)) / MB
    return None


def read_cells(roots: list[Path]) -> tuple[dict[tuple[str, str], float], dict[str, float]]:
    """``{(method, task): main metric}`` and ``{method: size in MB}`` from the runs under ``roots``."""
    cells, sizes = {}, {}
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
        cells[(method, task)] = metrics[key]
        size = model_mb(method, metrics)
        if size is not None:
            sizes.setdefault(method, size)
    return cells, sizes


def markdown(cells: dict[tuple[str, str], float], sizes: dict[str, float]) -> str:
    tasks = [t for t in GLUE_TASKS if any(task == t for _, task in cells)]
    methods = [m for m in METHODS if any(method == m for method, _ in cells)]
    head = [f"{t} ({GLUE_TASKS[t].main_metric})" for t in tasks]
    lines = [f"| method | {' | '.join(head)} | average | size (MB) |", "|---" * (len(tasks) + 3) + "|"]
    for method in methods:
        values = [cells.get((method, t)) for t in tasks]
        shown = [f"{100 * v:.1f}" if v is not None else "" for v in values]
        done = [v for v in values if v is not None]
        average = f"{100 * sum(done) / len(done):.1f}" if len(done) == len(tasks) else ""
        size = f"{sizes[method]:.1f}" if method in sizes else ""
        lines.append(f"| {METHODS[method]} | {' | '.join(shown)} | {average} | {size} |")
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
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("roots", nargs="+", type=Path, help="folders holding the runs (searched recursively)")
    parser.add_argument("--out", type=Path, required=True, help="figure file (.png, .svg, .pdf)")
    parser.add_argument("--md", type=Path, help="also write the markdown table to this file")
    args = parser.parse_args(argv)
    missing = [str(root) for root in args.roots if not root.is_dir()]
    if missing:
        print(f"error: roots: no such folder {missing[0]}", file=sys.stderr)
        return 2
    cells, sizes = read_cells(args.roots)
    if not cells:
        print(
            f"error: roots: no finished GLUE table run under {', '.join(map(str, args.roots))}",
            file=sys.stderr,
        )
        return 2
    table = markdown(cells, sizes)
    print(table)
    if args.md is not None:
        args.md.parent.mkdir(parents=True, exist_ok=True)
        args.md.write_text(table + "\n")
    plot(cells, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
