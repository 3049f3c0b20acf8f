"""QAT overhead per format: quantized training-step time / float32 step time on MiniLM-sized layers.

One run measures, interleaved (so machine load hits every format alike):

* ``encoder layer``: one BERT encoder layer with MiniLM's sizes (hidden 384, 12 heads, FFN 1536),
  every linear layer quantized with the ``conf/quant/<preset>.yaml`` config, all parameters
  trainable (full QAT, the most expensive case: weight quantizers need gradient masks too);
* ``FFN linears``: just the 384 -> 1536 -> 384 linear pair, the same way.

A step is forward + backward + SGD update on ``--batch x --seq`` tokens. The ``integer (torch
fused)`` row swaps in ``torch.fake_quantize_per_tensor_affine`` for comparison with the composite
ops :class:`adls_lightning.quant.formats.fixed_point.IntegerQuantizer` uses.

Clock: on CPU the default is this process's CPU time with one thread (``--clock cpu``), which
other processes on a shared machine barely disturb; ``--clock wall --threads N`` measures wall
time. On CUDA (``--device cuda``) it is wall time with synchronisation.

Usage::

    python benchmarks/bench_quant.py                  # all presets
    python benchmarks/bench_quant.py --presets int8 mxint8 --rounds 3 --steps 3
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from adls_lightning.quant import QuantLinear, quantize_model, quantized_layers  # noqa: E402
from adls_lightning.quant.formats.fixed_point import IntegerQuantizer  # noqa: E402
from adls_lightning.script_args import Parser, positive_int  # noqa: E402

PRESETS = (
    "int8",
    "int16",
    "minifloat_ieee",
    "minifloat_denorm",
    "log",
    "block_fp",
    "block_minifloat",
    "block_log",
    "binary",
    "binary_scaling",
    "binary_residual",
    "ternary",
    "mxint8",
)
FUSED = "integer (torch fused)"


class FusedIntegerQuantizer(IntegerQuantizer):
    """The same fixed-point grid through PyTorch's fused fake-quant kernel (clipping-aware STE built in)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.fake_quantize_per_tensor_affine(x, 2.0**-self.frac_width, 0, self.qmin, self.qmax)


def preset_config(preset: str) -> dict:
    """The ``config`` of ``conf/quant/<preset>.yaml``, composed by Hydra (presets inherit from int8)."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("train", overrides=[f"quant={preset}", "logger=none"])
    return OmegaConf.to_container(cfg.quant.config, resolve=True)


def minilm_layer() -> nn.Module:
    from transformers import BertConfig
    from transformers.models.bert.modeling_bert import BertLayer

    config = BertConfig(hidden_size=384, num_attention_heads=12, intermediate_size=1536)
    layer = BertLayer(config)

    class Wrapper(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = layer

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out = self.layer(x)
            return out[0] if isinstance(out, tuple) else out

    return Wrapper()


def ffn_linears() -> nn.Module:
    return nn.Sequential(nn.Linear(384, 1536), nn.GELU(), nn.Linear(1536, 384))


def build(kind: str, variant: str, configs: dict[str, dict]) -> nn.Module:
    torch.manual_seed(0)
    model = minilm_layer() if kind == "encoder layer" else ffn_linears()
    if variant == "fp32":
        return model
    if variant == FUSED:
        quantize_model(model, configs["int8"])
        for layer in quantized_layers(model):
            for slot in ("data_in", "weight", "bias"):
                q = layer.quantizer(slot)
                setattr(layer, f"{slot}_quantizer", FusedIntegerQuantizer(q.width, q.frac_width))
        return model
    quantize_model(model, configs[variant])
    assert any(isinstance(m, QuantLinear) for m in model.modules())
    return model


def step_fn(model: nn.Module, tokens: torch.Tensor) -> Callable[[], None]:
    model.to(tokens.device)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        x = tokens.clone().requires_grad_(True)  # a middle layer: its input carries gradient
        model(x).square().mean().backward()
        optimizer.step()

    return step


def timer(clock: str, device: torch.device) -> Callable[[], float]:
    if device.type == "cuda":

        def wall_synced() -> float:
            torch.cuda.synchronize(device)
            return time.perf_counter()

        return wall_synced
    return time.process_time if clock == "cpu" else time.perf_counter


def main() -> None:
    parser = Parser(description=__doc__)
    parser.add_argument("--presets", nargs="*", choices=list(PRESETS), default=list(PRESETS))
    parser.add_argument("--batch", type=positive_int, default=8)
    parser.add_argument("--seq", type=positive_int, default=128)
    parser.add_argument(
        "--rounds", type=positive_int, default=7, help="interleaved rounds; the fastest is reported"
    )
    parser.add_argument("--steps", type=positive_int, default=3, help="timed steps per format per round")
    parser.add_argument(
        "--threads", type=positive_int, default=1, help="CPU threads (default 1, see --clock)"
    )
    parser.add_argument(
        "--clock", choices=("cpu", "wall"), default="cpu", help="CPU: process time or wall time"
    )
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device (valid here: cpu)")
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    now = timer(args.clock, device)

    configs = {p: preset_config(p) for p in set(args.presets) | {"int8"}}
    variants = ["fp32"] + [p for p in args.presets] + ([FUSED] if "int8" in args.presets else [])
    kinds = ("encoder layer", "FFN linears")
    tokens = torch.randn(args.batch, args.seq, 384, device=device)
    steps = {(k, v): step_fn(build(k, v, configs), tokens) for k in kinds for v in variants}
    for step in steps.values():  # warm-up (allocator, lazy init of learned scales)
        step()
    times: dict[tuple[str, str], list[float]] = {key: [] for key in steps}
    order = list(steps)
    for round_index in range(args.rounds):
        # Rotate the order each round so no format always runs right after the same neighbour.
        shift = round_index % len(order)
        for key in order[shift:] + order[:shift]:
            step = steps[key]
            start = now()
            for _ in range(args.steps):
                step()
            times[key].append((now() - start) / args.steps)

    # The fastest round: interference from other processes only ever adds time.
    best = {key: min(values) for key, values in times.items()}
    clock = "wall time" if device.type == "cuda" or args.clock == "wall" else "process CPU time"
    print(
        f"QAT step time / fp32 step time; {args.batch}x{args.seq} tokens, {device}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, {clock}, fastest of {args.rounds} rounds x {args.steps} steps"
    )
    header = f"| {'format':<22} | " + " | ".join(f"{k} ms | {k} ratio" for k in kinds) + " |"
    print(header)
    print("|" + "---|" * (1 + 2 * len(kinds)))
    for variant in variants:
        cells = []
        for kind in kinds:
            ms = 1e3 * best[(kind, variant)]
            cells += [f"{ms:.1f}", f"{best[(kind, variant)] / best[(kind, 'fp32')]:.2f}x"]
        print(f"| {variant:<22} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
