"""``python -m adls_lightning.export ckpt=PATH out=DIR [format=mxint8|hf|onnx] [options] [model overrides]``
(installed as ``adls-export``).

Options: ``group_size=32``, ``exclude=classifier`` (comma-separated module names left float),
``pack_embeddings=false`` (also pack the word embeddings), ``int8=false`` (``format=onnx`` only: ``true`` also
writes ONNX Runtime's dynamic int8 model; ``scaled`` writes instead the int8 graph of a ``quant=int8_scaled`` run
with the run's own weight codes and calibrated activation scales, :mod:`adls_lightning.export.int8`),
``int4=false`` (``format=onnx`` only: ``true`` writes instead ``model_int4.onnx``, the 4-bit weights of a
``quant=w4_gptq`` run as ONNX Runtime's ``MatMulNBits`` with the run's own codes and group steps, float inputs;
``int8_inputs``: the same, the kernel quantizing each block of inputs to int8; :mod:`adls_lightning.export.int4`),
``overwrite=false`` (allow a non-empty ``out``); ``--help``: this text.

Every export checks itself (:mod:`adls_lightning.export.selfcheck`): ``export.json`` in the folder and a short
table give the artifact's label agreement with the run's own model on held rows, the largest logit difference,
and its speedup over torch eager fp32 of the run's uncompressed architecture per batch size, with what it is
worth (mask-only pruning, not faster, no runtime for the format). ``check=full`` (default), ``agreement`` (no
timing) or ``none``; ``check_rows=200`` (held rows of the run's test split), ``check_threads=1``,
``check_tokens=128``, ``check_batches=1,8``, ``check_rounds=5``.
The model, its data and its compression are the run's own: the overrides Hydra recorded next to the checkpoint
(``<run>/.hydra/overrides.yaml``, for a checkpoint in ``<run>/checkpoints/``); every other ``key=value`` is a
Hydra override of ``conf/train.yaml`` on top of them (without a run record: on top of the MiniLM + LoRA of
``train.py``), e.g. ``model=tiny_random``. LoRA adapters are merged before anything is written; what a
compressed run computed is baked into the weights (pruning masks, weights and biases as quantized, QAT or PTQ)
and what acts on activations is written beside them (``compression.json``, :mod:`adls_lightning.export.compressed`),
which ``format=onnx`` and ``mxint8`` cannot carry and so refuse. Bad input (an ``out`` that cannot be written, an
``exclude`` pattern that matches no linear layer, ...): one line naming the key, exit code 2, nothing written,
before the model is loaded where it can be. An ONNX file whose ONNX
Runtime logits miss PyTorch's: one line, exit code 1 (the file is kept for inspection).
"""

from __future__ import annotations

import copy
import re
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from adls_lightning.errors import ConfigError
from adls_lightning.export.compressed import RECIPE_FILE
from adls_lightning.export.folder import save_tokenizer, write_config
from adls_lightning.export.selfcheck import OPTIONS as CHECK_OPTIONS
from adls_lightning.export.selfcheck import CheckSettings, self_check
from adls_lightning.logs import configure_tool
from adls_lightning.run_loading import LoadedRun, load_checkpoint_model
from adls_lightning.tool_options import FLAGS, HelpRequested, check_writable, flag_option, split_options

OPTIONS = {
    "ckpt": None,
    "out": None,
    "format": "mxint8",
    "group_size": "32",
    "exclude": "classifier",
    "pack_embeddings": "false",
    "int8": "false",
    "int4": "false",
    "overwrite": "false",
    **CHECK_OPTIONS,
}
FORMATS = ("mxint8", "hf", "onnx")


def parse_arguments(argv: Sequence[str]) -> tuple[dict[str, str | None], list[str]]:
    """Split ``key=value`` tokens into this command's options and Hydra overrides of the model config."""
    return split_options(argv, OPTIONS, "ckpt=PATH out=DIR format=mxint8")


def check_options(options: dict[str, str | None]) -> dict:
    """Validated options (paths, format, group size, flags); raises ConfigError naming the first bad key."""
    for key in ("ckpt", "out"):
        if not options[key]:
            raise ConfigError(f"{key}: required (usage: python -m adls_lightning.export ckpt=PATH out=DIR)")
    ckpt, out = Path(options["ckpt"]), Path(options["out"])
    if not ckpt.is_file():
        raise ConfigError(f"ckpt={ckpt}: no such checkpoint file")
    if options["format"] not in FORMATS:
        raise ConfigError(f"format={options['format']}: must be one of {', '.join(FORMATS)}")
    if out.exists() and not out.is_dir():
        raise ConfigError(f"out={out}: is a file, expected a folder (new or empty)")
    overwrite = flag_option(options, "overwrite")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise ConfigError(f"out={out}: folder is not empty; choose a new one or pass overwrite=true")
    check_writable(out, "out")  # before the checkpoint is read
    try:
        group_size = int(options["group_size"])
    except ValueError:
        group_size = 0
    if group_size <= 0:
        raise ConfigError(f"group_size={options['group_size']}: must be a positive integer, e.g. 32")
    exclude = tuple(name for name in str(options["exclude"]).split(",") if name)
    for pattern in exclude:
        try:
            re.compile(pattern)
        except re.error as error:
            raise ConfigError(f"exclude={options['exclude']}: {pattern!r} is not a regex ({error})") from None
    int8: bool | str = "scaled" if str(options["int8"]).lower() == "scaled" else None
    if int8 is None:
        if str(options["int8"]).lower() not in FLAGS:
            raise ConfigError(f"int8={options['int8']}: must be true, false or scaled")
        int8 = flag_option(options, "int8")
    if int8 and options["format"] != "onnx":
        raise ConfigError(
            f"int8={options['int8']}: only with format=onnx (ONNX Runtime's int8); format={options['format']} "
            "takes int8=false"
        )
    int4: bool | str = "int8_inputs" if str(options["int4"]).lower() == "int8_inputs" else None
    if int4 is None:
        if str(options["int4"]).lower() not in FLAGS:
            raise ConfigError(f"int4={options['int4']}: must be true, false or int8_inputs")
        int4 = flag_option(options, "int4")
    if int4 and (options["format"] != "onnx" or int8):
        raise ConfigError(
            f"int4={options['int4']}: only with format=onnx and int8=false (one graph: ONNX Runtime's MatMulNBits); "
            f"format={options['format']} int8={options['int8']} takes int4=false"
        )
    return {
        "ckpt": ckpt,
        "out": out,
        "format": options["format"],
        "group_size": group_size,
        "exclude": exclude,
        "pack_embeddings": flag_option(options, "pack_embeddings"),
        "int8": int8,
        "int4": int4,
        "check": CheckSettings.from_options(options),
    }


def export(options: dict, overrides: Sequence[str]) -> None:
    from adls_lightning.export import WEIGHTS_FILE, folder_bytes, pack_for_export, save_packed

    if options["format"] == "onnx" and options["int8"] == "scaled":
        export_scaled_int8(options, overrides)
        return
    if options["int4"]:
        export_int4(options, overrides)
        return
    loaded = load_checkpoint_model(options["ckpt"], overrides, options=list(OPTIONS))
    model, recipe = loaded.model, loaded.recipe
    if options["format"] != "hf":
        refuse_compression_beyond_weights(loaded, options["format"])
    out: Path = options["out"]
    with tempfile.TemporaryDirectory() as fp32_dir:
        model.save_pretrained(fp32_dir)
        fp32_bytes = folder_bytes(Path(fp32_dir), [WEIGHTS_FILE])
    if options["format"] == "onnx":
        out.mkdir(parents=True, exist_ok=True)
        summary = export_onnx_files(model, out, options["int8"])
    elif options["format"] == "hf":
        out.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(out)
        summary = f"save_pretrained (merged, fp32): {fp32_bytes / 1e6:.1f} MB"
    else:
        check_exclude(model, options["exclude"])
        try:
            packed = pack_for_export(
                model, options["group_size"], options["exclude"], options["pack_embeddings"]
            )
        except ValueError as error:
            raise ConfigError(f"group_size={options['group_size']}: {error}") from error
        save_packed(model, packed, out)
        weights = folder_bytes(out, [WEIGHTS_FILE])
        summary = (
            f"{len(packed.linear)} linear layers packed"
            f"{', word embeddings packed' if packed.embeddings else ''}; {WEIGHTS_FILE} {weights / 1e6:.1f} MB "
            f"vs fp32 save_pretrained {fp32_bytes / 1e6:.1f} MB ({1 - weights / fp32_bytes:.1%} smaller)"
        )
    # every format: config.json with the label names (format=hf: written by save_pretrained) and the tokenizer,
    # so the folder predicts alone (python -m adls_lightning.export.predict)
    write_config(model.config, out, loaded.inputs)
    recipe.write(out, loaded.activation_state)
    tokenizer_saved = save_tokenizer(loaded.tokenizer, out)
    print(
        f"exported {options['format']} to {out}: {summary}; folder {folder_bytes(out) / 1e6:.1f} MB"
        f"{' (tokenizer included)' if tokenizer_saved else ''}"
    )
    if recipe.baked["quantized_layers"] or recipe.baked["pruned_layers"] or recipe.activation_prune:
        print(
            f"compression: {recipe.baked['quantized_layers']} quantized and {recipe.baked['pruned_layers']} "
            f"pruned layers baked into the weights; {len(recipe.activation_quant)} layers quantize activations"
            f"{', input activations pruned' if recipe.activation_prune else ''} ({RECIPE_FILE}: "
            "python -m adls_lightning.export.evaluate applies it)"
        )
    if loaded.note:
        print(f"note: {loaded.note}")
    artifact = out
    if options["format"] == "onnx":
        from adls_lightning.export import onnx as onnx_export

        # int8=true: the dynamic int8 graph is the one asked for; model.onnx is the float reference beside it
        artifact = out / (onnx_export.ONNX_INT8_FILE if options["int8"] else onnx_export.ONNX_FILE)
    check_export(
        options,
        overrides,
        loaded,
        artifact,
        runs_formats=options["format"] == "mxint8",
    )


def run_model(options: dict, overrides: Sequence[str], loaded: LoadedRun):
    """The run's own model as it evaluated it (fake-quantized, with its activation quantizers and pruning): the
    reference of the self-check. A run that quantized nothing evaluated the exported float model itself."""
    if loaded.recipe.baked.get("quantized_layers"):
        model = load_checkpoint_model(
            options["ckpt"], overrides, keep_quantized=True, options=list(OPTIONS)
        ).model
    else:
        model = loaded.model
    if loaded.recipe.activation_prune:
        from adls_lightning.prune import Pruner

        model = copy.deepcopy(model)
        Pruner(weight=None, key=RECIPE_FILE, **loaded.recipe.activation_prune).attach_activation(model)
    return model.eval()


def check_export(
    options: dict,
    overrides: Sequence[str],
    loaded: LoadedRun,
    artifact: Path,
    reference=None,
    runs_formats: bool = False,
) -> None:
    """The export's self-check (:func:`adls_lightning.export.selfcheck.self_check`) of ``artifact`` against the
    run's model (``reference``, else :func:`run_model`)."""
    from adls_lightning.prune.structured import CONFIG_ATTRIBUTE

    settings: CheckSettings = options["check"]
    if settings.mode == "none":
        return
    reference = run_model(options, overrides, loaded) if reference is None else reference
    self_check(
        options["out"],
        artifact,
        reference,
        loaded.config,
        settings,
        mask_pruned=loaded.recipe.baked.get("pruned_layers", 0),
        structured=bool(getattr(reference.config, CONFIG_ATTRIBUTE, None)),
        runs_formats=runs_formats,
    )


def check_exclude(model, exclude: Sequence[str]) -> None:
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


def export_scaled_int8(options: dict, overrides: Sequence[str]) -> None:
    """``format=onnx int8=scaled``: :data:`~adls_lightning.export.int8.INT8_SCALED_FILE` of a scaled-int8 run,
    checked in ONNX Runtime against the fake-quantized model; every refusal comes before anything is written."""
    from adls_lightning.export import int8 as int8_export

    loaded = load_checkpoint_model(options["ckpt"], overrides, keep_quantized=True, options=list(OPTIONS))
    model = loaded.model
    if loaded.recipe.activation_prune:
        raise ConfigError(
            "int8=scaled: the run prunes input activations, which the int8 graph does not carry; valid: override "
            "prune.activation=null"
        )
    calibrated = ""
    if int8_export.uncalibrated(model):
        # a PTQ run calibrates at evaluation, after its checkpoint was written: its ranges are not in the file
        batches = int8_export.calibrate_as_run(model, loaded.config)
        if batches:
            calibrated = (
                f"; input scales calibrated here on {batches} training batches (a PTQ checkpoint has none)"
            )
    # refuses what the graph cannot carry before anything is written
    if not int8_export.scaled_int8_layers(model):
        raise ConfigError(
            "int8=scaled: the run quantizes no linear layer; pass its quant=int8_scaled overrides (a float "
            "checkpoint: quant=int8_scaled quant.mode=ptq), or int8=true for ONNX Runtime's dynamic int8"
        )
    out: Path = options["out"]
    out.mkdir(parents=True, exist_ok=True)
    path = out / int8_export.INT8_SCALED_FILE
    layers = int8_export.export_int8_graph(model, path)
    check = int8_export.check_int8(path, model)
    loaded.recipe.baked["quantized_layers"] = len(layers)
    write_config(model.config, out, loaded.inputs)
    loaded.recipe.write(out, {})
    tokenizer_saved = save_tokenizer(loaded.tokenizer, out)
    from adls_lightning.export import onnx as onnx_export

    print(
        f"exported onnx int8=scaled to {out}: {path.name} {path.stat().st_size / 1e6:.1f} MB, {len(layers)} linear "
        f"layers on the run's int8 grid (weights per output channel, static input scales){calibrated}; ONNX "
        f"Runtime vs the fake-quantized PyTorch model on {onnx_export.SAMPLE_ROWS}×{onnx_export.SAMPLE_TOKENS} "
        f"tokens: {check.describe()} (tolerance {int8_export.INT8_ATOL:g} + {int8_export.INT8_RTOL:g}·|logit|)"
        f"{' (tokenizer included)' if tokenizer_saved else ''}"
    )
    check_export(options, overrides, loaded, path, reference=model, runs_formats=True)


def export_int4(options: dict, overrides: Sequence[str]) -> None:
    """``format=onnx int4=true``: :data:`~adls_lightning.export.int4.INT4_FILE` of a 4-bit weight run, checked in
    ONNX Runtime against the fake-quantized model; every refusal comes before anything is written."""
    from adls_lightning.export import int4 as int4_export
    from adls_lightning.export import onnx as onnx_export

    loaded = load_checkpoint_model(options["ckpt"], overrides, keep_quantized=True, options=list(OPTIONS))
    model = loaded.model
    if loaded.recipe.activation_prune:
        raise ConfigError(
            "int4=true: the run prunes input activations, which the int4 graph does not carry; valid: override "
            "prune.activation=null"
        )
    layers = int4_export.nbits_layers(model)  # refuses what the graph cannot carry before anything is written
    if not layers:
        raise ConfigError(
            "int4=true: the run quantizes no linear layer; pass its quant=w4_gptq overrides (a float checkpoint: "
            "quant=w4_gptq quant.gptq=null for round to nearest)"
        )
    out: Path = options["out"]
    out.mkdir(parents=True, exist_ok=True)
    path = out / int4_export.INT4_FILE
    accuracy = int4_export.INT8_INPUTS if options["int4"] == "int8_inputs" else 0
    int4_export.export_int4_graph(model, path, accuracy)
    check = int4_export.check_int4(path, model, accuracy)
    loaded.recipe.baked["quantized_layers"] = len(layers)
    write_config(model.config, out, loaded.inputs)
    loaded.recipe.write(out, {})
    tokenizer_saved = save_tokenizer(loaded.tokenizer, out)
    blocks = sorted({layer.block_size for layer in layers.values()})
    print(
        f"exported onnx int4={'int8_inputs' if accuracy else 'true'} to {out}: {path.name} {path.stat().st_size / 1e6:.1f} MB, "
        f"{len(layers)} linear layers as MatMulNBits (4-bit codes and the run's steps, blocks of "
        f"{'/'.join(map(str, blocks))} inputs, "
        f"{'inputs quantized to int8 per block by the kernel' if accuracy else 'float inputs'}); ONNX Runtime vs "
        f"the fake-quantized PyTorch model on {onnx_export.SAMPLE_ROWS}×{onnx_export.SAMPLE_TOKENS} tokens: "
        f"{check.describe()}{' (tokenizer included)' if tokenizer_saved else ''}"
    )
    check_export(options, overrides, loaded, path, reference=model, runs_formats=True)


def refuse_compression_beyond_weights(loaded: LoadedRun, format: str) -> None:
    """``format=onnx`` and ``mxint8`` carry weights only: a run that quantized or pruned activations, or (mxint8)
    quantized weights in another format, is refused in one line naming the layer and the format."""
    found = loaded.activation_compression()
    if found:
        raise ConfigError(
            f"format={format}: {found}, which a {format} folder does not carry; valid: format=hf (its "
            f"{RECIPE_FILE} carries it), or export the weights alone by overriding the run's activation settings "
            "(e.g. prune.activation=null)"
        )
    if format == "mxint8" and loaded.recipe.baked["quantized_layers"]:
        raise ConfigError(
            "format=mxint8: the run quantized its weights (e.g. with quant=); packing those values as MXINT8 would "
            "quantize them a second time; valid: format=hf, or the float checkpoint of a run without quant="
        )


def export_onnx_files(model, out: Path, int8: bool) -> str:
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


def main(argv: Sequence[str] | None = None) -> int:
    from adls_lightning.export.onnx import ExportCheckError

    configure_tool()
    try:
        options, overrides = parse_arguments(sys.argv[1:] if argv is None else argv)
        export(check_options(options), overrides)
    except HelpRequested:
        print(__doc__.strip())
        return 0
    except ConfigError as error:
        print(f"error: {' '.join(str(error).split())}", file=sys.stderr)
        return 2
    except ExportCheckError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
