"""Which int8 runtime is fastest on this CPU kind, measured side by side on the model and cached (issue 59).

The candidates run the same model's linear layers on int8 codes, each through another kernel library:

* ``torch-dynamic``: ``torch.ao.quantization.quantize_dynamic`` of every ``nn.Linear`` (int8 weights, inputs
  quantized per call) on torch's ``x86`` quantized engine (fbgemm / oneDNN, VNNI where the CPU has it);
* ``ort-dynamic``: ONNX Runtime's dynamic int8 graph, as ``python -m adls_lightning.export format=onnx int8=true``
  writes it (:func:`adls_lightning.export.onnx.quantize_int8`);
* ``pt2e-x86-inductor``: torch's PT2E flow with the x86 inductor quantizer (static int8, calibrated on the timing
  batch) compiled by inductor with freezing: oneDNN's int8 kernels, the route to AMX-INT8 on Xeons that have it.
  It lives in ``torchao`` (``torchao.quantization.pt2e``; torch 2.13 no longer ships it): measured only where
  ``torchao`` imports, otherwise left out and said so.

:func:`measure` times them at one ``batch x tokens`` and thread count (interleaved rounds, the median kept: load
from other processes falls on all alike); :func:`best_int8_runtime` returns the fastest for this CPU kind, reading
``paths.cache_dir/int8_runtime.json`` (keyed by CPU kind, its int8 flags, threads, torch and ONNX Runtime versions,
shape) before measuring anything, as ``trainer.precision=auto`` caches its choice. ``benchmarks/bench_int8_runtimes.py``
prints the table and records the answer where the int8 export can read it.

Library code: no Lightning imports.
"""

from __future__ import annotations

import copy
import logging
import os
import tempfile
from collections.abc import Callable, Collection
from pathlib import Path

import torch

from adls_lightning.export.pt2e import pt2e_unusable
from adls_lightning.gemm import (
    INT8_DOT_PRODUCT_FLAGS,
    _read_cache,
    _write_cache,
    cpu_flags,
    cpu_kind,
    cpu_name,
    u8s8_saturates,
)
from adls_lightning.search.cost import clock_for, time_calls

log = logging.getLogger(__name__)

TORCH_DYNAMIC = "torch-dynamic"
ORT_DYNAMIC = "ort-dynamic"
PT2E = "pt2e-x86-inductor"
RUNTIMES = (TORCH_DYNAMIC, ORT_DYNAMIC, PT2E)
#: the runtimes of a run's own int8 grid (``format=onnx int8=scaled``): ONNX Runtime's QDQ graph and PT2E with the
#: run's steps fixed (:func:`adls_lightning.export.pt2e.write_run_codes_package`), timed as the files they write
ORT_QDQ = "ort-qdq"
PT2E_RUN_CODES = "pt2e-run-codes"
RUN_CODE_RUNTIMES = (ORT_QDQ, PT2E_RUN_CODES)
CACHE_FILE = "int8_runtime.json"
#: the CPU flags that decide int8 matrix rates: VNNI dot products (AVX-512 / AVX) and AMX's int8 tiles, then AVX2
INT8_FLAGS = (*sorted(INT8_DOT_PRODUCT_FLAGS), "avx2")

Runner = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def int8_flags(flags: str | None = None) -> list[str]:
    """The flags among the CPU's (or ``flags``) that bear on int8 matrix products."""
    present = set((cpu_flags() if flags is None else flags).split())
    return [f for f in INT8_FLAGS if f in present]


def cache_key(batch: int, tokens: int, flags: str | None = None, runtimes: tuple[str, ...] = RUNTIMES) -> str:
    """This CPU kind and run shape: the CPU's kind (:func:`~adls_lightning.gemm.cpu_kind`), its int8 flags, threads,
    torch and ONNX Runtime versions (and whether ONNX Runtime's int8 weights run as uint8 here,
    :func:`~adls_lightning.gemm.u8s8_saturates`: times taken before that repair are not this code's), batch x
    tokens (and the runtimes compared, when they are not :data:`RUNTIMES`)."""
    try:
        import onnxruntime

        ort = onnxruntime.__version__ + ("+u8-weights" if u8s8_saturates(flags) else "")
    except ImportError:
        ort = "none"
    return "|".join(
        [
            cpu_kind(flags),
            " ".join(int8_flags(flags)) or "no-int8-flags",
            f"threads={torch.get_num_threads()}",
            f"torch={torch.__version__}",
            f"ort={ort}",
            f"{batch}x{tokens}",
            *([] if runtimes == RUNTIMES else [",".join(runtimes)]),
        ]
    )


def _torch_dynamic(model: torch.nn.Module, inputs: dict[str, torch.Tensor], _work: Path) -> Runner:
    torch.backends.quantized.engine = "x86"
    quantized = torch.ao.quantization.quantize_dynamic(
        copy.deepcopy(model), {torch.nn.Linear}, dtype=torch.qint8
    ).eval()

    def run(input_ids, attention_mask):
        with torch.inference_mode():
            return quantized(input_ids=input_ids, attention_mask=attention_mask).logits

    return run


def _ort_dynamic(model: torch.nn.Module, _inputs: dict[str, torch.Tensor], work: Path) -> Runner:
    from adls_lightning.export import onnx as onnx_export

    fp32_path, int8_path = work / onnx_export.ONNX_FILE, work / onnx_export.ONNX_INT8_FILE
    onnx_export.export_onnx(model, fp32_path)
    onnx_export.quantize_int8(fp32_path, int8_path)
    return file_runner(int8_path)


def file_runner(path: Path, exact_int8: bool = True) -> Runner:
    """An exported graph as a runner: an ONNX file in ONNX Runtime (loaded now; ``exact_int8``: as
    :func:`~adls_lightning.export.onnx.onnx_session` takes it), or a ``.pt2`` package."""
    if path.suffix == ".pt2":
        from adls_lightning.export.pt2e import Pt2Classifier

        package = Pt2Classifier(path)
        return lambda input_ids, attention_mask: (
            package(input_ids=input_ids, attention_mask=attention_mask).logits
        )
    from adls_lightning.export import onnx as onnx_export

    session = onnx_export.onnx_session(path, exact_int8=exact_int8)

    def run(input_ids, attention_mask):
        logits = onnx_export.onnx_logits(session, {"input_ids": input_ids, "attention_mask": attention_mask})
        return torch.from_numpy(logits)

    return run


def _pt2e(model: torch.nn.Module, inputs: dict[str, torch.Tensor], _work: Path) -> Runner:
    import torch._inductor.config as inductor_config

    from adls_lightning.export.pt2e import quantize_pt2e

    args = (inputs["input_ids"], inputs["attention_mask"])
    converted, _ = quantize_pt2e(model, [inputs])  # calibration: the timing batch
    with torch.no_grad(), inductor_config.patch(freezing=True):  # int8 weights packed at compile
        compiled = torch.compile(converted)
        compiled(*args)  # compiles now, not in the first timed round

    def run(input_ids, attention_mask):
        with torch.no_grad():
            return compiled(input_ids, attention_mask)

    return run


BUILDERS: dict[str, Callable[[torch.nn.Module, dict[str, torch.Tensor], Path], Runner]] = {
    TORCH_DYNAMIC: _torch_dynamic,
    ORT_DYNAMIC: _ort_dynamic,
    PT2E: _pt2e,
}


def sample_batch(batch: int, tokens: int, vocab_size: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random token ids without padding (every position computed), as the inference benchmarks time."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(1000 if vocab_size > 2000 else 1, vocab_size, (batch, tokens), generator=generator)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def time_runners(
    runners: dict[str, Runner], inputs: dict[str, torch.Tensor], repeats: int = 5
) -> dict[str, float]:
    """Seconds per call of each runner, median of ``repeats`` interleaved rounds after warm-up
    (:func:`adls_lightning.search.cost.time_calls`), on the clock that function's callers read at this thread
    count."""
    args = (inputs["input_ids"], inputs["attention_mask"])
    seconds = time_calls({name: lambda run=run: run(*args) for name, run in runners.items()}, repeats)
    return {name: clocks[clock_for(torch.get_num_threads())] for name, clocks in seconds.items()}


def build_runners(
    model: torch.nn.Module,
    inputs: dict[str, torch.Tensor],
    runtimes: tuple[str, ...] = RUNTIMES,
    skipped: dict[str, str] | None = None,
    work: Path | None = None,
) -> dict[str, Runner]:
    """A runner per available runtime (``skipped`` collects why one is not: PT2E without torchao, a failed
    export or compile, in one line each)."""
    skipped = {} if skipped is None else skipped
    work = Path(tempfile.mkdtemp(prefix="adls-int8-")) if work is None else work
    runners = {}
    for name in runtimes:
        if name == PT2E and (why := pt2e_unusable()) is not None:
            skipped[name] = why
            continue
        try:
            runners[name] = BUILDERS[name](model.eval(), inputs, work)
        except Exception as error:  # a runtime that cannot take this model is left out, with the reason
            skipped[name] = (
                f"{type(error).__name__}: {str(error).splitlines()[0][:200] if str(error) else ''}"
            )
    return runners


def measure(
    model: torch.nn.Module, batch: int, tokens: int, repeats: int = 5, skipped: dict[str, str] | None = None
) -> dict[str, float]:
    """Seconds per ``batch x tokens`` forward of each available int8 runtime on ``model`` (:func:`time_runners`)."""
    inputs = sample_batch(batch, tokens, model.config.vocab_size)
    with tempfile.TemporaryDirectory(prefix="adls-int8-") as work:  # the graphs are loaded, then not needed
        runners = build_runners(model, inputs, skipped=skipped, work=Path(work))
        return time_runners(runners, inputs, repeats)


def runtime_times(
    cache_dir: str | os.PathLike | None,
    model: torch.nn.Module | None = None,
    batch: int = 8,
    tokens: int = 128,
    measure_fn: Callable[..., dict[str, float]] | None = None,
    flags: str | None = None,
    runtimes: tuple[str, ...] = RUNTIMES,
) -> tuple[dict[str, float], str]:
    """Seconds per ``batch x tokens`` call of each int8 runtime for this CPU kind, and where they came from: the
    cached answer in ``cache_dir/int8_runtime.json`` if this CPU kind has one (``"cached"``); else measured on
    ``model`` (by ``measure_fn``, default :func:`measure`) and cached (``"measured"``); empty without a cached answer
    or a model to measure. ``runtimes``: the set compared (:data:`RUNTIMES`, or :data:`RUN_CODE_RUNTIMES` with a
    ``measure_fn`` that times them), cached apart."""
    key = cache_key(batch, tokens, flags, runtimes)
    cache = Path(cache_dir) / CACHE_FILE if cache_dir is not None else None
    entries = _read_cache(cache)
    times = entries.get(key)
    if isinstance(times, dict) and times and set(times) <= set(runtimes):
        return dict(times), "cached"
    if model is None:
        return {}, "none cached"
    times = (measure_fn or measure)(model, batch, tokens)
    if times and cache is not None:
        entries[key] = times
        _write_cache(cache, entries)
    return dict(times or {}), "measured"


def fastest(times: dict[str, float], among: Collection[str] | None = None) -> str | None:
    """The runtime of ``times`` with the shortest time, among ``among`` (default: all); None when none is timed."""
    usable = {name: t for name, t in times.items() if among is None or name in among}
    return min(usable, key=usable.get) if usable else None


def describe_times(times: dict[str, float]) -> str:
    """``name 12.3 ms, ...``, fastest first."""
    return ", ".join(f"{name} {1e3 * t:.1f} ms" for name, t in sorted(times.items(), key=lambda kv: kv[1]))


def describe_setting(batch: int, tokens: int, threads: int) -> str:
    """Where times were taken: ``batch B x T tokens, N thread(s); CPU <model>, <its int8 flags>``."""
    flags = " ".join(int8_flags()) or "no int8 flags"
    return f"batch {batch} x {tokens} tokens, {threads} thread(s); CPU {cpu_name()}, {flags}"


def best_int8_runtime(
    cache_dir: str | os.PathLike | None,
    model: torch.nn.Module | None = None,
    batch: int = 8,
    tokens: int = 128,
    measure_fn: Callable[..., dict[str, float]] | None = None,
    flags: str | None = None,
    among: Collection[str] | None = None,
) -> str | None:
    """The fastest int8 runtime (one of :data:`RUNTIMES`) for this CPU kind at ``batch x tokens``, of
    :func:`runtime_times`; None without a cached answer or a model to measure, or when none of ``among`` (the
    runtimes the caller can use; default all) was timed. Logs one line starting ``int8 runtime:`` with every
    runtime's time."""
    times, source = runtime_times(cache_dir, model, batch, tokens, measure_fn, flags)
    best = fastest(times, among)
    if best is None:
        return None
    overall = fastest(times)
    log.info(
        "int8 runtime: %s%s (%s at %dx%d tokens, %d thread(s): %s; CPU %s, %s)",
        best,
        f", the fastest of {', '.join(sorted(n for n in times if n in among))}; {overall} is faster but not usable here"
        if best != overall and among is not None
        else "",
        source,
        batch,
        tokens,
        torch.get_num_threads(),
        describe_times(times),
        cpu_name(),
        " ".join(int8_flags(flags)) or "no int8 flags",
    )
    return best


def record(cache_dir: str | os.PathLike, batch: int, tokens: int, times: dict[str, float]) -> str:
    """Write measured ``times`` (seconds per call per runtime) as this CPU kind's answer; returns the fastest."""
    cache = Path(cache_dir) / CACHE_FILE
    entries = _read_cache(cache)
    kept = {k: v for k, v in times.items() if k in RUNTIMES}
    entries[cache_key(batch, tokens)] = kept
    _write_cache(cache, entries)
    return fastest(kept)
