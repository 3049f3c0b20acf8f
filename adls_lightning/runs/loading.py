"""Loading a ``train.py`` run's model from one of its checkpoints: the run's config composed again (its recorded
overrides, then the caller's), the model built from it, the checkpoint's weights and its compression applied.

The library verb behind ``export``, ``export.evaluate`` and ``quant.sensitivity`` (:mod:`adls_lightning.tools`):
``compose_train_config`` composes ``conf/train.yaml`` with Hydra's compose API (not its runtime, which is the
application's), ``load_checkpoint_model`` returns a :class:`LoadedRun`.
"""

from __future__ import annotations

import os
import re
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from adls_lightning.configs import CONF_DIR
from adls_lightning.errors import ConfigError, composition_error_line
from adls_lightning.export.compressed import (
    bake_quantized_layers,
    record_compression,
    run_compression,
    run_overrides,
)
from adls_lightning.export.folder import task_inputs
from adls_lightning.export.recipe import ExportRecipe
from adls_lightning.overrides import merge_overrides, override_key

PROJECT_ROOT = Path(__file__).resolve().parents[2]
# the state keys of a linear layer pruned through torch.nn.utils.parametrize (adls_lightning.prune.WeightMask)
PRUNED_WEIGHT = ".parametrizations.weight.original"
PRUNING_MASK = ".parametrizations.weight.0.mask"


def fake_quantized_key(state: dict, model_keys: set[str]) -> str | None:
    """The first state key of a fake-quantized layer (``QuantLinear``: the wrapped ``linear``, quantizer state)
    that the float model lacks, or None."""
    for key in state:
        if key not in model_keys and ("_quantizer." in key or ".linear." in key):
            return key
    return None


def bake_pruning_masks(state: dict) -> int:
    """Replace each pruned layer's ``parametrizations.weight.{original, 0.mask}`` by its effective ``weight``
    (zeros where masked), in place; returns the layers baked.

    The float model the export builds has plain linear layers, and this is exactly what ``WeightMask`` computes on
    every read, so the exported weights are the ones the run evaluated.
    """
    layers = [key.removesuffix(PRUNED_WEIGHT) for key in state if key.endswith(PRUNED_WEIGHT)]
    for layer in layers:
        original = state.pop(layer + PRUNED_WEIGHT)
        mask = state.pop(layer + PRUNING_MASK, None)
        state[layer + ".weight"] = original if mask is None else torch.where(mask, original, 0.0)
    return len(layers)


@dataclass
class LoadedRun:
    """A checkpoint's model as the run evaluated it, with the compression baked into its weights
    (:mod:`adls_lightning.export.compressed`), and what is not: the recipe and the activation quantizers' state."""

    model: Any
    tokenizer: str | None
    recipe: ExportRecipe
    activation_state: dict[str, torch.Tensor]
    note: str | None = None
    #: the run's composed config (what the int8 export calibrates from)
    config: Any = None
    #: how the run fed texts to the model (:func:`adls_lightning.export.folder.task_inputs`), for config.json
    inputs: dict[str, Any] | None = None

    def activation_compression(self) -> str | None:
        """The first thing that acts on activations (a layer and its format, or the pruning), or None."""
        for name, operands in self.recipe.activation_quant.items():
            for operand, spec in operands.items():
                if spec:
                    return f"layer {name} quantizes its {operand} as {spec['format']}"
        if self.recipe.activation_prune:
            return f"the run prunes input activations to {self.recipe.activation_prune['activation']['sparsity']}"
        return None


def compose_train_config(
    overrides: Sequence[str], return_hydra_config: bool = False, options: Sequence[str] | None = None
):
    """``conf/train.yaml`` with ``overrides``, composed as ``train.py`` composes it (one line for a bad one).

    ``options``: the calling tool's own keys, named beside the config's when an override sets a key neither has.
    """
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    os.environ.setdefault("PROJECT_ROOT", str(PROJECT_ROOT))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Hydra's version_base deprecation: not the user's concern here
            with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
                # a search.py trial's run (its overrides choose a search= space) composes search.yaml, as its
                # re-run command does (issue 60: exporting a Pareto point of a study)
                config = "search" if any(override_key(o) == "search" for o in overrides) else "train"
                return compose(config, overrides=list(overrides), return_hydra_config=return_hydra_config)
    except (HydraException, OmegaConfBaseException) as error:
        first = str(error).splitlines()[0]
        unknown = re.match(r"Could not override '([^']+)'", first)
        if unknown and options is not None:
            # a misspelt option of the tool reaches Hydra as an override: say both what the tool and the config take
            raise ConfigError(
                f"{unknown.group(1)}: unknown key; valid: this command's options ({', '.join(options) or 'none'}) or a key "
                f"of conf/train.yaml (model=..., data.*, quant.*; a new key: +{unknown.group(1)}=...)"
            ) from None
        raise ConfigError(composition_error_line(error)) from None


def keep_run_settings(cfg: Any, overrides: list[str], checkpoint: Mapping[str, Any]) -> list[str]:
    """``overrides`` and ``cfg`` with each ``auto`` the run resolved on its own machine (``trainer.precision``,
    ``runtime.gemm``: recorded in ``checkpoint``) replaced by its answer, so a later evaluation computes as the
    run's test did; a value the caller gave is kept."""
    from omegaconf import OmegaConf, open_dict

    from adls_lightning.checkpoints import RESOLVED_KEY

    resolved = checkpoint.get(RESOLVED_KEY) or {}
    kept = {k: v for k, v in resolved.items() if OmegaConf.select(cfg, k, default=None) == "auto"}
    with open_dict(cfg):
        for key, value in kept.items():
            OmegaConf.update(cfg, key, value)
    return merge_overrides(overrides, [f"{key}={value}" for key, value in kept.items()])


def load_checkpoint_model(
    ckpt: Path, overrides: Sequence[str], keep_quantized: bool = False, options: Sequence[str] | None = None
) -> LoadedRun:
    """The merged Hugging Face model of a ``train.py`` checkpoint, with what its run's compression computed.

    The model and its compression come from the run's own overrides (Hydra's record next to the checkpoint's
    folder), then ``overrides`` on top. ``keep_quantized``: leave the fake-quantized layers in place (the model
    the run evaluated, for the int8 export) instead of baking them. ``options``: the calling tool's own keys
    (:func:`compose_train_config`).
    """
    from peft import PeftModel

    from adls_lightning.build import build
    from adls_lightning.checkpoints import complete_light_state, read_checkpoint
    from adls_lightning.compression_record import CompressionRecord, rebuild_quantization
    from adls_lightning.lora import merge_lora
    from adls_lightning.prune.structured import apply_sizes, fit_structure_to_state
    from adls_lightning.quant import quantize_model

    overrides = merge_overrides(run_overrides(ckpt), overrides)
    cfg = compose_train_config(overrides, options=options)
    tokenizer = cfg.data.get("tokenizer")
    # the data's task shapes the head (labels, regression) as in the run that wrote the checkpoint
    data = build(cfg.data, "data")
    task = data.task
    module = build(cfg.model, "model", _convert_="partial", **task.model_overrides())
    checkpoint = read_checkpoint(ckpt, "ckpt")  # a damaged or foreign file: one line naming it
    overrides = keep_run_settings(cfg, overrides, checkpoint)
    record = CompressionRecord.from_checkpoint(checkpoint, f"ckpt={ckpt}")
    # the checkpoint's record says what the run compressed; one written before records: the run's config
    compression = run_compression(cfg) if record is None else record_compression(record, ckpt)
    # a light checkpoint (LoRA adapters and trained heads) is completed from the base the model was just built from
    state = dict(complete_light_state(module, checkpoint, ckpt, "ckpt"))
    del checkpoint
    quantized = fake_quantized_key(state, set(module.state_dict()))
    if quantized is not None and compression.quant is None:
        raise ConfigError(
            f"ckpt={ckpt}: {quantized} is the state of a fake-quantized layer, but the run's config "
            f"({list(overrides) or 'the defaults'}) quantizes nothing; pass the quant= or compress= overrides it "
            "was trained with"
        )
    if (
        compression.quant is not None
        and isinstance(module.model, PeftModel)
        and not getattr(module, "merge_lora_before_compress", False)
    ):
        raise ConfigError(
            "model.merge_lora_before_compress=false: the run's LoRA adapters computed beside its quantized layers "
            "at full precision, which no exported layer reproduces; valid: runs with "
            "model.merge_lora_before_compress=true (the default)"
        )
    pruned = bake_pruning_masks(state)
    if isinstance(module.model, PeftModel) and not any(".lora_" in key for key in state):
        # Compression runs merge LoRA before they prune (merge_lora_before_compress): their checkpoints hold the
        # merged layout, which loads into the merged model.
        merge_lora(module)
    # a structurally pruned run saved smaller layers: the model takes their sizes (and records them in its config
    # as structured_pruning, which format=hf keeps), before any layer is quantized (a quantized one is not sliced)
    if compression.structured:
        apply_sizes(module, compression.structured)
    else:
        fit_structure_to_state(module, state)
    applied = compression.record.applied if compression.record is not None else quantized is not None
    if applied:  # QAT, or the evaluated model of a PTQ run: the checkpoint holds the quantized layers
        if compression.record is not None:
            rebuild_quantization(module.model, compression.record)
        else:
            quantize_model(module.model, compression.quant, key=compression.quant_key)
    try:
        module.load_state_dict(state, strict=True)
    except RuntimeError as error:
        first = str(error).splitlines()[0]
        raise ConfigError(
            f"ckpt={ckpt}: its weights do not fit the model built from {list(overrides) or 'the defaults'} "
            f"({first}); pass the model overrides it was trained with"
        ) from error
    merge_lora(module)
    model = module.model.eval()
    if compression.quant is not None and not applied:  # PTQ: quantized for evaluation, as the run did
        quantize_model(model, compression.quant, key=compression.quant_key)
        model.eval()  # the new quantizers start in training mode, where static ranges update from each batch
    baked = None
    if compression.quant is not None and not keep_quantized:
        baked = bake_quantized_layers(model, compression.quant)
    recipe = ExportRecipe(
        run_overrides=list(overrides),
        activation_quant=baked.activations if baked else {},
        activation_prune=compression.activation_prune,
        baked={"quantized_layers": len(baked.layers) if baked else 0, "pruned_layers": pruned},
        smoothed=baked.smoothed if baked else [],
    )
    return LoadedRun(
        model, tokenizer, recipe, baked.state if baked else {}, compression.note, cfg, task_inputs(data)
    )
