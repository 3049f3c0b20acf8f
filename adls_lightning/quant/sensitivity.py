"""Per-layer quantization sensitivity, the measurement behind ``python -m adls_lightning.quant.sensitivity`` (the
command is :mod:`adls_lightning.tools.sensitivity`, where its options are described).

Starting from a full-precision model, each group of linear layers (and encoder points) in turn is quantized with a
preset's recipe while every other layer stays float, and the task's main metric is measured
(:func:`layer_sensitivity`); :func:`run_sensitivity` loads a ``train.py`` checkpoint's model and data for it
(:mod:`adls_lightning.runs.loading`). The groups: one linear layer each (``by=layer``), one kind of layer across blocks
(``by=kind``) or one encoder block (``by=block``).
"""

from __future__ import annotations

import csv
import re
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

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


def run_sensitivity(ckpt: Path, options: dict, overrides: list[str]):
    """Load the checkpoint's float model and data, then :func:`layer_sensitivity` (``options``: the command's, of
    :mod:`adls_lightning.tools.sensitivity`: ``quant``, ``by``, ``split``; their keys are named in errors).

    Returns:
        The main metric's name, its full-precision value, the groups' scores (most sensitive first), the table's
        title, the preset's ``quant.config.default`` (a plain mapping, or None) and the overrides the run's model
        and data were composed with (its recorded ones, then the command's; a search from the checkpoint takes
        them).
    """
    from omegaconf import OmegaConf

    from adls_lightning.build import build
    from adls_lightning.data.inputs import model_inputs
    from adls_lightning.data.tasks import build_metric
    from adls_lightning.export.compressed import run_compression, run_overrides
    from adls_lightning.overrides import merge_overrides, override_key
    from adls_lightning.quant.scaled import calibrate
    from adls_lightning.runs.loading import compose_train_config, load_checkpoint_model

    preset = options["quant"]
    # quant.* overrides shape the preset; the run's model and data take the rest
    preset_args = [o for o in overrides if override_key(o).startswith("quant.")]
    overrides = [o for o in overrides if o not in preset_args]
    run_args = merge_overrides(run_overrides(ckpt), overrides)
    run_cfg = compose_train_config(run_args, options=list(options))
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
            logits = candidate(**model_inputs(batch)).logits
            predicted = logits.squeeze(-1) if task.is_regression else logits.argmax(-1)
            metric.update(predicted, batch["labels"])
        return float(metric.compute())

    def prepare(candidate: nn.Module) -> None:
        if calibration:
            calibrate(candidate, data.train_dataloader(), lambda b: candidate(**model_inputs(b)), calibration)

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
    return task.main_metric, baseline, scores, title, preset_default, run_args


if __name__ == "__main__":  # `python -m adls_lightning.quant.sensitivity`, the spelling the docs use
    from adls_lightning.tools.sensitivity import main

    sys.exit(main())
