"""One step of a pruning schedule: the weight masks of MiniLM's 37 pruned linears recomputed from their scores.

A scheduled method (``prune.schedule``: gradual L1, ``movement``, ``movement_adam``) ranks every pruned layer's
scores after every optimizer step. One run times, interleaved, on the CPU (one thread) or a CUDA device:

* ``ours``: :func:`adls_lightning.prune.masks_from_scores` (on the CPU a sampled bracket around the k-th score; off
  it one stable sort per layer, :func:`adls_lightning.prune.smallest_k_by_sort`);
* ``kthvalue``: the plain exact route, a ``kthvalue`` threshold per layer and ties by position, which this project
  took on every device before (CUDA's ``kthvalue`` selects a row inside one thread block).

Both must give the same masks (checked). Prints milliseconds per step for all 37 layers, kthvalue's time divided by
ours, and the floor: the bytes a step must move (4 per score read, 1 per mask written) at the device's copy
bandwidth, measured in the same run.

    python benchmarks/bench_masks.py
    python benchmarks/bench_masks.py --device cuda --sparsity 0.5 0.9
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_prune import kthvalue_pruned  # noqa: E402

from adls_lightning.prune import MaskSpec, masks_from_scores  # noqa: E402
from adls_lightning.script_args import Parser, fraction, positive_int  # noqa: E402

# all-MiniLM-L6-v2's pruned linears (out x in): per layer query, key, value, attention output, FFN in, FFN out;
# then the pooler
MINILM_SHAPES = [(384, 384)] * 4 + [(1536, 384), (384, 1536)]
MINILM_LAYERS = 6


def kthvalue_masks(scores: dict[str, torch.Tensor], sparsity: float) -> dict[str, torch.Tensor]:
    return {name: ~kthvalue_pruned(s.reshape(1, -1), sparsity).view_as(s) for name, s in scores.items()}


def timed_ms(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fn()  # warm-up
    sync()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    sync()
    return (time.perf_counter() - start) / repeats * 1e3


def main() -> None:
    parser = Parser(description=__doc__)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="cpu (one thread) or cuda")
    parser.add_argument("--sparsity", type=fraction, nargs="+", default=[0.5, 0.9])
    parser.add_argument("--rounds", type=positive_int, default=3)
    parser.add_argument("--repeats", type=positive_int, default=5)
    parser.add_argument("--dry-run", action="store_true", help="check the arguments and say what would run")
    args = parser.parse_args()
    if args.dry_run:
        sparsities = ", ".join(f"{s:g}" for s in args.sparsity)
        print(
            f"dry run: would time the mask step of 37 MiniLM linears at sparsity {sparsities} on {args.device}"
        )
        return
    # after the dry run, which checks the arguments on any machine (scripts/gpu_check.sh --dry-run without a GPU)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device (valid here: cpu)")
    device = torch.device(args.device)
    torch.set_num_threads(1)

    g = torch.Generator().manual_seed(0)
    shapes = [*(MINILM_SHAPES * MINILM_LAYERS), (384, 384)]
    scores = {f"linear{i}": torch.randn(shape, generator=g).to(device) for i, shape in enumerate(shapes)}
    total = sum(s.numel() for s in scores.values())

    # the floor: a device-to-device copy of all the scores, in bytes read + written per second
    src = torch.cat([s.flatten() for s in scores.values()])
    dst = torch.empty_like(src)
    copy_ms = min(timed_ms(lambda: dst.copy_(src), device, args.repeats) for _ in range(args.rounds))
    bandwidth = 2 * src.numel() * 4 / (copy_ms * 1e-3)
    floor_ms = total * 5 / bandwidth * 1e3
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU, 1 thread"
    print(f"{len(scores)} MiniLM linears, {total:,} scores, {name}; copy {bandwidth / 1e9:.1f} GB/s")
    print(f"{'sparsity':>9}{'ours ms':>10}{'kthvalue ms':>13}{'ratio':>8}{'floor ms':>10}")
    for sparsity in args.sparsity:
        spec = MaskSpec(sparsity)
        methods = {
            "ours": lambda spec=spec: masks_from_scores(scores, spec),
            "kthvalue": lambda sparsity=sparsity: kthvalue_masks(scores, sparsity),
        }
        ours, plain = methods["ours"](), methods["kthvalue"]()
        assert all(torch.equal(ours[n], plain[n]) for n in scores), "the two routes' masks differ"
        best = dict.fromkeys(methods, float("inf"))
        for _ in range(args.rounds):
            for key, fn in methods.items():
                best[key] = min(best[key], timed_ms(fn, device, args.repeats))
        print(
            f"{sparsity:>9g}{best['ours']:>10.2f}{best['kthvalue']:>13.2f}"
            f"{best['kthvalue'] / best['ours']:>7.2f}x{floor_ms:>10.3f}"
        )


if __name__ == "__main__":
    main()
