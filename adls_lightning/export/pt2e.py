"""int8 through torch's PT2E flow with the x86 inductor quantizer, written as an AOTInductor package (issue 59).

This is the int8 route that reaches oneDNN's int8 kernels, and through them AMX-INT8 on the Xeons that have it
(:mod:`adls_lightning.int8_runtime` measures it beside ONNX Runtime's and torch's dynamic int8). The model's
linear layers get static int8 activations (one scale per tensor, calibrated on batches of the run's training
split) and int8 weights per output channel; ``torch.export`` captures ``(input_ids, attention_mask) -> logits``
with the batch and sequence axes dynamic, and AOTInductor compiles it ahead of time with freezing (the int8
weights packed for oneDNN at compile) into one ``.pt2`` file.

Quantizing needs ``torchao`` (``pip install 'adls-lightning[int8]'``: torch 2.13 no longer ships PT2E); running
the package needs torch alone (:class:`Pt2Classifier`, ``torch._inductor.aoti_load_package``). Compiling needs the
C++ compiler inductor uses (about 35 s for MiniLM on one core).

Library code: no Lightning imports.
"""

from __future__ import annotations

import copy
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from adls_lightning.errors import ConfigError
from adls_lightning.export.onnx import INPUT_NAMES, LogitsOnly, OnnxCheck, sample_inputs

PT2E_FILE = "model_int8_pt2e.pt2"
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
    layers = sum(1 for node in converted.graph.nodes if node.target == torch.ops.aten.linear.default)
    with torch.no_grad():
        exported = torch.export.export(converted, example, dynamic_shapes=_dynamic_shapes(model))
        # compiled beside the target and renamed over it: a killed compile leaves no package that looks whole
        with tempfile.TemporaryDirectory(dir=path.parent, prefix=f".{path.name}.") as work:
            partial = Path(work) / path.name  # the packager takes only names ending in .pt2
            torch._inductor.aoti_compile_and_package(
                exported, package_path=str(partial), inductor_configs={"freezing": True}
            )
            os.replace(partial, path)
    return layers


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
    "MAX_BATCH",
    "PT2E_FILE",
    "Pt2Classifier",
    "check_package",
    "pt2e_available",
    "quantize_pt2e",
    "write_pt2e_package",
]
