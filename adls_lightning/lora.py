"""Merging LoRA adapters into the base weights before compression, as the labs do (Tutorial 2 -> 3 -> 4).

Quantizing or pruning a model whose adapters stay beside the frozen base layers measures neither an "int8" nor
a "50 % sparse" model: the adapters run in fp32 and dense. :func:`merge_lora` folds them in with PEFT's own
``merge_and_unload`` (``W + B @ A * scaling``), after which the plain model is what gets compressed and trained.

Checkpoints written before the merge (a LoRA fine-tune used as ``init_ckpt``, or the best checkpoint of a
LoRA fit that post-training quantization then evaluates) still load: :func:`merge_lora` registers a
``load_state_dict`` pre-hook that rewrites such a state into the merged layout with the same arithmetic.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from typing import Any

import torch
from peft import LoraConfig, PeftModel
from peft.tuners.lora import LoraLayer
from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING
from transformers import PreTrainedModel

from adls_lightning.errors import ConfigError

log = logging.getLogger(__name__)

PEFT_PREFIX = "base_model.model."


def linear_layer_names(model: PreTrainedModel) -> list[str]:
    """The model's ``nn.Linear`` layers as LoRA target names, one per kind: the name after the layer index
    (``attention.self.query``) for linears inside the repeated layers, the path below the base model otherwise
    (``pooler.dense``, ``classifier``). Each is a valid ``target_modules`` entry (PEFT matches name suffixes)."""
    prefix = f"{model.base_model_prefix}."
    names: list[str] = []
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        parts = name.split(".")
        indices = [i for i, part in enumerate(parts) if part.isdigit()]
        short = ".".join(parts[indices[-1] + 1 :]) if indices else name.removeprefix(prefix)
        if short not in names:
            names.append(short)
    return names


def _matches(name: str, entry: str) -> bool:
    # PEFT's rule for a list of names: the module's full name, or its name ending in ".<entry>".
    return name == entry or name.endswith(f".{entry}")


def check_lora_targets(model: PreTrainedModel, config: LoraConfig) -> None:
    """Every entry of ``target_modules`` and ``modules_to_save`` names a layer of ``model``, before PEFT wraps it.

    PEFT stops only when nothing at all matches (with a traceback), and says nothing when some entries match and
    others do not: another family's names (BERT's ``query`` on DeBERTa's ``query_proj``) then silently leave a kind
    of linear without adapters. ``target_modules=None`` takes PEFT's default for the model type, where it has one.

    Raises:
        ConfigError: naming ``model.lora.target_modules`` (or ``modules_to_save``), the entries that match nothing
            and the model's linear layer names.
    """
    names = [name for name, module in model.named_modules() if name and not list(module.children())]
    containers = [name for name, _ in model.named_modules() if name]
    linears = ", ".join(linear_layer_names(model))
    targets = config.target_modules
    model_type = model.config.model_type
    if targets is None:
        if model_type not in TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING:
            raise ConfigError(
                f"model.lora.target_modules=null: PEFT has no default for {model_type} models; list the layers "
                f"to adapt (its linear layers: {linears})"
            )
        return
    if not targets:  # [] or "": PEFT would stop with a traceback ("no modules were targeted")
        shown = repr(targets) if isinstance(targets, str) else "[]"
        default = (
            ", null for PEFT's default"
            if model_type in TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING
            else ""
        )
        raise ConfigError(
            f"model.lora.target_modules={shown}: names no layer to adapt; list some of this {model_type} model's "
            f"linear layers ({linears}){default}, or give model/lora=none for full fine-tuning"
        )
    for key, entries in (("target_modules", targets), ("modules_to_save", config.modules_to_save or ())):
        odd = next((e for e in ([] if isinstance(entries, str) else entries) if not isinstance(e, str)), None)
        if odd is not None:  # PEFT would compare it with the layer names and stop with a TypeError
            raise ConfigError(f"model.lora.{key}: {odd!r} is not a layer name (its linear layers: {linears})")
    if isinstance(targets, str):  # a regular expression over full names, or PEFT's "all-linear"
        if targets != "all-linear" and not any(re.fullmatch(targets, name) for name in names):
            raise ConfigError(
                f"model.lora.target_modules={targets!r}: matches no layer of this {model_type} model "
                f"(its linear layers: {linears})"
            )
        return
    for key, entries, candidates in (
        ("target_modules", targets, names),
        ("modules_to_save", config.modules_to_save or (), containers),
    ):
        missing = sorted(e for e in entries if not any(_matches(name, e) for name in candidates))
        if missing:
            raise ConfigError(
                f"model.lora.{key}: {', '.join(missing)} match{'es' if len(missing) == 1 else ''} no layer of "
                f"this {model_type} model (its linear layers: {linears})"
            )


def lora_scalings(peft_model: PeftModel) -> dict[str, float]:
    """``{layer path in the base model: scaling}`` of the active adapter of every LoRA layer.

    Raises:
        ValueError: an adapter kind whose merge is not ``W + B @ A * scaling`` (DoRA, fan-in-fan-out layers).
    """
    scalings = {}
    for name, module in peft_model.named_modules():
        if not isinstance(module, LoraLayer):
            continue
        adapter = module.active_adapters[0]
        if module.use_dora.get(adapter) or getattr(module, "fan_in_fan_out", False):
            raise ValueError(
                f"model.lora: layer {name} uses DoRA or fan_in_fan_out, which this merge does not map"
            )
        scalings[name.removeprefix(PEFT_PREFIX)] = float(module.scaling[adapter])
    return scalings


def merged_state(state: Mapping[str, Any], prefix: str, scalings: Mapping[str, float]) -> dict[str, Any]:
    """An unmerged PEFT state (keys ``{prefix}base_model.model...``) in the merged model's layout.

    ``...base_layer.X`` becomes ``...X``, ``modules_to_save.<adapter>`` replaces ``original_module``, and each
    layer's ``lora_B @ lora_A * scaling`` is added to its weight, as PEFT's merge does. Keys outside
    ``prefix`` pass through; a state that is already merged is returned unchanged.
    """
    head = prefix + PEFT_PREFIX
    if not any(key.startswith(head) for key in state):
        return dict(state)
    out: dict[str, Any] = {}
    deltas: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in state.items():
        if not key.startswith(head):
            out[key] = value
            continue
        path = key[len(head) :]
        if ".original_module." in path:
            continue
        if ".lora_A." in path or ".lora_B." in path:
            layer, rest = path.split(".lora_", 1)
            deltas.setdefault(layer, {})[rest[0]] = value
            continue
        if ".modules_to_save." in path:
            before, after = path.split(".modules_to_save.", 1)
            path = f"{before}.{after.split('.', 1)[1]}"
        out[prefix + path.replace(".base_layer.", ".")] = value
    for layer, pair in deltas.items():
        weight_key = next(
            k for k in (f"{prefix}{layer}.weight", f"{prefix}{layer}.linear.weight") if k in out
        )
        weight = out[weight_key]
        delta = (pair["B"] @ pair["A"]) * scalings[layer]
        out[weight_key] = weight + delta.to(weight.dtype)
    return out


def merge_lora(module: torch.nn.Module, attribute: str = "model") -> int:
    """Merge the PEFT LoRA model at ``module.<attribute>`` into a plain model, in place; returns the adapter
    parameter count folded in (0 when there was nothing to merge).

    Every parameter of the merged model is left trainable: what trains after the merge (QAT, the fine-tune
    after pruning) is the merged weights themselves, as in the labs.
    """
    peft_model = getattr(module, attribute)
    if not isinstance(peft_model, PeftModel):
        return 0
    scalings = lora_scalings(peft_model)
    adapters = sum(p.numel() for n, p in peft_model.named_parameters() if ".lora_" in n)
    merged = peft_model.merge_and_unload()
    merged.requires_grad_(True)
    setattr(module, attribute, merged)

    def load_unmerged(_module: torch.nn.Module, state: dict[str, Any], prefix: str, *_: Any) -> None:
        converted = merged_state(state, f"{prefix}{attribute}.", scalings)
        state.clear()
        state.update(converted)

    module.register_load_state_dict_pre_hook(load_unmerged)
    log.info(
        "Merged %d LoRA layers (%s adapter parameters) into the base weights", len(scalings), f"{adapters:,}"
    )
    return adapters


def merge_before_compression(module: torch.nn.Module) -> int:
    """What every compression callback calls before it first changes the model: merges LoRA when the module asks
    for it (``SequenceClassifier.merge_lora_before_compress``); returns the adapter parameters merged (0 if none).

    Any LightningModule can sit under the callbacks; one without the switch is left as it is.
    """
    if getattr(module, "merge_lora_before_compress", False):
        return module.merge_lora()
    return 0
