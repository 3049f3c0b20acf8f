"""GEMM rates of a linear layer's three products on MiniLM's shapes: aten (torch's default, MKL sgemm on x86) against
oneDNN (``torch.ops.mkldnn._linear_pointwise``, the path ``runtime.gemm=onednn`` takes; docs/gemm.md).

Rows: each token count (``--tokens``: 16x256 is the `make train` step, 8x128 an inference batch) x MiniLM's linear
shapes (hidden 384, FFN 1536: q/k/v/attention-output 384->384, intermediate 384->1536, output 1536->384) x pass:

* ``fwd``: ``y = x @ W.T`` -- aten ``F.linear``; oneDNN ``_linear_pointwise(x, W)``;
* ``grad_in``: ``g @ W`` -- aten ``torch.mm``; oneDNN ``_linear_pointwise(g, W.T.contiguous())``;
* ``grad_w``: ``g.T @ x`` -- aten ``torch.mm``; oneDNN ``_linear_pointwise(g.T.contiguous(), x.T.contiguous())``.

oneDNN's times include those transposes (what :class:`adls_lightning.gemm.OneDNNLinear` runs). ``packed``: the
same with the weight operand prepacked once by ``torch.ops.mkldnn._reorder_linear_weight`` (a frozen weight's
case; not for ``grad_w``, whose operands change every step). ``diff``: max |oneDNN - aten| / max |aten| (fp32
summation order only). The methods run in turn, ``--repeats`` rounds; the best round is kept, so load from other
processes hits all alike. The machine's peak fp32 rate is estimated from /proc/cpuinfo (see :func:`peak`).

Then the cost of the routing itself (``runtime.gemm=onednn`` intercepts ``F.linear`` with a ``TorchFunctionMode``,
which every torch function called from Python passes through): µs per call of a tiny ``torch.add`` and a tiny
``nn.Linear`` with and without it, and a whole MiniLM-shaped model (random weights: hidden 384, 6 layers, 12
heads, FFN 1536) forward at each ``--tokens`` in eval mode, and forward + backward in train mode, on each backend.

    python benchmarks/bench_gemm.py                          # 1 and 2 threads, both token counts
    python benchmarks/bench_gemm.py --threads 1 --tokens 8x128 --repeats 10
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from adls_lightning.gemm import cpu_name, gemm_backend, onednn_available, onednn_linear  # noqa: E402
from adls_lightning.script_args import Parser, batch_by_length, positive_float, positive_int  # noqa: E402

# MiniLM (all-MiniLM-L6-v2): hidden 384, intermediate 1536; (in_features, out_features) of its linear layers.
SHAPES = {"384->384": (384, 384), "384->1536": (384, 1536), "1536->384": (1536, 384)}


def cpuinfo() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo (empty where there is none)."""
    fields: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if not line.strip():
                break
            key, _, value = line.partition(":")
            fields[key.strip()] = value.strip()
    except OSError:
        pass
    return fields


def peak(ghz: float | None) -> tuple[float, str]:
    """Peak fp32 GFLOP/s of one core and how it was estimated.

    FLOP per cycle: 2 FMA pipes x vector lanes x 2 (an FMA is two FLOPs): AVX-512 64 (32 on AMD family 25, Zen 4,
    whose AVX-512 runs on 256-bit units), AVX2 + FMA 32, else SSE 8. The clock is ``--ghz`` or the "cpu MHz" of
    /proc/cpuinfo, which on a VM is the nominal (base) clock: a core that boosts computes faster than this peak.
    """
    info = cpuinfo()
    flags = set(info.get("flags", "").split())
    family = info.get("cpu family", "?")
    if "avx512f" in flags:
        per_cycle = 32 if info.get("vendor_id") == "AuthenticAMD" and family == "25" else 64
        isa = "AVX-512"
    elif {"avx2", "fma"} <= flags:
        per_cycle, isa = 32, "AVX2+FMA"
    else:
        per_cycle, isa = 8, "SSE"
    source = "--ghz"
    if ghz is None:
        ghz = float(info.get("cpu MHz", "nan")) / 1000
        source = "nominal, /proc/cpuinfo cpu MHz"
    how = f"{isa} (family {family}): {per_cycle} FLOP/cycle x {ghz:.2f} GHz ({source})"
    return per_cycle * ghz, how


def methods(
    shape: tuple[int, int], rows: int, step: str
) -> tuple[float, dict[str, Callable[[], torch.Tensor]]]:
    """FLOPs of the product and its implementations (aten first: the reference of the diff)."""
    fan_in, fan_out = shape
    x = torch.randn(rows, fan_in)
    w = torch.randn(fan_out, fan_in) / fan_in**0.5
    g = torch.randn(rows, fan_out)
    flops = 2.0 * rows * fan_in * fan_out
    if step == "fwd":
        packed = torch.ops.mkldnn._reorder_linear_weight(w, rows)
        return flops, {
            "aten": lambda: F.linear(x, w),
            "onednn": lambda: onednn_linear(x, w),
            "packed": lambda: onednn_linear(x, packed),
        }
    if step == "grad_in":
        packed = torch.ops.mkldnn._reorder_linear_weight(w.t().contiguous(), rows)
        return flops, {
            "aten": lambda: torch.mm(g, w),
            "onednn": lambda: onednn_linear(g, w.t().contiguous()),
            "packed": lambda: onednn_linear(g, packed),
        }
    return flops, {
        "aten": lambda: torch.mm(g.t(), x),
        "onednn": lambda: onednn_linear(g.t().contiguous(), x.t().contiguous()),
    }


def per_call_us(call: Callable[[], object], calls: int = 2000) -> float:
    call()
    start = time.perf_counter()
    for _ in range(calls):
        call()
    return 1e6 * (time.perf_counter() - start) / calls


def routing_overhead() -> None:
    """µs per call of small ops with and without the ``TorchFunctionMode`` of ``runtime.gemm=onednn``."""
    a = torch.randn(8, 8)
    layer = torch.nn.Linear(8, 8)
    rows = {"torch.add 8x8": lambda: torch.add(a, a), "nn.Linear 8->8 forward": lambda: layer(a)}
    print(f"\nrouting overhead, 1 thread, µs per call\n{'':>24} {'aten':>7} {'oneDNN':>7}")
    torch.set_num_threads(1)
    for label, call in rows.items():
        times = {}
        for backend in ("aten", "onednn"):
            with torch.no_grad(), gemm_backend(backend):
                times[backend] = min(per_call_us(call) for _ in range(3))
        print(f"{label:>24} {times['aten']:>7.1f} {times['onednn']:>7.1f}")


def minilm_shaped_model() -> torch.nn.Module:
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=1000,  # the embedding table is no GEMM; a small one keeps the model quick to build
        hidden_size=384,
        num_hidden_layers=6,
        num_attention_heads=12,
        intermediate_size=1536,
        attn_implementation="sdpa",
    )
    return BertForSequenceClassification(config)


def model_steps(threads: list[int], tokens: list[str], repeats: int) -> None:
    """ms of a MiniLM-shaped model's eval forward and train forward + backward on each backend."""
    model = minilm_shaped_model()
    print(f"\nMiniLM-shaped model (random weights), ms, best of {repeats}")
    print(
        f"{'thr':>3} {'tokens':>7} {'step':>14} {'aten':>8} {'oneDNN':>8} {'aten/oneDNN':>12} {'max diff':>9}"
    )
    for n in threads:
        torch.set_num_threads(n)
        for shape in tokens:
            batch, length = (int(v) for v in shape.split("x"))
            ids = torch.randint(0, 1000, (batch, length))

            def forward(ids: torch.Tensor) -> torch.Tensor:
                model.eval()
                with torch.no_grad():
                    return model(input_ids=ids).logits

            def train_step(ids: torch.Tensor) -> torch.Tensor:
                model.train()
                torch.manual_seed(1)  # the same dropout masks on both backends
                model.zero_grad(set_to_none=True)
                logits = model(input_ids=ids).logits
                logits.square().sum().backward()
                return logits.detach()

            for label, step in (("eval forward", forward), ("train fwd+bwd", train_step)):
                best, out = {}, {}
                for backend in ("aten", "onednn"):
                    with gemm_backend(backend):
                        out[backend] = step(ids)  # warm-up
                        best[backend] = float("inf")
                for _ in range(repeats):
                    for backend in ("aten", "onednn"):
                        with gemm_backend(backend):
                            start = time.perf_counter()
                            step(ids)
                            best[backend] = min(best[backend], time.perf_counter() - start)
                diff = float((out["onednn"] - out["aten"]).abs().max())
                ratio = best["aten"] / best["onednn"]
                print(
                    f"{n:>3} {shape:>7} {label:>14} {1e3 * best['aten']:>8.1f} {1e3 * best['onednn']:>8.1f}"
                    f" {ratio:>11.2f}x {diff:>9.1e}"
                )


def tokens_arg(text: str) -> str:
    """``--tokens``: ``BATCHxLENGTH``, checked when parsed (the loops split it again)."""
    batch_by_length(text)
    return text


def main() -> None:
    parser = Parser(description=__doc__)
    parser.add_argument("--threads", type=positive_int, nargs="+", default=[1, 2])
    parser.add_argument(
        "--tokens", type=tokens_arg, nargs="+", default=["16x256", "8x128"], help="batch x sequence length"
    )
    parser.add_argument("--repeats", type=positive_int, default=5)
    parser.add_argument(
        "--ghz", type=positive_float, default=None, help="clock for the peak estimate (default: cpuinfo)"
    )
    parser.add_argument("--no-model", action="store_true", help="skip the routing and whole-model timings")
    args = parser.parse_args()
    if not onednn_available():
        sys.exit("error: this torch build has no oneDNN (torch.backends.mkldnn.is_available() is false)")
    per_core, how = peak(args.ghz)
    print(f"{cpu_name()}, {os.cpu_count()} logical CPU(s), torch {torch.__version__}, float32")
    print(f"peak estimate: {per_core:.0f} GFLOP/s per core; {how}")
    print(f"best of {args.repeats} rounds; GFLOP/s, ratio to aten; diff = max|oneDNN - aten| / max|aten|")
    header = f"{'thr':>3} {'tokens':>7} {'shape':>10} {'pass':>8} {'aten':>7} {'oneDNN':>7} {'packed':>7}"
    header += f" {'oneDNN/aten':>12} {'packed/aten':>12} {'%peak':>6} {'diff':>8}"
    for threads in args.threads:
        torch.set_num_threads(threads)
        print("\n" + header)
        totals = {"aten": 0.0, "onednn": 0.0}
        total_flops = 0.0
        for tokens in args.tokens:
            batch, length = (int(n) for n in tokens.split("x"))
            rows = batch * length
            for label, shape in SHAPES.items():
                for step in ("fwd", "grad_in", "grad_w"):
                    flops, calls = methods(shape, rows, step)
                    results = {name: call() for name, call in calls.items()}  # warm-up and the diff
                    ref = results["aten"]
                    diff = max(float((r - ref).abs().max() / ref.abs().max()) for r in results.values())
                    best = dict.fromkeys(calls, float("inf"))
                    for _ in range(args.repeats):
                        for name, call in calls.items():
                            start = time.perf_counter()
                            call()
                            best[name] = min(best[name], time.perf_counter() - start)
                    rate = {name: flops / t / 1e9 for name, t in best.items()}
                    for name in totals:
                        totals[name] += best[name]
                    total_flops += flops
                    packed = rate.get("packed")
                    line = f"{threads:>3} {tokens:>7} {label:>10} {step:>8} {rate['aten']:>7.1f} {rate['onednn']:>7.1f}"
                    line += f" {packed:>7.1f}" if packed else f" {'-':>7}"
                    line += f" {rate['onednn'] / rate['aten']:>11.2f}x"
                    line += f" {packed / rate['aten']:>11.2f}x" if packed else f" {'-':>12}"
                    line += f" {100 * max(rate.values()) / (per_core * threads):>5.0f}%"
                    print(line + f" {diff:>8.1e}")
        aten, onednn = (total_flops / totals[name] / 1e9 for name in ("aten", "onednn"))
        print(
            f"{threads} thread(s), all rows (time-weighted): aten {aten:.1f}, oneDNN {onednn:.1f} GFLOP/s, "
            f"oneDNN/aten {onednn / aten:.2f}x; peak estimate {per_core * threads:.0f}"
        )
    if not args.no_model:
        routing_overhead()
        model_steps(args.threads, args.tokens, max(2, args.repeats // 2))


if __name__ == "__main__":
    main()
