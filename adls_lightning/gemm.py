"""The GEMM backend of linear layers on CPU (``runtime.gemm=auto|aten|onednn``): torch's own (aten, MKL's sgemm
on x86) or oneDNN's, through ``torch.ops.mkldnn._linear_pointwise`` of the same torch wheel.

MKL takes its AVX2 code on AMD processors, so on an AVX-512 AMD CPU oneDNN's kernels compute a linear layer about
twice as fast (issue 36); on an AVX2-only CPU, or an Intel one, the two are about level and aten stays.

:func:`gemm_backend` routes every ``F.linear`` of the code run inside it -- ``nn.Linear``, PEFT's LoRA layers (base
and adapters), :class:`~adls_lightning.quant.linear.QuantLinear` after its fake quantization, a pruned linear after
its mask (a parametrization feeds ``F.linear`` the masked weight) -- through :class:`OneDNNLinear`, by a
``TorchFunctionMode``: one interception point covers every layer type without touching modules or checkpoints.
Only fp32 CPU dense tensors outside autocast and ``torch.compile`` are routed; anything else calls ``F.linear``.
A weight that is a module's parameter and gets no gradient in that call (a frozen LoRA base weight, or any weight at
evaluation) is reordered once into oneDNN's own layout (:class:`PackedWeights`) and reused while it is unchanged.

:func:`choose` resolves ``auto``: it times both backends on the model's own linear shapes (forward, grad input,
grad weight where the weight trains) and takes oneDNN only when it is faster by more than ``MARGIN``, so ``auto``
never makes a run slower than torch's default. The answer is cached per CPU kind (:func:`cpu_kind`), thread count, torch version
and shapes in a small JSON file -- but only a measurement that can be trusted (:func:`untrustworthy`): the
timing is repeated and compared with a reference GEMM of the same process, and one taken under load (repeats that
disagree, a CPU far below any CPU's rate) is used for nothing: the run takes aten, says why, and caches nothing.

Library code: no Lightning imports.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import time
import weakref
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from adls_lightning.errors import ConfigError, require_choice
from adls_lightning.runtime import GEMM_BACKENDS as BACKENDS

log = logging.getLogger(__name__)

# oneDNN must beat aten by more than this on the model's shapes for `auto` to take it: below it the difference is
# within the timing noise of a shared machine, and aten (torch's default) is the safe side.
MARGIN = 1.05
# `auto` times at most this many rows (tokens): GEMM rates have levelled off well before, and it keeps the start-up
# measurement to milliseconds per shape.
TIMING_ROWS = 512
CACHE_FILE = "gemm_choice.json"
# `auto` measures the model's GEMMs this many times (each the best of `measure`'s rounds) and trusts them only when
# they agree: a choice cached from one timing taken under load (issue 56: "aten 0.2 vs oneDNN 0.2 GFLOP/s") stayed
# wrong for every later run on that machine.
MEASUREMENTS = 3
# The slowest of the repeats may take at most this many times the fastest's time, per backend. On an idle machine
# the repeats of this project's CPU agree within 12 % (MiniLM's shapes at 512 rows, one thread); more means other
# work took the CPU in the middle of a repeat, and the 5 % MARGIN cannot be read from such numbers.
MAX_SPREAD = 1.25
# The reference GEMM: a 256 x 256 x 256 fp32 torch.mm, big enough for every BLAS to run at its full rate, small
# enough to take well under a millisecond (this project's AMD CPU: 100 GFLOP/s on one thread).
REFERENCE_SIZE = 256
# A CPU that computes the reference below this is not running the process at full speed: one AVX2 core does over
# 30 GFLOP/s on it and even an SSE2-only one over 5, so 2 GFLOP/s is a CPU shared with other work (or OpenMP
# threads oversubscribed), whose timing says nothing about the backends.
REFERENCE_FLOOR_GFLOPS = 2.0
# How much slower than the reference a model's GEMM may plausibly run (see `untrustworthy`): oneDNN's copies of
# transposed operands, memory-bound thin shapes (LoRA's rank-8 layers) and another BLAS's kernels stay well within it.
PLAUSIBLE_SLOWDOWN = 8.0


def validate(value: object) -> None:
    """Raise ConfigError unless ``value`` is one of :data:`BACKENDS` (and oneDNN exists where it is asked for)."""
    require_choice("runtime.gemm", value, BACKENDS)
    if value == "onednn" and not onednn_available():
        raise ConfigError(
            "runtime.gemm=onednn: this torch build has no oneDNN (torch.backends.mkldnn.is_available() is "
            "false); give runtime.gemm=aten or auto"
        )


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` by oneDNN (no autograd): ``x`` (..., in), ``weight`` (out, in) dense or prepacked."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


class PackedWeights:
    """oneDNN's prepacked copies of weights that get no gradient, made once per weight and reused until the weight
    changes: the reorder into oneDNN's blocked layout is then paid once, not on every call.

    Only ``nn.Parameter`` weights are packed: a quantized or pruned layer hands ``F.linear`` a new tensor on every
    call (the fake-quantized or masked weight), which would be packed and thrown away each time. A packed copy is
    valid while the parameter is the same object with the same version counter (an optimizer step or an in-place
    load bumps it) and is dropped with the parameter."""

    def __init__(self) -> None:
        self._entries: dict[int, tuple[weakref.ref, int, torch.Tensor]] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, weight: torch.Tensor) -> torch.Tensor | None:
        """The packed copy of ``weight``, or None for a weight that is not packed (not a parameter)."""
        if not isinstance(weight, torch.nn.Parameter) or weight.is_inference():
            return None
        key = id(weight)
        entry = self._entries.get(key)
        if entry is not None and entry[0]() is weight and entry[1] == weight._version:
            return entry[2]
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach())
        ref = weakref.ref(weight, lambda _, key=key: self._entries.pop(key, None))
        self._entries[key] = (ref, weight._version, packed)
        return packed


class OneDNNLinear(torch.autograd.Function):
    """``F.linear`` with its three GEMMs through oneDNN: forward, grad input (``g @ W``) and grad weight
    (``g.T @ x``, only when the weight requires grad: a frozen LoRA base weight costs no third GEMM). ``packed``:
    the weight prepacked for the forward (frozen weights), or None."""

    @staticmethod
    def forward(
        ctx,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        packed: torch.Tensor | None = None,
    ) -> torch.Tensor:
        # x is saved only when the weight's gradient needs it (frozen base weights: W alone).
        ctx.save_for_backward(x if ctx.needs_input_grad[1] else None, weight)
        return onednn_linear(x, weight if packed is None else packed, bias)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            # g @ W as a linear: weight operand W.T (in, out), made contiguous: oneDNN on the strided view was
            # slower than the copy plus the GEMM (66 vs 76 GFLOP/s at 4096 x 1536 -> 384 on this project's CPU).
            grad_x = onednn_linear(grad, weight.t().contiguous())
        if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:
            grad_2d = grad.reshape(-1, grad.shape[-1])
            if ctx.needs_input_grad[1]:
                x_2d = x.reshape(-1, x.shape[-1])
                # g.T @ x as a linear: input g.T (out, rows), weight operand x.T (in, rows)
                grad_w = onednn_linear(grad_2d.t().contiguous(), x_2d.t().contiguous())
            if ctx.needs_input_grad[2]:
                grad_b = grad_2d.sum(0)
        return grad_x, grad_w, grad_b, None


def _routable(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """fp32 dense CPU tensors outside autocast and torch.compile (which traces aten's linear and fuses around it)."""
    for t in (x, weight) if bias is None else (x, weight, bias):
        # tensor subclasses (DTensor, fake tensors) keep their own dispatch
        if (
            type(t) not in _PLAIN
            or t.dtype != torch.float32
            or t.device.type != "cpu"
            or t.is_mkldnn
            or t.is_sparse
        ):
            return False
    return (
        x.dim() >= 2
        and x.numel() > 0
        and not torch.is_autocast_enabled("cpu")
        and not torch.compiler.is_compiling()
    )


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def routed_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    packed_weights: PackedWeights | None = None,
) -> torch.Tensor:
    """``F.linear`` through oneDNN where :func:`_routable`, else ``F.linear`` itself; a weight that gets no gradient
    here runs from its packed copy in ``packed_weights`` when there is one."""
    if not _routable(x, weight, bias):
        return F.linear(x, weight, bias)
    grad = torch.is_grad_enabled()
    weight_trains = grad and weight.requires_grad
    packed = None if packed_weights is None or weight_trains else packed_weights.get(weight)
    if grad and any(t is not None and t.requires_grad for t in (x, weight, bias)):
        return OneDNNLinear.apply(x, weight, bias, packed)
    return onednn_linear(x, weight if packed is None else packed, bias)


class OneDNNLinearMode(TorchFunctionMode):
    """Sends every ``F.linear`` called inside it to :func:`routed_linear`, with the packed weights of this mode's
    lifetime (:class:`PackedWeights`); every other function runs unchanged."""

    def __init__(self) -> None:
        super().__init__()
        self.packed_weights = PackedWeights()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            return routed_linear(*args, **kwargs, packed_weights=self.packed_weights)
        return func(*args, **kwargs)


def gemm_backend(backend: str):
    """A context manager running linear layers on ``backend`` (``aten`` or ``onednn``; resolve ``auto`` first
    with :func:`choose`). Torch function modes are per thread: enter it in the thread that runs the model."""
    if backend == "onednn":
        return OneDNNLinearMode()
    if backend == "aten":
        return nullcontext()
    raise ConfigError(f"runtime.gemm={backend!r}: resolve it with gemm.choose() first (aten or onednn)")


# --- auto: timing both backends on the model's shapes ----------------------------------------------------------


@dataclass(frozen=True)
class LinearShape:
    """One linear layer's GEMMs: ``rows`` tokens, ``in_features`` -> ``out_features``; ``train_weight``: the weight
    gets a gradient (a third GEMM)."""

    in_features: int
    out_features: int
    train_weight: bool

    @property
    def key(self) -> str:
        return f"{self.in_features}x{self.out_features}{'w' if self.train_weight else ''}"


def model_linear_shapes(model: torch.nn.Module) -> Counter[LinearShape]:
    """The distinct linear shapes of a model and how often each occurs (wrappers counted once: by their inner
    ``nn.Linear``, which PEFT's LoRA, QuantLinear and pruning keep)."""
    shapes: Counter[LinearShape] = Counter()
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            weight = module.weight
            shapes[LinearShape(module.in_features, module.out_features, bool(weight.requires_grad))] += 1
    return shapes


#: where the CPU describes itself (tests point it at another CPU's lines)
CPUINFO = Path("/proc/cpuinfo")


def _cpuinfo_field(names: tuple[str, ...]) -> str | None:
    """The first :data:`CPUINFO` line's value whose key is one of ``names``; None where there is none."""
    try:
        for line in CPUINFO.read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() in names:
                return value.strip()
    except OSError:
        pass
    return None


def cpu_name() -> str:
    """The CPU's model name and, where ``/proc/cpuinfo`` gives them (x86), its family and model numbers.

    A virtual machine's name is often generic: "AMD EPYC" on a Zen 3 guest (family 25, model 1; AVX2) and on a Zen 4
    one (family 25, model 17; AVX-512 BF16) alike. The numbers tell such machines apart in logs and benchmarks."""
    name = _cpuinfo_field(("model name",)) or platform.processor() or platform.machine()
    family, model = _cpuinfo_field(("cpu family",)), _cpuinfo_field(("model",))
    return f"{name} (family {family}, model {model})" if family and model else name


def cpu_flags() -> str:
    """The CPU's feature flags (``/proc/cpuinfo`` ``flags``, Arm ``Features``); empty where unreadable."""
    return _cpuinfo_field(("flags", "Features")) or ""


def cpu_kind(flags: str | None = None) -> str:
    """The machine part of every measurement cache's key: :func:`cpu_name` and a digest of the CPU's flags (or
    ``flags`` given). A name can hide which vector units a machine has (a hypervisor may also mask some), and a
    timing taken on one kind must not decide for another that shares a cache folder."""
    flags = cpu_flags() if flags is None else flags
    digest = hashlib.sha1(" ".join(sorted(flags.split())).encode()).hexdigest()[:12]
    return f"{cpu_name()}|flags={digest}"


# Feature flags of bfloat16 arithmetic: Intel AMX and AVX-512 BF16 (x86 ``flags``), Armv8.6 BF16 (Arm ``Features``).
BFLOAT16_FLAGS = frozenset({"amx_bf16", "avx512_bf16", "bf16"})


def native_bfloat16(flags: str | None = None) -> bool | None:
    """Whether the CPU computes in bfloat16 natively, from its ``/proc/cpuinfo`` flags (or ``flags`` given);
    None where they cannot be read. Without it autocast's bfloat16 has no hardware path, likely slower than fp32."""
    if flags is None:
        flags = _cpuinfo_field(("flags", "Features"))
    if not flags:
        return None
    return not BFLOAT16_FLAGS.isdisjoint(flags.split())


#: x86 flags of an int8 dot product that sums u8 x s8 products in int32: VNNI's ``vpdpbusd``, AMX's int8 tiles
INT8_DOT_PRODUCT_FLAGS = frozenset({"avx512_vnni", "avx_vnni", "amx_int8"})


def u8s8_saturates(flags: str | None = None, machine: str | None = None) -> bool:
    """Whether int8 matrix kernels that multiply uint8 by int8 saturate on this CPU (or one with ``flags`` on
    ``machine``): ONNX Runtime's and oneDNN's (torch's PT2E int8).

    An x86 CPU without :data:`INT8_DOT_PRODUCT_FLAGS` (AVX2 only, AVX-512 without VNNI) multiplies with
    ``vpmaddubsw``, which adds each pair of u8 x s8 products in saturating int16: 2 * 255 * 127 > 32767, so pairs of
    large activation codes against large weights of one sign are clipped. Both libraries compute exactly that on a
    Zen 3 AMD EPYC (AVX2): ONNX Runtime's ``int8=scaled`` graph of the tiny model left its integer grid by up to
    0.56 logits, and a PT2E linear compiled by inductor matched a saturating emulation to 1e-7 and the exact sum
    only to 20 % of its outputs (docs/precision.md). Other architectures, and a CPU whose flags cannot be read, are
    taken as exact."""
    present = set((cpu_flags() if flags is None else flags).split())
    x86 = (machine or platform.machine()) in ("x86_64", "AMD64", "i686", "i386")
    return x86 and bool(present) and present.isdisjoint(INT8_DOT_PRODUCT_FLAGS)


def _gemm_calls(shape: LinearShape, rows: int, backend: str) -> list[Callable[[], object]]:
    """The GEMMs one training step of this layer runs on ``backend``: forward, grad input, [grad weight]."""
    # A private generator: timing must not draw from the global one, or a run's data order and dropout masks would
    # depend on whether the choice was already cached (same seed, different results).
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(rows, shape.in_features, generator=gen)
    w = torch.randn(shape.out_features, shape.in_features, generator=gen)
    g = torch.randn(rows, shape.out_features, generator=gen)
    if backend == "aten":
        calls = [lambda: F.linear(x, w), lambda: torch.mm(g, w)]
        if shape.train_weight:
            calls.append(lambda: torch.mm(g.t(), x))
        return calls
    calls = [lambda: onednn_linear(x, w), lambda: onednn_linear(g, w.t().contiguous())]
    if shape.train_weight:
        calls.append(lambda: onednn_linear(g.t().contiguous(), x.t().contiguous()))
    return calls


def best_call_seconds(calls: dict[str, list[Callable[[], object]]], repeats: int) -> dict[str, list[float]]:
    """The best time of each call of each named list over ``repeats`` rounds, after one warm-up call each, the
    lists alternating within each round so load from other processes falls on all alike."""
    best = {name: [float("inf")] * len(name_calls) for name, name_calls in calls.items()}
    for name_calls in calls.values():  # warm-up: first-touch pages, oneDNN's primitive cache
        for call in name_calls:
            call()
    for _ in range(repeats):
        for name, name_calls in calls.items():
            for i, call in enumerate(name_calls):
                start = time.perf_counter()
                call()
                best[name][i] = min(best[name][i], time.perf_counter() - start)
    return best


def measure(shapes: Counter[LinearShape], rows: int, repeats: int = 5) -> dict[str, float]:
    """Seconds per step of all the model's linear GEMMs on each backend (each shape x its count): the best of
    ``repeats`` rounds per GEMM, the two backends alternating within each round (:func:`best_call_seconds`)."""
    total = {"aten": 0.0, "onednn": 0.0}
    for shape, count in shapes.items():
        best = best_call_seconds({backend: _gemm_calls(shape, rows, backend) for backend in total}, repeats)
        for backend in total:
            total[backend] += count * sum(best[backend])
    return total


def _flops(shapes: Counter[LinearShape], rows: int) -> float:
    return sum(
        count * 2.0 * rows * s.in_features * s.out_features * (3 if s.train_weight else 2)
        for s, count in shapes.items()
    )


def reference_gflops(repeats: int = 5) -> float:
    """GFLOP/s of the reference GEMM (:data:`REFERENCE_SIZE` cubed, torch.mm, this process's threads): the best of
    ``repeats`` after one warm-up call."""
    gen = torch.Generator().manual_seed(0)  # not the global stream: see _gemm_calls
    a = torch.randn(REFERENCE_SIZE, REFERENCE_SIZE, generator=gen)
    b = torch.randn(REFERENCE_SIZE, REFERENCE_SIZE, generator=gen)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - start)
    return 2.0 * REFERENCE_SIZE**3 / best / 1e9


def _slowest_plausible(shapes: Counter[LinearShape], rows: int, reference: float) -> float:
    """Seconds above which a measurement of all the model's GEMMs on one backend is implausible, given the
    reference GEMM's rate (GFLOP/s) measured in the same process.

    A GEMM's rate ``work / (overhead + work / peak)`` only grows with its work, so one smaller than the reference
    runs at least at ``reference x work / reference work``: no GEMM plausibly takes longer than the reference GEMM
    takes for ``max(its work, the reference's)``, times :data:`PLAUSIBLE_SLOWDOWN`. Tiny shapes get a loose bound
    (their time is call overhead), large ones a tight one."""
    reference_work = 2.0 * REFERENCE_SIZE**3
    seconds = 0.0
    for s, count in shapes.items():
        work = 2.0 * rows * s.in_features * s.out_features
        seconds += count * (3 if s.train_weight else 2) * max(work, reference_work)
    return PLAUSIBLE_SLOWDOWN * seconds / (reference * 1e9)


def timed_repeats(
    shapes: Counter[LinearShape],
    rows: int,
    measure_fn: Callable[[Counter[LinearShape], int], dict[str, float]],
    reference_fn: Callable[[], float],
) -> tuple[list[dict[str, float]], list[float], dict[str, float]]:
    """:data:`MEASUREMENTS` runs of ``measure_fn`` between two of the reference GEMM (what an ``auto`` choice
    judges them by, :func:`repeats_untrustworthy`): (the runs, the reference rates, the best time of each option)."""
    references = [reference_fn()]
    runs = [measure_fn(shapes, rows) for _ in range(MEASUREMENTS)]
    references.append(reference_fn())
    return runs, references, {name: min(run[name] for run in runs) for name in runs[0]}


def repeats_untrustworthy(
    runs: list[dict[str, float]],
    references: list[float],
    faster: Callable[[dict[str, float]], str],
    default: str,
    what: str,
    check_spread: bool = True,
) -> str | None:
    """Why repeated measurements (``runs``: seconds per option, each one round) with the reference GEMM's rates
    taken around them (``references``, GFLOP/s) cannot be trusted; None when they can. The checks every ``auto``
    choice makes: the reference GEMM at a plausible rate, positive times, repeats within :data:`MAX_SPREAD` of
    each other (``check_spread``), and every repeat agreeing when the best times pick another option than
    ``default`` (``faster`` names the option a set of times picks; ``what`` is said in the message)."""
    slowest_reference = min(references)
    if not slowest_reference >= REFERENCE_FLOOR_GFLOPS:
        return (
            f"the reference GEMM ran at {slowest_reference:.1f} GFLOP/s, below the {REFERENCE_FLOOR_GFLOPS:g} "
            "GFLOP/s any CPU core computes it at: the CPU is busy with other work"
        )
    for name in runs[0]:
        times = [run[name] for run in runs]
        if not all(t > 0 for t in times):
            return f"{name} measured {min(times):g} s, not a time"
        if check_spread and max(times) > MAX_SPREAD * min(times):
            return (
                f"{name}'s {len(times)} measurements spread {max(times) / min(times):.2f}x, more than "
                f"{MAX_SPREAD:g}x: other work took the CPU in between"
            )
    best = {name: min(run[name] for run in runs) for name in runs[0]}
    # the other option only when every repeat says so: where the two are level the repeats fall on both sides of
    # the margin, and the default is then a safe answer to cache
    if faster(best) != default and any(faster(run) == default for run in runs):
        return f"the {len(runs)} measurements disagree on whether {what} is faster"
    return None


def untrustworthy(
    runs: list[dict[str, float]], references: list[float], shapes: Counter[LinearShape], rows: int
) -> str | None:
    """Why repeated measurements (``runs``: seconds per backend, each a :func:`measure`) with the reference GEMM's
    rates taken around them (``references``, GFLOP/s) cannot be trusted; None when they can."""
    why = repeats_untrustworthy(runs, references, _faster, "aten", "oneDNN")
    if why is not None:
        return why
    best = {backend: min(run[backend] for run in runs) for backend in runs[0]}
    limit = _slowest_plausible(shapes, rows, max(references))
    flops = _flops(shapes, rows)
    for backend, seconds in best.items():
        if seconds > limit:
            return (
                f"{backend} ran at {flops / seconds / 1e9:.2g} GFLOP/s, below the {flops / limit / 1e9:.2g} GFLOP/s "
                f"plausible on this model's shapes when the reference GEMM runs at {max(references):.1f} GFLOP/s"
            )
    return None


def _faster(times: Mapping[str, float]) -> str:
    return "onednn" if times["aten"] > MARGIN * times["onednn"] else "aten"


def choose(
    backend: str,
    model: torch.nn.Module,
    rows: int,
    cache_dir: str | os.PathLike | None = None,
    measure_fn: Callable[[Counter[LinearShape], int], dict[str, float]] | None = None,
    reference_fn: Callable[[], float] | None = None,
) -> str:
    """Resolve ``runtime.gemm``: ``aten``/``onednn`` as given; ``auto`` -> the faster of the two on the model's linear
    shapes at ``rows`` tokens (capped at :data:`TIMING_ROWS`), oneDNN only when faster by more than
    :data:`MARGIN`. ``auto``'s answer is logged in one line and cached in ``cache_dir/gemm_choice.json`` when the
    measurement can be trusted (:func:`untrustworthy`); otherwise this run takes aten and nothing is cached.
    ``measure_fn`` (default :func:`measure`) and ``reference_fn`` (default :func:`reference_gflops`) are the
    timings."""
    validate(backend)
    if backend != "auto":
        return backend
    if not onednn_available():
        log.info("runtime.gemm=auto: aten (this torch build has no oneDNN)")
        return "aten"
    shapes = model_linear_shapes(model)
    if not shapes:
        return "aten"
    rows = max(1, min(rows, TIMING_ROWS))
    key = [
        cpu_kind(),
        f"threads={torch.get_num_threads()}",
        f"torch={torch.__version__}",
        f"rows={rows}",
        # timings cached before they were checked (issue 56) may have been taken under load: not read
        "checked",
        *sorted(f"{s.key}:{n}" for s, n in shapes.items()),
    ]
    flops = _flops(shapes, rows)
    # looked up here, not bound as defaults: tests (and callers) replace the module's timings
    times, source, why, references = cached_timings(
        Path(cache_dir) / CACHE_FILE if cache_dir is not None else None,
        key,
        ("aten", "onednn"),
        lambda: timed_repeats(shapes, rows, measure_fn or measure, reference_fn or reference_gflops),
        lambda runs, refs: untrustworthy(runs, refs, shapes, rows),
    )
    if why is not None:
        log.warning(
            "runtime.gemm=auto: aten, the default, for this run, and nothing cached: the timing cannot be "
            "trusted (%s; aten %.2g GFLOP/s, oneDNN %.2g GFLOP/s, the reference GEMM %s GFLOP/s)",
            why,
            flops / times["aten"] / 1e9,
            flops / times["onednn"] / 1e9,
            " and ".join(f"{r:.1f}" for r in references),
        )
        return "aten"
    choice = _faster(times)
    log.info(
        "runtime.gemm=auto: %s (%s on this model's %d linear shapes: aten %.1f GFLOP/s, oneDNN %.1f GFLOP/s; "
        "oneDNN is taken when > %d%% faster)",
        choice,
        source,
        len(shapes),
        flops / times["aten"] / 1e9,
        flops / times["onednn"] / 1e9,
        round((MARGIN - 1) * 100),
    )
    return choice


def cached_timings(
    cache: Path | None,
    key: list[str],
    names: tuple[str, ...],
    time_repeats: Callable[[], tuple[list[dict[str, float]], list[float], dict[str, float]]],
    why_untrusted: Callable[[list[dict[str, float]], list[float]], str | None],
) -> tuple[dict[str, float], str, str | None, list[float]]:
    """The timings of a measured-once choice (``runtime.gemm=auto``, ``trainer.precision=auto``): those cached in
    the JSON file ``cache`` under ``key`` (joined by ``|``) when they hold every one of ``names``, else
    ``time_repeats()``'s (:func:`timed_repeats`), cached only when ``why_untrusted`` finds nothing wrong with
    them. Returns the timings, where they came from, why they cannot be trusted (None when they can) and the
    reference GEMM's rates taken around them (empty when cached)."""
    joined = "|".join(key)
    entries = _read_cache(cache)
    times = entries.get(joined)
    if isinstance(times, dict) and set(names) <= times.keys():
        return times, "cached", None, []
    runs, references, times = time_repeats()
    why = why_untrusted(runs, references)
    if why is None and cache is not None:
        entries[joined] = times
        _write_cache(cache, entries)
    return times, f"measured {MEASUREMENTS} times", why, references


def _read_cache(path: Path | None) -> dict[str, dict[str, float]]:
    if path is None or not path.is_file():
        return {}
    try:
        entries = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}  # a damaged cache is re-measured, never an error
    return entries if isinstance(entries, dict) else {}


def _write_cache(path: Path, entries: dict[str, dict[str, float]]) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(entries, indent=1, sort_keys=True))
        os.replace(tmp, path)  # atomic: concurrent runs (a search's workers) never read half a file
    except OSError as err:
        log.debug("runtime.gemm: cache %s not written (%s)", path, err)


def batch_rows(data: Mapping[str, object]) -> int:
    """The rows of one batch's linear layers that ``auto`` times at: a data config's ``batch_size x max_length``
    (1 and 128 where unset)."""
    return (data.get("batch_size") or 1) * (data.get("max_length") or 128)


@contextmanager
def gemm_for(backend: str, model: torch.nn.Module, rows: int, cache_dir=None) -> Iterator[str]:
    """:func:`choose` then :func:`gemm_backend` in one: ``with gemm_for(cfg_value, model, rows) as chosen: ...``."""
    chosen = choose(backend, model, rows, cache_dir)
    with gemm_backend(chosen):
        yield chosen
