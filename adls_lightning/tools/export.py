"""``python -m adls_lightning.export ckpt=PATH out=DIR [format=mxint8|hf|onnx] [options] [model overrides]``
(installed as ``adls-export``).

Options: ``group_size=32``, ``exclude=classifier`` (comma-separated module names left float),
``pack_embeddings=false`` (also pack the word embeddings), ``int8=false`` (``format=onnx`` only: ``true`` also
writes ONNX Runtime's dynamic int8 model; ``scaled`` writes instead the int8 graph of a ``quant=int8_scaled`` run
with the run's own weight codes and calibrated activation scales, :mod:`adls_lightning.export.int8`, in the
runtime ``int8_runtime=auto`` measures faster on this CPU kind at those codes: ONNX Runtime's QDQ graph
``model_int8_scaled.onnx`` or, where ``torchao`` is installed, the PT2E package ``model_int8_scaled.pt2``;
``int8_runtime=onnx`` or ``pt2e`` names one; ``auto``
writes beside ``model.onnx`` the int8 model in the runtime measured fastest for this CPU kind, cached:
ONNX Runtime's dynamic int8, or where ``torchao`` is installed PT2E int8 compiled by AOTInductor into
``model_int8_pt2e.pt2``, oneDNN's int8 kernels and AMX-INT8 where the CPU has it,
:func:`adls_lightning.export.from_checkpoint.choose_int8_runtime`),
``int4=false`` (``format=onnx`` only: ``true`` writes instead ``model_int4.onnx``, the 4-bit weights of a
``quant=w4_gptq`` run as ONNX Runtime's ``MatMulNBits`` with the run's own codes and group steps, float inputs;
``int8_inputs``: the same, the kernel quantizing each block of inputs to int8; :mod:`adls_lightning.export.int4`),
``overwrite=false`` (``true``: allow a non-empty ``out``, whose earlier export's files are replaced by this one's,
other files left, and put back when this export fails its self-check; refused when the export reads one of them);
``--help``: this text.

Every export checks itself (:mod:`adls_lightning.export.selfcheck`): ``export.json`` in the folder and a short
table give the artifact's label agreement with the run's own model on held rows, the largest logit difference,
and its speedup over torch eager fp32 of the run's uncompressed architecture per batch size, with what it is
worth (mask-only pruning, not faster, no runtime for the format). ``check=full`` (default), ``agreement`` (no
timing) or ``none``; ``check_rows=200`` (held rows of the run's test split), ``check_threads=1``,
``check_tokens=128``, ``check_batches=1,8``, ``check_rounds=5``.
The model, its data and its compression are the run's own: the overrides Hydra recorded next to the checkpoint
(``<run>/.hydra/overrides.yaml``, for a checkpoint in ``<run>/checkpoints/``); every other ``key=value`` is a
Hydra override of ``conf/train.yaml`` on top of them (without a run record: those a soup carries, else on top of
the MiniLM + LoRA of ``train.py``), e.g. ``model=tiny_random``; data overrides that give another task than the one
the checkpoint records are refused (its classifier would be written with that task's labels). LoRA adapters are merged before anything is written; what a
compressed run computed is baked into the weights (pruning masks, weights and biases as quantized, QAT or PTQ)
and what acts on activations is written beside them (``compression.json``, :mod:`adls_lightning.export.compressed`),
which ``format=onnx`` and ``mxint8`` cannot carry and so refuse (the ``l1_*`` and ``random_*`` prune presets prune
activations: ``format=hf``; the weights-only ones, ``wanda``, ``sparsegpt``, ``l1_2of4``, ``movement``,
``structured``, export to all three). Bad input (an ``out`` that cannot be written, an
``exclude`` pattern that matches no linear layer, ...): one line naming the key, exit code 2, nothing written,
before the model is loaded where it can be. An ONNX file whose ONNX
Runtime logits miss PyTorch's: one line, exit code 1 (the file is kept for inspection); so is a self-check whose
read-back runs another file than the one written, or misses the run's logits beyond the bound of an exact format
(``hf``, the fp32 graph, ``int8=scaled``, ``int4``): ``export.json`` marks the folder failed and the readers refuse it.
Ctrl-C: one line, ``interrupted: out=DIR is as it was before this export ...``, exit code 130.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Sequence
from pathlib import Path

from adls_lightning.checkpoints import missing_checkpoint
from adls_lightning.errors import ConfigError
from adls_lightning.export.settings import FORMATS, CheckSettings, ExportCheckError, ExportSettings
from adls_lightning.export.settings import OPTIONS as CHECK_OPTIONS
from adls_lightning.logs import configure_tool
from adls_lightning.tools.options import FLAGS, HelpRequested, check_writable, flag_option, split_options

#: ``int8=`` values besides the flags: the run's own int8 codes, or the runtime measured fastest on this CPU
INT8_WORDS = ("scaled", "auto")
#: ``int8_runtime=`` (``int8=scaled``): measured faster here, ONNX Runtime's QDQ graph, or the PT2E package
INT8_RUNTIMES = ("auto", "onnx", "pt2e")
OPTIONS = {
    "ckpt": None,
    "out": None,
    "format": "mxint8",
    "group_size": "32",
    "exclude": "classifier",
    "pack_embeddings": "false",
    "int8": "false",
    "int8_runtime": "auto",
    "int4": "false",
    "overwrite": "false",
    **CHECK_OPTIONS,
}


#: The options of ``format=mxint8`` alone.
PACKING_OPTIONS = ("group_size", "exclude", "pack_embeddings")


def parse_arguments(argv: Sequence[str]) -> tuple[dict[str, str | None], list[str]]:
    """Split ``key=value`` tokens into this command's options and Hydra overrides of the model config."""
    return split_options(argv, OPTIONS, "ckpt=PATH out=DIR format=mxint8")


def check_options(options: dict[str, str | None]) -> ExportSettings:
    """Validated options (paths, format, group size, flags); raises ConfigError naming the first bad key."""
    for key in ("ckpt", "out"):
        if not options[key]:
            raise ConfigError(f"{key}: required (usage: python -m adls_lightning.export ckpt=PATH out=DIR)")
    ckpt, out = Path(options["ckpt"]), Path(options["out"])
    if not ckpt.is_file():
        raise missing_checkpoint(ckpt, "ckpt")
    if options["format"] not in FORMATS:
        raise ConfigError(f"format={options['format']}: must be one of {', '.join(FORMATS)}")
    # the MXINT8 packing's options: read by no other format, so a value given with one is refused, not ignored
    for key in PACKING_OPTIONS:
        if options["format"] != "mxint8" and str(options[key]).lower() != OPTIONS[key]:
            raise ConfigError(
                f"{key}={options[key]}: only with format=mxint8 (an option of its packing); format={options['format']} "
                f"takes no {key}"
            )
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
    int8: bool | str | None = str(options["int8"]).lower()
    if int8 not in INT8_WORDS:
        if int8 not in FLAGS:
            raise ConfigError(f"int8={options['int8']}: must be true, false, {' or '.join(INT8_WORDS)}")
        int8 = flag_option(options, "int8")
    if int8 and options["format"] != "onnx":
        raise ConfigError(
            f"int8={options['int8']}: only with format=onnx (ONNX Runtime's int8); format={options['format']} "
            "takes int8=false"
        )
    int8_runtime = str(options["int8_runtime"]).lower()
    if int8_runtime not in INT8_RUNTIMES:
        raise ConfigError(
            f"int8_runtime={options['int8_runtime']}: must be one of {', '.join(INT8_RUNTIMES)}"
        )
    if int8_runtime != "auto" and int8 != "scaled":
        raise ConfigError(
            f"int8_runtime={options['int8_runtime']}: only with int8=scaled (the runtime of the run's own int8 "
            f"codes); int8={options['int8']} takes int8_runtime=auto"
        )
    if int8_runtime == "pt2e":
        from adls_lightning.export.pt2e import pt2e_unusable

        if (why := pt2e_unusable()) is not None:
            raise ConfigError(f"int8_runtime=pt2e: {why}")
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
    return ExportSettings(
        ckpt=ckpt,
        out=out,
        format=str(options["format"]),
        group_size=group_size,
        exclude=exclude,
        pack_embeddings=flag_option(options, "pack_embeddings"),
        int8=int8,
        int8_runtime=int8_runtime,
        int4=int4,
        check=CheckSettings.from_options(options),
        overwrite=overwrite,
        tool_keys=tuple(OPTIONS),
    )


def export(settings: ExportSettings, overrides: Sequence[str]) -> None:
    """The command (for :func:`main`): the folder written, what it holds printed, then the self-check. Ctrl-C ends
    it in one line, exit code 130, with ``out`` as it was before (:func:`~adls_lightning.export.from_checkpoint.
    earlier_export_kept_until_checked`)."""
    from adls_lightning.app.cli import exit_interrupted, noting_interrupts

    with noting_interrupts() as interrupts:
        try:
            # imported once the options are checked (torch and the model's code take seconds, --help and a bad
            # option none), and inside the block: a Ctrl-C in those seconds is an interrupt too
            from adls_lightning.export.from_checkpoint import (
                check_export,
                earlier_export_kept_until_checked,
                export_checkpoint,
            )

            with earlier_export_kept_until_checked(settings.out, interrupts):
                exported = export_checkpoint(settings, overrides)
                for line in exported.lines:
                    print(line)
                check_export(settings, overrides, exported)
        except BaseException:
            if not interrupts:
                raise
            exit_interrupted(f"out={settings.out} is as it was before this export; run the command again")


def main(argv: Sequence[str] | None = None) -> int:
    """``adls-export`` and ``python -m adls_lightning.export``."""
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
