"""Packed MXINT8 linear layers: the fused kernel vs nn.Linear (fp32) and vs dequantize + matmul, in one run.

For each thread count, layer shape (BERT-base's FFN: 768->3072 and 3072->768) and number of input rows
(batch x tokens), times with the best of interleaved rounds (``bench_mxint8.best_seconds``), fp32
activations, group size 32, under ``torch.inference_mode``:

* ``nn.Linear``: the fp32 layer the packed one replaces;
* ``fused``: ``torch.ops.adls.mxint8_linear`` (reads the int8 mantissas, never builds the float weight);
* ``deq+mm``: ``mxint8_dequantize`` (native kernel) to fp32, then ``F.linear``;
* ``QLinearPacked``: the layer's forward, which picks one of the two by ``FUSED_MAX_ROWS``.

"weight GB/s" is the bytes of the weight each layer has to read (fp32: 4 per weight; packed: 1 + 1/32) over
its time, beside the machine's copy bandwidth for a buffer of the fp32 weight's size: at a few rows both
layers are limited by reading their weight. "fus %FMA" is the fused kernel's multiply-add rate as a share of
a 1024^3 fp32 BLAS matmul's (timed on its own): from about 8 rows the layer is bound by its multiply-adds,
and the summary prints, at 8 rows, deq+mm over the time those multiply-adds alone would take at the matmul's
rate -- the largest fused/deq ratio any kernel could show. The last lines give the measured switch point and the issue's
goals (rows <= 8: >= 1.5x nn.Linear and >= 3x dequantize + matmul; 512 rows: QLinearPacked no slower than
dequantize + matmul).

    python benchmarks/bench_mxint8_linear.py                 # 1 and 2 threads, rows 1 2 4 8 16 32 64 128 512
    python benchmarks/bench_mxint8_linear.py --threads 1 --rows 1 8
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_mxint8 import best_seconds, print_header  # noqa: E402

from adls_lightning.mxint8 import (  # noqa: E402
    FUSED_MAX_ROWS,
    QLinearPacked,
    dequantize,
    linear,
    native_cpu_isa,
    native_linear_kernel_loaded,
)
from adls_lightning.script_args import Parser, positive_float, positive_int  # noqa: E402

SHAPES = [(768, 3072), (3072, 768)]
ROWS = [1, 2, 4, 8, 16, 32, 64, 128, 512]
GROUP_SIZE = 32
PEAK_SIZE = 1024  # the FMA limit is estimated by a square fp32 matmul of this size (BLAS, compute-bound)


def bench_layer(
    in_features: int, out_features: int, rows: list[int], device: torch.device, budget_s: float
) -> list[dict]:
    torch.manual_seed(0)
    dense = torch.nn.Linear(in_features, out_features, device=device)
    packed = QLinearPacked.from_linear(dense, GROUP_SIZE)
    mantissa, scale, bias = packed.weight_mantissa, packed.weight_scale, packed.bias
    weight = dense.weight.detach()
    matmul_flops = matmul_rate(device, budget_s)
    results = []
    for n in rows:
        x = torch.randn(n, in_features, device=device)
        fns = {
            "nn.Linear": lambda x=x: dense(x),
            "fused": lambda x=x: linear(x, mantissa, scale, bias, GROUP_SIZE),
            "deq+mm": lambda x=x: F.linear(x, dequantize(mantissa, scale, GROUP_SIZE), bias),
            "QLinearPacked": lambda x=x: packed(x),
        }
        if n == rows[0]:
            fns["copy"] = lambda: torch.empty_like(weight).copy_(weight)
        with torch.inference_mode():
            seconds = best_seconds(fns, device, budget_s, max_rounds=200)
        results.append({"rows": n, **seconds})
    copy_seconds = results[0].pop("copy")
    for result in results:
        result["copy"] = copy_seconds
        result["matmul_flops"] = matmul_flops
    return results


def matmul_rate(device: torch.device, budget_s: float) -> float:
    """FLOP/s of a square fp32 BLAS matmul: the rate at which this machine does multiply-adds (timed on its
    own, not interleaved with the layers, whose weights it would evict from the caches)."""
    square = torch.randn(PEAK_SIZE, PEAK_SIZE, device=device)
    seconds = best_seconds({"matmul": lambda: torch.mm(square, square)}, device, budget_s, max_rounds=50)
    return 2 * PEAK_SIZE**3 / seconds["matmul"]


def fma_share(result: dict, weights: int) -> float:
    """The fused kernel's multiply-add rate as a share of the matmul's (1.0: as compute-bound as BLAS)."""
    return 2 * weights * result["rows"] / result["fused"] / result["matmul_flops"]


def print_table(in_features: int, out_features: int, results: list[dict]) -> None:
    weights = in_features * out_features
    fp32_bytes, packed_bytes = 4 * weights, weights + weights // GROUP_SIZE
    copy_gbs = 2 * fp32_bytes / results[0]["copy"] / 1e9
    peak = results[0]["matmul_flops"]
    print(
        f"\n{in_features}->{out_features} (copy of the fp32 weight: {copy_gbs:.1f} GB/s read+write;"
        f" fp32 {PEAK_SIZE}^3 matmul: {peak / 1e9:.1f} GFLOP/s, so {2 * weights / peak * 1e6:.1f} us per row"
        f" at least)"
    )
    print_header(
        [
            ("rows", ">5", ""),
            ("nn.Linear", ">10", "us"),
            ("fused", ">9", "us"),
            ("deq+mm", ">9", "us"),
            ("QLinPack", ">9", "us"),
            ("fused/Lin", ">9", ""),
            ("fused/deq", ">9", ""),
            ("QLP/deq", ">8", ""),
            ("W GB/s Lin", ">10", ""),
            ("W GB/s fus", ">10", ""),
            ("fus %FMA", ">8", ""),
        ]
    )
    for r in results:
        print(
            f"{r['rows']:>5} {r['nn.Linear'] * 1e6:10.1f} {r['fused'] * 1e6:9.1f} {r['deq+mm'] * 1e6:9.1f}"
            f" {r['QLinearPacked'] * 1e6:9.1f} {r['nn.Linear'] / r['fused']:8.2f}x {r['deq+mm'] / r['fused']:8.2f}x"
            f" {r['deq+mm'] / r['QLinearPacked']:7.2f}x {fp32_bytes / r['nn.Linear'] / 1e9:10.1f}"
            f" {packed_bytes / r['fused'] / 1e9:10.1f} {fma_share(r, weights):7.0%}"
        )


def summarise(all_results: list[tuple[int, str, list[dict]]]) -> None:
    weights_of = {f"{i}->{o}": i * o for i, o in SHAPES}
    rows_fused_wins = []
    small = {"vs_linear": [], "vs_deq": []}
    large = []
    ceilings = []
    for threads, label, results in all_results:
        wins = [r["rows"] for r in results if r["fused"] <= r["deq+mm"]]
        rows_fused_wins.append(max(wins) if wins else 0)
        for r in results:
            if r["rows"] <= 8:
                small["vs_linear"].append(r["nn.Linear"] / r["fused"])
                small["vs_deq"].append(r["deq+mm"] / r["fused"])
            if r["rows"] == 8:
                # A kernel doing its multiply-adds at the matmul's rate, and nothing else, would take this long.
                compute_bound = 2 * weights_of[label] * r["rows"] / r["matmul_flops"]
                ceilings.append(f"{threads} thr {label}: {r['deq+mm'] / compute_bound:.2f}x")
            if r["rows"] == 512:
                large.append(r["deq+mm"] / r["QLinearPacked"])
    print(
        f"\nlargest rows where fused <= deq+mm, per table: {rows_fused_wins} (FUSED_MAX_ROWS = {FUSED_MAX_ROWS})"
    )
    if small["vs_linear"]:
        print(
            f"rows <= 8: fused vs nn.Linear {min(small['vs_linear']):.2f}-{max(small['vs_linear']):.2f}x (goal >= 1.5x),"
            f" vs deq+mm {min(small['vs_deq']):.2f}-{max(small['vs_deq']):.2f}x (goal >= 3x)"
        )
    if ceilings:
        print(
            "8 rows, deq+mm over the time of the multiply-adds alone at the matmul's rate (the most any"
            " kernel could show): " + ", ".join(ceilings)
        )
    if large:
        print(
            f"512 rows: QLinearPacked vs deq+mm {min(large):.2f}-{max(large):.2f}x (goal >= 1x, i.e. no slower)"
        )


def main() -> None:
    parser = Parser(description=__doc__)
    parser.add_argument("--threads", type=positive_int, nargs="+", default=[1, 2], help="CPU thread counts")
    parser.add_argument(
        "--rows", type=positive_int, nargs="+", default=ROWS, help="input rows (batch x tokens)"
    )
    parser.add_argument("--budget", type=positive_float, default=0.5, help="seconds of rounds per row")
    parser.add_argument(
        "--device",
        default="cpu",
        choices=["cpu", "cuda"],
        help="cpu or cuda (on CUDA both routes dequantize + matmul)",
    )
    parser.add_argument("--dry-run", action="store_true", help="check the arguments and say what would run")
    args = parser.parse_args()
    device = torch.device(args.device)
    if args.dry_run:
        print(f"dry run: would time rows {args.rows} of {SHAPES} on {device}, threads {args.threads}")
        return
    # after the dry run, which checks the arguments on any machine (scripts/gpu_check.sh --dry-run without a GPU)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device (valid here: cpu)")
    print(
        f"native fused kernel: {'yes (' + str(native_cpu_isa()) + ')' if native_linear_kernel_loaded() else 'NO'}, "
        f"group_size={GROUP_SIZE}, fp32 activations, device={device}"
    )
    all_results = []
    for threads in args.threads if device.type == "cpu" else [torch.get_num_threads()]:
        torch.set_num_threads(threads)
        print(f"\n=== threads={threads}")
        for in_features, out_features in SHAPES:
            results = bench_layer(in_features, out_features, args.rows, device, args.budget)
            print_table(in_features, out_features, results)
            all_results.append((threads, f"{in_features}->{out_features}", results))
    summarise(all_results)


if __name__ == "__main__":
    main()
