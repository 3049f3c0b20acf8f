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
search=mixed_precision``) over the layers of the ``search_top`` most sensitive groups only (default: the more
sensitive half), every other layer fixed at the preset's format (``quant.config.default``), so the trials spend
their budget where precision matters. Bad input: one line naming the key, exit code 2, nothing written, before the
model is loaded; an ``out`` that already holds files is refused unless ``overwrite=true``, one that cannot be written
before the measurement starts. The preset's settings (``quant.calibration``, ...) are checked by the callback
``train.py`` builds from them, so both commands accept and refuse the same values. ``--help``: this text.

The model, data and task are the run's own (the overrides Hydra recorded beside the checkpoint); other
``key=value`` tokens are Hydra overrides of ``conf/train.yaml`` on top of them (e.g. ``data.val_size=500``); those
under ``quant.`` change the preset only (``quant=int8_scaled quant.config.default.weight.params.width=4``).
"""

from __future__ import annotations

import csv
import re
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from adls_lightning.errors import ConfigError
from adls_lightning.layers import swap_module
from adls_lightning.quant.linear import QuantLinear
from adls_lightning.quant.points import find_points, remove_points
from adls_lightning.quant.recipe import LayerRecipe, QuantRecipe
from adls_lightning.quant.transform import find_linear_layers, quantize_model

GROUPINGS = ("layer", "kind", "block")
SPLITS = ("val", "test")
OPTIONS: dict[str, str | None] = {
    "ckpt": None,
    "quant": "int8",
    "by": "layer",
    "split": "val",
    "out": None,
    "overwrite": "false",
    "search_top": None,
}
CSV_FILE = "sensitivity.csv"
FIGURE_FILE = "sensitivity.png"
SEARCH_FILE = "search_command.txt"
#: an encoder block's prefix in a canonical layer name (BERT ``encoder.layer.3.``, DistilBERT ``transformer.layer.3.``)
_BLOCK = re.compile(r"^(.*?\blayer\.\d+)\.(.+)$")


@dataclass(frozen=True)
class GroupScore:
    """One group's metric with only its layers quantized, and the drop from full precision (positive = worse)."""

    group: str
    layers: tuple[str, ...]
    metric: float
    drop: float


def layer_groups(names: Iterable[str], by: str) -> dict[str, list[str]]:
    """Layer names grouped ``by`` (see the module docstring), in first-seen order; a layer outside the encoder
    blocks (the pooler, the classifier) is its own group under ``kind`` and ``block``."""
    if by not in GROUPINGS:
        raise ConfigError(f"by={by!r}: must be one of {', '.join(GROUPINGS)}")
    groups: dict[str, list[str]] = {}
    for name in names:
        match = _BLOCK.match(name)
        if by == "layer" or match is None:
            key = name
        else:
            key = match.group(2) if by == "kind" else match.group(1)
        groups.setdefault(key, []).append(name)
    return groups


def recipe_entries(model: nn.Module, recipe: QuantRecipe) -> dict[str, LayerRecipe | None]:
    """``recipe``'s entry for each linear layer and encoder point of ``model`` (None: kept float), by name."""
    points = find_points(model)
    entries = recipe.for_layers([layer.name for layer in find_linear_layers(model)], [p.name for p in points])
    entries.update({point.name: recipe.for_point(point.name, point.kind)[0] for point in points})
    return entries


def quantize_only(model: nn.Module, recipe: QuantRecipe, names: Sequence[str]) -> list[str]:
    """Quantize ``names`` (linear layers and encoder points) of ``model`` with ``recipe``'s entries for them; every
    other layer and point stays float."""
    entries = recipe_entries(model, recipe)
    only = QuantRecipe(layers={name: entries[name] for name in names}, key=recipe.key)
    return quantize_model(model, only, key=recipe.key)


def unquantize(model: nn.Module) -> None:
    """Put every ``QuantLinear`` of ``model`` back to the linear it wraps (which it never copied), and every encoder
    point back to full precision."""
    for layer in find_linear_layers(model):
        if isinstance(layer.module, QuantLinear):
            swap_module(model, layer.path, layer.module.linear)
    remove_points(model)


def layer_sensitivity(
    model: nn.Module,
    recipe: QuantRecipe,
    groups: dict[str, list[str]],
    evaluate: Callable[[nn.Module], float],
    prepare: Callable[[nn.Module], None] | None = None,
    progress: Callable[[int, int, GroupScore], None] | None = None,
) -> tuple[float, list[GroupScore]]:
    """The full-precision metric and, for each group, the metric with only that group quantized (``prepare`` runs
    after quantizing: calibration), sorted by drop, largest first. ``model`` is float again afterwards."""
    baseline = evaluate(model)
    scores = []
    for index, (group, names) in enumerate(groups.items()):
        quantize_only(model, recipe, names)
        try:
            if prepare is not None:
                prepare(model)
            metric = evaluate(model)
        finally:
            unquantize(model)
        scores.append(GroupScore(group, tuple(names), metric, baseline - metric))
        if progress is not None:
            progress(index + 1, len(groups), scores[-1])
    return baseline, sorted(scores, key=lambda score: (-score.drop, score.group))


def format_table(metric_name: str, baseline: float, scores: Sequence[GroupScore]) -> str:
    width = max([len("group"), *(len(s.group) for s in scores)])
    lines = [
        f"{'group':<{width}}  layers  {metric_name:>8}  drop (pt)",
        f"{'(none: full precision)':<{width}}  {0:>6}  {baseline:>8.4f}  {0:>9.2f}",
    ]
    lines += [
        f"{s.group:<{width}}  {len(s.layers):>6}  {s.metric:>8.4f}  {100 * s.drop:>9.2f}" for s in scores
    ]
    return "\n".join(lines)


def write_csv(path: Path, baseline: float, scores: Sequence[GroupScore]) -> None:
    with path.open("w", newline="") as file:
        writer = csv.writer(file)
        writer.writerow(["group", "layers", "metric", "drop"])
        writer.writerow(["(full precision)", "", f"{baseline:.6f}", "0"])
        for s in scores:
            writer.writerow([s.group, " ".join(s.layers), f"{s.metric:.6f}", f"{s.drop:.6f}"])


def plot(path: Path, title: str, metric_name: str, scores: Sequence[GroupScore]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = list(reversed(scores))  # the most sensitive at the top
    figure, axes = plt.subplots(figsize=(7.5, 0.28 * len(shown) + 1.4))
    axes.barh([s.group for s in shown], [100 * s.drop for s in shown], color="tab:red")
    axes.axvline(0, color="black", linewidth=0.8)
    axes.set_xlabel(f"{metric_name} drop from full precision (points), only this group quantized")
    axes.set_title(title, fontsize=10)
    axes.tick_params(axis="y", labelsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


# ------------------------------------------------------------------------------------------------ command line
def parse_arguments(argv: Sequence[str]) -> tuple[dict[str, str | None], list[str]]:
    from adls_lightning.export.compressed import override_key
    from adls_lightning.tool_options import flag_option, split_options

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
    if any(override_key(override) in ("compress", "prune") for override in overrides):
        raise ConfigError("compress= / prune=: sensitivity measures quantization alone; leave them out")
    return options, overrides


def search_command(preset_default: Any, scores: Sequence[GroupScore], top: int) -> str:
    """``search.py`` over the layers of the ``top`` most sensitive groups, every other layer at ``preset_default``
    (the preset's ``quant.config.default``, a plain mapping)."""
    searched = [name for score in scores[:top] for name in score.layers]
    formats = [v["format"] for v in preset_default.values() if isinstance(v, dict) and "format" in v]
    precision = f"search.precision={formats[0]} " if formats else ""
    # the space's regex fullmatches layer names; a dot matching itself is all it needs here (no backslashes to
    # escape through the shell and Hydra's parser)
    return (
        f"python search.py search=mixed_precision {precision}"
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


def _batch_inputs(batch: dict[str, Any]) -> dict[str, Any]:
    from adls_lightning.export.evaluate import MODEL_INPUTS

    return {key: batch[key] for key in MODEL_INPUTS if key in batch}


def check_out(ckpt: Path, options: dict) -> Path:
    """The output folder (default: beside the checkpoint's run), refused before any work when it holds files
    (without ``overwrite=true``) or cannot be written."""
    from adls_lightning.tool_options import check_writable

    out = Path(options["out"]) if options["out"] else default_out(ckpt, options["quant"], options["by"])
    if out.exists() and not out.is_dir():
        raise ConfigError(f"out={out}: is a file, not a folder (give a folder path)")
    if out.is_dir() and any(out.iterdir()) and options["overwrite"] != "true":
        raise ConfigError(f"out={out}: already holds files; give another out= or overwrite=true")
    check_writable(out, "out")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    from adls_lightning.logs import configure_tool
    from adls_lightning.tool_options import run_tool

    argv = list(sys.argv[1:] if argv is None else argv)
    configure_tool()
    return run_tool(lambda: measure_and_write(argv), __doc__)


def measure_and_write(argv: Sequence[str]) -> None:
    """The command (for :func:`main`): check everything, measure, print and write ``out``."""
    options, overrides = parse_arguments(argv)
    ckpt = Path(options["ckpt"])
    if not ckpt.is_file():
        raise ConfigError(f"ckpt={ckpt}: no such file (give a train.py checkpoint)")
    out = check_out(ckpt, options)
    metric_name, baseline, scores, title, preset_default = run_sensitivity(ckpt, options, overrides)
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
        command = search_command(preset_default, scores, top)
        (out / SEARCH_FILE).write_text(command + "\n")
        written.append(SEARCH_FILE)
        print(
            f"search over the {min(top, len(scores))} most sensitive groups, the rest fixed at quant={options['quant']}:"
        )
        print(command)
    print(f"wrote {', '.join(str(out / name) for name in written)}")


def run_sensitivity(ckpt: Path, options: dict, overrides: list[str]):
    """Load the checkpoint's float model and data, then :func:`layer_sensitivity` (for :func:`main`)."""
    from omegaconf import OmegaConf

    from adls_lightning.build import build
    from adls_lightning.data.tasks import build_metric
    from adls_lightning.export.__main__ import compose_train_config, load_checkpoint_model
    from adls_lightning.export.compressed import (
        merge_overrides,
        override_key,
        run_compression,
        run_overrides,
    )
    from adls_lightning.quant.scaled import calibrate

    preset = options["quant"]
    # quant.* overrides shape the preset; the run's model and data take the rest
    preset_args = [o for o in overrides if override_key(o).startswith("quant.")]
    overrides = [o for o in overrides if o not in preset_args]
    run_args = merge_overrides(run_overrides(ckpt), overrides)
    run_cfg = compose_train_config(run_args, options=list(OPTIONS))
    compression = run_compression(run_cfg)
    if compression.quant is not None or compression.pruner is not None:
        raise ConfigError(
            f"ckpt={ckpt}: its run was compressed ({list(run_args)}); sensitivity starts from a full-precision "
            "checkpoint"
        )
    preset_cfg = compose_train_config([*run_args, f"quant={preset}", *preset_args])
    if preset_cfg.quant.get("config") is None or "QuantizationCallback" not in str(
        preset_cfg.quant.get("_target_")
    ):
        raise ConfigError(
            f"quant={preset}: quantizes nothing; give a preset such as int8, int4 or int8_scaled"
        )
    config = preset_cfg.quant.config
    preset_default = None
    if OmegaConf.is_dict(config) and config.get("default") is not None:
        preset_default = OmegaConf.to_container(config.default, resolve=True)
    # The preset's callback, built as train.py builds it: its constructor checks every quant.* setting (calibration,
    # GPTQ, SmoothQuant, the recipe), so the two commands refuse the same values, before the model is loaded.
    quantization = build(preset_cfg.quant, "quant")
    if quantization.gptq is not None or quantization.smoothquant_alpha is not None:
        raise ConfigError(
            f"quant={preset}: quant.gptq / quant.smoothquant.alpha change the weights from calibration data; "
            "sensitivity rounds each group to nearest; valid: quant.gptq=null quant.smoothquant.alpha=null"
        )
    recipe = quantization.recipe
    calibration = quantization.calibration_batches
    model = load_checkpoint_model(ckpt, overrides).model.eval()
    data = build(run_cfg.data, "data")
    task = data.task
    data.setup("fit")  # calibration reads training batches
    if options["split"] == "test":
        data.setup("test")
    loader = data.val_dataloader() if options["split"] == "val" else data.test_dataloader()

    @torch.inference_mode()
    def evaluate(candidate: nn.Module) -> float:
        metric = build_metric(task.main_metric, task.num_labels)
        for batch in loader:
            logits = candidate(**_batch_inputs(batch)).logits
            predicted = logits.squeeze(-1) if task.is_regression else logits.argmax(-1)
            metric.update(predicted, batch["labels"])
        return float(metric.compute())

    def prepare(candidate: nn.Module) -> None:
        if calibration:
            calibrate(
                candidate, data.train_dataloader(), lambda b: candidate(**_batch_inputs(b)), calibration
            )

    # the linear layers and the encoder points (quant=int8_scaled_all: softmax, GELU, LayerNorm, adds, products)
    entries = recipe_entries(model, recipe)
    groups = layer_groups(list(entries), options["by"])
    # only the layers and points the preset quantizes (a preset may keep e.g. the classifier float)
    groups = {g: [n for n in names if entries[n] is not None] for g, names in groups.items()}
    groups = {g: names for g, names in groups.items() if names}

    def progress(done: int, total: int, score: GroupScore) -> None:
        print(
            f"[{done}/{total}] {score.group}: {task.main_metric} {score.metric:.4f} (drop {100 * score.drop:.2f} pt)",
            flush=True,
        )

    print(
        f"{len(groups)} groups (by={options['by']}), quant={preset}, the {options['split']} split "
        f"({len(loader.dataset)} rows): one evaluation each after the full-precision one",
        flush=True,
    )
    baseline, scores = layer_sensitivity(model, recipe, groups, evaluate, prepare, progress)
    title = (
        f"quant={' '.join([preset, *preset_args])}, one group at a time (by={options['by']}), {task.main_metric} "
        f"on the {options['split']} "
        f"split, {ckpt.name}"
    )
    return task.main_metric, baseline, scores, title, preset_default


if __name__ == "__main__":
    sys.exit(main())
