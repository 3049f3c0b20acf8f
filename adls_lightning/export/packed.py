"""The ``format=mxint8`` folder: a Hugging Face model with its linear layers (LoRA merged first, the classifier
excluded) packed as :class:`~adls_lightning.mxint8.QLinearPacked`, optionally its word embeddings as
:class:`~adls_lightning.mxint8.QEmbeddingPacked`. ``model.safetensors`` holds the state dict as is (int8 mantissas,
uint8 scales, float tensors for what stays float); ``mxint8_config.json`` holds the Hugging Face config and which
modules are packed with which group size. :func:`load_packed` rebuilds the model from the folder alone
(``from_config``, no network, no checkpoint) and loads the tensors strictly. The names are re-exported by
:mod:`adls_lightning.export`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoConfig, AutoModelForSequenceClassification, PreTrainedModel

from adls_lightning.export.folder import CONFIG_FILE, WEIGHTS_FILE
from adls_lightning.mxint8 import QEmbeddingPacked, QLinearPacked, pack_linear_layers

EXPORT_FORMATS = ("mxint8", "hf")
FORMAT_VERSION = 1


@dataclass
class PackedExport:
    """What :func:`pack_for_export` packed (written to ``mxint8_config.json``)."""

    group_size: int
    linear: list[str] = field(default_factory=list)
    embeddings: list[str] = field(default_factory=list)


def word_embedding_names(model: PreTrainedModel) -> list[str]:
    """Module names of the model's input (word) embedding table."""
    table = model.get_input_embeddings()
    return [name for name, module in model.named_modules() if module is table]


def _replace(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, attribute = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, attribute, module)


@torch.no_grad()
def pack_for_export(
    model: PreTrainedModel,
    group_size: int = 32,
    exclude: Sequence[str] = ("classifier",),
    pack_embeddings: bool = False,
) -> PackedExport:
    """Pack ``model``'s linear layers (and with ``pack_embeddings`` its word embeddings), in place."""
    packed = PackedExport(group_size)
    swaps = pack_linear_layers(model, group_size, exclude)
    paths = {id(module): name for name, module in model.named_modules()}
    packed.linear = [paths[id(swap.packed)] for swap in swaps]  # module paths, which load_packed swaps back
    if pack_embeddings:
        for name in word_embedding_names(model):
            _replace(model, name, QEmbeddingPacked.from_embedding(model.get_submodule(name), group_size))
            packed.embeddings.append(name)
    return packed


def save_packed(model: PreTrainedModel, packed: PackedExport, out: Path) -> None:
    """Write a model packed by :func:`pack_for_export` to ``out`` (safetensors + JSON config)."""
    out.mkdir(parents=True, exist_ok=True)
    state = {key: value.detach().contiguous() for key, value in model.state_dict().items()}
    save_file(state, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    config = {
        "format": "mxint8",
        "format_version": FORMAT_VERSION,
        "group_size": packed.group_size,
        "packed_linear": packed.linear,
        "packed_embeddings": packed.embeddings,
        "architecture": type(model).__name__,
        "hf_config": model.config.to_dict(),
    }
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=1) + "\n")


def load_packed(directory: str | Path) -> PreTrainedModel:
    """Rebuild the packed model written by ``format=mxint8`` from ``directory`` alone (eval mode, CPU).

    Raises:
        FileNotFoundError: ``directory`` lacks ``mxint8_config.json`` or ``model.safetensors``.
    """
    directory = Path(directory)
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        if not (directory / name).is_file():
            raise FileNotFoundError(f"{directory / name}: missing; not a folder written by format=mxint8")
    config = json.loads((directory / CONFIG_FILE).read_text())
    hf_config = dict(config["hf_config"])
    hf_config = AutoConfig.for_model(hf_config.pop("model_type"), **hf_config)
    model = AutoModelForSequenceClassification.from_config(hf_config)
    group_size = config["group_size"]
    for name in config["packed_linear"]:
        linear = model.get_submodule(name)
        _replace(
            model,
            name,
            QLinearPacked(linear.in_features, linear.out_features, linear.bias is not None, group_size),
        )
    for name in config["packed_embeddings"]:
        table = model.get_submodule(name)
        _replace(model, name, QEmbeddingPacked(table.num_embeddings, table.embedding_dim, group_size))
    model.load_state_dict(load_file(str(directory / WEIGHTS_FILE)), strict=True)
    return model.eval()


def folder_bytes(directory: Path, names: Iterable[str] | None = None) -> int:
    """Bytes of the files in ``directory`` (only ``names`` when given)."""
    files = (
        [directory / n for n in names]
        if names is not None
        else [p for p in directory.iterdir() if p.is_file()]
    )
    return sum(p.stat().st_size for p in files)


__all__ = [
    "CONFIG_FILE",
    "EXPORT_FORMATS",
    "WEIGHTS_FILE",
    "PackedExport",
    "folder_bytes",
    "load_packed",
    "pack_for_export",
    "save_packed",
    "word_embedding_names",
]
