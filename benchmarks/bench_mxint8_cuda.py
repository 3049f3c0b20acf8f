"""The fused MXINT8 packed linear on a CUDA GPU against ``nn.Linear`` in fp32 and bf16, in one run (issue 62).

Where decoding is memory-bound (few rows: a matrix-vector product), a kernel that reads 8.25 bits per weight and
never writes the dequantized weight can be up to 16 / 8.25 = 1.94x faster than a bf16 ``nn.Linear`` and
32 / 8.25 = 3.9x faster than an fp32 one. For BERT-base's and MiniLM's FFN shapes and each row count this prints
the device time per call of

* ``nn.Linear`` with weights and input in the dtype (cuBLAS),
* ``fused``: ``torch.ops.adls.mxint8_linear`` with the input in the dtype (the fused kernel up to its row limit,
  then dequantize + cuBLAS, both chosen in C++),
* ``deq+mm``: ``mxint8_dequantize`` into the dtype, then ``F.linear`` (what the layer did before the kernel),

each captured 50 times in a CUDA graph and replayed over interleaved rounds (the best round), so the times are
the GPU's and not the host's launch cost; the weight bytes each read per second beside the device's copy
bandwidth; and the largest difference between ``fused`` and ``deq+mm``. Then the host time per call of the op
(grad mode, ``no_grad``, ``inference_mode``) beside ``F.linear``'s, and a MiniLM forward (random weights from the
config, nothing downloaded) at batch 1 with bf16 weights vs packed ones. Everything is written to ``--out`` as JSON
with the device name and date (``scripts/gpu_check.sh`` step 4).

    python benchmarks/bench_mxint8_cuda.py --out gpu_results/mxint8_cuda.json
    python benchmarks/bench_mxint8_cuda.py --dry-run          # argument checks only, any machine
"""

from __future__ import annotations

import datetime
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from adls_lightning.mxint8 import (  # noqa: E402
    dequantize,
    linear,
    native_cuda_linear_loaded,
    pack_linear_layers,
    quantize,
)
from adls_lightning.script_args import Parser, positive_int  # noqa: E402

SHAPES = {"bert-base": [(768, 3072), (3072, 768)], "minilm": [(384, 1536), (1536, 384)]}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
GROUP_SIZE = 32
CALLS_PER_GRAPH = 50
PACKED_BITS = 8 + 8 / GROUP_SIZE  # an int8 mantissa per weight and a shared 8-bit exponent per group
GOALS = {"bfloat16": 1.6, "float32": 3.0}  # issue 62, rows 1-16


def graph_seconds(fns: dict[str, Callable[[], object]], rounds: int) -> dict[str, float]:
    """Device seconds per call of each function: CALLS_PER_GRAPH calls captured in one CUDA graph, replayed in
    interleaved rounds, the best round kept."""
    graphs = {}
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for fn in fns.values():  # warm-up outside the capture (allocator pools, cuBLAS handles)
            for _ in range(3):
                fn()
    torch.cuda.current_stream().wait_stream(stream)
    for name, fn in fns.items():
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(CALLS_PER_GRAPH):
                fn()
        graphs[name] = graph
    best = dict.fromkeys(fns, float("inf"))
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(rounds):
        for name, graph in graphs.items():
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            best[name] = min(best[name], start.elapsed_time(end) / 1e3 / CALLS_PER_GRAPH)
    return best


def copy_bandwidth(device: torch.device) -> float:
    """Bytes per second read + written by a device copy of 256 MiB (the memory's practical limit)."""
    source = torch.empty(64 * 2**20, dtype=torch.float32, device=device)
    target = torch.empty_like(source)
    seconds = graph_seconds({"copy": lambda: target.copy_(source)}, rounds=5)["copy"]
    return 2 * source.numel() * 4 / seconds


def layer_routes(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, mantissa: torch.Tensor, scale: torch.Tensor
) -> dict[str, Callable[[], torch.Tensor]]:
    """The three ways to compute the layer for ``x`` (all in ``x``'s dtype)."""
    return {
        "nn.Linear": lambda: F.linear(x, weight, bias),
        "fused": lambda: linear(x, mantissa, scale, bias, GROUP_SIZE),
        "deq+mm": lambda: F.linear(x, dequantize(mantissa, scale, GROUP_SIZE, x.dtype), bias),
    }


def bench_layers(shape_names: list[str], rows: list[int], dtypes: list[str], rounds: int) -> list[dict]:
    device = torch.device("cuda")
    results = []
    for shape_name in shape_names:
        for in_features, out_features in SHAPES[shape_name]:
            torch.manual_seed(0)
            weight32 = torch.randn(out_features, in_features, device=device) / in_features**0.5
            bias32 = torch.randn(out_features, device=device)
            mantissa, scale = quantize(weight32, GROUP_SIZE)
            for dtype_name in dtypes:
                dtype = DTYPES[dtype_name]
                weight, bias = weight32.to(dtype), bias32.to(dtype)
                for n in rows:
                    x = torch.randn(n, in_features, device=device, dtype=dtype)
                    fns = layer_routes(x, weight, bias, mantissa, scale)
                    with torch.inference_mode():
                        seconds = graph_seconds(fns, rounds)
                        difference = (fns["fused"]().float() - fns["deq+mm"]().float()).abs().max().item()
                    weights = in_features * out_features
                    results.append(
                        {
                            "shape": f"{in_features}->{out_features}",
                            "model": shape_name,
                            "dtype": dtype_name,
                            "rows": n,
                            **{f"{name}_us": value * 1e6 for name, value in seconds.items()},
                            "fused_vs_linear": seconds["nn.Linear"] / seconds["fused"],
                            "fused_vs_deq": seconds["deq+mm"] / seconds["fused"],
                            "fused_weight_gbs": weights * PACKED_BITS / 8 / seconds["fused"] / 1e9,
                            "linear_weight_gbs": weights * weight.element_size() / seconds["nn.Linear"] / 1e9,
                            "max_abs_diff_vs_deq": difference,
                        }
                    )
    return results


def host_overhead_us(calls: int) -> dict[str, float]:
    """Host microseconds per call, enqueue only (one row, 384 -> 384: the GPU finishes each call before the host
    issues the next, so the loop measures the host's work per call)."""
    device = torch.device("cuda")
    mantissa, scale = quantize(torch.randn(384, 384, device=device), GROUP_SIZE)
    weight = dequantize(mantissa, scale, GROUP_SIZE)
    x = torch.randn(1, 384, device=device)

    def per_call(fn: Callable[[], object]) -> float:
        for _ in range(100):
            fn()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        elapsed = time.perf_counter() - start
        torch.cuda.synchronize()
        return elapsed / calls * 1e6

    op = torch.ops.adls.mxint8_linear
    out = {"op_grad_mode": per_call(lambda: op(x, mantissa, scale, None, GROUP_SIZE))}
    with torch.no_grad():
        out["op_no_grad"] = per_call(lambda: op(x, mantissa, scale, None, GROUP_SIZE))
        out["F.linear_no_grad"] = per_call(lambda: F.linear(x, weight))
    with torch.inference_mode():
        out["op_inference_mode"] = per_call(lambda: op(x, mantissa, scale, None, GROUP_SIZE))
    return out


def minilm_forward(tokens: list[int], rounds: int) -> list[dict]:
    """A MiniLM-shaped BertModel (6 layers, hidden 384, random weights) at batch 1: bf16 weights vs packed."""
    from transformers import BertConfig, BertModel

    config = BertConfig(hidden_size=384, num_hidden_layers=6, num_attention_heads=12, intermediate_size=1536)
    torch.manual_seed(0)
    dense = BertModel(config).eval().to("cuda", torch.bfloat16)
    packed = BertModel(config).eval().to("cuda", torch.bfloat16)
    packed.load_state_dict(dense.state_dict())
    pack_linear_layers(packed, GROUP_SIZE, exclude=())
    results = []
    for n in tokens:
        ids = torch.randint(0, config.vocab_size, (1, n), device="cuda")
        fns = {"bf16": lambda ids=ids: dense(input_ids=ids), "packed": lambda ids=ids: packed(input_ids=ids)}
        best = dict.fromkeys(fns, float("inf"))
        with torch.inference_mode():
            for fn in fns.values():
                fn()
            for _ in range(rounds):
                for name, fn in fns.items():
                    torch.cuda.synchronize()
                    start = time.perf_counter()
                    fn()
                    torch.cuda.synchronize()
                    best[name] = min(best[name], time.perf_counter() - start)
        results.append({"tokens": n, **{f"{k}_ms": v * 1e3 for k, v in best.items()}})
    return results


def print_layers(results: list[dict]) -> None:
    print(
        f"\n{'model':>9} {'shape':>10} {'dtype':>8} {'rows':>4} {'Linear us':>9} {'fused us':>8} {'deq+mm us':>9}"
        f" {'fus/Lin':>7} {'fus/deq':>7} {'fused GB/s':>10} {'Linear GB/s':>11} {'max diff':>9}"
    )
    for r in results:
        print(
            f"{r['model']:>9} {r['shape']:>10} {r['dtype']:>8} {r['rows']:>4} {r['nn.Linear_us']:9.2f}"
            f" {r['fused_us']:8.2f} {r['deq+mm_us']:9.2f} {r['fused_vs_linear']:6.2f}x {r['fused_vs_deq']:6.2f}x"
            f" {r['fused_weight_gbs']:10.0f} {r['linear_weight_gbs']:11.0f} {r['max_abs_diff_vs_deq']:9.2e}"
        )
    for dtype_name, goal in GOALS.items():
        ratios = [
            r["fused_vs_linear"]
            for r in results
            if r["dtype"] == dtype_name and r["rows"] <= 16 and r["model"] == "bert-base"
        ]
        if ratios:
            bound = (16 if dtype_name == "bfloat16" else 32) / PACKED_BITS
            print(
                f"BERT-base, rows <= 16, {dtype_name}: fused vs nn.Linear {min(ratios):.2f}-{max(ratios):.2f}x"
                f" (goal >= {goal}x; bound {bound:.2f}x)"
            )


def main() -> None:
    parser = Parser(description=__doc__)
    parser.add_argument("--rows", type=positive_int, nargs="+", default=[1, 8, 16, 64], help="input rows")
    parser.add_argument(
        "--shapes", nargs="+", choices=sorted(SHAPES), default=sorted(SHAPES), help="layer shapes"
    )
    parser.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=["float32", "bfloat16"])
    parser.add_argument("--rounds", type=positive_int, default=20, help="interleaved rounds (best kept)")
    parser.add_argument(
        "--tokens", type=positive_int, nargs="+", default=[1, 8], help="MiniLM forward tokens"
    )
    parser.add_argument("--out", type=Path, default=None, help="write the results here as JSON")
    parser.add_argument("--dry-run", action="store_true", help="check the arguments and say what would run")
    args = parser.parse_args()
    if args.out is not None and args.out.exists() and args.out.is_dir():
        parser.error(
            f"--out {args.out}: is a folder; give a file name such as {args.out / 'mxint8_cuda.json'}"
        )
    if args.dry_run:
        print(
            f"dry run: would time rows {args.rows} of {args.shapes} in {args.dtypes} on CUDA, the op's host "
            f"overhead and a MiniLM forward at tokens {args.tokens}; results to {args.out or '(stdout only)'}"
        )
        return
    if not torch.cuda.is_available():
        parser.error(
            "torch sees no CUDA device (this benchmark is for a GPU machine; --dry-run checks arguments)"
        )
    if not native_cuda_linear_loaded():
        parser.error(
            "the fused CUDA kernel is not built: run ADLS_USE_CUDA=1 python setup.py build_ext --inplace"
        )
    device_name = torch.cuda.get_device_name()
    bandwidth = copy_bandwidth(torch.device("cuda"))
    print(
        f"{device_name}, torch {torch.__version__}, CUDA {torch.version.cuda}; copy: {bandwidth / 1e9:.0f} GB/s"
    )
    layers = bench_layers(args.shapes, args.rows, args.dtypes, args.rounds)
    print_layers(layers)
    host = host_overhead_us(calls=2000)
    print(
        "\nhost time per call (us): "
        + ", ".join(f"{k} {v:.1f}" for k, v in host.items())
        + " (goal: op <= 10)"
    )
    forward = minilm_forward(args.tokens, args.rounds)
    for r in forward:
        print(
            f"MiniLM forward, batch 1 x {r['tokens']} tokens: bf16 {r['bf16_ms']:.3f} ms, packed"
            f" {r['packed_ms']:.3f} ms ({r['bf16_ms'] / r['packed_ms']:.2f}x)"
        )
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        record = {
            "device": device_name,
            "date": datetime.date.today().isoformat(),
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "copy_gbs": bandwidth / 1e9,
            "layers": layers,
            "host_overhead_us": host,
            "minilm_forward": forward,
        }
        args.out.write_text(json.dumps(record, indent=1) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
