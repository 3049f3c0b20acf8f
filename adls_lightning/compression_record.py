"""One typed, versioned record of what a run compressed, written into its checkpoints.

Each compression callback (quantization, pruning, ``compress=``, MXINT8 packing) writes its part of a
:class:`CompressionRecord` into every checkpoint it saves, under :data:`CHECKPOINT_KEY`, through Lightning's
``on_save_checkpoint`` (:func:`merge_into`). Whoever reads the checkpoint later (the export, ``evaluate``) rebuilds
the model the run evaluated from the record and the state alone (:func:`rebuild_quantization`), without the run's
config or the callbacks' classes.

Post-training quantization (PTQ, GPTQ, SmoothQuant, calibration) and an evaluation-only (``train=false``) pruning
run compress at evaluation, after any fit's checkpoints were written: the run then saves the evaluated model with its
record as :data:`COMPRESSED_CHECKPOINT` beside them (once, whichever callbacks compressed it), the checkpoint such a
run exports from.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from adls_lightning.errors import ConfigError

#: the checkpoint key holding the record (a plain dict: :meth:`CompressionRecord.to_dict`)
CHECKPOINT_KEY = "adls_compression"
RECORD_VERSION = 1
#: the evaluated model of a post-training-quantized or evaluation-only pruned run, saved after its test
COMPRESSED_CHECKPOINT = "compressed.ckpt"
OPERANDS = ("data_in", "weight", "bias", "data_out")


@dataclass
class QuantizationRecord:
    """The quantization a run applied, as plain data.

    ``layers``: canonical layer name → ``{operand: {format, params} | None}`` for every quantized linear layer;
    ``applied``: the checkpoint's model holds the quantized layers (false in a PTQ run's fit checkpoints, written
    before the evaluation quantized them); ``smoothed``: the layers whose input and weight quantizers SmoothQuant
    wrapped (their factors are model state); ``gptq``: GPTQ chose the weights (in the state); ``lsq``: learned
    steps (in the state); ``calibrated``: static activation ranges observed on training batches (in the state).
    """

    layers: dict[str, dict[str, dict[str, Any] | None]] = field(default_factory=dict)
    mode: str = "qat"
    applied: bool = True
    smoothquant: dict[str, Any] | None = None
    smoothed: list[str] = field(default_factory=list)
    gptq: bool = False
    lsq: bool = False
    calibrated: bool = False

    def recipe(self):
        """The recipe that quantizes exactly the recorded layers the recorded way."""
        from adls_lightning.quant import QuantRecipe

        return QuantRecipe(layers=dict(self.layers), key=CHECKPOINT_KEY)

    @property
    def needs_data(self) -> bool:
        """Its evaluated model depends on training batches (GPTQ, SmoothQuant, calibration)."""
        return self.gptq or bool(self.smoothquant) or self.calibrated


@dataclass
class PruningRecord:
    """The pruning a run applied: the weight and activation specs (``{sparsity, method, ...}``), which layers
    (``include``/``exclude``), the seed, and for structured pruning the kept sizes per encoder layer
    (``{"heads": [...], "intermediate": [...]}``). Weight masks are model state."""

    weight: dict[str, Any] | None = None
    activation: dict[str, Any] | None = None
    include: list[str] | None = None
    exclude: list[str] | None = None
    seed: int = 0
    structured: dict[str, list[int]] | None = None

    def activation_spec(self) -> dict[str, Any] | None:
        """What acts on activations, as :class:`~adls_lightning.prune.Pruner` takes it (None: nothing)."""
        if not self.activation:
            return None
        return {
            "activation": dict(self.activation),
            "include": self.include,
            "exclude": self.exclude,
            "seed": self.seed,
        }


@dataclass
class PackingRecord:
    """An evaluation through packed layers (``quant=mxint8_packed``): the format and its settings."""

    format: str = "mxint8"
    group_size: int = 32
    exclude: list[str] = field(default_factory=list)


@dataclass
class CompressionRecord:
    """What a run compressed: quantization, pruning and packing, each None when the run did not."""

    quantization: QuantizationRecord | None = None
    pruning: PruningRecord | None = None
    packing: PackingRecord | None = None
    version: int = RECORD_VERSION

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = CHECKPOINT_KEY) -> CompressionRecord:
        """The record of ``data``; a version this project does not read, or a damaged record, is one line."""
        if not isinstance(data, Mapping):
            raise ConfigError(f"{where}: damaged compression record (not a mapping)")
        version = data.get("version")
        if version != RECORD_VERSION:
            raise ConfigError(
                f"{where}: compression record version {version!r}; this project reads {RECORD_VERSION}"
            )
        parts = {"quantization": QuantizationRecord, "pruning": PruningRecord, "packing": PackingRecord}
        try:
            values = {
                name: None if data.get(name) is None else kind(**data[name]) for name, kind in parts.items()
            }
        except TypeError as error:
            raise ConfigError(f"{where}: damaged compression record ({error})") from None
        return cls(**values)

    @classmethod
    def from_checkpoint(cls, checkpoint: Mapping[str, Any], where: str) -> CompressionRecord | None:
        """The record a checkpoint holds, or None for one written without (before records, or uncompressed)."""
        data = checkpoint.get(CHECKPOINT_KEY)
        return None if data is None else cls.from_dict(data, f"{where}: {CHECKPOINT_KEY}")


def merge_into(checkpoint: dict[str, Any], **parts: Any) -> None:
    """Set the given parts (``quantization=QuantizationRecord(...)``...) of the checkpoint's record, keeping the
    parts other callbacks wrote."""
    current = checkpoint.get(CHECKPOINT_KEY)
    record = CompressionRecord() if current is None else CompressionRecord.from_dict(current)
    for name, part in parts.items():
        if not hasattr(record, name) or name == "version":
            raise ValueError(f"{name}: not a part of a compression record")
        setattr(record, name, part)
    checkpoint[CHECKPOINT_KEY] = record.to_dict()


def _operand(recipe: Any) -> dict[str, Any] | None:
    return None if recipe is None else {"format": recipe.format, "params": dict(recipe.params)}


def quantization_record(
    model: nn.Module,
    recipe: Any,
    mode: str,
    smoothquant: Mapping[str, Any] | None = None,
    gptq: bool = False,
    calibrated: bool = False,
) -> QuantizationRecord:
    """The record of ``recipe`` applied to ``model`` (the network the callback quantizes): the layers it
    quantized (all those the recipe gives a format, when the model is not quantized yet), SmoothQuant's wrapped
    layers, LSQ."""
    from adls_lightning.quant.linear import QuantLinear
    from adls_lightning.quant.points import find_points
    from adls_lightning.quant.smoothquant import Smoothed
    from adls_lightning.quant.transform import find_linear_layers

    layers = find_linear_layers(model)
    quantized = {layer.name: layer.module for layer in layers if isinstance(layer.module, QuantLinear)}
    # per-name entries may name encoder points (quant/points.py) as well as linear layers
    recipes = recipe.for_layers([layer.name for layer in layers], [p.name for p in find_points(model)])
    names = list(quantized) if quantized else [name for name, entry in recipes.items() if entry is not None]
    entries = {}
    for name in names:
        entry = recipes.get(name)
        if entry is not None:
            entries[name] = {op: _operand(getattr(entry, op)) for op in OPERANDS}
    lsq = any(
        getattr(getattr(module, f"{op}_quantizer", None), "lsq", False)
        for module in quantized.values()
        for op in OPERANDS
    ) or any(
        (operand or {}).get("params", {}).get("lsq", False)
        for entry in entries.values()
        for operand in entry.values()
    )
    smoothed = sorted(
        name for name, module in quantized.items() if isinstance(module.data_in_quantizer, Smoothed)
    )
    return QuantizationRecord(
        layers=entries,
        mode=mode,
        applied=bool(quantized),
        smoothquant=dict(smoothquant) if smoothquant else None,
        smoothed=smoothed,
        gptq=gptq,
        lsq=lsq,
        calibrated=calibrated,
    )


def rebuild_quantization(model: nn.Module, record: QuantizationRecord) -> list[str]:
    """Quantize ``model`` (a network with plain linear layers) exactly as recorded, with SmoothQuant's wrappers
    on the recorded layers, so that the checkpoint's state loads into it strictly; returns the layers quantized."""
    import torch

    from adls_lightning.quant import quantize_model
    from adls_lightning.quant.smoothquant import Smoothed
    from adls_lightning.quant.transform import find_linear_layers

    names = quantize_model(model, record.recipe())
    layers = {layer.name: layer.module for layer in find_linear_layers(model)}
    for name in record.smoothed:
        layer = layers.get(name)
        if layer is None:
            raise ConfigError(
                f"{CHECKPOINT_KEY}.quantization.smoothed: {name} is not a linear layer of this model"
            )
        # the factors are model state: ones here, the checkpoint's values when it loads
        ones = torch.ones(layer.in_features, device=layer.linear.weight.device)
        layer.data_in_quantizer = Smoothed(layer.data_in_quantizer, ones, weight=False)
        layer.weight_quantizer = Smoothed(layer.weight_quantizer, ones, weight=True)
    return names


def structured_sizes(model: nn.Module) -> dict[str, list[int]] | None:
    """The kept heads and FFN neurons per encoder layer of a structurally pruned model (None: not pruned so)."""
    from adls_lightning.prune.structured import CONFIG_ATTRIBUTE, hf_model

    try:
        sizes = getattr(hf_model(model).config, CONFIG_ATTRIBUTE, None)
    except ConfigError:
        return None
    return None if not sizes else {key: [int(v) for v in values] for key, values in dict(sizes).items()}


def pruning_record(pruner: Any, structured: Mapping[str, list[int]] | None = None) -> PruningRecord:
    """The record of a :class:`~adls_lightning.prune.Pruner` (and structured sizes, when the run pruned so)."""

    def spec(part: Any) -> dict[str, Any] | None:
        return None if part is None else {k: v for k, v in dataclasses.asdict(part).items() if k != "key"}

    return PruningRecord(
        weight=spec(pruner.weight),
        activation=spec(pruner.activation),
        include=pruner.include,
        exclude=pruner.exclude,
        seed=int(pruner.seed),
        structured=dict(structured) if structured else None,
    )
