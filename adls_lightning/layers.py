"""The one walker over a model's linear layers, and the one name each layer goes by.

Quantization (:func:`adls_lightning.quant.find_linear_layers`), pruning (:func:`adls_lightning.prune.find_prune_targets`)
and MXINT8 packing (:func:`adls_lightning.mxint8.packable_linear_layers`) all list their layers with
:func:`target_layers` and name them with :func:`canonical_name`.

**The canonical name** is the module's path in the network a user configured (the Hugging Face model), with the
wrappers this project and PEFT add dropped: a LightningModule's ``model.``, PEFT's ``base_model.model.``,
``.base_layer``, ``.modules_to_save.<adapter>`` and ``QuantLinear``'s ``.linear``. So
``bert.encoder.layer.0.attention.self.query`` names that layer with and without LoRA, quantized or not, in metrics
(``prune/layer/<name>``), in exclusion regexes and in per-layer quantization overrides. Exclusion and inclusion
lists are regular expressions matched with ``re.search`` against it (:func:`name_filter`).

**A target layer** is a chain of modules from the outermost wrapper (which receives the layer input: a PEFT LoRA
layer, a ``QuantLinear``) down to the ``nn.Linear`` holding the weight. LoRA adapters (``lora_A``/``lora_B``) are
never targets, nor (except for MXINT8 packing, which frees their float weights) PEFT's unused ``original_module``
copies.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from torch import nn

#: ``filter_fn(module, canonical_name) -> keep?``; ``module`` is the outermost module of the layer.
FilterFn = Callable[[nn.Module, str], bool]

_PEFT_PREFIX = "base_model.model."
#: Path components never walked into: LoRA adapters.
SKIPPED_NAME_PARTS = frozenset({"lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B"})
#: PEFT's inactive copy of a ``modules_to_save`` module (kept for unloading; never called in the forward).
UNUSED_COPY = "original_module"
#: Path components that are wrapper internals, dropped from the canonical name.
_WRAPPER_PARTS = frozenset({"base_layer"})


@dataclass(frozen=True)
class TargetLayer:
    """One linear layer of a model.

    Attributes:
        name: the canonical name (see the module docstring).
        chain: ``(path, module)`` from the outermost wrapper to the ``nn.Linear``; paths are relative to the model
            that was walked (so ``swap_module(model, path, new)`` works on it).
    """

    name: str
    chain: tuple[tuple[str, nn.Module], ...]

    @property
    def path(self) -> str:
        """Path of the outermost module (the one that receives the layer input)."""
        return self.chain[0][0]

    @property
    def module(self) -> nn.Module:
        """The outermost module."""
        return self.chain[0][1]

    @property
    def linear_path(self) -> str:
        return self.chain[-1][0]

    @property
    def linear(self) -> nn.Linear:
        """The ``nn.Linear`` whose weight the layer uses."""
        return self.chain[-1][1]  # type: ignore[return-value]


def _wrapped_child(module: nn.Module) -> str | None:
    """Name of the child through which a wrapper calls the layer it wraps, or None for a non-wrapper.

    Wrappers declare it: this project's (``QuantLinear.wrapped_child = "linear"``) as a class attribute, PEFT's
    tuner layers as ``base_layer`` (``BaseTunerLayer.get_base_layer``).
    """
    declared = getattr(type(module), "wrapped_child", None)
    if isinstance(declared, str):
        return declared
    if hasattr(module, "get_base_layer") and isinstance(getattr(module, "base_layer", None), nn.Module):
        return "base_layer"
    return None


def _network_prefix(model: nn.Module) -> str:
    """The path prefix of the configured network inside ``model``: ``model.`` for a LightningModule."""
    from lightning.pytorch import (
        LightningModule,
    )  # the library's own module class wraps the network as .model

    return (
        "model."
        if isinstance(model, LightningModule) and isinstance(getattr(model, "model", None), nn.Module)
        else ""
    )


def canonical_name(path: str, prefix: str = "") -> str:
    """The user-facing name of the module at ``path`` (``prefix``: see :func:`_network_prefix`)."""
    name = path.removeprefix(prefix).removeprefix(_PEFT_PREFIX)
    out: list[str] = []
    parts = name.split(".")
    index = 0
    while index < len(parts):
        part = parts[index]
        if part == "modules_to_save":
            index += 2  # and the adapter name that follows
            continue
        if part not in _WRAPPER_PARTS:
            out.append(part)
        index += 1
    return ".".join(out)


def target_layers(
    model: nn.Module, filter_fn: FilterFn | None = None, unused_copies: bool = False
) -> list[TargetLayer]:
    """The model's linear layers, in module order, each once (its wrappers and adapters are not listed apart).

    Args:
        model: any module tree: a Hugging Face model, a PEFT model, a quantized model, a LightningModule.
        filter_fn: ``filter_fn(outermost module, canonical name)``; layers for which it is false are left out.
        unused_copies: also list the layers of PEFT's ``original_module`` copies (named with ``original_module``
            in them): MXINT8 packing packs them too, so they stop holding float weights.
    """
    prefix = _network_prefix(model)
    skipped = SKIPPED_NAME_PARTS if unused_copies else SKIPPED_NAME_PARTS | {UNUSED_COPY}
    layers: list[TargetLayer] = []
    claimed: list[str] = []  # subtrees already part of a layer (a wrapper's internals)
    for path, module in model.named_modules():
        if any(path.startswith(c) for c in claimed) or skipped.intersection(path.split(".")):
            continue
        chain = [(path, module)]
        while (child := _wrapped_child(chain[-1][1])) is not None:
            chain.append((f"{chain[-1][0]}.{child}", getattr(chain[-1][1], child)))
        if len(chain) > 1:
            claimed.append(path + ".")
        if not isinstance(chain[-1][1], nn.Linear):
            continue
        name = canonical_name(path, prefix)
        if filter_fn is None or filter_fn(module, name):
            layers.append(TargetLayer(name, tuple(chain)))
    return layers


def name_filter(include: Sequence[str] | None = None, exclude: Sequence[str] | None = None) -> FilterFn:
    """A filter keeping layers whose canonical name ``re.search``-matches an ``include`` regex (all when None)
    and no ``exclude`` regex."""

    def keep(module: nn.Module, name: str) -> bool:
        if include and not any(re.search(p, name) for p in include):
            return False
        return not (exclude and any(re.search(p, name) for p in exclude))

    return keep


def swap_module(model: nn.Module, path: str, new: nn.Module) -> nn.Module:
    """Put ``new`` at ``path`` of ``model`` (a dotted module path) and return the module it replaces."""
    parent_path, _, attribute = path.rpartition(".")
    parent = model.get_submodule(parent_path) if parent_path else model
    old = getattr(parent, attribute)
    setattr(parent, attribute, new)
    return old
