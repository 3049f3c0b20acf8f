"""Exporting a compressed run: what the run computed, baked into plain layers, and a recipe for the rest.

A run with ``quant=`` (QAT or PTQ), ``prune=`` or ``compress=`` evaluates a model that no Hugging Face class
computes: weights fake-quantized on every forward, masked weights, and input activations quantized or pruned per
sample. The export splits that in two:

* **baked into the weights** (:func:`bake_quantized_layers`, with the masks baked by the export's reader): each
  quantized layer's weight and bias become the values its quantizers gave them, so the folder is a standard
  ``save_pretrained`` folder that ``from_pretrained`` loads anywhere;
* **a recipe beside them** (:mod:`adls_lightning.export.recipe`: its file and :class:`ExportRecipe`): what acts on
  the activations (each layer's ``data_in`` / ``data_out`` formats, their quantizer state in
  :data:`ACTIVATION_STATE_FILE`, the activation pruning spec), which :func:`apply_recipe` puts back on the loaded
  model. With both, the exported model computes exactly what the run evaluated, so
  ``python -m adls_lightning.export.evaluate DIR`` reproduces the run's ``test/acc``. The recipe also keeps the
  run's overrides, from which ``evaluate`` builds the same test split.

Which compression a run applied comes from the checkpoint's own record (:mod:`adls_lightning.compression_record`,
written by the compression callbacks; :func:`record_compression`); a checkpoint written before records existed
falls back to the run's composed config (:func:`run_compression`: the ``quant``, ``prune`` and ``compress`` groups,
as ``train.py`` composed them). :func:`run_overrides` finds the overrides of the run a checkpoint belongs to
(Hydra's record, ``<run>/.hydra/overrides.yaml``, or for a checkpoint written elsewhere, such as a soup, the copy
it carries under :data:`RUN_OVERRIDES_KEY`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, ListConfig, OmegaConf
from safetensors.torch import load_file
from torch import nn

from adls_lightning.compression_record import COMPRESSED_CHECKPOINT, CompressionRecord, QuantizationRecord
from adls_lightning.errors import ConfigError
from adls_lightning.export.recipe import ACTIVATION_STATE_FILE, RECIPE_FILE, ExportRecipe, absolute_paths
from adls_lightning.layers import swap_module
from adls_lightning.prune import Pruner, lab_pruning_specs
from adls_lightning.quant import QuantRecipe, quantize_model, to_recipe
from adls_lightning.quant.linear import QuantLinear
from adls_lightning.quant.points import find_points
from adls_lightning.quant.smoothquant import Smoothed
from adls_lightning.quant.transform import find_linear_layers

#: the activation operands of a linear layer (what the recipe keeps; weight and bias are baked)
ACTIVATION_OPERANDS = ("data_in", "data_out")
#: Hydra's record of a run, relative to the folder of a checkpoint in ``<run>/checkpoints/``
RUN_OVERRIDES = Path("..") / ".hydra" / "overrides.yaml"
#: where a checkpoint written outside its run's folder (a soup, :mod:`adls_lightning.soup`) carries the overrides of
#: the run it came from, as :func:`run_overrides` returned them there
RUN_OVERRIDES_KEY = "adls_run_overrides"
#: override keys that say where a run wrote or which checkpoint it resumed, not which model or data it used
_RUN_ONLY_KEYS = ("hydra.", "ckpt_path", "init_ckpt", "init_head", "paths.output_dir")
_PRUNE_KEYS = ("weight", "activation", "include", "exclude", "seed")


def run_overrides(ckpt: Path) -> list[str]:
    """The overrides of the ``train.py`` / ``search.py`` run that wrote ``ckpt`` (model, data, compression...),
    without those that only say where it wrote; outside its run folder, those the checkpoint carries
    (:func:`carried_run_overrides`)."""
    record = (ckpt.parent / RUN_OVERRIDES).resolve()
    if not record.is_file():
        return carried_run_overrides(ckpt)
    try:
        tokens = OmegaConf.load(record)
    except Exception as error:  # noqa: BLE001 - a damaged record: say which file, as every bad input here
        raise ConfigError(f"{record}: unreadable run record ({str(error).splitlines()[0]})") from None
    if not isinstance(tokens, ListConfig):
        raise ConfigError(f"{record}: not a list of overrides (a Hydra run record)")
    kept = [str(t) for t in tokens if not str(t).lstrip("+~").startswith(_RUN_ONLY_KEYS)]
    # a relative data folder was typed where the run started (Hydra's record says where): read from there, and
    # recorded so by the export, whatever folder the export or a later adls-evaluate runs in
    started = run_folder_cwd(record.parent)
    return kept if started is None else absolute_paths(kept, started)


def carried_run_overrides(ckpt: Path) -> list[str]:
    """The run overrides ``ckpt`` carries under :data:`RUN_OVERRIDES_KEY` (a soup: its first run's); empty for a
    checkpoint without them, or one that cannot be read (the read that loads it says why, naming its key)."""
    from adls_lightning.checkpoints import read_checkpoint

    try:
        carried = read_checkpoint(ckpt, "ckpt", mmap=True).get(RUN_OVERRIDES_KEY)
    except ConfigError:
        return []
    return [str(token) for token in carried] if isinstance(carried, (list, tuple)) else []


def run_folder_cwd(record_dir: Path) -> Path | None:
    """The folder a run was started in (Hydra's record, ``hydra.runtime.cwd`` of ``<run>/.hydra/hydra.yaml``), or
    None when the record does not say."""
    try:
        cwd = OmegaConf.select(OmegaConf.load(record_dir / "hydra.yaml"), "hydra.runtime.cwd", default=None)
    except Exception:  # noqa: BLE001 - no record, or a damaged one: the overrides stay as typed
        return None
    return Path(cwd) if isinstance(cwd, str) and cwd else None


@dataclass
class RunCompression:
    """The compression a run applied: its quantization recipe (and the key it came from) and its pruner."""

    quant: QuantRecipe | None = None
    quant_key: str = "quant.config"
    pruner: Pruner | None = None
    #: what the export does not carry over, said once when it writes (e.g. an evaluation through packed layers)
    note: str | None = None
    #: from a record: the quantization as recorded (None: read from the config, applied or not as the state says)
    record: QuantizationRecord | None = None
    #: the activation pruning, as :class:`ExportRecipe` keeps it
    activation_prune: dict[str, Any] | None = None
    #: a structurally pruned run's kept sizes per encoder layer (from a record; otherwise read from the state)
    structured: dict[str, list[int]] | None = None


def _builds_callback(node: Any) -> bool:
    return isinstance(node, Mapping | DictConfig) and bool(node.get("_target_"))


def _quant_recipe(node: Any, key: str) -> QuantRecipe | None:
    """A ``quant.config``-style node as a recipe: a ``_target_`` leaf (typed recipe), a MASE dict or a file."""
    from adls_lightning.build import build

    if node is None or (isinstance(node, Mapping | DictConfig) and not node):
        return None
    if isinstance(node, DictConfig) and "_target_" in node:
        node = build(node, key)
    elif isinstance(node, DictConfig):
        node = OmegaConf.to_container(node, resolve=True)
    return to_recipe(node, key)


def _pruner(node: Any, key: str) -> Pruner | None:
    values = {k: node.get(k) for k in _PRUNE_KEYS if node.get(k) is not None}
    if node.get("config") is not None:
        values["weight"], values["activation"] = lab_pruning_specs(node.config, f"{key}.config")
    values = OmegaConf.to_container(OmegaConf.create(values), resolve=True)
    if not values.get("weight") and not values.get("activation"):
        return None
    return Pruner(**values, key=key)


def run_compression(cfg: DictConfig) -> RunCompression:
    """The compression groups of a run's composed config, for a checkpoint written without a record (before
    :mod:`adls_lightning.compression_record`).

    Read by their settings, as the callbacks of those days read them: a ``quant`` group with a ``config`` (its
    recipe, QAT or PTQ alike), a ``prune`` group, a ``compress`` group (its quant recipe and pruning); a ``quant``
    group with a ``group_size`` and no recipe (``quant=mxint8_packed``, an evaluation through packed layers)
    leaves a note.
    """
    found = RunCompression()
    quant, prune, compress = (cfg.get(group) for group in ("quant", "prune", "compress"))
    if _builds_callback(quant) and "config" in quant:
        if (quant.get("smoothquant") or {}).get("alpha") is not None:
            raise ConfigError(
                "quant.smoothquant.alpha: the export does not carry SmoothQuant's per-channel factors yet; valid: "
                "runs without quant.smoothquant"
            )
        if quant.get("gptq") is not None:
            raise ConfigError(
                "quant.gptq: GPTQ chose the weights from calibration batches after the checkpoint was written; the "
                "export does not rerun it yet; valid: runs without quant.gptq (round to nearest)"
            )
        found.quant = _quant_recipe(quant.get("config"), "quant.config")
    elif _builds_callback(quant) and "group_size" in quant:
        found.note = (
            "the run evaluated through MXINT8 packed layers (quant=mxint8_packed); format=mxint8 packs the same "
            "way, other formats hold the float weights"
        )
    if _builds_callback(prune):
        found.pruner = _pruner(prune, "prune")
    if _builds_callback(compress):
        recipe = _quant_recipe(compress.get("quant"), "compress.quant")
        if recipe is not None:
            found.quant, found.quant_key = recipe, "compress.quant"
        found.pruner = _pruner(compress.get("prune") or {}, "compress.prune") or found.pruner
    found.activation_prune = ExportRecipe.prune_spec(found.pruner)
    return found


def record_compression(record: CompressionRecord, ckpt: Path) -> RunCompression:
    """The compression a checkpoint's record says its run applied.

    A PTQ run's fit checkpoint (quantization recorded as not applied yet) whose evaluated model depended on
    training batches (GPTQ, SmoothQuant, calibrated ranges) is refused, naming the checkpoint that holds it
    (:data:`~adls_lightning.compression_record.COMPRESSED_CHECKPOINT`).
    """
    found = RunCompression(quant_key="ckpt record")
    quantization = record.quantization
    if quantization is not None and quantization.layers:
        if not quantization.applied and quantization.needs_data:
            chosen = [
                what
                for what, on in (
                    ("GPTQ", quantization.gptq),
                    ("SmoothQuant", quantization.smoothquant),
                    ("calibration", quantization.calibrated),
                )
                if on
            ]
            raise ConfigError(
                f"ckpt={ckpt}: holds the weights before post-training quantization, which took "
                f"{' and '.join(chosen)} from training batches at evaluation; valid: the evaluated model the run "
                f"saved, ckpt={ckpt.parent / COMPRESSED_CHECKPOINT}"
            )
        found.record = quantization
        found.quant = quantization.recipe()
    if record.pruning is not None:
        found.activation_prune = record.pruning.activation_spec()
        found.structured = record.pruning.structured
    if record.packing is not None:
        found.note = (
            f"the run evaluated through {record.packing.format.upper()} packed layers; format={record.packing.format} "
            "packs the same way, other formats hold the float weights"
        )
    return found


def _operand_recipe(recipe: Any) -> dict[str, Any] | None:
    return None if recipe is None else {"format": recipe.format, "params": dict(recipe.params)}


@dataclass
class BakedLayers:
    """What :func:`bake_quantized_layers` did: the layers baked, their activation formats and quantizer state."""

    layers: list[str] = field(default_factory=list)
    #: layers whose input quantizer SmoothQuant wrapped (its factors are in ``state``)
    smoothed: list[str] = field(default_factory=list)
    #: layer name → ``{data_in: {format, params} | None, data_out: ...}`` for layers quantizing an activation
    activations: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: ``<layer>.<operand>_quantizer.<name>`` → tensor (formats with state: most have none)
    state: dict[str, torch.Tensor] = field(default_factory=dict)


@torch.no_grad()
def bake_quantized_layers(model: nn.Module, recipe: QuantRecipe) -> BakedLayers:
    """Replace every :class:`QuantLinear` of ``model`` by a plain ``nn.Linear`` holding the weight and bias its
    quantizers computed (the values the run multiplied with), in place; the activation formats are returned for
    :data:`RECIPE_FILE` (what :func:`apply_recipe` puts back)."""
    layers = find_linear_layers(model)
    # per-name entries may name encoder points (quant/points.py) as well as linear layers
    recipes = recipe.for_layers([layer.name for layer in layers], [p.name for p in find_points(model)])
    baked = BakedLayers()
    for layer in layers:
        if not isinstance(layer.module, QuantLinear):
            continue
        quantized: QuantLinear = layer.module
        weight = quantized.linear.weight  # through a pruning mask, if any: what the forward reads
        plain = nn.Linear(quantized.in_features, quantized.out_features, bias=quantized.bias is not None)
        plain.to(device=weight.device, dtype=weight.dtype)
        plain.weight.copy_(
            weight if quantized.weight_quantizer is None else quantized.weight_quantizer(weight)
        )
        if quantized.bias is not None:
            bias = quantized.linear.bias
            plain.bias.copy_(bias if quantized.bias_quantizer is None else quantized.bias_quantizer(bias))
        kept = {op: _operand_recipe(getattr(recipes[layer.name], op)) for op in ACTIVATION_OPERANDS}
        if any(kept.values()):
            baked.activations[layer.name] = kept
            if isinstance(quantized.data_in_quantizer, Smoothed):
                baked.smoothed.append(layer.name)
            for operand in ACTIVATION_OPERANDS:
                quantizer = quantized.quantizer(operand)
                for key, value in (quantizer.state_dict() if quantizer is not None else {}).items():
                    baked.state[f"{layer.name}.{operand}_quantizer.{key}"] = value.detach().contiguous()
        swap_module(model, layer.path, plain)
        baked.layers.append(layer.name)
    return baked


def apply_recipe(model: nn.Module, folder: Path, recipe: ExportRecipe) -> nn.Module:
    """Put the recipe's activation quantizers (with their saved state) and activation pruning back on ``model``,
    a ``from_pretrained`` of ``folder``; returns ``model``, in the mode (eval or train) it came in.

    The quantizers are new modules, in training mode as every new module is: a static activation scale in training
    mode updates its range from each batch it sees (QAT's running range), so left so, the folder's model would drift
    from the run's ranges with every evaluated batch; they take the model's mode."""
    training = model.training
    if recipe.activation_quant:
        layers = {
            name: {**entry, "weight": None, "bias": None} for name, entry in recipe.activation_quant.items()
        }
        quantize_model(model, QuantRecipe(layers=layers, key=RECIPE_FILE))
        if recipe.smoothed:
            found = {layer.name: layer.module for layer in find_linear_layers(model)}
            for name in recipe.smoothed:
                layer = found[name]
                # SmoothQuant's factors: ones here, the saved ones when the state loads
                ones = torch.ones(layer.in_features, device=layer.linear.weight.device)
                layer.data_in_quantizer = Smoothed(layer.data_in_quantizer, ones, weight=False)
        state_file = folder / ACTIVATION_STATE_FILE
        if state_file.is_file():
            missing_or_unexpected = model.load_state_dict(
                load_file(str(state_file)), strict=False
            ).unexpected_keys
            if missing_or_unexpected:
                raise ConfigError(f"{state_file}: {missing_or_unexpected[0]} is not a layer of this model")
    if recipe.activation_prune:
        Pruner(weight=None, key=RECIPE_FILE, **recipe.activation_prune).attach_activation(model)
    return model.train(training)
