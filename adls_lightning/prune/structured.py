"""Structured pruning: whole attention heads and FFN neurons physically removed, so the model gets smaller and faster.

Unlike the masks of :mod:`~adls_lightning.prune.pruner` (dense tensors with zeros, no faster on CPU), every pruned
linear is rebuilt smaller: for each removed head the ``head_dim`` output rows of query, key and value and the
``head_dim`` input columns of the attention output projection go, for each removed FFN neuron its row of the
intermediate linear (and bias entry) and its column of the FFN output linear. The layers stay ``nn.Linear`` (new,
smaller ``nn.Parameter`` objects) and the attention module's head count is updated; Hugging Face's attention reshapes
with ``-1`` heads, so nothing else changes. The pruned model computes exactly what the dense model computes with
those heads' context outputs and those neurons' activations zeroed (tests/test_prune_structured.py checks it).

**What is removed** (:class:`StructuredPruner`): in every encoder layer ``round_half_up(heads · n_heads)`` heads and
``round_half_up(neurons · n_ffn)`` neurons, exactly, ranked by importance (lowest first), ties broken by position
(the lower index goes first). Importance ``l1``: the L1 norm of what a unit owns (a head: its query, key and value
rows and its output-projection columns; a neuron: its intermediate row and its output column), read from the
effective weight (base + LoRA's ``B @ A · scaling`` when adapters are unmerged); ``random``: seeded uniform noise.
``gradient``: the loss-gradient importance of Michel et al. (2019), ``Σ_batches |∂L/∂ξ|`` of a gate ``ξ = 1`` on
each head's context output (and on each neuron's activation), from calibration batches (:func:`gradient_scores`).

**LoRA**: an unmerged PEFT LoRA layer is sliced consistently: an output-sliced layer loses the same rows of its
base weight, bias and every adapter's ``lora_B``, an input-sliced one the same columns of its base weight and every
``lora_A``; the adapters keep their rank.

**Reloading**: the kept sizes are read back from a state's shapes (:func:`fit_structure_to_state`: a checkpoint
holds the sliced tensors, so only their sizes matter for loading), and are recorded in the Hugging Face config as
``structured_pruning`` (kept heads and FFN neurons per layer: the config's ``num_attention_heads`` /
``intermediate_size`` stay those of the dense model, as a BERT config cannot express heads narrower than
``hidden_size``); :func:`load_pretrained_structured` rebuilds such a ``save_pretrained`` folder
(``from_pretrained`` alone refuses it with size mismatches).

Families: BERT, RoBERTa, ELECTRA (``encoder.layer``: ``attention.self.{query,key,value}``,
``attention.output.dense``, ``intermediate.dense``, ``output.dense``) and DistilBERT (``transformer.layer``:
``attention.{q,k,v,out}_lin``, ``ffn.lin1``, ``ffn.lin2``); others are refused in one line.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypedDict

import torch
from torch import nn

from adls_lightning.errors import ConfigError
from adls_lightning.layers import _network_prefix, _wrapped_child, canonical_name, target_layers
from adls_lightning.prune.masks import is_weight_pruned, num_to_prune

STRUCTURED_METHODS = ("l1", "random", "gradient")
#: the Hugging Face config attribute holding the kept sizes per layer
CONFIG_ATTRIBUTE = "structured_pruning"


@dataclass(frozen=True)
class FamilyLayout:
    """Where a family keeps its heads and FFN: paths below the base model (``layers``) and below each layer."""

    layers: str
    attention: str  # the module holding the head count
    heads_attr: str  # its head-count attribute (and the config's, for the dense count)
    ffn_config: str  # the config's FFN width attribute
    query: str
    key: str
    value: str
    attn_out: str
    ffn_in: str
    ffn_out: str


_BERT = FamilyLayout(
    "encoder.layer",
    "attention.self",
    "num_attention_heads",
    "intermediate_size",
    "attention.self.query",
    "attention.self.key",
    "attention.self.value",
    "attention.output.dense",
    "intermediate.dense",
    "output.dense",
)
LAYOUTS: dict[str, FamilyLayout] = {
    "bert": _BERT,
    "roberta": _BERT,
    "electra": _BERT,
    "distilbert": FamilyLayout(
        "transformer.layer",
        "attention",
        "n_heads",
        "hidden_dim",
        "attention.q_lin",
        "attention.k_lin",
        "attention.v_lin",
        "attention.out_lin",
        "ffn.lin1",
        "ffn.lin2",
    ),
}
#: the roles that lose output rows; the others (attention output, FFN output) lose input columns
_OUTPUT_SLICED = ("query", "key", "value", "ffn_in")


@dataclass
class Block:
    """One encoder layer: its attention module and its six linears, each as ``(outer module, nn.Linear)``."""

    index: int
    attention: nn.Module
    heads_attr: str
    head_size: int
    linears: dict[str, tuple[nn.Module, nn.Linear]]

    @property
    def heads(self) -> int:
        return self.linears["query"][1].out_features // self.head_size

    @property
    def neurons(self) -> int:
        return self.linears["ffn_in"][1].out_features


def hf_model(model: nn.Module) -> nn.Module:
    """The Hugging Face model inside ``model`` (a LightningModule, a PEFT model or the model itself)."""
    from transformers import PreTrainedModel

    for module in model.modules():
        if isinstance(module, PreTrainedModel):
            return module
    raise ConfigError(f"prune.structured: {type(model).__name__} holds no Hugging Face model")


def _layout(model: nn.Module) -> tuple[nn.Module, FamilyLayout]:
    hf = hf_model(model)
    family = getattr(hf.config, "model_type", None)
    if family not in LAYOUTS:
        raise ConfigError(
            f"prune.structured: model type {family!r} is not supported; valid: {', '.join(sorted(LAYOUTS))}"
        )
    return hf, LAYOUTS[family]


def _chain_end(module: nn.Module) -> nn.Linear:
    """The ``nn.Linear`` a (possibly wrapped) layer multiplies with; refuses what cannot be sliced."""
    outer = module
    while (child := _wrapped_child(module)) is not None:
        # a quantized layer (QuantLinear) is read through (sizes, scores); _slice refuses to cut it
        if (not _is_lora(module) and getattr(type(module), "wrapped_child", None) is None) or getattr(
            module, "merged", False
        ):
            raise ConfigError(
                f"prune.structured: {type(module).__name__} layers (quantized or merged in place) cannot be "
                "sliced; prune before quantizing (no quant= with prune.structured)"
            )
        if len(getattr(module, "lora_magnitude_vector", {}) or {}):
            raise ConfigError(
                "prune.structured: DoRA adapters cannot be sliced; use plain LoRA or merge first"
            )
        module = getattr(module, child)
    if not isinstance(module, nn.Linear):
        raise ConfigError(f"prune.structured: {type(outer).__name__} is not a linear layer")
    if is_weight_pruned(module):
        raise ConfigError(
            "prune.structured: the layers carry weight masks; structured pruning removes rows instead, so "
            "set prune.weight=null"
        )
    return module


def _is_lora(module: nn.Module) -> bool:
    return hasattr(module, "lora_A") and hasattr(module, "lora_B")


def blocks(model: nn.Module) -> list[Block]:
    """The encoder layers of ``model`` (any wrapper), in order."""
    hf, layout = _layout(model)
    found = []
    for index, layer in enumerate(hf.base_model.get_submodule(layout.layers)):
        attention = layer.get_submodule(layout.attention)
        linears = {}
        for role in ("query", "key", "value", "attn_out", "ffn_in", "ffn_out"):
            outer = layer.get_submodule(getattr(layout, role))
            linears[role] = (outer, _chain_end(outer))
        found.append(Block(index, attention, layout.heads_attr, int(attention.attention_head_size), linears))
    return found


def effective_weight(outer: nn.Module, linear: nn.Linear) -> torch.Tensor:
    """The weight the layer computes with: the base weight plus each active LoRA adapter's ``B @ A · scaling``."""
    weight = linear.weight.detach()
    if _is_lora(outer):
        for adapter in outer.active_adapters:
            if adapter in outer.lora_A:
                delta = outer.lora_B[adapter].weight.detach() @ outer.lora_A[adapter].weight.detach()
                weight = weight + delta * outer.scaling[adapter]
    return weight


def head_scores(block: Block) -> torch.Tensor:
    """L1 norm per head of its query, key and value rows and its output-projection columns (float64, CPU)."""
    size = block.head_size
    total = torch.zeros(block.heads, dtype=torch.float64)
    for role in ("query", "key", "value"):
        rows = effective_weight(*block.linears[role]).abs().sum(dim=1).double().cpu()
        total += rows.view(-1, size).sum(dim=1)
    columns = effective_weight(*block.linears["attn_out"]).abs().sum(dim=0).double().cpu()
    return total + columns.view(-1, size).sum(dim=1)


def neuron_scores(block: Block) -> torch.Tensor:
    """L1 norm per FFN neuron of its intermediate row and its output column (float64, CPU)."""
    rows = effective_weight(*block.linears["ffn_in"]).abs().sum(dim=1).double().cpu()
    return rows + effective_weight(*block.linears["ffn_out"]).abs().sum(dim=0).double().cpu()


def gradient_scores(
    model: nn.Module, batches: Iterable[Any], loss: Callable[[Any], torch.Tensor], count: int
) -> tuple[list[torch.Tensor], list[torch.Tensor], int]:
    """Michel et al. (2019) importance per head and per FFN neuron of every layer: gates ``ξ = 1`` multiply each
    head's context output (the attention output projection's input columns of the head) and each neuron's
    activation (the FFN output linear's input), and the importance is ``Σ_batches |∂L/∂ξ|`` over ``count`` of
    ``batches`` (``loss(batch)`` the task loss of ``model``), in eval mode (no dropout). Only the gates get
    gradients (``torch.autograd.grad``): no parameter's ``.grad`` changes.

    Returns:
        Head scores and neuron scores per layer (float64, CPU), and the number of batches read.
    """
    found = blocks(model)
    gates, handles = [], []
    for block in found:
        device = block.linears["query"][1].weight.device
        pair = (
            torch.ones(block.heads, device=device, requires_grad=True),
            torch.ones(block.neurons, device=device, requires_grad=True),
        )
        gates.append(pair)
        size = block.head_size

        def head_gate(module, args, gate=pair[0], size=size):
            return (args[0] * gate.repeat_interleave(size).to(args[0].dtype),)

        def neuron_gate(module, args, gate=pair[1]):
            return (args[0] * gate.to(args[0].dtype),)

        handles.append(block.linears["attn_out"][0].register_forward_pre_hook(head_gate))
        handles.append(block.linears["ffn_out"][0].register_forward_pre_hook(neuron_gate))
    heads = [torch.zeros(b.heads, dtype=torch.float64) for b in found]
    neurons = [torch.zeros(b.neurons, dtype=torch.float64) for b in found]
    training = model.training
    model.eval()
    run = 0
    try:
        with torch.inference_mode(False), torch.enable_grad():
            for batch in itertools.islice(batches, count):
                flat = [gate for pair in gates for gate in pair]
                grads = torch.autograd.grad(loss(batch), flat)
                for index in range(len(found)):
                    heads[index] += grads[2 * index].detach().abs().double().cpu()
                    neurons[index] += grads[2 * index + 1].detach().abs().double().cpu()
                run += 1
    finally:
        for handle in handles:
            handle.remove()
        model.train(training)
    return heads, neurons, run


def lowest(scores: torch.Tensor, count: int) -> torch.Tensor:
    """Indices kept when the ``count`` lowest scores go (ties: the lower index goes first), ascending."""
    order = torch.sort(scores, stable=True).indices
    return torch.sort(order[count:]).values


def _new_param(param: torch.Tensor, index: torch.Tensor, dim: int) -> nn.Parameter:
    sliced = param.detach().index_select(dim, index.to(param.device)).clone()
    return nn.Parameter(sliced, requires_grad=param.requires_grad)


def _slice(outer: nn.Module, linear: nn.Linear, index: torch.Tensor, dim: int) -> None:
    """Keeps output rows (``dim`` 0) or input columns (``dim`` 1) ``index`` of a linear and of its LoRA adapters."""
    if outer is not linear and not _is_lora(outer):
        raise ConfigError(
            f"prune.structured: {type(outer).__name__} layers (quantized) cannot be sliced; prune before quantizing"
        )
    linear.weight = _new_param(linear.weight, index, dim)
    if dim == 0:
        if linear.bias is not None:
            linear.bias = _new_param(linear.bias, index, 0)
        linear.out_features = len(index)
    else:
        linear.in_features = len(index)
    if not _is_lora(outer):
        return
    adapters = outer.lora_B if dim == 0 else outer.lora_A
    for adapter in adapters.values():
        _slice(adapter, adapter, index, dim)  # B's rows / A's columns; an adapter is a plain nn.Linear
    setattr(outer, "out_features" if dim == 0 else "in_features", len(index))


@torch.no_grad()
def shrink(block: Block, heads: torch.Tensor, neurons: torch.Tensor) -> None:
    """Keeps heads ``heads`` and FFN neurons ``neurons`` (ascending indices) of ``block``; the rest is removed."""
    size = block.head_size
    rows = (heads.view(-1, 1) * size + torch.arange(size)).flatten()
    for role in ("query", "key", "value"):
        _slice(*block.linears[role], rows, 0)
    _slice(*block.linears["attn_out"], rows, 1)
    setattr(block.attention, block.heads_attr, len(heads))
    if hasattr(block.attention, "all_head_size"):
        block.attention.all_head_size = len(heads) * size
    _slice(*block.linears["ffn_in"], neurons, 0)
    _slice(*block.linears["ffn_out"], neurons, 1)


def record_sizes(model: nn.Module) -> dict[str, list[int]]:
    """Writes the kept heads and FFN neurons per layer into the HF config (``structured_pruning``); returns them."""
    found = blocks(model)
    sizes = {"heads": [b.heads for b in found], "intermediate": [b.neurons for b in found]}
    setattr(hf_model(model).config, CONFIG_ATTRIBUTE, sizes)
    return sizes


def apply_sizes(model: nn.Module, sizes: Mapping[str, list[int]]) -> None:
    """Shrinks every layer to the given kept counts (the first ones: for a model whose weights load next)."""
    for block in blocks(model):
        heads, neurons = int(sizes["heads"][block.index]), int(sizes["intermediate"][block.index])
        if (heads, neurons) != (block.heads, block.neurons):
            shrink(block, torch.arange(heads), torch.arange(neurons))
    record_sizes(model)


def fit_structure_to_state(model: nn.Module, state_dict: Mapping[str, Any], prefix: str = "") -> bool:
    """Shrinks ``model``'s layers to the sizes a structurally pruned ``state_dict`` (about to be loaded into it at
    ``prefix``) holds; True when anything changed. The sizes are read from the query and intermediate weights
    (by canonical layer name, so merged-LoRA, LoRA and plain layouts all match); the values are the state's to
    fill. A model of an unsupported family, or a state that matches, is left as it is."""
    try:
        found = blocks(model)
    except ConfigError:
        return False
    network = prefix + _network_prefix(model)
    rows = {}
    for key, value in state_dict.items():
        if key.startswith(prefix) and key.endswith(".weight") and isinstance(value, torch.Tensor):
            rows[canonical_name(key.removesuffix(".weight"), network)] = value.shape[0]
    names = {id(layer.linear): layer.name for layer in target_layers(model)}
    changed = False
    for block in found:
        query = rows.get(names.get(id(block.linears["query"][1]), ""))
        ffn = rows.get(names.get(id(block.linears["ffn_in"][1]), ""))
        heads = block.heads if query is None or query % block.head_size else query // block.head_size
        neurons = block.neurons if ffn is None else ffn
        if (
            (heads, neurons) != (block.heads, block.neurons)
            and heads <= block.heads
            and neurons <= block.neurons
        ):
            shrink(block, torch.arange(heads), torch.arange(neurons))
            changed = True
    if changed:
        record_sizes(model)
    return changed


def dense_numel(model: nn.Module) -> dict[str, int]:
    """Canonical layer name → weight entries the layer had before structured pruning (from the config's dense
    head count and FFN width), for the six linears of every layer."""
    hf, layout = _layout(model)
    dense_heads = int(getattr(hf.config, layout.heads_attr))
    dense_ffn = int(getattr(hf.config, layout.ffn_config))
    names = {id(layer.linear): layer.name for layer in target_layers(model)}
    counts = {}
    for block in blocks(model):
        removed_heads = (dense_heads - block.heads) * block.head_size
        removed_ffn = dense_ffn - block.neurons
        for role, (_, linear) in block.linears.items():
            removed = removed_heads if role in ("query", "key", "value", "attn_out") else removed_ffn
            other = linear.in_features if role in _OUTPUT_SLICED else linear.out_features
            counts[names[id(linear)]] = linear.weight.numel() + removed * other
    return counts


def layer_sparsity(model: nn.Module, layers: Mapping[str, nn.Linear]) -> dict[str, float]:
    """Layer name → fraction of the dense layer's weights that are removed or zero (``layers``: name → linear)."""
    dense = dense_numel(model)
    out = {}
    with torch.no_grad():
        for name, linear in layers.items():
            total = dense.get(name, linear.weight.numel())
            out[name] = (int((linear.weight == 0).sum()) + total - linear.weight.numel()) / total
    return out


def weight_sparsity(model: nn.Module, layers: Mapping[str, nn.Linear]) -> float:
    """Fraction of the dense weights of ``layers`` (name → linear) that are removed or zero: what
    ``prune/weight_sparsity`` means for structured pruning (a removed weight counts as a zero that is not stored)."""
    dense = dense_numel(model)
    zeros = total = 0
    with torch.no_grad():
        for name, linear in layers.items():
            numel = dense.get(name, linear.weight.numel())
            zeros += int((linear.weight == 0).sum()) + numel - linear.weight.numel()
            total += numel
    return zeros / total if total else 0.0


class StructuredSettings(TypedDict, total=False):
    """``prune.structured`` as a config gives it (:class:`StructuredPruner`'s arguments)."""

    heads: float
    neurons: float
    method: str


class StructuredPruner:
    """Removes a fraction of the attention heads and of the FFN neurons of every encoder layer.

    Args:
        heads: Fraction of each layer's heads removed, in ``[0, 1)``; at least one head must stay.
        neurons: Fraction of each layer's FFN neurons removed, in ``[0, 1)``; at least one must stay.
        method: ``l1`` (importance: L1 norm of what a unit owns), ``random`` (seeded) or ``gradient`` (Michel et al.
            2019, from calibration batches given to :meth:`prune`).
        seed: Seed of ``random``.
        key: Config key for error messages.

    Raises:
        ConfigError: On a value out of range, at construction; a fraction that would remove every head or neuron
            of a layer, at :meth:`prune`.
    """

    def __init__(
        self,
        heads: float = 0.0,
        neurons: float = 0.0,
        method: str = "l1",
        seed: int = 0,
        key: str = "prune.structured",
    ) -> None:
        for name, value in (("heads", heads), ("neurons", neurons)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
                raise ConfigError(
                    f"{key}.{name}={value!r}: must be a fraction in [0, 1) of each layer's {name} to remove"
                )
        if method not in STRUCTURED_METHODS:
            raise ConfigError(f"{key}.method={method!r}: must be one of {', '.join(STRUCTURED_METHODS)}")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ConfigError(f"{key}.seed={seed!r}: must be an integer")
        self.heads, self.neurons, self.method, self.seed, self.key = (
            float(heads),
            float(neurons),
            method,
            seed,
            key,
        )

    def _count(self, name: str, fraction: float, total: int, layer: int) -> int:
        count = num_to_prune(total, fraction)
        if count >= total:
            bound = 1 - 0.5 / total
            raise ConfigError(
                f"{self.key}.{name}={fraction}: removes all {total} {name} of layer {layer}; valid: a fraction in "
                f"[0, {bound:.4g}) (at least one stays)"
            )
        return count

    @property
    def needs_calibration(self) -> bool:
        """True when the importance is read from calibration batches (``gradient``)."""
        return self.method == "gradient"

    def prune(
        self,
        model: nn.Module,
        batches: Iterable[Any] | None = None,
        loss: Callable[[Any], torch.Tensor] | None = None,
        count: int = 0,
    ) -> dict[str, list[list[int]]]:
        """Removes the least important heads and neurons of every layer, in place.

        ``batches``, ``loss`` and ``count``: what ``gradient`` reads (:func:`gradient_scores`); unused otherwise.

        Returns:
            ``{"heads": [...], "neurons": [...]}``: per layer, the indices kept (of the layer as it was).
        """
        found = blocks(model)
        for block in found:  # every count checked before any layer changes
            self._count("heads", self.heads, block.heads, block.index)
            self._count("neurons", self.neurons, block.neurons, block.index)
        if self.needs_calibration:
            if batches is None or loss is None or count < 1:
                raise ConfigError(
                    f"{self.key}.method=gradient: scores heads and neurons from calibration batches; give "
                    "prune.calibration.batches=N (N >= 1)"
                )
            gradient = gradient_scores(model, batches, loss, count)
            if gradient[2] == 0:
                raise ConfigError(f"{self.key}.method=gradient: the calibration data held no batch")
        with torch.no_grad():
            return self._prune(model, found, gradient if self.needs_calibration else None)

    def _prune(
        self, model: nn.Module, found: list[Block], gradient: tuple[list, list, int] | None
    ) -> dict[str, list[list[int]]]:
        generator = torch.Generator().manual_seed(self.seed)
        kept: dict[str, list[list[int]]] = {"heads": [], "neurons": []}
        for block in found:
            if gradient is not None:
                heads, neurons = gradient[0][block.index], gradient[1][block.index]
            elif self.method == "l1":
                heads, neurons = head_scores(block), neuron_scores(block)
            else:
                heads = torch.rand(block.heads, generator=generator, dtype=torch.float64)
                neurons = torch.rand(block.neurons, generator=generator, dtype=torch.float64)
            keep_heads = lowest(heads, self._count("heads", self.heads, block.heads, block.index))
            keep_neurons = lowest(neurons, self._count("neurons", self.neurons, block.neurons, block.index))
            shrink(block, keep_heads, keep_neurons)
            kept["heads"].append(keep_heads.tolist())
            kept["neurons"].append(keep_neurons.tolist())
        record_sizes(model)
        return kept


def load_pretrained_structured(folder: str | Path, **kwargs: Any) -> nn.Module:
    """A sequence classifier from a ``save_pretrained`` folder, rebuilt at the kept sizes its config records
    (``structured_pruning``); a folder without them loads with plain ``from_pretrained``."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForSequenceClassification

    config = AutoConfig.from_pretrained(folder)
    sizes = getattr(config, CONFIG_ATTRIBUTE, None)
    if not sizes:
        return AutoModelForSequenceClassification.from_pretrained(folder, **kwargs)
    model = AutoModelForSequenceClassification.from_config(config, **kwargs)
    apply_sizes(model, sizes)
    model.load_state_dict(load_file(str(Path(folder) / "model.safetensors")), strict=True)
    return model.eval()
