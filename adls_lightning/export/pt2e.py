"""int8 through torch's PT2E flow with the x86 inductor quantizer, written as an AOTInductor package (issue 59).

This is the int8 route that reaches oneDNN's int8 kernels, and through them AMX-INT8 on the Xeons that have it
(:mod:`adls_lightning.int8_runtime` measures it beside ONNX Runtime's and torch's dynamic int8). The model's
linear layers get static int8 activations (one scale per tensor, calibrated on batches of the run's training
split) and int8 weights per output channel; ``torch.export`` captures ``(input_ids, attention_mask) -> logits``
with the batch and sequence axes dynamic, and AOTInductor compiles it ahead of time with freezing (the int8
weights packed for oneDNN at compile) into one ``.pt2`` file.

:func:`write_run_codes_package` writes a ``quant=int8_scaled`` run the same way but on the run's own grid
(``format=onnx int8=scaled``, where it measures faster than ONNX Runtime's QDQ graph): each quantized layer's
weight codes and per-channel steps, and its calibrated static input step, fixed in the graph instead of observed,
so the package computes the run's integers (:func:`run_codes_quantizer`).

Quantizing needs ``torchao`` (``pip install 'adls-lightning[int8]'``: torch 2.13 no longer ships PT2E); running
the package needs torch alone (:class:`Pt2Classifier`, ``torch._inductor.aoti_load_package``). Compiling needs the
C++ compiler inductor uses (about 35 s for MiniLM on one core).

A package is machine code for the exporting CPU's instruction set: inductor compiles it with ``-march=native`` and
its vector ISA's options (``-mavx512f ...``, ``-mamx-tile ...``), and a CPU without those instructions stops the
process with an illegal instruction, no message. The package records the exporting CPU (:func:`compile_package`
puts its name and instruction-set flags in AOTInductor's metadata, beside torch's own ``AOTI_CPU_ISA``), and
:class:`Pt2Classifier` reads that record before loading and refuses, in one line, a package this CPU cannot run.

Library code: no Lightning imports.
"""

from __future__ import annotations

import copy
import json
import os
import platform
import tempfile
import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from adls_lightning.errors import ConfigError
from adls_lightning.export.onnx import INPUT_NAMES, LogitsOnly, OnnxCheck, sample_inputs
from adls_lightning.gemm import cpu_flags, cpu_name, u8s8_saturates

PT2E_FILE = "model_int8_pt2e.pt2"
#: ``format=onnx int8=scaled`` in PT2E (:func:`write_run_codes_package`)
RUN_CODES_FILE = "model_int8_scaled.pt2"
#: the largest batch the package accepts (its dynamic batch axis needs a bound for inductor's guards)
MAX_BATCH = 1024


def pt2e_available() -> str | None:
    """None where torch's PT2E x86 inductor quantization imports, else why not (one line)."""
    try:
        from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e  # noqa: F401
        from torchao.quantization.pt2e.quantizer.x86_inductor_quantizer import X86InductorQuantizer  # noqa: F401
    except ImportError as error:
        return f"torchao's PT2E quantization does not import ({error}); pip install 'adls-lightning[int8]'"
    return None


def saturation_problem(flags: str | None = None) -> str | None:
    """Why oneDNN's int8 kernels (what a PT2E package runs) are not exact on this CPU (or one with ``flags``), or
    None: where :func:`~adls_lightning.gemm.u8s8_saturates`, their uint8 x int8 products are added in pairs in
    saturating int16."""
    if not u8s8_saturates(flags):
        return None
    return (
        f"this CPU ({cpu_name()}) has no int8 dot product (VNNI or AMX-INT8), and oneDNN's int8 kernels add pairs "
        "of uint8 x int8 products in saturating int16 on it, off the exact sums by up to a fifth of a layer's "
        "outputs; ONNX Runtime's int8 graphs (model_int8.onnx, model_int8_scaled.onnx) compute exactly here"
    )


def pt2e_unusable() -> str | None:
    """Why the PT2E int8 route is not offered here (torchao missing, :func:`pt2e_available`; or this CPU's int8
    kernels saturate, :func:`saturation_problem`), or None: what ``int8=auto``, ``int8_runtime=pt2e`` and the int8
    runtime measurements ask before they write, time or run a package."""
    return pt2e_available() or saturation_problem()


def quantize_pt2e(model: nn.Module, batches: Sequence[dict[str, torch.Tensor]]) -> tuple[nn.Module, tuple]:
    """``model`` (a float classifier, left untouched) as PT2E's converted int8 graph module, calibrated on
    ``batches`` (their ``input_ids`` and ``attention_mask``); returns it and the example arguments it was
    captured with, whose sequence length is the longest batch's.

    Raises:
        ConfigError: torchao is not installed (one line naming the extra).
    """
    why = pt2e_available()
    if why is not None:
        raise ConfigError(f"int8 PT2E: {why}")
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e
    from torchao.quantization.pt2e.quantizer import x86_inductor_quantizer as xiq

    wrapped = LogitsOnly(copy.deepcopy(model)).eval()
    example = _example(batches)
    with torch.no_grad():
        captured = torch.export.export(wrapped, example, dynamic_shapes=_dynamic_shapes(model)).module()
        quantizer = xiq.X86InductorQuantizer().set_global(xiq.get_default_x86_inductor_quantization_config())
        prepared = prepare_pt2e(captured, quantizer)
        for batch in batches:  # observers record each activation's range
            prepared(*(batch[name] for name in INPUT_NAMES))
        return convert_pt2e(prepared), example


def _example(batches: Sequence[dict[str, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    if not batches:
        raise ConfigError("int8 PT2E: no calibration batches")
    batch = max(batches, key=lambda b: b["input_ids"].shape[1])
    # at least 2 rows and 2 tokens: an axis of size 1 would be specialised, not dynamic
    ids, mask = batch["input_ids"][:2], batch["attention_mask"][:2]
    if ids.shape[0] < 2:
        ids, mask = ids.repeat(2, 1), mask.repeat(2, 1)
    return ids, mask


def _dynamic_shapes(model: nn.Module) -> tuple[dict, dict]:
    batch = torch.export.Dim("batch", min=1, max=MAX_BATCH)
    tokens = torch.export.Dim("sequence", min=1, max=int(model.config.max_position_embeddings))
    return ({0: batch, 1: tokens}, {0: batch, 1: tokens})


def write_pt2e_package(model: nn.Module, batches: Sequence[dict[str, torch.Tensor]], path: Path) -> int:
    """``model`` quantized by :func:`quantize_pt2e` on ``batches`` and compiled by AOTInductor into ``path``
    (written whole or not at all); returns the number of int8 linear layers in the compiled graph."""
    converted, example = quantize_pt2e(model, batches)
    compile_package(converted, example, _dynamic_shapes(model), path)
    return sum(1 for node in converted.graph.nodes if node.target == torch.ops.aten.linear.default)


def compile_package(converted: nn.Module, example: tuple, dynamic_shapes: tuple, path: Path) -> None:
    """A converted PT2E graph compiled by AOTInductor with freezing into ``path``, written whole or not at all; its
    metadata records the exporting CPU (:data:`CPU_KEY`, :data:`CPU_FLAGS_KEY`) for :func:`package_cpu_problem`."""
    metadata = {CPU_KEY: cpu_name(), CPU_FLAGS_KEY: " ".join(isa_flags(cpu_flags()))}
    with torch.no_grad():
        exported = torch.export.export(converted, example, dynamic_shapes=dynamic_shapes)
        if any(str(node.target).startswith("quantized_decomposed.") for node in exported.graph.nodes):
            metadata[INT8_KEY] = "uint8 x int8"
        # compiled beside the target and renamed over it: a killed compile leaves no package that looks whole
        with tempfile.TemporaryDirectory(dir=path.parent, prefix=f".{path.name}.") as work:
            partial = Path(work) / path.name  # the packager takes only names ending in .pt2
            torch._inductor.aoti_compile_and_package(
                exported,
                package_path=str(partial),
                inductor_configs={"freezing": True, "aot_inductor.metadata": metadata},
            )
            os.replace(partial, path)


# ------------------------------------------------------------------------------- which CPU a package runs on
#: the package metadata's keys for the exporting CPU: its name (:func:`~adls_lightning.gemm.cpu_name`) and flags
CPU_KEY, CPU_FLAGS_KEY = "adls_cpu", "adls_cpu_flags"
#: the package metadata's key of an int8 package (its operands' types), which :class:`Pt2Classifier` refuses
#: where :func:`saturation_problem` (:func:`is_int8_package`)
INT8_KEY = "adls_int8"
#: ``/proc/cpuinfo`` flags that name instruction-set extensions a compiler may emit under ``-march=native``
#: (SSE to AVX-512 and AMX, FMA, F16C, BMI, the crypto and bit-manipulation sets), by prefix
ISA_FLAG_PREFIXES = (
    "sse", "ssse3", "pni", "popcnt", "abm", "movbe", "avx", "fma", "f16c", "bmi", "adx", "aes", "vaes",
    "pclmulqdq", "vpclmulqdq", "gfni", "sha_ni", "amx",
)  # fmt: skip
#: the flags each word of torch's ``AOTI_CPU_ISA`` (the vector ISA inductor compiled for) needs, from the
#: ``-m`` options of :mod:`torch._inductor.cpu_vec_isa`'s classes
AOTI_ISA_FLAGS = {
    "AVX2": ("avx2", "fma", "f16c"),
    "AVX512": ("avx512f", "avx512dq", "avx512vl", "avx512bw", "fma"),
    "AVX512_VNNI": ("avx512_vnni",),
    "AMX_TILE": ("amx_tile", "amx_bf16", "amx_int8"),
}


def isa_flags(flags: str) -> list[str]:
    """The instruction-set flags among ``flags`` (``/proc/cpuinfo``'s), sorted."""
    return sorted(f for f in set(flags.split()) if f.startswith(ISA_FLAG_PREFIXES))


def package_metadata(path: Path) -> dict[str, str]:
    """The AOTInductor metadata of a ``.pt2`` package (its wrapper's ``*_metadata.json``), read from the archive
    without loading its code; empty where it has none or cannot be read (loading it then says what is wrong)."""
    try:
        with zipfile.ZipFile(path) as archive:
            names = [n for n in archive.namelist() if n.endswith("wrapper_metadata.json")]
            meta = json.loads(archive.read(names[0])) if names else {}
    except (OSError, zipfile.BadZipFile, ValueError):
        return {}
    return meta if isinstance(meta, dict) else {}


def package_cpu_problem(path: Path, flags: str | None = None) -> str | None:
    """Why this CPU (its ``flags``, default ``/proc/cpuinfo``'s) cannot run the package at ``path``, or None.

    It needs the machine it was compiled for (``AOTI_MACHINE``), the flags its vector ISA implies
    (:data:`AOTI_ISA_FLAGS` of ``AOTI_CPU_ISA``) and, where it recorded them (packages exported since
    2026-11-29), every instruction-set flag of the exporting CPU: ``-march=native`` lets the compiler use any."""
    meta = package_metadata(path)
    machine = meta.get("AOTI_MACHINE")
    if machine and machine != platform.machine():
        return f"compiled for {machine}, this machine is {platform.machine()}"
    present = set((cpu_flags() if flags is None else flags).split())
    if not present:
        return None  # flags unreadable: nothing to compare against
    needed = {f for word in meta.get("AOTI_CPU_ISA", "").split() for f in AOTI_ISA_FLAGS.get(word, ())}
    needed |= set(meta.get(CPU_FLAGS_KEY, "").split())
    missing = sorted(needed - present)
    if not missing:
        return None
    where = meta.get(CPU_KEY, f"a CPU with {meta.get('AOTI_CPU_ISA', '?')}")
    shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
    return (
        f"compiled on {where} for its instruction set; this CPU ({cpu_name()}) lacks {shown}, and would stop "
        "with an illegal instruction: export again on this kind of CPU, or run an ONNX graph (model.onnx, "
        "model_int8.onnx), which runs on any CPU"
    )


def is_int8_package(path: Path) -> bool:
    """Whether the package at ``path`` runs oneDNN's int8 kernels: its metadata says so (:data:`INT8_KEY`), or,
    written before packages recorded anything of ours (no :data:`CPU_KEY`), it has an int8 export's file name
    (:data:`PT2E_FILE`, :data:`RUN_CODES_FILE`)."""
    meta = package_metadata(path)
    return INT8_KEY in meta or (CPU_KEY not in meta and path.name in (PT2E_FILE, RUN_CODES_FILE))


# ------------------------------------------------------------------------------- the run's own int8 grid
def run_channel_observer(steps: torch.Tensor, qmax: int) -> type:
    """An observer class for a weight whose per-output-channel steps are the run's: it observes nothing and
    returns them (zero points 0), so the graph's codes are ``round(w / step)``, the run's integers."""
    from torchao.quantization.pt2e.observer import ObserverBase

    class RunChannelSteps(ObserverBase):
        def __init__(self, **_: Any) -> None:
            super().__init__(dtype=torch.int8)
            self.qscheme, self.ch_axis = torch.per_channel_symmetric, 0
            self.quant_min, self.quant_max = -qmax, qmax
            self.register_buffer("scale", steps.detach().float().clone())
            self.register_buffer("zero_point", torch.zeros(steps.numel(), dtype=torch.int64))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x

        def calculate_qparams(self) -> tuple[torch.Tensor, torch.Tensor]:
            return self.scale, self.zero_point

    return RunChannelSteps


#: uint8 activations (what oneDNN's int8 linear takes) holding the run's symmetric codes: ``code + 128``, and
#: ``quant_min`` 1 keeps the run's lowest code, -127
ACTIVATION_ZERO = 128


def run_codes_quantizer(steps_by_weight: dict[str, Any], qmax: int):
    """A PT2E ``Quantizer`` that annotates each ``aten.linear`` whose weight (a ``get_attr`` target of the
    captured graph) is in ``steps_by_weight`` with the run's grid: the input on its static step (uint8, zero
    point :data:`ACTIVATION_ZERO`), the weight on its per-channel steps; every other op stays float, as in the
    run. ``steps_by_weight``: target -> an object with ``input_scale`` and ``weight_scale``
    (:class:`adls_lightning.export.int8.ScaledInt8Layer`)."""
    from torchao.quantization.pt2e.quantizer.quantizer import (
        FixedQParamsQuantizationSpec,
        QuantizationAnnotation,
        QuantizationSpec,
        Quantizer,
    )

    class RunCodesQuantizer(Quantizer):
        def annotate(self, graph_module: torch.fx.GraphModule) -> torch.fx.GraphModule:
            for node in graph_module.graph.nodes:
                if node.target != torch.ops.aten.linear.default or node.args[1].op != "get_attr":
                    continue
                layer = steps_by_weight.get(node.args[1].target)
                if layer is None:
                    continue
                node.meta["quantization_annotation"] = QuantizationAnnotation(
                    input_qspec_map={
                        node.args[0]: FixedQParamsQuantizationSpec(
                            dtype=torch.uint8,
                            scale=float(layer.input_scale),
                            zero_point=ACTIVATION_ZERO,
                            quant_min=ACTIVATION_ZERO - qmax,
                            quant_max=ACTIVATION_ZERO + qmax,
                            qscheme=torch.per_tensor_affine,
                        ),
                        node.args[1]: QuantizationSpec(
                            dtype=torch.int8,
                            observer_or_fake_quant_ctr=run_channel_observer(layer.weight_scale, qmax),
                            quant_min=-qmax,
                            quant_max=qmax,
                            qscheme=torch.per_channel_symmetric,
                            ch_axis=0,
                        ),
                    },
                    _annotated=True,
                )
            return graph_module

        def validate(self, graph_module: torch.fx.GraphModule) -> None:
            annotated = {
                node.args[1].target
                for node in graph_module.graph.nodes
                if "quantization_annotation" in node.meta and node.target == torch.ops.aten.linear.default
            }
            missing = sorted(set(steps_by_weight) - annotated)
            if missing:
                raise ConfigError(f"int8=scaled: no linear node reads {missing[0]} in the captured graph")

    return RunCodesQuantizer()


class _DividedInput(nn.Module):
    """SmoothQuant's layer as the run computes it: the input divided by the factors, then the linear layer."""

    def __init__(self, linear: nn.Linear, smooth: torch.Tensor) -> None:
        super().__init__()
        self.linear = linear
        self.register_buffer("smooth", smooth.detach().float().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x / self.smooth)


def quantize_run_codes(fake_model: nn.Module, layers: dict[str, Any], qmax: int) -> tuple[nn.Module, tuple]:
    """``fake_model`` (a fake-quantized classifier, left untouched) as a converted PT2E graph on the run's grid:
    ``layers`` (:func:`adls_lightning.export.int8.scaled_int8_layers`) become plain linear layers holding
    ``codes · step`` (SmoothQuant's division kept before them), which :func:`run_codes_quantizer` quantizes on
    the run's steps, so the graph's weight codes are ``layers``' own (``qmax``: the grid's largest code, 127 for
    the run's symmetric int8); returns it and its example arguments.

    Raises:
        ConfigError: torchao is not installed, or a layer has no linear node in the captured graph.
    """
    why = pt2e_available()
    if why is not None:
        raise ConfigError(f"int8=scaled PT2E: {why}")
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    from adls_lightning.layers import swap_module
    from adls_lightning.quant.scaled import fix_calibrated_grids
    from adls_lightning.quant.transform import find_linear_layers

    carrier = copy.deepcopy(fake_model).eval()
    # the encoder points' grids (quant=int8_scaled_all), in a form torch.export can trace
    fix_calibrated_grids(carrier)
    planted: dict[int, Any] = {}
    for layer in find_linear_layers(carrier):
        spec = layers.get(layer.name)
        if spec is None:
            continue
        module = layer.module
        plain = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None)
        with torch.no_grad():
            plain.weight.copy_(spec.codes.float() * spec.weight_scale[:, None])
            if module.bias is not None:
                plain.bias.copy_(module.bias)
        swap_module(carrier, layer.path, plain if spec.smooth is None else _DividedInput(plain, spec.smooth))
        planted[id(plain.weight)] = spec
    wrapped = LogitsOnly(carrier).eval()
    steps_by_weight = {name: planted[id(p)] for name, p in wrapped.named_parameters() if id(p) in planted}
    inputs = sample_inputs(fake_model)
    example = (inputs["input_ids"][:2], inputs["attention_mask"][:2])
    with torch.no_grad():
        captured = torch.export.export(wrapped, example, dynamic_shapes=_dynamic_shapes(fake_model)).module()
        prepared = prepare_pt2e(captured, run_codes_quantizer(steps_by_weight, qmax))
        prepared(*example)  # nothing to observe: every step is fixed
        return convert_pt2e(prepared), example


def write_run_codes_package(fake_model: nn.Module, layers: dict[str, Any], qmax: int, path: Path) -> None:
    """:func:`quantize_run_codes` compiled by AOTInductor into ``path`` (written whole or not at all)."""
    converted, example = quantize_run_codes(fake_model, layers, qmax)
    compile_package(converted, example, _dynamic_shapes(fake_model), path)


def check_package(path: Path, model: nn.Module) -> OnnxCheck:
    """The package's logits against ``model``'s on the ONNX export's sample batch (half its rows padded)."""
    inputs = sample_inputs(model)
    with torch.inference_mode():
        expected = LogitsOnly(model)(**inputs)
        actual = Pt2Classifier(path)(**inputs).logits
    return OnnxCheck(
        max_abs_diff=float((actual - expected).abs().max()),
        argmax_agree=int((actual.argmax(-1) == expected.argmax(-1)).sum()),
        rows=len(expected),
    )


class Pt2Classifier(nn.Module):
    """A ``.pt2`` package of :func:`write_pt2e_package`, called as a Hugging Face classifier is:
    ``model(input_ids=..., attention_mask=...).logits`` (other inputs are not passed: the package takes those
    two, as the ONNX graphs do)."""

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.path = path
        problem = package_cpu_problem(path)
        if problem is None and is_int8_package(path):
            problem = saturation_problem()
            problem = problem and f"an int8 package, and {problem}"
        if problem is not None:
            raise ConfigError(f"{path}: {problem}")
        self.runner = torch._inductor.aoti_load_package(str(path))

    def forward(self, **inputs: torch.Tensor) -> Any:
        from transformers.modeling_outputs import SequenceClassifierOutput

        missing = [name for name in INPUT_NAMES if name not in inputs]
        if missing:
            raise ConfigError(f"{self.path}: the package takes {missing[0]}, which the inputs lack")
        with torch.no_grad():
            logits = self.runner(*(inputs[name] for name in INPUT_NAMES))
        return SequenceClassifierOutput(logits=logits)


__all__ = [
    "AOTI_ISA_FLAGS",
    "CPU_FLAGS_KEY",
    "CPU_KEY",
    "INT8_KEY",
    "MAX_BATCH",
    "PT2E_FILE",
    "RUN_CODES_FILE",
    "Pt2Classifier",
    "check_package",
    "compile_package",
    "is_int8_package",
    "isa_flags",
    "package_cpu_problem",
    "package_metadata",
    "pt2e_available",
    "pt2e_unusable",
    "quantize_pt2e",
    "quantize_run_codes",
    "run_codes_quantizer",
    "saturation_problem",
    "write_pt2e_package",
    "write_run_codes_package",
]
