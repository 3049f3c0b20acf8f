"""MXINT8 kernel throughput: native ops vs a plain copy and vs the pure-PyTorch reference, in one run.

Dequantize moves ``n + n/g`` bytes in and ``n * out_bytes`` out; it is compared with
``torch.empty_like(out).copy_(out)`` (a copy of the output size, allocation included like the op's
own) and with :func:`adls_lightning.mxint8.dequantize_reference`. Quantize moves ``4n`` bytes in and
``n + n/g`` out; it is compared with a copy of its float32 input and with ``quantize_reference``.
Throughput is bytes read + written per second (GB/s on CPU, TB/s on a GPU), from the best of
interleaved rounds (see :func:`best_seconds`).

"ceiling" bounds the "vs ref" column: any dequantize kernel must at least write its output, so it
cannot beat ``torch.empty_like(out).fill_(1)`` of the same output, and the ratio of the reference's
time to that fill's time is the most "vs ref" any kernel could show on this machine. "of ceil" is the
fraction of that write-only ceiling the kernel reaches (the fill's time over the kernel's), beside "vs copy",
its fraction of the copy bandwidth.

    python benchmarks/bench_mxint8.py            # 4K ... 64M elements, CPU (+ GPU rows when present)
    python benchmarks/bench_mxint8.py --quick    # 4K ... 4M elements, fewer repeats
    python benchmarks/bench_mxint8.py --sizes 64M 256M 1G --cpu-only   # chosen sizes (GPU check: 64M ... 1G)

By default glibc malloc is told to keep freed blocks (``--allocator reuse``), as PyTorch's CUDA
caching allocator does on a GPU: otherwise every tensor above 32 MB is a fresh ``mmap`` whose page
faults, not the kernels, set the large-size numbers (on a small VM they cap even a plain copy at
about 1 GB/s). ``--allocator os`` keeps glibc's defaults.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from adls_lightning.mxint8 import (
    dequantize,
    dequantize_reference,
    native_cpu_isa,
    native_cuda_kernels_loaded,
    native_kernels_loaded,
    quantize,
    quantize_reference,
)
from adls_lightning.runtime import keep_freed_memory
from adls_lightning.script_args import Parser, positive_int

SIZES = [4 << 10, 64 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]
QUICK_SIZES = [4 << 10, 64 << 10, 1 << 20, 4 << 20]
ROW = 4096  # tensors are (n / 4096, 4096), like a linear layer's weight


def best_seconds(
    fns: dict[str, Callable[[], object]], device: torch.device, budget_s: float, max_rounds: int
) -> dict[str, float]:
    """Best wall time of each function over interleaved rounds (one call of each per round).

    Interleaving gives every function the same share of a shared machine's noise, and the best
    round is the least disturbed one.
    """
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for fn in fns.values():  # warm-up
        fn()
    sync()
    best = dict.fromkeys(fns, float("inf"))
    start = time.perf_counter()
    rounds = 0
    while rounds < max_rounds and (rounds < 3 or time.perf_counter() - start < budget_s):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            sync()
            best[name] = min(best[name], time.perf_counter() - t0)
        rounds += 1
    return best


def print_header(columns: list[tuple[str, str, str]]) -> None:
    """Print a table's header: a line of units, the column names, a rule. ``columns`` holds
    ``(name, format spec, unit)``, e.g. ``("native", ">9", "GB/s")``; the rows use the same specs."""
    print(" ".join(f"{unit:{spec}}" for _, spec, unit in columns).rstrip())
    header = " ".join(f"{name:{spec}}" for name, spec, _ in columns)
    print(header)
    print("-" * len(header))


def bench_device(
    device: torch.device, sizes: list[int], group_size: int, budget_s: float, max_rounds: int, allocator: str
) -> None:
    unit, scale = ("TB/s", 1e12) if device.type == "cuda" else ("GB/s", 1e9)
    if device.type == "cuda":
        native = "yes" if native_cuda_kernels_loaded() else "NO (reference)"
    else:
        native = f"yes ({native_cpu_isa()})" if native_kernels_loaded() else "NO (reference)"
    print(
        f"\n{device.type.upper()}: group_size={group_size}, native kernels={native}"
        + (
            f", threads={torch.get_num_threads()}, allocator={allocator}"
            if device.type == "cpu"
            else f", {torch.cuda.get_device_name()}"
        )
    )
    print_header(
        [
            ("elements", ">9", ""),
            ("op", "<18", ""),
            ("native", ">9", unit),
            ("copy", ">9", unit),
            ("reference", ">9", unit),
            ("vs copy", ">8", ""),
            ("vs ref", ">8", ""),
            ("ceiling", ">8", ""),
            ("of ceil", ">8", ""),
        ]
    )
    for n in sizes:
        bench_size(n, device, group_size, budget_s, max_rounds, scale)


def bench_size(
    n: int, device: torch.device, group_size: int, budget_s: float, max_rounds: int, scale: float
) -> None:
    """Rows for one tensor of ``n`` elements: dequantize to float32 and bfloat16, then quantize."""
    x = torch.randn(max(n // ROW, 1), min(n, ROW), device=device)
    mantissa, scales = quantize(x, group_size)
    packed_bytes = n + n // group_size
    for dtype, label in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
        out = dequantize(mantissa, scales, group_size, dtype)
        moved = packed_bytes + n * out.element_size()
        t = best_seconds(
            {
                "native": lambda d=dtype: dequantize(mantissa, scales, group_size, d),
                "copy": lambda o=out: torch.empty_like(o).copy_(o),
                "reference": lambda d=dtype: dequantize_reference(mantissa, scales, group_size, d),
                "fill": lambda o=out: torch.empty_like(o).fill_(1),
            },
            device,
            budget_s,
            max_rounds,
        )
        print_row(n, f"dequantize->{label}", moved, 2 * n * out.element_size(), t, scale)
    t = best_seconds(
        {
            "native": lambda: quantize(x, group_size),
            "copy": lambda: torch.empty_like(x).copy_(x),
            "reference": lambda: quantize_reference(x, group_size),
        },
        device,
        budget_s,
        max_rounds,
    )
    print_row(n, "quantize fp32", 4 * n + packed_bytes, 8 * n, t, scale)


def print_row(
    n: int, name: str, op_bytes: int, copy_bytes: int, seconds: dict[str, float], scale: float
) -> None:
    op = op_bytes / seconds["native"] / scale
    copy = copy_bytes / seconds["copy"] / scale
    ref = op_bytes / seconds["reference"] / scale
    if "fill" in seconds:
        ceiling = f"{seconds['reference'] / seconds['fill']:7.1f}x"
        of_ceiling = f"{seconds['fill'] / seconds['native']:8.2f}"
    else:
        ceiling = of_ceiling = f"{'-':>8}"
    print(
        f"{size_label(n):>9} {name:<18} {op:9.3f} {copy:9.3f} {ref:9.3f} {op / copy:7.2f}x {op / ref:7.1f}x"
        f" {ceiling} {of_ceiling}"
    )


def size_label(n: int) -> str:
    if n >= 1 << 30 and n % (1 << 30) == 0:
        return f"{n >> 30}G"
    return f"{n >> 20}M" if n >= 1 << 20 else f"{n >> 10}K"


def parse_size(label: str) -> int:
    """``"64M"`` -> 64 * 2^20 elements (suffixes K, M, G; a plain number is elements)."""
    shift = {"K": 10, "M": 20, "G": 30}.get(label[-1:].upper())
    try:
        n = int(label[:-1]) << shift if shift else int(label)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{label}: expected e.g. 64M, 1G or 4096") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"{label}: must be at least 1 element, e.g. 64M, 1G or 4096")
    return n


def main() -> None:
    parser = Parser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="sizes up to 4M elements and fewer repeats")
    parser.add_argument("--group-size", type=positive_int, default=32)
    parser.add_argument("--sizes", type=parse_size, nargs="+", help="element counts, e.g. 64M 256M 1G")
    parser.add_argument("--cpu-only", action="store_true", help="skip the GPU rows")
    parser.add_argument("--gpu-only", action="store_true", help="skip the CPU rows")
    parser.add_argument("--dry-run", action="store_true", help="check the arguments and say what would run")
    parser.add_argument("--threads", type=positive_int, help="CPU threads (default: torch's default)")
    parser.add_argument(
        "--allocator", choices=["reuse", "os"], default="reuse", help="keep freed CPU memory (default) or not"
    )
    args = parser.parse_args()
    if args.cpu_only and args.gpu_only:
        parser.error("--cpu-only and --gpu-only: together they leave nothing to measure; give one")
    sizes = args.sizes or (QUICK_SIZES if args.quick else SIZES)
    # every size is a (rows, min(n, ROW)) tensor quantized in groups along its rows: checked before the dry run
    # and before the first size is timed, not at the size that does not fit
    if bad := [n for n in sizes if min(n, ROW) % args.group_size]:
        parser.error(
            f"--group-size {args.group_size}: does not divide the {size_label(bad[0])}-element tensor's rows of "
            f"{min(bad[0], ROW)} (give a divisor of {ROW}, e.g. 32, or sizes that are multiples of it)"
        )
    if args.threads:
        torch.set_num_threads(args.threads)
    allocator = args.allocator
    if allocator == "reuse" and not keep_freed_memory():
        allocator = "os (glibc malloc not configurable here)"
    if args.dry_run:
        devices = ([] if args.gpu_only else ["cpu"]) + (["cuda"] if not args.cpu_only else [])
        print(
            f"dry run: would measure {', '.join(size_label(n) for n in sizes)} elements on {', '.join(devices)}"
        )
        return
    # after the dry run, which checks the arguments on any machine (scripts/gpu_check.sh --dry-run without a GPU)
    if args.gpu_only and not torch.cuda.is_available():
        parser.error("--gpu-only: torch sees no CUDA device (drop it, or give --cpu-only)")
    budget_s, max_rounds = (0.2, 20) if args.quick else (0.5, 100)
    torch.manual_seed(0)
    if not args.gpu_only:
        bench_device(torch.device("cpu"), sizes, args.group_size, budget_s, max_rounds, allocator)
    if torch.cuda.is_available() and not args.cpu_only:
        bench_device(torch.device("cuda"), sizes, args.group_size, budget_s, max(max_rounds, 50), "caching")


if __name__ == "__main__":
    main()
