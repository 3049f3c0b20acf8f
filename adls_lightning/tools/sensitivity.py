"""Per-layer quantization sensitivity: ``python -m adls_lightning.quant.sensitivity ckpt=CKPT [quant=PRESET]
[by=layer|kind|block] [split=val|test] [out=DIR] [overwrite=false] [overrides]``.

Starting from a full-precision checkpoint (LoRA merged, as the export loads it), each group of linear layers in
turn is quantized with the preset's recipe while every other layer stays float, and the task's main metric (IMDb:
accuracy, MRPC: F1, STS-B: Pearson) is measured on the run's validation split (``split=test``: its test split).
Static activation scales (``quant=int8_scaled``) are calibrated for the group on the preset's
``quant.calibration.batches`` training batches first. The groups are one linear layer each (``by=layer``), one kind
of layer across blocks (``by=kind``: every ``attention.self.query``, ...) or one encoder block (``by=block``). A preset
with encoder points (``quant=int8_scaled_all``, ``ibert_int8``) measures them too, as groups of their own
(``attention.self.softmax``, ``intermediate.intermediate_act_fn``, ``output.add``, ``output.LayerNorm``...).

Output: the table sorted by the metric's drop from full precision (largest first), printed, and written to
``out`` as ``sensitivity.csv`` and ``sensitivity.png`` (default ``out``: ``<run>/sensitivity/<preset>-<by>`` beside
the checkpoint's run folder), and ``search_command.txt``: a Lab 3 mixed-precision search (``search.py
search=mixed_precision``) from the checkpoint (``init_ckpt=`` and its run's model and data overrides) over the
layers of the ``search_top`` most sensitive groups only (default: the more sensitive half), every other layer fixed
at the preset's format (``quant.config.default``), so the trials spend their budget where precision matters. Bad input: one line naming the key, exit code 2, nothing written, before the
model is loaded; an ``out`` that already holds files is refused unless ``overwrite=true``, one that cannot be written
before the measurement starts. The preset's settings (``quant.calibration``, ...) are checked by the callback
``train.py`` builds from them, so both commands accept and refuse the same values. ``--help``: this text.

The model, data and task are the run's own (the overrides Hydra recorded beside the checkpoint); other
``key=value`` tokens are Hydra overrides of ``conf/train.yaml`` on top of them (e.g. ``data.val_size=500``); those
under ``quant.`` change the preset only (``quant=int8_scaled quant.config.default.weight.params.width=4``).

The command; the measurement is :mod:`adls_lightning.quant.sensitivity`.
"""

from __future__ import annotations

import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from adls_lightning.checkpoints import missing_checkpoint
from adls_lightning.errors import ConfigError
from adls_lightning.quant.sensitivity import (
    CSV_FILE,
    FIGURE_FILE,
    GROUPINGS,
    SEARCH_FILE,
    SPLITS,
    GroupScore,
    format_table,
    plot,
    run_sensitivity,
    write_csv,
)
from adls_lightning.tools.options import (
    check_override_keys,
    check_writable,
    flag_option,
    override_key,
    run_tool,
    split_options,
)

OPTIONS: dict[str, str | None] = {
    "ckpt": None,
    "quant": "int8",
    "by": "layer",
    "split": "val",
    "out": None,
    "overwrite": "false",
    "search_top": None,
}


def parse_arguments(argv: Sequence[str]) -> tuple[dict[str, str | None], list[str]]:
    options, overrides = split_options(argv, OPTIONS, "ckpt=PATH quant=int8 by=layer")
    if not options["ckpt"]:
        raise ConfigError("ckpt: required, the path of a full-precision train.py checkpoint (ckpt=PATH)")
    if options["by"] not in GROUPINGS:
        raise ConfigError(f"by={options['by']}: must be one of {', '.join(GROUPINGS)}")
    if options["split"] not in SPLITS:
        raise ConfigError(f"split={options['split']}: must be one of {', '.join(SPLITS)}")
    if options["search_top"] is not None and not options["search_top"].isdigit():
        raise ConfigError(
            f"search_top={options['search_top']}: must be an integer >= 0 (0: no search command)"
        )
    options["overwrite"] = "true" if flag_option(options, "overwrite") else "false"
    check_override_keys(overrides, list(OPTIONS))
    if any(override_key(override) in ("compress", "prune") for override in overrides):
        raise ConfigError("compress= / prune=: sensitivity measures quantization alone; leave them out")
    return options, overrides


#: override keys of the analysed run a search does not take: the search sets its own quantization and study, and
#: sensitivity refuses a compressed run
NOT_SEARCHED_FROM = ("quant", "prune", "compress", "search", "init_from_study")


def search_command(
    preset_default: Any, scores: Sequence[GroupScore], top: int, ckpt: Path, run_args: Sequence[str]
) -> str:
    """``search.py`` over the layers of the ``top`` most sensitive groups, every other layer at ``preset_default``
    (the preset's ``quant.config.default``, a plain mapping), from the analysed checkpoint: ``init_ckpt=`` (its
    absolute path) and the overrides its run's model and data were built with (``run_args``: the run's recorded
    ones and the command's own, as :func:`~adls_lightning.quant.sensitivity.run_sensitivity` composed them)."""
    searched = [name for score in scores[:top] for name in score.layers]
    formats = [v["format"] for v in preset_default.values() if isinstance(v, dict) and "format" in v]
    precision = f"search.precision={formats[0]} " if formats else ""
    run = [shlex.quote(arg) for arg in run_args if override_key(arg).split(".")[0] not in NOT_SEARCHED_FROM]
    start = " ".join([shlex.quote(f"init_ckpt={Path(ckpt).absolute()}"), *run])
    # the space's regex fullmatches layer names; a dot matching itself is all it needs here (no backslashes to
    # escape through the shell and Hydra's parser)
    return (
        f"python search.py search=mixed_precision {start} {precision}"
        f"'hydra.sweeper.search_space.layers=\"{'|'.join(searched)}\"' "
        f"'+quant.config.default={_flow(preset_default)}'"
    )


def _flow(value: Any) -> str:
    """A plain value in Hydra's override syntax (``{a: {b: 1}}``)."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_flow(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(_flow(v) for v in value) + "]"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


def default_out(ckpt: Path, preset: str, by: str) -> Path:
    run = ckpt.parent.parent if ckpt.parent.name == "checkpoints" else ckpt.parent
    return run / "sensitivity" / f"{preset}-{by}"


def check_out(ckpt: Path, options: dict) -> Path:
    """The output folder (default: beside the checkpoint's run), refused before any work when it holds files
    (without ``overwrite=true``) or cannot be written."""
    out = Path(options["out"]) if options["out"] else default_out(ckpt, options["quant"], options["by"])
    if out.exists() and not out.is_dir():
        raise ConfigError(f"out={out}: is a file, not a folder (give a folder path)")
    if out.is_dir() and any(out.iterdir()) and options["overwrite"] != "true":
        raise ConfigError(f"out={out}: already holds files; give another out= or overwrite=true")
    check_writable(out, "out")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    from adls_lightning.logs import configure_tool

    argv = list(sys.argv[1:] if argv is None else argv)
    configure_tool()
    return run_tool(lambda: measure_and_write(argv), __doc__)


def measure_and_write(argv: Sequence[str]) -> None:
    """The command (for :func:`main`): check everything, measure, print and write ``out``."""
    options, overrides = parse_arguments(argv)
    ckpt = Path(options["ckpt"])
    if not ckpt.is_file():
        raise missing_checkpoint(ckpt, "ckpt", "a train.py checkpoint")
    out = check_out(ckpt, options)
    metric_name, baseline, scores, title, preset_default, run_args = run_sensitivity(ckpt, options, overrides)
    table = format_table(metric_name, baseline, scores)
    print(title)
    print(table)
    out.mkdir(parents=True, exist_ok=True)
    write_csv(out / CSV_FILE, baseline, scores)
    plot(out / FIGURE_FILE, title, metric_name, scores)
    written = [CSV_FILE, FIGURE_FILE]
    # default: the more sensitive half of the groups
    top = int(options["search_top"]) if options["search_top"] is not None else (len(scores) + 1) // 2
    if top and preset_default is not None:
        command = search_command(preset_default, scores, top, ckpt, run_args)
        (out / SEARCH_FILE).write_text(command + "\n")
        written.append(SEARCH_FILE)
        print(
            f"search over the {min(top, len(scores))} most sensitive groups, the rest fixed at quant={options['quant']}:"
        )
        print(command)
    print(f"wrote {', '.join(str(out / name) for name in written)}")


if __name__ == "__main__":
    sys.exit(main())
