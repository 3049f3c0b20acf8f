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

Last, the CPU's matrix units (issue 59; ``--no-dtypes`` skips it): the forward ``y = x @ W.T`` of each shape in fp32
(aten), bf16 with the weight cast once (``F.linear`` on bf16 tensors: the inference case), bf16 under autocast
(input and weight cast on every call: ``trainer.precision=bf16-mixed``'s forward), int8 x int8 -> int32
(``torch._int_mm``, the bare integer GEMM) and torch's dynamic-quantized int8 linear (activations quantized per
call, fp32 out), with the peak estimate of each (:func:`matrix_peaks`: fp32 FMA, AVX-512 BF16 / AMX-BF16,
AVX-512 VNNI / AVX-VNNI / AMX-INT8 from the CPU's flags). The CPU's model name and flags are printed first.

    python benchmarks/bench_gemm.py                          # 1 and 2 threads, both token counts
    python benchmarks/bench_gemm.py --threads 1 --tokens 8x128 --repeats 10
    python benchmarks/bench_gemm.py --threads 1 --tokens 8x128 --no-model --dtypes-only   # the matrix units only
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

from adls_lightning import gemm  # noqa: E402
from adls_lightning.gemm import cpu_name, gemm_backend, onednn_available, onednn_linear  # noqa: E402
from adls_lightning.script_args import Parser, batch_by_length, positive_float, positive_int  # noqa: E402

# MiniLM (all-MiniLM-L6-v2): hidden 384, intermediate 1536; (in_features, out_features) of its linear layers.
SHAPES = {"384->384": (384, 384), "384->1536": (384, 1536), "1536->384": (1536, 384)}


def cpuinfo() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo (the library's ``gemm.CPUINFO``; empty where there is none)."""
    fields: dict[str, str] = {}
    try:
        for line in gemm.CPUINFO.read_text().splitlines():
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
    per_cycle = _fp32_per_cycle(info)
    isa = "AVX-512" if "avx512f" in flags else "AVX2+FMA" if {"avx2", "fma"} <= flags else "SSE"
    source = "--ghz"
    if ghz is None:
        ghz = float(info.get("cpu MHz", "nan")) / 1000
        source = "nominal, /proc/cpuinfo cpu MHz"
    how = f"{isa} (family {family}): {per_cycle} FLOP/cycle x {ghz:.2f} GHz ({source})"
    return per_cycle * ghz, how


def matrix_peaks(per_core_fp32: float) -> dict[str, tuple[float | None, str]]:
    """Peak GFLOP/s (int8: GOP/s) of one core per number format, from the fp32 peak and the CPU's flags.

    bf16: AVX-512 BF16's ``vdpbf16ps`` does two bf16 products per fp32 lane (2x fp32); AMX-BF16's tile unit 1,024
    FLOP/cycle (16x fp32's 64 on the same core). int8: a VNNI ``vpdpbusd`` does four int8 products per 32-bit lane
    (4x fp32, AVX-512 VNNI or AVX-VNNI at their widths); AMX-INT8 2,048 OP/cycle; plain AVX2 needs ``vpmaddubsw``
    then ``vpmaddwd`` (two multiplies where VNNI has one) for the same products, 2x fp32. None where the CPU has no
    such unit (the format then runs on its fp32 or emulated path)."""
    info = cpuinfo()
    flags = set(info.get("flags", "").split())
    ghz = per_core_fp32 / max(1, _fp32_per_cycle(info))
    if "amx_bf16" in flags:
        bf16 = (1024 * ghz, "AMX-BF16: 1024 FLOP/cycle")
    elif "avx512_bf16" in flags:
        bf16 = (2 * per_core_fp32, "AVX-512 BF16: 2x fp32")
    else:
        bf16 = (None, "no bf16 unit (autocast emulates it)")
    if "amx_int8" in flags:
        int8 = (2048 * ghz, "AMX-INT8: 2048 OP/cycle")
    elif "avx512_vnni" in flags or "avx_vnni" in flags:
        int8 = (4 * per_core_fp32, "VNNI: 4x fp32")
    elif "avx2" in flags:
        int8 = (2 * per_core_fp32, "AVX2 vpmaddubsw + vpmaddwd, no VNNI: 2x fp32")
    else:
        int8 = (None, "no int8 dot-product unit")
    return {"fp32": (per_core_fp32, "FMA"), "bf16": bf16, "int8": int8}


def _fp32_per_cycle(info: dict[str, str]) -> int:
    flags = set(info.get("flags", "").split())
    if "avx512f" in flags:
        return 32 if info.get("vendor_id") == "AuthenticAMD" and info.get("cpu family") == "25" else 64
    return 32 if {"avx2", "fma"} <= flags else 8


def dtype_methods(shape: tuple[int, int], rows: int) -> dict[str, Callable[[], torch.Tensor]]:
    """The forward of one linear shape in each number format (see the module's last paragraph)."""
    fan_in, fan_out = shape
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(rows, fan_in, generator=gen)
    w = torch.randn(fan_out, fan_in, generator=gen) / fan_in**0.5
    xb, wb = x.bfloat16(), w.bfloat16()
    xi = torch.randint(-128, 128, (rows, fan_in), dtype=torch.int8, generator=gen)
    wi_t = torch.randint(-128, 128, (fan_in, fan_out), dtype=torch.int8, generator=gen)
    calls: dict[str, Callable[[], torch.Tensor]] = {
        "fp32": lambda: F.linear(x, w),
        "bf16": lambda: F.linear(xb, wb),
    }

    def autocast() -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return F.linear(x, w)

    calls["bf16 autocast"] = autocast
    calls["int8 _int_mm"] = lambda: torch._int_mm(xi, wi_t)
    try:
        import warnings

        from torch.ao.nn.quantized.dynamic import Linear as DynamicLinear

        # torch 2.13 marks its quantized tensors deprecated; they remain its dynamic int8 linear's weights
        warnings.filterwarnings(
            "ignore", message=".*quantized tensor creation functions", category=UserWarning
        )

        dynamic = DynamicLinear(fan_in, fan_out)
        dynamic.set_weight_bias(
            torch.quantize_per_tensor(w, float(w.abs().max()) / 127, 0, torch.qint8), torch.zeros(fan_out)
        )
        calls["int8 dynamic"] = lambda: dynamic(x)
    except (ImportError, RuntimeError, AttributeError):  # a torch without the quantized engines
        pass
    return calls


def matrix_units(threads: list[int], tokens: list[str], repeats: int, per_core: float) -> None:
    """GFLOP/s (int8: GOP/s) of the forward of each shape per number format, and the peak estimates."""
    peaks = matrix_peaks(per_core)
    print("\nmatrix units: forward y = x @ W.T per number format, GFLOP/s (int8: GOP/s), best of", repeats)
    print(
        "peak estimate per core: "
        + "; ".join(f"{k} {v:.0f} ({how})" if v else f"{k} - ({how})" for k, (v, how) in peaks.items())
    )
    names = list(dtype_methods((8, 8), 16))
    print(
        f"{'thr':>3} {'tokens':>7} {'shape':>10}"
        + "".join(f" {n:>14}" for n in names)
        + f" {'bf16/fp32':>10}"
    )
    for n in threads:
        torch.set_num_threads(n)
        totals: dict[str, float] = {}
        total_flops = 0.0
        for tokens_text in tokens:
            batch, length = (int(v) for v in tokens_text.split("x"))
            rows = batch * length
            for label, shape in SHAPES.items():
                calls = dtype_methods(shape, rows)
                flops = 2.0 * rows * shape[0] * shape[1]
                for call in calls.values():
                    call()  # warm-up: first-touch pages, oneDNN's primitive cache
                best = dict.fromkeys(calls, float("inf"))
                for _ in range(repeats):
                    for name, call in calls.items():
                        start = time.perf_counter()
                        call()
                        best[name] = min(best[name], time.perf_counter() - start)
                for name, t in best.items():
                    totals[name] = totals.get(name, 0.0) + t
                total_flops += flops
                rate = {name: flops / t / 1e9 for name, t in best.items()}
                print(
                    f"{n:>3} {tokens_text:>7} {label:>10}"
                    + "".join(f" {rate.get(name, float('nan')):>14.1f}" for name in names)
                    + f" {rate['bf16'] / rate['fp32']:>9.2f}x"
                )
        overall = {name: total_flops / t / 1e9 for name, t in totals.items()}
        print(
            f"{n} thread(s), all rows (time-weighted): "
            + ", ".join(f"{name} {rate:.1f}" for name, rate in overall.items())
            + f"; bf16/fp32 {overall['bf16'] / overall['fp32']:.2f}x, "
            f"bf16 autocast/fp32 {overall['bf16 autocast'] / overall['fp32']:.2f}x, "
            f"int8 _int_mm/fp32 {overall['int8 _int_mm'] / overall['fp32']:.2f}x"
            + "; peak estimate "
            + ", ".join(f"{k} {v * n:.0f}" for k, (v, _how) in peaks.items() if v)
        )


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
    parser.add_argument("--no-dtypes", action="store_true", help="skip the matrix units' table (bf16, int8)")
    parser.add_argument(
        "--dtypes-only", action="store_true", help="only the matrix units' table (fp32, bf16, int8 per shape)"
    )
    args = parser.parse_args()
    if not onednn_available():
        sys.exit("error: this torch build has no oneDNN (torch.backends.mkldnn.is_available() is false)")
    per_core, how = peak(args.ghz)
    print(f"{cpu_name()}, {os.cpu_count()} logical CPU(s), torch {torch.__version__}, float32")
    shown = [f for f in cpuinfo().get("flags", "").split() if f.startswith(("avx", "amx", "fma"))]
    print(f"flags: {' '.join(shown) or '(none of avx*/amx*/fma)'}")
    print(f"peak estimate: {per_core:.0f} GFLOP/s per core; {how}")
    if args.dtypes_only:
        matrix_units(args.threads, args.tokens, args.repeats, per_core)
        return
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
    if not args.no_dtypes:
        matrix_units(args.threads, args.tokens, args.repeats, per_core)


if __name__ == "__main__":
    main()
