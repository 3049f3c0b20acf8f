"""A run's checkpoint exported to a folder: the verbs behind ``adls-export`` (:mod:`adls_lightning.tools.export`,
which parses the command line into :class:`ExportSettings` and prints what :func:`export_checkpoint` returns).

:func:`export_checkpoint` loads the run's model as it evaluated it (:func:`adls_lightning.runs.loading.
load_checkpoint_model`), writes the folder in the format asked (``mxint8`` packed weights, an ``hf`` folder, an
``onnx`` graph: fp32, ONNX Runtime's dynamic int8, the run's own scaled int8 or GPTQ 4-bit codes), with
``config.json``, the tokenizer and the recipe of what acted on activations (``compression.json``), and returns
the lines that say what it wrote; :func:`check_export` then runs the export's self-check
(:mod:`adls_lightning.export.selfcheck`). Every refusal is a ConfigError naming the option, raised before anything
is written where it can be.
"""

from __future__ import annotations

import contextlib
import copy
import re
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from adls_lightning.errors import ConfigError
from adls_lightning.export.folder import (
    CONFIG_FILE,
    EXPORT_JSON,
    HF_CONFIG_FILE,
    WEIGHTS_FILE,
    save_tokenizer,
    write_config,
)
from adls_lightning.export.recipe import ACTIVATION_STATE_FILE, RECIPE_FILE, ExportRecipe
from adls_lightning.export.selfcheck import self_check
from adls_lightning.export.settings import CheckSettings, ExportSettings
from adls_lightning.files.earlier_outputs import earlier_outputs_kept_until_done, removed_lines, set_aside
from adls_lightning.runs.loading import LoadedRun, load_checkpoint_model


@dataclass
class Exported:
    """What :func:`export_checkpoint` wrote: the lines that say so, and what :func:`check_export` compares."""

    loaded: LoadedRun
    #: the file (or folder) the self-check runs
    artifact: Path
    lines: list[str]
    #: the model the artifact must agree with (None: the run's own, :func:`run_model`)
    reference: nn.Module | None = None
    #: whether the artifact runs the formats it holds (not a mask-only or float stand-in)
    runs_formats: bool = False
    #: whether the artifact is the run's int8 codes as an int8 graph (``int8=scaled``): not advised again
    int8_scaled: bool = False
    #: ``(atol, rtol)`` within which the artifact's logits are the reference's (the self-check fails beyond it);
    #: None: an approximation (dynamic int8, PT2E int8, MXINT8 packing), whose agreement is reported
    tolerance: tuple[float, float] | None = None


def export_checkpoint(settings: ExportSettings, overrides: Sequence[str]) -> Exported:
    """The run of ``settings.ckpt`` written to ``settings.out`` (``overrides``: Hydra overrides on top of the
    run's own); the self-check is :func:`check_export`'s.

    Raises:
        ConfigError: what the format cannot carry, an ``exclude`` that matches no layer, ... (one line).
    """
    from adls_lightning.export import WEIGHTS_FILE, folder_bytes, pack_for_export, save_packed

    check_checkpoint_task(settings, overrides)  # before the model is loaded
    if settings.format == "onnx" and settings.int8 == "scaled":
        return export_scaled_int8(settings, overrides)
    if settings.int4:
        return export_int4(settings, overrides)
    loaded = load_checkpoint_model(settings.ckpt, overrides, options=list(settings.tool_keys))
    model, recipe = loaded.model, loaded.recipe
    if settings.format != "hf":
        refuse_compression_beyond_weights(loaded, settings.format)
    if settings.format == "mxint8":
        check_exclude(model, settings.exclude)  # refused before an earlier export's files are removed
    reference = None  # the self-check's run model (run_model) unless packing consumes it below
    out = settings.out
    with tempfile.TemporaryDirectory() as fp32_dir:
        model.save_pretrained(fp32_dir)
        fp32_bytes = folder_bytes(Path(fp32_dir), [WEIGHTS_FILE])
    int8_file, int8_choice = None, None
    if settings.format == "onnx":
        from adls_lightning.int8_runtime import ORT_DYNAMIC, PT2E

        runtime = None
        if settings.int8 == "auto":
            runtime, int8_choice = choose_int8_runtime(model, loaded.config, settings.check)
        removed = replace_earlier_export(settings, loaded.config)
        summary = export_onnx_files(model, out, settings.int8 is True or runtime == ORT_DYNAMIC)
        if runtime == PT2E:
            int8_file, written = export_pt2e_file(model, out, loaded.config)
            summary += f"; {written}"
    elif settings.format == "hf":
        removed = replace_earlier_export(settings, loaded.config)
        model.save_pretrained(out)
        summary = f"save_pretrained (merged, fp32): {fp32_bytes / 1e6:.1f} MB"
    else:
        # packing replaces the model's layers in place: the self-check compares the folder with the float model
        if settings.check.mode != "none":
            reference = copy.deepcopy(model).eval()
        try:
            packed = pack_for_export(model, settings.group_size, settings.exclude, settings.pack_embeddings)
        except ValueError as error:
            raise ConfigError(f"group_size={settings.group_size}: {error}") from error
        removed = replace_earlier_export(settings, loaded.config)
        save_packed(model, packed, out)
        weights = folder_bytes(out, [WEIGHTS_FILE])
        summary = (
            f"{len(packed.linear)} linear layers packed"
            f"{', word embeddings packed' if packed.embeddings else ''}; {WEIGHTS_FILE} {weights / 1e6:.1f} MB "
            f"vs fp32 save_pretrained {fp32_bytes / 1e6:.1f} MB ({1 - weights / fp32_bytes:.1%} smaller)"
        )
    # every format: config.json with the label names (format=hf: written by save_pretrained) and the tokenizer,
    # so the folder predicts alone (adls-predict)
    write_config(model.config, out, loaded.inputs)
    recipe.write(out, loaded.activation_state)
    tokenizer_saved = save_tokenizer(loaded.tokenizer, out)
    lines = [
        f"exported {settings.format} to {out}: {summary}; folder {folder_bytes(out) / 1e6:.1f} MB"
        f"{' (tokenizer included)' if tokenizer_saved else ''}"
    ]
    if recipe.baked["quantized_layers"] or recipe.baked["pruned_layers"] or recipe.activation_prune:
        lines.append(
            f"compression: {recipe.baked['quantized_layers']} quantized and {recipe.baked['pruned_layers']} "
            f"pruned layers baked into the weights; {len(recipe.activation_quant)} layers quantize activations"
            f"{', input activations pruned' if recipe.activation_prune else ''} ({RECIPE_FILE}: "
            "python -m adls_lightning.export.evaluate applies it)"
        )
    if int8_choice:
        lines.append(int8_choice)
    if loaded.note:
        lines.append(f"note: {loaded.note}")
    lines += removed_lines(removed, "export")
    artifact = out
    # an hf folder and the fp32 graph compute the run's logits up to float rounding; int8 and packing approximate
    tolerance = None if settings.format == "mxint8" or settings.int8 else fp32_tolerance()
    if settings.format == "onnx":
        from adls_lightning.export import onnx as onnx_export

        # int8=true|auto: the int8 file is the one asked for; model.onnx is the float reference beside it
        artifact = int8_file or out / (onnx_export.ONNX_INT8_FILE if settings.int8 else onnx_export.ONNX_FILE)
    return Exported(
        loaded,
        artifact,
        lines,
        reference=reference,
        runs_formats=settings.format == "mxint8",
        tolerance=tolerance,
    )


def check_checkpoint_task(settings: ExportSettings, overrides: Sequence[str]) -> None:
    """Refuse a checkpoint trained on another task than the export's (its data overrides, or without a run record
    the default data): its classifier would be written with that task's labels and ``adls_inputs.task``, and
    ``adls-evaluate`` would then score it on that task, as ``train.py train=false ckpt_path=`` refuses to. A
    checkpoint that records no task, or a folder task (any data set), is not compared.

    Raises:
        ConfigError: ``ckpt=PATH: a glue/mrpc checkpoint, this export's task is glue/rte ...``.
    """
    from adls_lightning.build import build
    from adls_lightning.checkpoints import read_checkpoint
    from adls_lightning.data.datamodule import FolderDataModule, checkpoint_task
    from adls_lightning.export.compressed import run_overrides
    from adls_lightning.overrides import merge_overrides, override_key
    from adls_lightning.runs.loading import compose_train_config

    recorded = checkpoint_task(read_checkpoint(settings.ckpt, "ckpt", mmap=True))
    if recorded is None:
        return
    run = run_overrides(settings.ckpt)
    cfg = compose_train_config(merge_overrides(run, overrides), options=list(settings.tool_keys))
    task = build(cfg.data, "data").task.name
    if task in (recorded, FolderDataModule.TASK_NAME):
        return
    given = [o for o in overrides if override_key(o).split(".")[0] == "data"]
    where = f"ckpt={settings.ckpt}: a {recorded} checkpoint, this export's task is {task}"
    # the task came from the command line's data overrides, or (no run record to start from) from the defaults
    source, valid = (
        (" ".join(given), f"without {' '.join(given)} (the run's own data)")
        if given
        else (
            "the default data: no run record beside the checkpoint",
            f"the data overrides of its run ({recorded})",
        )
    )
    raise ConfigError(
        f"{where} ({source}), and the export would label its classifier, trained for {recorded}, with {task}'s "
        f"labels; valid: {valid}, or a checkpoint of {task}"
    )


def fp32_tolerance() -> tuple[float, float]:
    """The bound of an fp32 artifact's logits (ONNX Runtime's graph, an ``hf`` folder with its recipe)."""
    from adls_lightning.export.onnx import FP32_ATOL, FP32_RTOL

    return FP32_ATOL, FP32_RTOL


#: the tokenizer files ``save_pretrained`` writes (transformers' names: its config, special tokens and added tokens,
#: the fast tokenizer's file, and the vocabularies of WordPiece, BPE and SentencePiece tokenizers)
TOKENIZER_FILES = (
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.json",
    "chat_template.jinja",
    "vocab.txt",
    "vocab.json",
    "merges.txt",
    "spiece.model",
    "sentencepiece.bpe.model",
    "tokenizer.model",
)


def export_outputs() -> tuple[str, ...]:
    """The names of the files an export of any format writes into its folder (``adls-budget``'s per-layer mixed
    export too): what ``overwrite=true`` replaces (:func:`replace_earlier_export`). A graph larger than 2 GB keeps
    its weights beside it, in ``<graph>.data``."""
    from adls_lightning.export import int4, int8, onnx, pt2e
    from adls_lightning.export.mixed import MIXED_CONFIG_FILE

    graphs = (onnx.ONNX_FILE, onnx.ONNX_INT8_FILE, int8.INT8_SCALED_FILE, int4.INT4_FILE)
    return (
        WEIGHTS_FILE,
        HF_CONFIG_FILE,
        "generation_config.json",
        CONFIG_FILE,
        MIXED_CONFIG_FILE,
        RECIPE_FILE,
        ACTIVATION_STATE_FILE,
        EXPORT_JSON,
        *graphs,
        *(f"{graph}.data" for graph in graphs),
        pt2e.PT2E_FILE,
        pt2e.RUN_CODES_FILE,
        *TOKENIZER_FILES,
    )


def earlier_export_outputs(out: Path) -> list[Path]:
    """The files of ``out`` an earlier export wrote (:func:`export_outputs`), in name order."""
    names = set(export_outputs())
    try:
        return sorted(p for p in out.iterdir() if p.name in names and not p.is_dir())
    except OSError:  # no folder yet
        return []


def replace_earlier_export(settings: ExportSettings, cfg: Any) -> list[str]:
    """Ready ``settings.out`` for this export, right before its first file is written (every refusal that can come
    first has): created, and with ``overwrite=true`` an earlier export's files removed, so that none of another
    model's weights, graphs or recipe is read beside this one's (a graph of the old run would run instead of new
    ``hf`` weights). Files no export writes stay. Returns the names removed.

    Raises:
        ConfigError: the export reads one of those files, or the folder itself, as an input (its checkpoint, a
            path of the run's config such as a ``model.name`` folder): nothing is removed.
    """
    from omegaconf import OmegaConf

    from adls_lightning.runs.folder import config_strings, path_named_among

    out = settings.out
    earlier = earlier_export_outputs(out) if settings.overwrite else []
    if earlier:
        config = OmegaConf.to_container(cfg, resolve=False) if cfg is not None else {}
        named = [("ckpt", str(settings.ckpt)), *config_strings(config)]
        # a file it removes, or the folder itself (a model.name folder); not any path below it: out may be "."
        read = path_named_among(named, [*earlier, out], files_only=False, inside=False)
        if read is not None:
            key, value = read
            raise ConfigError(
                f"overwrite=true: {key}={value} is read by this export from {out}, whose earlier export's files "
                "it would remove; valid: another out=, or copy it elsewhere first"
            )
        kept = out / EARLIER_EXPORT_DIR
        if kept.exists():
            raise ConfigError(
                f"overwrite=true: {kept} holds the files of an earlier export, kept there by an export that was "
                f"stopped before its self-check; valid: move them back into {out} (or delete {kept}), then export"
            )
        set_aside(earlier, kept)
    out.mkdir(parents=True, exist_ok=True)
    return [p.name for p in earlier]


#: Where ``overwrite=true`` keeps the earlier export's files until this export has passed its self-check
#: (:func:`earlier_export_kept_until_checked`).
EARLIER_EXPORT_DIR = ".earlier-export"


@contextlib.contextmanager
def earlier_export_kept_until_checked(out: Path, interrupts: Sequence[int] = ()) -> Iterator[None]:
    """Around an export and its self-check into ``out``: the earlier export's files that ``overwrite=true`` set
    aside (:func:`replace_earlier_export`) are deleted once the block succeeds, and put back, in place of this
    export's files, when it fails (a failed self-check, a refusal, Ctrl-C): a failed export never costs the working
    one it was meant to replace (:func:`adls_lightning.files.earlier_outputs.earlier_outputs_kept_until_done`).

    ``interrupts``: Ctrl-C as :func:`adls_lightning.app.cli.noting_interrupts` notes it. An interrupted export's
    files are deleted too, and the folders it created, so ``out`` is as it was (a failed self-check's files stay
    for inspection, in a folder marked failed); the line saying the earlier files are back is the failure's, the
    caller says it for an interrupt.
    """
    with earlier_outputs_kept_until_done(
        out,
        EARLIER_EXPORT_DIR,
        earlier_export_outputs,
        restored_line=lambda count: (
            f"overwrite=true: this export failed; the earlier export's {count} files are back in {out}"
        ),
        interrupts=interrupts,
    ):
        yield


def run_model(settings: ExportSettings, overrides: Sequence[str], loaded: LoadedRun) -> nn.Module:
    """The run's own model as it evaluated it (fake-quantized, with its activation quantizers and pruning): the
    reference of the self-check. A run that quantized nothing evaluated the exported float model itself."""
    if loaded.recipe.baked.get("quantized_layers"):
        model = load_checkpoint_model(
            settings.ckpt, overrides, keep_quantized=True, options=list(settings.tool_keys)
        ).model
    else:
        model = loaded.model
    if loaded.recipe.activation_prune:
        from adls_lightning.prune import Pruner

        model = copy.deepcopy(model)
        Pruner(weight=None, key=RECIPE_FILE, **loaded.recipe.activation_prune).attach_activation(model)
    return model.eval()


def check_export(settings: ExportSettings, overrides: Sequence[str], exported: Exported) -> None:
    """The export's self-check (:func:`adls_lightning.export.selfcheck.self_check`, which writes ``export.json``
    and prints its table) of ``exported.artifact`` against the run's model."""
    from adls_lightning.prune.structured import CONFIG_ATTRIBUTE

    if settings.check.mode == "none":
        return
    loaded = exported.loaded
    reference = exported.reference
    reference = run_model(settings, overrides, loaded) if reference is None else reference
    self_check(
        settings.out,
        exported.artifact,
        reference,
        loaded.config,
        settings.check,
        mask_pruned=loaded.recipe.baked.get("pruned_layers", 0),
        structured=bool(getattr(reference.config, CONFIG_ATTRIBUTE, None)),
        runs_formats=exported.runs_formats,
        int8_scaled=exported.int8_scaled,
        tolerance=exported.tolerance,
    )


def check_exclude(model: nn.Module, exclude: Sequence[str]) -> None:
    """Each ``exclude`` pattern (a regex searched in canonical layer names) matches a linear layer the packing
    would swap: a misspelt name would otherwise pack the layer it meant to keep float, silently."""
    from adls_lightning.mxint8.qlinear import packable_linear_layers

    names = [name for name, _ in packable_linear_layers(model, exclude=())]
    for pattern in exclude:
        if not any(re.search(pattern, name) for name in names):
            shown = ", ".join(names[:3] + names[-2:]) if len(names) > 5 else ", ".join(names)
            raise ConfigError(
                f"exclude={','.join(exclude)}: {pattern!r} matches no linear layer of the model; valid: regexes "
                f"searched in its layer names ({len(names)}: {shown}), e.g. exclude=classifier"
            )


def load_for_graph(settings: ExportSettings, overrides: Sequence[str], option: str, graph: str) -> LoadedRun:
    """The run's fake-quantized model for an ONNX graph of its own codes (``option``: the export option asking
    for the ``graph``), refused in one line when the run prunes input activations, which no such graph carries."""
    loaded = load_checkpoint_model(
        settings.ckpt, overrides, keep_quantized=True, options=list(settings.tool_keys)
    )
    if loaded.recipe.activation_prune:
        # the checkpoint's compression record says what the run computed; an override cannot unsay it
        raise ConfigError(
            f"{option}: the run prunes input activations, which the {graph} graph does not carry; valid: format=hf "
            f"(its {RECIPE_FILE} carries them), or a run trained without activation pruning (prune.activation=null)"
        )
    return loaded


def write_graph_folder(loaded: LoadedRun, out: Path, quantized_layers: int) -> bool:
    """The files beside an ONNX graph of the run's codes: ``config.json`` with the labels, the recipe (its
    quantized layers counted, activations carried by the graph) and the tokenizer; whether a tokenizer was
    saved."""
    loaded.recipe.baked["quantized_layers"] = quantized_layers
    write_config(loaded.model.config, out, loaded.inputs)
    loaded.recipe.write(out, {})
    return save_tokenizer(loaded.tokenizer, out)


def export_scaled_int8(settings: ExportSettings, overrides: Sequence[str]) -> Exported:
    """``format=onnx int8=scaled``: :data:`~adls_lightning.export.int8.INT8_SCALED_FILE` of a scaled-int8 run,
    checked in ONNX Runtime against the fake-quantized model; every refusal comes before anything is written."""
    from adls_lightning.export import int8 as int8_export
    from adls_lightning.export import onnx as onnx_export

    loaded = load_for_graph(settings, overrides, "int8=scaled", "int8")
    model = loaded.model
    calibrated = ""
    if int8_export.uncalibrated(model):
        # a PTQ run calibrates at evaluation, after its checkpoint was written: its ranges are not in the file
        batches = int8_export.calibrate_as_run(model, loaded.config)
        if batches:
            calibrated = (
                f"; input scales calibrated here on {batches} training batches (a PTQ checkpoint has none)"
            )
    # refuses what the graph cannot carry before anything is written
    layers = int8_export.scaled_int8_layers(model)
    if not layers:
        raise ConfigError(
            "int8=scaled: the run quantizes no linear layer; pass its quant=int8_scaled overrides (a float "
            "checkpoint: quant=int8_scaled quant.mode=ptq), or int8=true for ONNX Runtime's dynamic int8"
        )
    out = settings.out
    removed = replace_earlier_export(settings, loaded.config)
    path, choice = scaled_int8_runtime(model, layers, loaded.config, settings)
    check = int8_export.check_int8(path, model)
    tokenizer_saved = write_graph_folder(loaded, out, len(layers))
    engine = "the AOTInductor package" if path.suffix == ".pt2" else "ONNX Runtime"
    line = (
        f"exported onnx int8=scaled to {out}: {path.name} {path.stat().st_size / 1e6:.1f} MB, {len(layers)} linear "
        f"layers on the run's int8 grid (weights per output channel, static input scales){calibrated}; {engine} "
        f"vs the fake-quantized PyTorch model on {onnx_export.SAMPLE_ROWS}×{onnx_export.SAMPLE_TOKENS} "
        f"tokens: {check.describe()} (tolerance {int8_export.INT8_ATOL:g} + {int8_export.INT8_RTOL:g}·|logit|)"
        f"{' (tokenizer included)' if tokenizer_saved else ''}"
    )
    lines = [choice, line] if choice else [line]
    return Exported(
        loaded,
        path,
        lines + removed_lines(removed, "export"),
        reference=model,
        runs_formats=True,
        int8_scaled=True,
        tolerance=(int8_export.INT8_ATOL, int8_export.INT8_RTOL),
    )


def scaled_int8_runtime(
    model: nn.Module, layers: dict[str, Any], cfg: Any, settings: ExportSettings
) -> tuple[Path, str]:
    """``int8=scaled``'s file in ``settings.out``, in the runtime ``settings.int8_runtime`` names, or with
    ``auto`` the one measured faster at the run's own codes for this CPU kind (cached per CPU kind, threads and
    shape as ``int8=auto``'s choice; where nothing is cached both files are written and timed at the self-check's
    largest batch, and the slower one removed): ONNX Runtime's QDQ graph
    (:data:`~adls_lightning.export.int8.INT8_SCALED_FILE`) or, where torchao is installed, PT2E on the run's grid
    compiled by AOTInductor (:data:`~adls_lightning.export.pt2e.RUN_CODES_FILE`: oneDNN's int8 kernels, AMX-INT8
    where the CPU has it). Returns the file and a line starting ``int8_runtime=auto:`` (empty when one was named)."""
    from adls_lightning import int8_runtime
    from adls_lightning.export import int8 as int8_export
    from adls_lightning.export import pt2e
    from adls_lightning.search.cost import torch_threads

    out = settings.out
    files = {
        int8_runtime.ORT_QDQ: (out / int8_export.INT8_SCALED_FILE, int8_export.export_int8_graph),
        int8_runtime.PT2E_RUN_CODES: (
            out / pt2e.RUN_CODES_FILE,
            lambda fake, path: pt2e.write_run_codes_package(fake, layers, int8_export.QMAX, path),
        ),
    }

    def write(runtime: str) -> Path:
        path, writer = files[runtime]
        writer(model, path)
        return path

    if settings.int8_runtime != "auto":
        # int8_runtime=pt2e without torchao was refused with the options, before anything was read
        runtime = int8_runtime.PT2E_RUN_CODES if settings.int8_runtime == "pt2e" else int8_runtime.ORT_QDQ
        return write(runtime), ""
    why_not_pt2e = pt2e.pt2e_unusable()
    if why_not_pt2e is not None:
        path = write(int8_runtime.ORT_QDQ)
        return (
            path,
            f"int8_runtime=auto: {int8_runtime.ORT_QDQ} ({int8_runtime.PT2E_RUN_CODES} not measured: {why_not_pt2e})",
        )

    check = settings.check
    batch = max(check.batches)

    def measure_files(fake: nn.Module, rows: int, tokens: int) -> dict[str, float]:
        runners = {
            runtime: int8_runtime.file_runner(write(runtime)) for runtime in int8_runtime.RUN_CODE_RUNTIMES
        }
        return int8_runtime.time_runners(
            runners, int8_runtime.sample_batch(rows, tokens, fake.config.vocab_size)
        )

    with torch_threads(check.threads):  # the cache is kept per thread count
        times, source = int8_runtime.runtime_times(
            (cfg.get("paths") or {}).get("cache_dir"),
            model,
            batch,
            check.tokens,
            measure_files,
            runtimes=int8_runtime.RUN_CODE_RUNTIMES,
        )
    runtime = int8_runtime.fastest(times) or int8_runtime.ORT_QDQ
    path = files[runtime][0]
    for other, (other_path, _) in files.items():
        if other != runtime:
            other_path.unlink(missing_ok=True)  # timed here, not chosen
    # a measurement wrote both files; otherwise a file left by an earlier export (overwrite=true) is stale
    if source != "measured":
        write(runtime)
    return path, (
        f"int8_runtime=auto: {runtime} ({source}: {int8_runtime.describe_times(times) or 'not timed'} at "
        f"{int8_runtime.describe_setting(batch, check.tokens, check.threads)})"
    )


def export_int4(settings: ExportSettings, overrides: Sequence[str]) -> Exported:
    """``format=onnx int4=true``: :data:`~adls_lightning.export.int4.INT4_FILE` of a 4-bit weight run, checked in
    ONNX Runtime against the fake-quantized model; every refusal comes before anything is written."""
    from adls_lightning.export import int4 as int4_export
    from adls_lightning.export import onnx as onnx_export

    loaded = load_for_graph(settings, overrides, "int4=true", "int4")
    model = loaded.model
    layers = int4_export.nbits_layers(model)  # refuses what the graph cannot carry before anything is written
    if not layers:
        raise ConfigError(
            "int4=true: the run quantizes no linear layer; pass its quant=w4_gptq overrides (a float checkpoint: "
            "quant=w4_gptq quant.gptq=null for round to nearest)"
        )
    out = settings.out
    removed = replace_earlier_export(settings, loaded.config)
    path = out / int4_export.INT4_FILE
    accuracy = int4_export.INT8_INPUTS if settings.int4 == "int8_inputs" else 0
    int4_export.export_int4_graph(model, path, accuracy)
    check = int4_export.check_int4(path, model, accuracy)
    tokenizer_saved = write_graph_folder(loaded, out, len(layers))
    blocks = sorted({layer.block_size for layer in layers.values()})
    line = (
        f"exported onnx int4={'int8_inputs' if accuracy else 'true'} to {out}: {path.name} {path.stat().st_size / 1e6:.1f} MB, "
        f"{len(layers)} linear layers as MatMulNBits (4-bit codes and the run's steps, blocks of "
        f"{'/'.join(map(str, blocks))} inputs, "
        f"{'inputs quantized to int8 per block by the kernel' if accuracy else 'float inputs'}); ONNX Runtime vs "
        f"the fake-quantized PyTorch model on {onnx_export.SAMPLE_ROWS}×{onnx_export.SAMPLE_TOKENS} tokens: "
        f"{check.describe()}{' (tokenizer included)' if tokenizer_saved else ''}"
    )
    tolerance = (
        (int4_export.INT8_INPUTS_ATOL, int4_export.INT8_INPUTS_RTOL)
        if accuracy
        else (int4_export.INT4_ATOL, int4_export.INT4_RTOL)
    )
    return Exported(
        loaded,
        path,
        [line, *removed_lines(removed, "export")],
        reference=model,
        runs_formats=True,
        tolerance=tolerance,
    )


def refuse_compression_beyond_weights(loaded: LoadedRun, format: str) -> None:
    """``format=onnx`` and ``mxint8`` carry weights only: a run that quantized or pruned activations, or (mxint8)
    quantized weights in another format, is refused in one line naming the layer and the format."""
    found = loaded.activation_compression()
    if found:
        # a scaled int8 run (quant=int8_scaled) has its own int8 route, which keeps its activation grid
        scaled = (
            "int8=scaled (the run's int8 grid as an int8 graph), "
            if format == "onnx" and int8_inputs_only(loaded.recipe)
            else ""
        )
        # What the run computed comes from the checkpoint's compression record, which no override changes: an
        # export of the weights alone would compute a model the run never evaluated, and the self-check, comparing
        # it with the run's model stripped alike, could not tell. The weights-only exports are of runs trained so.
        retrain = (
            "a run trained without activation pruning (prune.activation=null, or a weights-only preset: "
            "prune=wanda_0.5, sparsegpt_0.5, l1_2of4, movement_0.9, structured_0.5)"
            if loaded.recipe.activation_prune
            else "a run that quantizes weights only"
        )
        raise ConfigError(
            f"format={format}: {found}, which a {format} folder does not carry; valid: {scaled}format=hf (its "
            f"{RECIPE_FILE} carries it), or {retrain}"
        )
    if format == "mxint8" and loaded.recipe.baked["quantized_layers"]:
        raise ConfigError(
            "format=mxint8: the run quantized its weights (e.g. with quant=); packing those values as MXINT8 would "
            "quantize them a second time; valid: format=hf, or the float checkpoint of a run without quant="
        )


def int8_inputs_only(recipe: ExportRecipe) -> bool:
    """Whether the only activation compression of ``recipe`` is 8-bit scaled-integer inputs of linear layers (what
    ``int8=scaled`` carries: a ``quant=int8_scaled`` run), no activation pruning, no quantized outputs."""
    operands = [spec for entry in recipe.activation_quant.values() for spec in entry.values()]
    inputs = [entry.get("data_in") for entry in recipe.activation_quant.values()]
    return (
        not recipe.activation_prune
        and bool(inputs)
        and sum(spec is not None for spec in operands) == len(inputs)
        and all(
            spec is not None
            and spec["format"] == "scaled_integer"
            and int(spec["params"].get("width", 0)) == 8
            for spec in inputs
        )
    )


#: how many training batches calibrate the PT2E graph's static activation scales (as quant.calibration.batches)
PT2E_CALIBRATION_BATCHES = 16


def choose_int8_runtime(model: nn.Module, cfg: Any, check: CheckSettings) -> tuple[str, str]:
    """``format=onnx int8=auto``'s runtime: the one measured fastest for this CPU kind
    (:func:`adls_lightning.int8_runtime.runtime_times` at the self-check's largest batch, its tokens and threads;
    cached per CPU kind) among those a file can hold: ONNX Runtime's dynamic int8 (``model_int8.onnx``) or, where
    torchao is installed, PT2E static int8 compiled by AOTInductor (:func:`export_pt2e_file`: oneDNN's int8
    kernels, AMX-INT8 where the CPU has it). torch's dynamic int8 has no file format: when it measures fastest the
    next one is chosen. ONNX Runtime's when nothing could be timed. Returns it and a line starting ``int8=auto:``
    that says why."""
    from adls_lightning import int8_runtime
    from adls_lightning.export import pt2e
    from adls_lightning.search.cost import torch_threads

    writable = [int8_runtime.ORT_DYNAMIC]
    why_not_pt2e = pt2e.pt2e_unusable()
    if why_not_pt2e is None:
        writable.append(int8_runtime.PT2E)
    batch = max(check.batches)
    with torch_threads(check.threads):  # the cache is kept per thread count
        times, _ = int8_runtime.runtime_times(
            (cfg.get("paths") or {}).get("cache_dir"), model, batch, check.tokens
        )
    choice = int8_runtime.fastest(times, writable) or int8_runtime.ORT_DYNAMIC
    why = (
        f"int8=auto: {choice} ({int8_runtime.describe_times(times) or 'not timed'} at "
        f"{int8_runtime.describe_setting(batch, check.tokens, check.threads)})"
    )
    overall = int8_runtime.fastest(times) or choice
    if overall != choice:
        why += f"; {overall} measured faster but has no file format"
    if why_not_pt2e is not None:
        why += f"; {int8_runtime.PT2E} not measured: {why_not_pt2e}"
    return choice, why


def export_pt2e_file(model: nn.Module, out: Path, cfg: Any) -> tuple[Path, str]:
    """:data:`~adls_lightning.export.pt2e.PT2E_FILE` in ``out``: ``model`` in PT2E static int8, calibrated on the
    run's training batches and compiled by AOTInductor, checked against ``model``; the file and what was written."""
    from adls_lightning.export import pt2e

    path = out / pt2e.PT2E_FILE
    batches, source = pt2e_calibration_batches(model, cfg)
    layers = pt2e.write_pt2e_package(model, batches, path)
    return path, (
        f"{path.name} {path.stat().st_size / 1e6:.1f} MB ({layers} linear layers in static int8, calibrated on "
        f"{source}; AOTInductor package): {pt2e.check_package(path, model).describe()}"
    )


def pt2e_calibration_batches(model: nn.Module, cfg: Any) -> tuple[list[dict], str]:
    """:data:`PT2E_CALIBRATION_BATCHES` of the run's training batches (token type ids left out: the package takes
    ids and mask), or random token ids when the run's data cannot be built here; and where they came from."""
    from itertools import islice

    from adls_lightning.export import int8 as int8_export
    from adls_lightning.export.onnx import INPUT_NAMES, sample_inputs

    try:
        batches = [
            {name: batch[name] for name in INPUT_NAMES}
            for batch in islice(int8_export.training_batches(cfg), PT2E_CALIBRATION_BATCHES)
        ]
        if batches:
            return batches, f"{len(batches)} training batches of the run's data"
        reason = "its training split is empty"
    except Exception as error:  # noqa: BLE001 - the data's own failures (files, hub, cache) are not the export's
        reason = f"{type(error).__name__}: {' '.join(str(error).split())[:160]}"
    batches = [sample_inputs(model, rows=8, tokens=128, seed=seed) for seed in range(4)]
    return batches, f"4 batches of random token ids (the run's data: {reason})"


def export_onnx_files(model: nn.Module, out: Path, int8: bool) -> str:
    """``model.onnx`` (and with ``int8`` ``model_int8.onnx``) in ``out``, each run in ONNX Runtime against
    ``model``; the summary of what was written and how close it came."""
    from adls_lightning.export import onnx as onnx_export

    fp32_path = out / onnx_export.ONNX_FILE
    onnx_export.export_onnx(model, fp32_path)
    check = onnx_export.check_against_torch(fp32_path, model)
    summary = (
        f"{fp32_path.name} {fp32_path.stat().st_size / 1e6:.1f} MB (opset {onnx_export.ONNX_OPSET}, "
        f"dynamic {' × '.join(onnx_export.DYNAMIC_AXES)}); ONNX Runtime vs PyTorch on "
        f"{onnx_export.SAMPLE_ROWS}×{onnx_export.SAMPLE_TOKENS} tokens: {check.describe()} "
        f"(tolerance {onnx_export.FP32_ATOL:g} + {onnx_export.FP32_RTOL:g}·|logit|)"
    )
    if int8:
        int8_path = out / onnx_export.ONNX_INT8_FILE
        onnx_export.quantize_int8(fp32_path, int8_path)
        # int8 is an approximation: reported, not held to the fp32 tolerance
        int8_check, _ = onnx_export.compare(int8_path, model, onnx_export.sample_inputs(model))
        summary += f"; {int8_path.name} {int8_path.stat().st_size / 1e6:.1f} MB: {int8_check.describe()}"
    return summary
