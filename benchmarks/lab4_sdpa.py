"""Lab 4 part 2: naive attention (matmul, scale, softmax, matmul) vs torch's fused scaled_dot_product_attention.

    python benchmarks/lab4_sdpa.py                       # CPU (or CUDA when present)
    python benchmarks/lab4_sdpa.py --seq-lens 64 128 256 512 1024 --repeats 20

1. Checks the two agree (``torch.testing.assert_close``, fp32 tolerances) on random inputs of the lab's shape
   (batch 32, 8 heads, 128 tokens, head size 64) and of a BERT-like one (MiniLM: batch 8, 12 heads, 128 tokens,
   head size 32), with and without a padding mask. Random inputs, not the lab's all-ones tensors: with
   identical keys every softmax is uniform, so a wrong scale or a transposed matmul would still pass.
2. Profiles both at the lab's shape with ``torch.profiler`` and saves the top-kernels tables
   (outputs/lab4_sdpa_profile.txt): the naive version launches one kernel per step, SDPA one fused kernel.
3. Times both over sequence lengths (inputs made beforehand, warm-up excluded, median and IQR; CUDA events),
   prints the speed-ups and writes docs/figures/lab4_sdpa.png. On CUDA it reports which SDPA backend ran
   (flash, memory-efficient, cuDNN or math), read from the profiler's kernel names.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from adls_lightning.script_args import Parser, check_outputs, positive_int  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))

from lab4_timing import machine_line, save_figure, time_call  # noqa: E402

# (name, batch, heads, head size) at the lab's 128 tokens; the sweep varies the sequence length.
SHAPES = {"lab": (32, 8, 64), "bert-like (MiniLM)": (8, 12, 32)}
# Substrings of CUDA kernel names -> the SDPA backend that launches them.
SDPA_KERNELS = {
    "flash": "flash",
    "efficient": "memory-efficient",
    "cudnn": "cuDNN",
    "fmha": "memory-efficient",
}


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None):
    """softmax(q k^T / sqrt(d) + mask) v, step by step as the lab writes it."""
    scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), v)


def fused_attention(q, k, v, mask=None):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def random_qkv(batch: int, heads: int, seq: int, head_dim: int, device, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, heads, seq, head_dim, generator=gen).to(device) for _ in range(3)]


def padding_mask(batch: int, seq: int, device) -> torch.Tensor:
    """Boolean key mask (True = attend): row i keeps its first seq - 4*i tokens (at least one)."""
    keep = torch.tensor([max(1, seq - 4 * i) for i in range(batch)])
    return (torch.arange(seq)[None, :] < keep[:, None])[:, None, None, :].to(device)


def check_agreement(device, seq: int) -> list[str]:
    lines = []
    for name, (batch, heads, head_dim) in SHAPES.items():
        q, k, v = random_qkv(batch, heads, seq, head_dim, device)
        for masked in (False, True):
            mask = padding_mask(batch, seq, device) if masked else None
            expected, actual = naive_attention(q, k, v, mask), fused_attention(q, k, v, mask)
            torch.testing.assert_close(actual, expected)  # fp32 defaults: rtol 1.3e-6, atol 1e-5
            err = (actual - expected).abs().max().item()
            lines.append(
                f"{name:20s} {batch}x{heads}x{seq}x{head_dim} mask={masked!s:5s} max |diff| {err:.2e}  ok"
            )
    return lines


def profile_table(fn, device, rows: int) -> tuple[str, list[str]]:
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    for _ in range(3):
        fn()
    with profile(activities=activities) as prof:
        for _ in range(10):
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
    sort = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
    names = [e.key for e in prof.key_averages()]
    return prof.key_averages().table(sort_by=sort, row_limit=rows), names


def sdpa_backend(kernel_names: list[str]) -> str:
    found = {label for name in kernel_names for key, label in SDPA_KERNELS.items() if key in name.lower()}
    return ", ".join(sorted(found)) or "math (no fused kernel found)"


def main() -> None:
    parser = Parser(description=__doc__)
    parser.add_argument("--seq-lens", nargs="+", type=positive_int, default=[64, 128, 256, 512, 1024])
    parser.add_argument("--repeats", type=positive_int, default=10)
    parser.add_argument("--rows", type=positive_int, default=12, help="rows of each profiler table")
    parser.add_argument("--profile-out", type=Path, default=ROOT / "outputs" / "lab4_sdpa_profile.txt")
    parser.add_argument("--figure", type=Path, default=ROOT / "docs" / "figures" / "lab4_sdpa.png")
    parser.add_argument("--json", type=Path, default=ROOT / "outputs" / "lab4_sdpa.json")
    args = parser.parse_args()
    check_outputs(
        parser,
        figures={"--figure": args.figure},
        files={"--profile-out": args.profile_out, "--json": args.json},
    )
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    print(machine_line())

    print("\n1. naive vs fused outputs (torch.testing.assert_close, fp32)")
    for line in check_agreement(device, seq=128):
        print("  " + line)

    batch, heads, head_dim = SHAPES["lab"]
    q, k, v = random_qkv(batch, heads, 128, head_dim, device)
    report = [machine_line(), f"lab shape {batch}x{heads}x128x{head_dim}, 10 calls each"]
    backend = None
    for label, fn in (("naive", naive_attention), ("sdpa", fused_attention)):
        table, names = profile_table(lambda fn=fn: fn(q, k, v), device, args.rows)
        report += [f"\n== {label} ==", table]
        if label == "sdpa" and device.type == "cuda":
            backend = sdpa_backend(names)
            report.append(f"SDPA backend chosen: {backend}")
    args.profile_out.parent.mkdir(parents=True, exist_ok=True)
    args.profile_out.write_text("\n".join(report))
    print(f"\n2. profiler top kernels -> {args.profile_out}")
    print("\n".join(report[2:]))
    if backend:
        print(f"SDPA backend chosen on {torch.cuda.get_device_name()}: {backend}")

    print("\n3. timing over sequence lengths (median ms, IQR; speed-up = naive / sdpa)")
    rows = []
    for name, (batch, heads, head_dim) in SHAPES.items():
        for seq in args.seq_lens:
            q, k, v = random_qkv(batch, heads, seq, head_dim, device)
            naive = time_call(lambda q=q, k=k, v=v: naive_attention(q, k, v), device, repeats=args.repeats)
            fused = time_call(lambda q=q, k=k, v=v: fused_attention(q, k, v), device, repeats=args.repeats)
            row = {
                "shape": name,
                "batch": batch,
                "heads": heads,
                "head_dim": head_dim,
                "seq": seq,
                "naive_ms": 1e3 * naive.median_s,
                "naive_iqr": naive.spread(),
                "sdpa_ms": 1e3 * fused.median_s,
                "sdpa_iqr": fused.spread(),
                "speedup": naive.median_s / fused.median_s,
            }
            rows.append(row)
            print(
                f"  {name:20s} {batch}x{heads}x{seq:<5d}x{head_dim}  naive {row['naive_ms']:9.2f} ms "
                f"{naive.spread():22s} sdpa {row['sdpa_ms']:9.2f} ms {fused.spread():22s} x{row['speedup']:.2f}",
                flush=True,
            )
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(
        json.dumps({"machine": machine_line(), "sdpa_backend": backend, "rows": rows}, indent=1)
    )
    plot(rows, args.figure)
    print(f"wrote {args.figure}, {args.json}")


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for name in SHAPES:
        sub = [r for r in rows if r["shape"] == name]
        seqs = [r["seq"] for r in sub]
        (line,) = axes[0].plot(seqs, [r["naive_ms"] for r in sub], "o--", label=f"{name}: naive")
        axes[0].plot(seqs, [r["sdpa_ms"] for r in sub], "o-", color=line.get_color(), label=f"{name}: sdpa")
        axes[1].plot(seqs, [r["speedup"] for r in sub], "o-", label=name)
    axes[0].set(xscale="log", yscale="log", xlabel="sequence length", ylabel="median ms per call")
    axes[1].set(xscale="log", xlabel="sequence length", ylabel="speed-up (naive / sdpa)")
    axes[1].axhline(1.0, color="grey", lw=0.8)
    for ax in axes:
        ax.legend(fontsize=8)
        ax.set_xticks(
            rows and sorted({r["seq"] for r in rows}), [str(s) for s in sorted({r["seq"] for r in rows})]
        )
    save_figure(fig, "naive attention vs F.scaled_dot_product_attention", path)


if __name__ == "__main__":
    main()
