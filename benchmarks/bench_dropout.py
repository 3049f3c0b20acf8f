"""Dropout's random numbers on one CPU thread: ns per element of ATen's generators, the Philox kernel and a copy.

A dropout reads its input and writes its output once, so a tensor copy (``clone``: read, allocate, write) is its
floor. Each row makes a new tensor the size of the input, as a dropout does:

* ``copy``: ``x.clone()``;
* ``torch.rand``: ``torch.rand_like(x)`` (ATen's uniform draw);
* ``bernoulli_``: ``torch.empty_like(x).bernoulli_(1 - p)`` (the draw ``F.dropout`` makes on CPU);
* ``F.dropout``: the whole of torch's dropout (mask, scale, multiply);
* ``philox_dropout``: ``torch.ops.adls.philox_dropout`` (the C++ kernel, mask and multiply in one pass).

The methods run in turn, ``--repeats`` rounds, so load from other processes hits them alike; medians are printed
with the ratio to the copy.

    python benchmarks/bench_dropout.py                      # MiniLM's hidden and attention-probability sizes
    python benchmarks/bench_dropout.py --threads 2
    python benchmarks/bench_dropout.py --dtype float32 bfloat16   # also bfloat16, the activations under autocast
"""

from __future__ import annotations

import itertools
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from adls_lightning.dropout import native_dropout_loaded  # noqa: E402
from adls_lightning.script_args import Parser, fraction, positive_int  # noqa: E402

# The `make train` step (16 x 256 tokens, MiniLM: hidden 384, 12 heads): hidden states and attention probabilities.
SHAPES = {"hidden 16x256x384": (16, 256, 384), "attention 16x12x256x256": (16, 12, 256, 256)}


def methods(x: torch.Tensor, p: float) -> dict[str, Callable[[], torch.Tensor]]:
    seed = torch.tensor(1234, dtype=torch.int64)
    return {
        "copy": lambda: x.clone(),
        "torch.rand": lambda: torch.rand_like(x),
        "bernoulli_": lambda: torch.empty_like(x).bernoulli_(1 - p),
        "F.dropout": lambda: F.dropout(x, p),
        "philox_dropout": lambda: torch.ops.adls.philox_dropout(x, p, seed, 0),
    }


def main() -> None:
    parser = Parser(description=__doc__)
    parser.add_argument("--threads", type=positive_int, default=1)
    parser.add_argument("--repeats", type=positive_int, default=15)
    parser.add_argument("--p", type=fraction, default=0.1, help="dropout probability, in [0, 1)")
    parser.add_argument(
        "--dtype",
        nargs="+",
        choices=("float32", "bfloat16"),
        default=["float32"],
        help="the activations' dtype: float32, or bfloat16 as under CPU autocast (trainer.precision=bf16-mixed)",
    )
    args = parser.parse_args()
    if not native_dropout_loaded():
        sys.exit(
            "error: the C++ extension adls_lightning._C is not built (pip install --no-build-isolation -e .)"
        )
    torch.set_num_threads(args.threads)
    print(f"{args.threads} thread(s), p = {args.p}, median of {args.repeats} rounds")
    for dtype_name, (label, shape) in itertools.product(args.dtype, SHAPES.items()):
        x = torch.randn(shape).to(getattr(torch, dtype_name))
        calls = methods(x, args.p)
        for call in calls.values():  # warm-up: first-touch page faults, allocator
            call()
        times: dict[str, list[float]] = {name: [] for name in calls}
        for _ in range(args.repeats):
            for name, call in calls.items():
                start = time.perf_counter()
                call()
                times[name].append(time.perf_counter() - start)
        ns = {name: 1e9 * statistics.median(t) / x.numel() for name, t in times.items()}
        print(f"\n{label}, {dtype_name} ({x.numel() / 1e6:.1f} M elements)")
        print(f"{'':>16}{'ns/element':>12}{'x copy':>9}")
        for name, value in ns.items():
            print(f"{name:>16}{value:>12.2f}{value / ns['copy']:>8.2f}x")


if __name__ == "__main__":
    main()
