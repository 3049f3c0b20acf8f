"""``trainer.precision=auto``, the CPU default: bfloat16 autocast (``bf16-mixed``) where the CPU executes bfloat16
natively and measurably faster than fp32 on the model's own linear shapes, fp32 (``32-true``) elsewhere.

CPUs with Intel AMX-BF16 or AVX-512 BF16 (``amx_bf16`` / ``avx512_bf16`` in ``/proc/cpuinfo``; Arm's ``bf16``)
compute bfloat16 matrix products at a multiple of their fp32 rate (issue 59: 2x on an AVX-512 BF16 AMD EPYC, 4-8x
on an AMX Xeon); without such flags autocast emulates bfloat16 and is slower, so ``auto`` keeps fp32 there without
measuring anything. Where the flags are present, :func:`choose` decides the way ``runtime.gemm=auto`` does
(:mod:`adls_lightning.gemm`, whose shapes, reference GEMM and cache it shares): it times one training step's GEMMs of
every linear layer of the model at the run's batch rows, in fp32 (the faster of aten and oneDNN, the backend
``runtime.gemm=auto`` would take) and under bfloat16 autocast (weight and input casts included), takes bf16 only when
it is faster by more than :data:`MARGIN`, caches the answer per CPU kind, thread count, torch version and shapes
in ``paths.cache_dir/precision_choice.json`` and logs one line starting ``trainer.precision=auto:`` with the choice,
both rates and the CPU model. A measurement taken under load (repeats that disagree, a reference GEMM below any
CPU's rate) is used for nothing: the run keeps fp32, says why, and caches nothing.

Any other value (``32-true``, ``bf16-mixed``, ...) is Lightning's and is returned unchanged.

Library code: no Lightning imports.
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from adls_lightning.errors import ConfigError
from adls_lightning.gemm import (
    BFLOAT16_FLAGS,
    TIMING_ROWS,
    LinearShape,
    _flops,
    _gemm_calls,
    best_call_seconds,
    cached_timings,
    cpu_flags,
    cpu_kind,
    cpu_name,
    model_linear_shapes,
    native_bfloat16,
    onednn_available,
    reference_gflops,
    repeats_untrustworthy,
    timed_repeats,
)
from adls_lightning.runtime import EVAL_PRECISIONS

log = logging.getLogger(__name__)

AUTO = "auto"
FP32 = "32-true"
BF16 = "bf16-mixed"
# bf16's GEMMs must beat fp32's by more than this for `auto` to take it: the GEMMs are about two thirds of a
# training step, the rest (softmax, layer norm, the optimizer, autocast's casts outside the GEMMs) gains nothing,
# so a smaller GEMM gain would leave the step within its noise while paying bf16's rounding in the activations.
MARGIN = 1.3
CACHE_FILE = "precision_choice.json"


#: Lightning's values that need NVIDIA's Transformer Engine (``transformer_engine``), usable only where it is installed
TRANSFORMER_ENGINE = "transformer-engine"


def valid_precisions() -> tuple[str, ...]:
    """``auto`` and Lightning's own precision values (all its ``_PRECISION_INPUT`` groups), the Transformer Engine
    ones only where its package is installed."""
    import importlib.util
    import typing

    from lightning.fabric.connector import _PRECISION_INPUT

    engine = importlib.util.find_spec("transformer_engine") is not None
    values = (str(v) for group in typing.get_args(_PRECISION_INPUT) for v in typing.get_args(group))
    return (AUTO, *dict.fromkeys(v for v in values if engine or not v.startswith(TRANSFORMER_ENGINE)))


def validate(value: object) -> None:
    """Raise ConfigError (one line, listing the valid values) unless ``value`` is ``auto`` or Lightning's (a
    Transformer Engine value: only where its package is installed)."""
    valid = valid_precisions()
    if str(value).startswith(TRANSFORMER_ENGINE) and str(value) not in valid:
        raise ConfigError(
            f"trainer.precision={value}: needs NVIDIA Transformer Engine (the transformer_engine package), not "
            f"installed here; valid: {', '.join(valid)}"
        )
    if str(value) not in valid or isinstance(value, bool):
        raise ConfigError(f"trainer.precision={value!r}: must be one of {', '.join(valid)}")


def bfloat16_flags(flags: str) -> list[str]:
    """The flags among ``flags`` that mean native bfloat16 arithmetic (amx_bf16, avx512_bf16, bf16)."""
    return sorted(BFLOAT16_FLAGS.intersection(flags.split()))


def _bf16_calls(shape: LinearShape, rows: int) -> list[Callable[[], object]]:
    """One training step's GEMMs of this layer under bfloat16 autocast, as the run computes them: the forward casts
    the fp32 input and weight (autocast re-casts a frozen weight on every call), the backward multiplies bfloat16
    gradients by the saved bfloat16 operands, and the weight's gradient is cast back to the fp32 parameter."""
    gen = torch.Generator().manual_seed(0)  # not the global stream: see gemm._gemm_calls
    x = torch.randn(rows, shape.in_features, generator=gen)
    w = torch.randn(shape.out_features, shape.in_features, generator=gen)
    g = torch.randn(rows, shape.out_features, generator=gen).bfloat16()
    xb, wb = x.bfloat16(), w.bfloat16()

    def forward():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return F.linear(x, w)

    calls = [forward, lambda: torch.mm(g, wb)]
    if shape.train_weight:
        calls.append(lambda: torch.mm(g.t(), xb).float())
    return calls


def measure(shapes: Counter[LinearShape], rows: int, repeats: int = 5) -> dict[str, float]:
    """Seconds per step of all the model's linear GEMMs in fp32 and under bf16 autocast: the best of ``repeats``
    rounds per GEMM, alternating within each round so load from other processes falls on all alike. fp32 is
    the faster of aten and oneDNN per GEMM (what ``runtime.gemm=auto`` can give the fp32 run)."""
    fp32_backends = ("aten", "onednn") if onednn_available() else ("aten",)
    total = {"fp32": 0.0, "bf16": 0.0}
    for shape, count in shapes.items():
        calls = {backend: _gemm_calls(shape, rows, backend) for backend in fp32_backends}
        calls["bf16"] = _bf16_calls(shape, rows)
        best = best_call_seconds(calls, repeats)
        total["fp32"] += count * min(sum(best[b]) for b in fp32_backends)
        total["bf16"] += count * sum(best["bf16"])
    return total


def _faster(times: dict[str, float]) -> str:
    return BF16 if times["fp32"] > MARGIN * times["bf16"] else FP32


def _decisive(runs: list[dict[str, float]]) -> bool:
    """Whether the answer holds whichever repeats are compared: bf16's slowest still more than :data:`MARGIN`
    faster than fp32's fastest, or fp32's slowest not beaten by bf16's fastest by it. Such a gap (AVX-512 BF16's
    2x, AMX's more) survives a loaded machine's spread, which a 5 % GEMM backend choice does not."""
    fp32, bf16 = [run["fp32"] for run in runs], [run["bf16"] for run in runs]
    return min(fp32) > MARGIN * max(bf16) or max(fp32) <= MARGIN * min(bf16)


def untrustworthy(runs: list[dict[str, float]], references: list[float]) -> str | None:
    """Why repeated measurements (``runs``, each a :func:`measure`) with the reference GEMM's rates around them
    cannot be trusted (the checks of :func:`adls_lightning.gemm.untrustworthy`, the spread's waived where the
    answer is :func:`_decisive`); None when they can."""
    return repeats_untrustworthy(runs, references, _faster, FP32, "bf16", check_spread=not _decisive(runs))


def choose(
    precision: str,
    model: torch.nn.Module,
    rows: int,
    cache_dir: str | os.PathLike | None = None,
    flags: str | None = None,
    measure_fn: Callable[[Counter[LinearShape], int], dict[str, float]] | None = None,
    reference_fn: Callable[[], float] | None = None,
) -> str:
    """Resolve ``trainer.precision`` for a CPU run: anything but ``auto`` unchanged (after :func:`validate`);
    ``auto`` -> ``bf16-mixed`` where the CPU has bfloat16 arithmetic (``flags``, default ``/proc/cpuinfo``'s)
    and bf16 autocast's GEMMs on the model's linear shapes at ``rows`` tokens (capped at
    :data:`~adls_lightning.gemm.TIMING_ROWS`) are more than :data:`MARGIN` faster than fp32's, else ``32-true``.
    Logs one line starting ``trainer.precision=auto:``; caches a trusted measurement in
    ``cache_dir/precision_choice.json``. ``measure_fn`` (default :func:`measure`) and ``reference_fn`` (default
    :func:`~adls_lightning.gemm.reference_gflops`) are the timings."""
    validate(precision)
    if precision != AUTO:
        return precision
    flags = cpu_flags() if flags is None else flags
    cpu = cpu_name()
    native = native_bfloat16(flags)
    if not native:
        why = "flags unreadable" if native is None else "no amx_bf16, avx512_bf16 or bf16 in its flags"
        log.info(
            "trainer.precision=auto: 32-true (this CPU computes no bfloat16 natively: %s; CPU %s)", why, cpu
        )
        return FP32
    shapes = model_linear_shapes(model)
    if not shapes:
        log.info("trainer.precision=auto: 32-true (the model has no linear layer to measure; CPU %s)", cpu)
        return FP32
    rows = max(1, min(rows, TIMING_ROWS))
    key = [
        cpu_kind(flags),
        f"threads={torch.get_num_threads()}",
        f"torch={torch.__version__}",
        f"rows={rows}",
        *sorted(f"{s.key}:{n}" for s, n in shapes.items()),
    ]
    flops = _flops(shapes, rows)
    times, source, why, references = cached_timings(
        Path(cache_dir) / CACHE_FILE if cache_dir is not None else None,
        key,
        ("fp32", "bf16"),
        lambda: timed_repeats(shapes, rows, measure_fn or measure, reference_fn or reference_gflops),
        untrustworthy,
    )
    if why is not None:
        log.warning(
            "trainer.precision=auto: 32-true, the default, for this run, and nothing cached: the timing cannot "
            "be trusted (%s; fp32 %.1f GFLOP/s, bf16 %.1f GFLOP/s, the reference GEMM %s GFLOP/s; CPU %s)",
            why,
            flops / times["fp32"] / 1e9,
            flops / times["bf16"] / 1e9,
            " and ".join(f"{r:.1f}" for r in references),
            cpu,
        )
        return FP32
    choice = _faster(times)
    log.info(
        "trainer.precision=auto: %s (%s on this model's %d linear shapes at %d rows: fp32 %.1f GFLOP/s, "
        "bf16 %.1f GFLOP/s, %.2fx; bf16 is taken when > %d%% faster; CPU %s, %s)",
        choice,
        source,
        len(shapes),
        rows,
        flops / times["fp32"] / 1e9,
        flops / times["bf16"] / 1e9,
        times["fp32"] / times["bf16"],
        round((MARGIN - 1) * 100),
        cpu,
        " ".join(bfloat16_flags(flags)),
    )
    return choice


# --- Inference in bfloat16: weights cast once -------------------------------------------------------------------

#: packages whose layers compute in whatever dtype their parameters have; layers of any other package (this
#: project's quantizers, MXINT8 packed layers, pruning masks) keep fp32 and get casts at their edge
_DTYPE_AGNOSTIC_PACKAGES = ("torch.", "transformers.", "peft.")


def eval_precision(value: str, trainer_precision: str | int, on_cpu: bool = True) -> str:
    """How an evaluation computes: ``bf16`` (weights cast to bfloat16 once, autocast off), ``32-true`` (fp32,
    autocast off) or ``trainer`` (as the trainer's precision does: fp32 under ``32-true``, autocast per call
    under ``bf16-mixed`` on a GPU). ``value`` is ``model.eval_precision`` (:data:`EVAL_PRECISIONS`); ``auto``
    follows ``trainer_precision`` as resolved for the run (:func:`choose`: bf16 only where the CPU measured it
    faster on this model's shapes), so the decision is measured once, for training and evaluation alike."""
    if value not in EVAL_PRECISIONS:
        raise ConfigError(f"model.eval_precision={value!r}: must be one of {', '.join(EVAL_PRECISIONS)}")
    if value != AUTO:
        return value
    return "bf16" if on_cpu and str(trainer_precision).startswith("bf16") else "trainer"


def _keeps_fp32(module: torch.nn.Module) -> bool:
    """A layer from outside :data:`_DTYPE_AGNOSTIC_PACKAGES` holding floating-point tensors: its own kernels and
    fake quantization assume fp32 (a bfloat16 weight would round before it is quantized)."""
    if type(module).__module__.startswith(_DTYPE_AGNOSTIC_PACKAGES):
        return False
    tensors = [*module.parameters(), *module.buffers()]
    return any(t.is_floating_point() for t in tensors)


def _fp32_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The outermost :func:`_keeps_fp32` layers of ``model`` (their insides stay as they are)."""
    found: list[torch.nn.Module] = []

    def walk(module: torch.nn.Module) -> None:
        if _keeps_fp32(module):
            found.append(module)
            return
        for child in module.children():
            walk(child)

    walk(model)
    return found


def _cast_floats(value: object, source: torch.dtype, target: torch.dtype) -> object:
    """``value`` with every ``source`` tensor in it (tuples, lists, dicts) cast to ``target``."""
    if isinstance(value, torch.Tensor):
        return value.to(target) if value.dtype == source else value
    if isinstance(value, (tuple, list)):
        return type(value)(_cast_floats(v, source, target) for v in value)
    if isinstance(value, dict):
        return {k: _cast_floats(v, source, target) for k, v in value.items()}
    return value


def _fp32_edge(module: torch.nn.Module) -> None:
    """bfloat16 inputs enter ``module`` as fp32, its fp32 outputs leave as bfloat16."""

    def enter(_module, args, kwargs):
        return _cast_floats(args, torch.bfloat16, torch.float32), _cast_floats(
            kwargs, torch.bfloat16, torch.float32
        )

    def leave(_module, _args, output):
        return _cast_floats(output, torch.float32, torch.bfloat16)

    module.register_forward_pre_hook(enter, with_kwargs=True)
    module.register_forward_hook(leave)


def bf16_inference_model(model: torch.nn.Module, copy: bool = True) -> torch.nn.Module:
    """``model`` for inference with its weights cast to bfloat16 once (not autocast's cast of every weight on every
    call): the parameters of torch's, Hugging Face's and PEFT's layers (linear, embedding, layer norm, LoRA) become
    bfloat16, so activations flow in bfloat16 end to end. This project's own layers (quantizers, MXINT8 packed
    linears, pruning masks: :func:`_keeps_fp32`) keep their fp32 tensors and compute as in fp32, their inputs cast
    up and outputs down at their edge. Buffers keep their dtype (rotary frequencies and the like are meant fp32).

    ``copy=True`` returns a new module (the model's fp32 weights untouched, none of them duplicated in fp32:
    a training run evaluates on it and trains on); ``copy=False`` casts ``model`` itself (an exported model loaded
    only to be evaluated). The result has no gradients. Run it with autocast off."""
    keep = {id(t) for layer in _fp32_layers(model) for t in layer.parameters()}
    cast = {
        id(p): torch.nn.Parameter(p.detach().to(torch.bfloat16), requires_grad=False)
        for p in model.parameters()
        if p.is_floating_point() and id(p) not in keep
    }
    if copy:
        import copy as copying

        result = copying.deepcopy(model, memo=dict(cast))
        for module in result.modules():
            # a module compiled in place (``nn.Module.compile``) would copy a compiled call bound to the original
            # module, running its fp32 weights: the copy runs eager
            if getattr(module, "_compiled_call_impl", None) is not None:
                module._compiled_call_impl = None
    else:
        for module in model.modules():
            for p in list(module.parameters(recurse=False)):
                if id(p) in cast:
                    p.data = cast[id(p)].data
                    p.requires_grad_(False)
        result = model
    for layer in _fp32_layers(result):
        _fp32_edge(layer)
    return result.requires_grad_(False).eval()


def inference_model(
    model: torch.nn.Module,
    eval_value: str,
    trainer_value: str,
    rows: int,
    cache_dir: str | os.PathLike | None = None,
) -> torch.nn.Module:
    """An evaluation-only model (an exported folder's) as a run would evaluate it: ``trainer_value`` resolved by
    :func:`choose` (``auto``: measured, or read from the cache, on this model's shapes), then ``eval_value``
    (``model.eval_precision``) by :func:`eval_precision`; ``bf16`` casts ``model`` in place
    (:func:`bf16_inference_model`), anything else leaves it fp32. Logs one line saying which."""
    how = eval_precision(eval_value, choose(trainer_value, model, rows, cache_dir))
    if how != "bf16":
        log.info("Inference: fp32 (model.eval_precision=%s, trainer.precision=%s)", eval_value, trainer_value)
        return model
    log.info(
        "Inference: weights cast to bf16 once (model.eval_precision=%s, trainer.precision=%s)",
        eval_value,
        trainer_value,
    )
    return bf16_inference_model(model, copy=False)
