"""Every export checks itself and says what it is worth: :data:`EXPORT_JSON` in the folder, and a short table.

The export command calls :func:`self_check` on what it wrote, read back from disk as ``adls-predict`` and
``adls-evaluate`` read it (:func:`adls_lightning.export.folder.load_folder`):

* **agreement** and **max_logit_diff**: the artifact against the run's own model (fake-quantized, pruned, with its
  activation quantizers: what the run evaluated) on held rows: ``check_rows`` rows of the run's test split (its
  stratified subset of that size when it is larger; or, when the run's data are not at hand, random token ids, and ``held`` says so). ``agreement`` is the
  share of those rows on which both give the same label.
* **speedup** per batch size (``{"1": x, "8": y}``): torch eager fp32 of the same run's *uncompressed* architecture
  (the model as built by the run's ``model=`` config, LoRA merged, no pruning or quantization) divided by the
  artifact's time, at ``check_threads`` threads (1) and ``check_tokens`` tokens (128), in ``check_rounds``
  interleaved rounds (baseline, artifact, baseline, ...: load on the machine hits both alike); the medians are
  compared. The CPU and the load average are written beside them.

What the numbers say is written too (``verdict``): mask-only pruning (the zeros are stored and multiplied at full
size), an artifact that is not faster (speedup below :data:`FASTER_AT` at some batch size), and a weight format with
no runtime here (minifloat, block formats, log, binary: the folder holds the fake-quantized weights as float), each
with the methods that would be faster (:data:`FASTER_METHODS`), less those the artifact already is.

``artifact`` names the file that ran, as the readers find it in the folder: the graph of an ONNX export, the
weights file of a folder (``hf``, ``mxint8``). The check fails (:class:`ExportCheckError`, exit code 1) when that is
not the file the export wrote (another graph in the folder would run instead), or when the export is exact up to a
stated tolerance (``tolerance``: fp32 graphs and ``hf`` folders, the run's own int8 and int4 codes) and a logit read
back misses the run's by more: ``export.json`` then says so under ``failed``, and the readers refuse the folder
(:func:`adls_lightning.export.folder.refuse_failed_export`). Approximations of the run's float model (ONNX Runtime's
dynamic int8, PT2E int8, MXINT8 packing) are reported, not held to a bound.

``check=full`` (the default) does both, ``check=agreement`` skips the timing, ``check=none`` writes no
``export.json`` (the export's own exactness checks still run).
"""

from __future__ import annotations

import copy
import json
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from adls_lightning.data.inputs import model_inputs
from adls_lightning.export.folder import EXPORT_JSON, FAILED_KEY
from adls_lightning.export.settings import CHECK_MODES, OPTIONS, CheckSettings, ExportCheckError
from adls_lightning.gemm import cpu_name
from adls_lightning.search.cost import clock_for, time_calls, torch_threads

#: below this speedup at any batch size an artifact is named "not faster" (timing noise under load is ~5 %)
FASTER_AT = 1.1
#: weight formats with a runtime here, and the export that runs them
RUNTIMES = {
    "scaled_integer 8-bit": "format=onnx int8=scaled (ONNX Runtime int8)",
    "scaled_integer 4-bit": "format=onnx int4=true (ONNX Runtime MatMulNBits)",
    "mxint8": "format=mxint8 (the packed MXINT8 kernels)",
}
#: the methods measured faster than torch eager fp32 here (docs/inference.md), by what an artifact already is
FASTER_METHODS = {
    "structured": "structured pruning (prune=structured_0.5, then format=onnx)",
    "int8_scaled": "int8 ONNX (quant=int8_scaled, then format=onnx int8=scaled)",
}


def faster_methods(structured: bool, int8_scaled: bool) -> str:
    """The faster methods (:data:`FASTER_METHODS`) an artifact is not already: ``structured``, a structurally
    pruned run; ``int8_scaled``, the run's int8 codes as an int8 graph (``int8=scaled``). Empty when it is
    both."""
    already = {"structured": structured, "int8_scaled": int8_scaled}
    return " or ".join(method for key, method in FASTER_METHODS.items() if not already[key])


def uncompressed_model(cfg: Any) -> nn.Module:
    """Torch eager fp32 of the run's architecture as its ``model=`` config builds it (LoRA merged; no pruning,
    no quantization): the baseline of the speedup."""
    from adls_lightning.build import build
    from adls_lightning.lora import merge_lora

    data = build(cfg.data, "data")
    module = build(cfg.model, "model", _convert_="partial", **data.task.model_overrides())
    merge_lora(module)
    return module.model.float().eval()


def held_batches(
    cfg: Any, rows: int, vocab_size: int, tokens: int
) -> tuple[list[dict[str, torch.Tensor]], str]:
    """``rows`` rows of the run's test split as batches of model inputs (all of it when it is no larger; else its
    seeded stratified subset of ``rows``, as ``data.test_size=rows`` draws it), and where they came from; when the
    run's data cannot be built here (not found, offline), ``rows`` rows of random token ids."""
    from adls_lightning.build import build

    data_cfg = copy.deepcopy(cfg.data)
    if "test_size" in data_cfg and (data_cfg.test_size is None or int(data_cfg.test_size) > rows):
        data_cfg.test_size = (
            rows  # the split's stratified subset of that size: no more rows tokenized than held
        )
    try:
        data = build(data_cfg, "data")
        data.setup("test")
        batches, taken = [], 0
        for batch in data.test_dataloader():
            keep = min(rows - taken, len(batch["input_ids"]))
            batches.append({key: value[:keep] for key, value in model_inputs(batch).items()})
            taken += keep
            if taken >= rows:
                break
        if taken:
            return batches, f"{taken} rows of the run's test split"
        reason = "its test split is empty"
    except Exception as error:  # noqa: BLE001 - the data's own failures (files, hub, cache) are not the export's
        reason = f"{type(error).__name__}: {' '.join(str(error).split())[:160]}"
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab_size, (rows, tokens), generator=generator)
    batches = [{"input_ids": part, "attention_mask": torch.ones_like(part)} for part in ids.split(32)]
    return batches, f"{rows} rows of random token ids ({tokens} tokens; the run's data: {reason})"


@torch.inference_mode()
def agreement(
    artifact: nn.Module,
    reference: nn.Module,
    batches: Sequence[dict[str, torch.Tensor]],
    tolerance: tuple[float, float] | None = None,
) -> dict:
    """Label agreement and the largest logit difference of ``artifact`` vs ``reference`` on ``batches``; with a
    ``tolerance`` ``(atol, rtol)``, ``within_tolerance``: every logit within ``atol + rtol·|reference logit|``."""
    same = total = 0
    largest = 0.0
    within = True
    for batch in batches:
        expected = reference(**batch).logits.float()
        actual = artifact(**batch).logits.float()
        same += int((expected.argmax(-1) == actual.argmax(-1)).sum())
        total += len(expected)
        difference = (expected - actual).abs()
        largest = max(largest, float(difference.max()))
        if tolerance is not None:
            atol, rtol = tolerance
            within = within and bool((difference <= atol + rtol * expected.abs()).all())
    result = {"agreement": same / total, "max_logit_diff": largest, "rows": total}
    if tolerance is not None:
        result["within_tolerance"] = within
    return result


@torch.inference_mode()
def speedups(
    baseline: nn.Module, load_artifact: Callable[[], nn.Module], settings: CheckSettings, vocab_size: int
) -> dict:
    """Per batch size: the baseline's and the artifact's median time of one batch of ``settings.tokens`` tokens
    at ``settings.threads`` threads, over interleaved rounds, and their ratio."""
    with torch_threads(settings.threads):
        artifact = load_artifact()  # an ONNX Runtime session takes torch's thread count when it is made
        measured = {}
        for batch in settings.batches:
            generator = torch.Generator().manual_seed(batch)
            ids = torch.randint(0, vocab_size, (batch, settings.tokens), generator=generator)
            inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
            models = {"baseline": baseline, "artifact": artifact}
            # interleaved rounds on the clock the cost model reads at this thread count (search.cost.time_calls)
            seconds = time_calls(
                {name: lambda m=m, x=inputs: m(**x) for name, m in models.items()}, settings.rounds
            )
            base, art = (seconds[name][clock_for(settings.threads)] for name in ("baseline", "artifact"))
            measured[str(batch)] = {
                "speedup": base / art,
                "baseline_ms": base * 1e3,
                "artifact_ms": art * 1e3,
            }
    return measured


def weight_formats(model: nn.Module) -> list[str]:
    """The weight formats of ``model``'s quantized layers, e.g. ``scaled_integer 4-bit``, ``minifloat_ieee``."""
    from adls_lightning.quant.linear import QuantLinear

    found: list[str] = []
    for module in model.modules():
        quantizer = module.weight_quantizer if isinstance(module, QuantLinear) else None
        quantizer = getattr(quantizer, "inner", quantizer)  # SmoothQuant's wrapper
        if quantizer is None:
            continue
        name = getattr(quantizer, "format_name", type(quantizer).__name__)
        if name == "scaled_integer":
            name = f"scaled_integer {quantizer.width}-bit"
        if name not in found:
            found.append(name)
    return found


def verdict(
    result: dict,
    formats: Sequence[str],
    mask_pruned: int,
    structured: bool,
    runs_formats: bool,
    int8_scaled: bool = False,
) -> list[str]:
    """What the artifact is worth, in lines: mask-only pruning, not faster, formats with no runtime here.

    ``runs_formats``: the artifact executes the run's weight format (an int8 or int4 graph, a packed folder)
    rather than its values as float; ``int8_scaled``: it is the run's int8 codes as an int8 graph
    (``format=onnx int8=scaled``), which the advice then does not recommend again."""
    notes = []
    advice = faster_methods(structured, int8_scaled)
    if mask_pruned and not structured:
        notes.append(
            f"mask-only pruning: {mask_pruned} layers hold zeros stored and multiplied at full size (no smaller, no "
            f"faster); faster: {advice}"
        )
    if not runs_formats:
        for name in formats:
            if name in RUNTIMES:
                notes.append(f"{name} weights run as float here; their runtime: {RUNTIMES[name]}")
            else:
                notes.append(
                    f"{name}: no runtime here for this format; this folder holds the fake-quantized weights as "
                    "float (format=hf), which computes the run's values at fp32 cost"
                )
    slow = {
        batch: m["speedup"] for batch, m in (result.get("speed") or {}).items() if m["speedup"] < FASTER_AT
    }
    if slow:
        shown = ", ".join(f"{s:.2f}x at batch {b}" for b, s in slow.items())
        notes.append(
            f"not faster than torch eager fp32 ({shown})" + (f"; faster: {advice}" if advice else "")
        )
    return notes


def self_check(
    out: Path,
    artifact_path: Path,
    reference: nn.Module,
    cfg: Any,
    settings: CheckSettings,
    *,
    mask_pruned: int = 0,
    structured: bool = False,
    runs_formats: bool = False,
    int8_scaled: bool = False,
    tolerance: tuple[float, float] | None = None,
) -> dict | None:
    """Check the export in ``out`` (the artifact at ``artifact_path``: the folder, or its ``.onnx`` file) against
    ``reference`` (the run's model as it evaluated it), write :data:`EXPORT_JSON` and print the table; returns
    what was written (None with ``check=none``). ``int8_scaled``: see :func:`verdict`. ``tolerance``: ``(atol,
    rtol)`` of an export that computes the run's logits up to float rounding (None: an approximation, reported).

    Raises:
        ExportCheckError: the readers would run another file than the artifact, or a logit misses the run's by
            more than ``tolerance``; :data:`EXPORT_JSON` then marks the folder failed (:data:`FAILED_KEY`).
    """
    from adls_lightning.export.folder import WEIGHTS_FILE, check_folder, load_folder
    from adls_lightning.export.recipe import ExportRecipe

    if settings.mode == "none":
        return None
    recipe = ExportRecipe.read(out)
    # the file adls-predict and adls-evaluate run when given this path: the one checked and named
    found = check_folder(artifact_path)
    ran = found.graph_file.name if found.graph_file is not None else WEIGHTS_FILE
    written = WEIGHTS_FILE if artifact_path.is_dir() else artifact_path.name
    if ran != written:
        fail(
            out,
            {"artifact": ran},
            f"the folder's readers run {ran}, not the {written} this export wrote; valid: a new out=, or move "
            f"{ran} out of {out}",
        )

    def load() -> nn.Module:
        return load_folder(artifact_path, recipe)

    vocab = int(reference.config.vocab_size)
    batches, held = held_batches(cfg, settings.rows, vocab, settings.tokens)
    result: dict[str, Any] = {"artifact": ran}
    result.update(agreement(load(), reference.eval(), batches, tolerance))
    result["held"] = held
    if tolerance is not None:
        result["tolerance"] = {"atol": tolerance[0], "rtol": tolerance[1]}
        if not result["within_tolerance"]:
            fail(
                out,
                result,
                f"{ran} read back disagrees with the run's own model beyond the export's tolerance (max |Δlogit| "
                f"{result['max_logit_diff']:.3g} > {tolerance[0]:g} + {tolerance[1]:g}·|logit|; agreement "
                f"{result['agreement']:.4f} on {held})",
            )
    if settings.mode == "full":
        baseline = uncompressed_model(cfg)
        speed = speedups(baseline, load, settings, vocab)
        result["speedup"] = {batch: round(m["speedup"], 3) for batch, m in speed.items()}
        result["speed"] = {
            batch: {key: round(value, 3) for key, value in m.items()} for batch, m in speed.items()
        }
        result["timing"] = {
            "baseline": "torch eager fp32 of the run's uncompressed architecture",
            "threads": settings.threads,
            "tokens": settings.tokens,
            "rounds": settings.rounds,
            "cpu": cpu_name(),
            "load_average": [round(x, 2) for x in os.getloadavg()],
            "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%d %H:%M"),
        }
    else:
        result["speedup"] = None
    result["verdict"] = verdict(
        result, weight_formats(reference), mask_pruned, structured, runs_formats, int8_scaled
    )
    (out / EXPORT_JSON).write_text(json.dumps(result, indent=1) + "\n")
    print(describe(result))
    return result


def fail(out: Path, result: dict[str, Any], why: str) -> None:
    """Mark the export in ``out`` failed (:data:`EXPORT_JSON` with ``why`` under :data:`FAILED_KEY`: its files stay
    for inspection, its readers refuse it) and raise :class:`ExportCheckError` saying so."""
    (out / EXPORT_JSON).write_text(json.dumps({**result, FAILED_KEY: why}, indent=1) + "\n")
    raise ExportCheckError(
        f"{out / EXPORT_JSON}: self-check failed: {why}; the folder is marked failed and adls-predict and "
        "adls-evaluate refuse it"
    )


def describe(result: dict) -> str:
    """The short table the export prints: agreement, logit difference, and per batch size the speedup."""
    lines = [
        f"self-check ({EXPORT_JSON}): {result['artifact']} vs the run's own model on {result['held']}",
        f"  agreement {result['agreement']:.4f} ({result['rows']} rows), max |Δlogit| {result['max_logit_diff']:.3g}",
    ]
    if result.get("speed"):
        timing = result["timing"]
        lines.append(
            f"  {'batch':>5}  {'fp32 eager ms':>13}  {'artifact ms':>11}  {'speedup':>7}   ({timing['threads']} thread(s), "
            f"{timing['tokens']} tokens, {timing['rounds']} rounds; {timing['cpu']}, load {timing['load_average'][0]})"
        )
        for batch, m in result["speed"].items():
            lines.append(
                f"  {batch:>5}  {m['baseline_ms']:>13.2f}  {m['artifact_ms']:>11.2f}  {m['speedup']:>6.2f}x"
            )
    lines += [f"  note: {note}" for note in result["verdict"]]
    return "\n".join(lines)


__all__ = [
    "CHECK_MODES",
    "EXPORT_JSON",
    "FASTER_AT",
    "OPTIONS",
    "CheckSettings",
    "agreement",
    "describe",
    "fail",
    "faster_methods",
    "held_batches",
    "self_check",
    "speedups",
    "uncompressed_model",
    "verdict",
]
