"""Activation-pruning cost per layer call: this project's exact per-sample selection vs the plain alternatives.

For MiniLM-sized layer inputs (batch x 256 tokens x 384 or 1536 features, l1 at 50 % by default) one run times,
interleaved (so machine load hits every method alike), with this process's CPU time on one thread:

* ``ours``: :meth:`adls_lightning.prune.ActivationSparsifier.prune` (exact count per sample, ties by position);
* ``kthvalue + masked_fill``: the straightforward exact version (``kthvalue`` threshold of each sample's row,
  ``masked_fill``), what this project did before;
* ``quantile (MASE)``: MASE's way, a ``torch.quantile`` threshold over the whole tensor and a multiply; not exact
  with ties, not per sample, and it raises on tensors above ~16 M elements.

Prints milliseconds per call and each alternative's time divided by ours.

    python benchmarks/bench_prune.py
    python benchmarks/bench_prune.py --batch 32 --sparsity 0.9 --rounds 5
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from adls_lightning.prune import ActivationSparsifier, MaskSpec, num_to_prune  # noqa: E402
from adls_lightning.script_args import Parser, fraction, positive_int  # noqa: E402


def kthvalue_pruned(rows: torch.Tensor, sparsity: float) -> torch.Tensor:
    """The plain exact selection: True at each row's ``num_to_prune`` lowest scores, by a ``kthvalue`` threshold
    and ties by position."""
    k = num_to_prune(rows.shape[1], sparsity)
    if k == 0:
        return torch.zeros_like(rows, dtype=torch.bool)
    threshold = rows.kthvalue(k, dim=1, keepdim=True).values
    below, ties = rows < threshold, rows == threshold
    return below | (ties & (ties.cumsum(dim=1) <= k - below.sum(dim=1, keepdim=True)))


def kthvalue_masked_fill(x: torch.Tensor, sparsity: float) -> torch.Tensor:
    pruned = kthvalue_pruned(x.reshape(x.shape[0], -1).abs(), sparsity)
    return x.masked_fill(pruned.view_as(x), 0)


def quantile_mase(x: torch.Tensor, sparsity: float) -> torch.Tensor:
    scores = x.abs()
    return x * (scores > torch.quantile(scores.flatten(), sparsity)).to(x.dtype)


def cpu_ms(fn: Callable[[], torch.Tensor], repeats: int) -> float:
    start = time.process_time()
    for _ in range(repeats):
        fn()
    return (time.process_time() - start) / repeats * 1e3


def main() -> None:
    parser = Parser(description=__doc__)
    parser.add_argument("--batch", type=positive_int, default=16)
    parser.add_argument("--seq", type=positive_int, default=256)
    parser.add_argument("--features", type=positive_int, nargs="+", default=[384, 1536])
    parser.add_argument("--sparsity", type=fraction, default=0.5)
    parser.add_argument("--rounds", type=positive_int, default=3)
    parser.add_argument("--repeats", type=positive_int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    sparsifier = ActivationSparsifier(MaskSpec(args.sparsity, "l1", key="prune.activation"))

    print(
        f"l1 activation pruning at {args.sparsity}, CPU time per call, 1 thread, best of {args.rounds} rounds"
    )
    print(f"{'input':>16}{'ours ms':>10}{'kthvalue+fill ms':>18}{'ratio':>8}{'quantile ms':>13}{'ratio':>8}")
    for features in args.features:
        x = torch.randn(args.batch, args.seq, features, generator=torch.Generator().manual_seed(0))
        methods = {
            "ours": lambda x=x: sparsifier.prune(x),
            "kthvalue": lambda x=x: kthvalue_masked_fill(x, args.sparsity),
            "quantile": lambda x=x: quantile_mase(x, args.sparsity),
        }
        # same result where both are exact (continuous input: no ties)
        assert torch.equal(methods["ours"]() == 0, methods["kthvalue"]() == 0)
        best = dict.fromkeys(methods, float("inf"))
        for _ in range(args.rounds):
            for name, fn in methods.items():
                fn()  # warm-up
                best[name] = min(best[name], cpu_ms(fn, args.repeats))
        shape = "x".join(map(str, x.shape))
        print(
            f"{shape:>16}{best['ours']:>10.1f}{best['kthvalue']:>18.1f}{best['kthvalue'] / best['ours']:>7.2f}x"
            f"{best['quantile']:>13.1f}{best['quantile'] / best['ours']:>7.2f}x"
        )


if __name__ == "__main__":
    main()
