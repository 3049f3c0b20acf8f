"""``quantize_model``: swap a model's linear layers for :class:`QuantLinear` following a quantization recipe.

The recipe is a typed :class:`~adls_lightning.quant.recipe.QuantRecipe` (or a
:class:`~adls_lightning.quant.recipe.LayerRecipe` for every layer), or the labs' MASE-style dict / lab config
file, converted at the edge by :func:`adls_lightning.quant.mase.to_recipe` (vocabulary: ``docs/quantization.md``).

Layer names are the canonical names of :func:`adls_lightning.layers.target_layers`: for a PEFT model the
``base_model.model.`` prefix, ``.base_layer`` and ``.modules_to_save.<adapter>`` are dropped, so ``classifier``
and ``bert.encoder.layer.0.attention.self.query`` name the same layers with and without LoRA. LoRA adapters
(``lora_A``/``lora_B``) are never quantized; PEFT's ``base_layer`` is, and PEFT's unused ``original_module``
copies are skipped.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from torch import nn

from adls_lightning.errors import ConfigError
from adls_lightning.layers import SKIPPED_NAME_PARTS, UNUSED_COPY, FilterFn, swap_module, target_layers
from adls_lightning.quant.linear import QuantLinear, dtype_bits
from adls_lightning.quant.mase import to_recipe
from adls_lightning.quant.points import (
    FAMILY_KINDS,
    KERNELS,
    KIND_OPERANDS,
    Point,
    find_points,
    ibert_input_problem,
    model_family,
    point_dimension_problem,
    quantized_points,
    why_unsupported,
)
from adls_lightning.quant.points import install as install_point
from adls_lightning.quant.quantizers import Quantizer, QuantizerParamError
from adls_lightning.quant.recipe import OPERANDS, POINT_KEYS, LayerRecipe, QuantRecipe


@dataclass
class LinearLayer:
    """A quantizable linear layer of a model.

    Attributes:
        name: user-facing name (PEFT wrappers stripped).
        path: the module's full name in the model.
        module: the ``nn.Linear`` or an existing ``QuantLinear``.
    """

    name: str
    path: str
    module: nn.Module


def find_linear_layers(model: nn.Module, filter_fn: FilterFn | None = None) -> list[LinearLayer]:
    """The model's quantizable linear layers, in module order (LoRA adapters and PEFT's spare copies excluded).

    Listed by :func:`adls_lightning.layers.target_layers` (canonical names); the module of each is the existing
    ``QuantLinear`` or the ``nn.Linear`` a quantized layer would replace (inside a LoRA layer: its base layer).
    """
    out = []
    for layer in target_layers(model, filter_fn):
        path, module = next((p, m) for p, m in layer.chain if isinstance(m, (QuantLinear, nn.Linear)))
        out.append(LinearLayer(layer.name, path, module))
    return out


def quantize_model(model: nn.Module, config: Any, *, key: str = "config") -> list[str]:
    """Swap ``model``'s linear layers for :class:`QuantLinear` in place, following ``config``.

    Already-quantized layers get new quantizers (their wrapped linear is reused). Works on plain
    Hugging Face models and on PEFT LoRA models (see the module docstring for names).

    Args:
        model: the model to quantize in place.
        config: a :class:`QuantRecipe` / :class:`LayerRecipe`, or a MASE-style dict or lab config file (not
            modified).
        key: the config's path, used in error messages (``quant.config`` from the callback).

    Returns:
        The user-facing names of the layers that were quantized.

    Raises:
        ConfigError: bad config, a per-name key matching no layer, or a block size that does not
            divide a layer's dimension. The model is not modified when this is raised.
    """
    planned, points = _plan(model, to_recipe(config, key))
    for layer, quantizers in planned:
        linear = layer.module.linear if isinstance(layer.module, QuantLinear) else layer.module
        new = QuantLinear(
            linear, *(quantizers[operand] for operand in ("data_in", "weight", "bias", "data_out"))
        )
        new.to(device=linear.weight.device)
        swap_module(model, layer.path, new)
    for point, quantizers, kernel, second in points:
        install_point(model, point, quantizers, kernel, second)
    return [layer.name for layer, _ in planned]


def check_recipe_fits(model: nn.Module, config: Any, *, key: str = "config") -> None:
    """Everything :func:`quantize_model` checks against the model's layers (names, block and group sizes, learned
    state), without swapping a layer: for a callback that quantizes later (post-training quantization, GPTQ, a
    compression step after some epochs) to refuse before training and checkpoints, not after them.

    Raises:
        ConfigError: as :func:`quantize_model` would.
    """
    _plan(model, to_recipe(config, key))


def _plan(
    model: nn.Module, recipe: QuantRecipe
) -> tuple[list[tuple[LinearLayer, dict[str, Quantizer | None]]], list[PlannedPoint]]:
    """Each layer and point to quantize with its new quantizers, every check done; the model is not touched."""
    layers = find_linear_layers(model)
    points = find_points(model)
    recipes = recipe.for_layers([layer.name for layer in layers], [point.name for point in points])
    planned: list[tuple[LinearLayer, dict[str, Quantizer | None]]] = []
    for layer in layers:
        layer_recipe = recipes[layer.name]
        if layer_recipe is None:
            continue
        if layer_recipe.kernel != "float":
            raise ConfigError(
                f"{recipe.where(layer.name)}.kernel={layer_recipe.kernel!r}: linear layers compute in float "
                f"(layer {layer.name}); kernel ibert is for gelu, softmax and layer_norm points"
            )
        quantizers = layer_recipe.quantizers()
        where = recipe.where(layer.name)
        _check_dims(layer, quantizers, layer_recipe, where)
        _bind(layer, quantizers, layer_recipe, where)
        planned.append((layer, quantizers))
    return planned, _plan_points(model, recipe, points)


#: A point with its new quantizers, its kernel and (residual adds) the second summand's quantizer.
PlannedPoint = tuple[Point, dict[str, Quantizer | None], str, Quantizer | None]


def _plan_points(model: nn.Module, recipe: QuantRecipe, points: list[Point]) -> list[PlannedPoint]:
    """The encoder points ``recipe`` quantizes, checked: each kind entry must find points in this model's family,
    give only the kind's operands, and a kernel the kind has on a grid it can read."""
    family = model_family(model)
    for kind_key in POINT_KEYS:
        kind = "matmul" if kind_key == "bmm" else kind_key
        if getattr(recipe, kind_key) is not None and not any(p.kind == kind for p in points):
            raise ConfigError(f"{recipe.key}.{kind_key}: {why_unsupported(family, kind)}")
    planned: list[PlannedPoint] = []
    for point in points:
        point_recipe, where = recipe.for_point(point.name, point.kind)
        if point_recipe is None:
            continue
        if point.kind not in FAMILY_KINDS.get(point.family, ()):
            raise ConfigError(f"{where}: {why_unsupported(point.family, point.kind)}")
        allowed = KIND_OPERANDS[point.kind]
        extra = next((o for o in OPERANDS if getattr(point_recipe, o) is not None and o not in allowed), None)
        if extra is not None:
            raise ConfigError(
                f"{where}.{extra}: a {point.kind} point has no {extra} (point {point.name}; operands: "
                f"{', '.join(allowed)})"
            )
        if point_recipe.kernel not in ("float", *([] if point.kind not in KERNELS["ibert"] else ["ibert"])):
            raise ConfigError(
                f"{where}.kernel={point_recipe.kernel!r}: a {point.kind} point computes in float (kernel ibert: "
                f"{', '.join(KERNELS['ibert'])})"
            )
        quantizers = point_recipe.quantizers()
        _check_point_dims(point, quantizers, where)
        if point_recipe.kernel == "ibert":
            problem = ibert_input_problem(quantizers["data_in"])
            if problem:
                raise ConfigError(f"{where}.kernel=ibert: {problem} (point {point.name})")
        for operand, quantizer in quantizers.items():
            if quantizer is None:
                continue
            shape = None
            if operand in ("weight", "bias") and point.kind == "layer_norm":
                tensor = getattr(point.module, operand, None)
                shape = None if tensor is None else tuple(tensor.shape)
            try:
                quantizer.bind(shape)
            except QuantizerParamError as err:
                raise ConfigError(
                    f"{where}.{point_recipe.key_of(operand, err.param)}{err.detail} (point {point.name})"
                ) from None
        second = None
        if point.kind == "add" and point_recipe.data_in is not None:
            second = point_recipe.data_in.build()
            second.bind(None)
        planned.append((point, quantizers, point_recipe.kernel, second))
    return planned


def _check_point_dims(point: Point, quantizers: dict[str, Quantizer | None], where: str) -> None:
    """Block and group sizes against the dimensions a point's operands are blocked along that the model fixes."""
    found = point_dimension_problem(point, quantizers)
    if found:
        raise ConfigError(f"{where}.{found[0]}: {found[1]}")


def _key(recipe: LayerRecipe, where: str, operand: str, param: str) -> str:
    """The full config key of a parameter: where a MASE config wrote it, else under the recipe entry's key."""
    return recipe.origins.get(f"{operand}_{param}") or f"{where}.{recipe.key_of(operand, param)}"


def _check_dims(
    layer: LinearLayer, quantizers: dict[str, Quantizer | None], recipe: LayerRecipe, where: str
) -> None:
    found = dimension_problem(layer.module, quantizers)
    if found:
        operand, problem = found
        quantizer = quantizers[operand]
        # the parameter that blocks the dimension: a scaled integer's group_size, else the block formats' block_size
        param = "group_size" if getattr(quantizer, "granularity", None) == "group" else "block_size"
        dim = "in_features" if operand in ("data_in", "weight") else "out_features"
        size = getattr(layer.module, dim)
        valid = [str(d) for d in range(1, size + 1) if size % d == 0]
        raise ConfigError(
            f"{_key(recipe, where, operand, param)}={getattr(quantizer, param, '?')} {problem} in layer {layer.name} "
            f"({dim}={size}; valid: {', '.join(valid)})"
        )


def _bind(
    layer: LinearLayer, quantizers: dict[str, Quantizer | None], recipe: LayerRecipe, where: str
) -> None:
    """Tell each quantizer its operand's shape (learned steps are sized now, before any optimizer exists)."""
    linear = layer.module
    shapes = {"data_in": None, "weight": tuple(linear.weight.shape), "data_out": None}
    shapes["bias"] = None if linear.bias is None else tuple(linear.bias.shape)
    for operand, quantizer in quantizers.items():
        if quantizer is None or (operand == "bias" and linear.bias is None):
            continue
        try:
            quantizer.bind(shapes[operand])
        except QuantizerParamError as err:
            raise ConfigError(
                f"{_key(recipe, where, operand, err.param)}{err.detail} (layer {layer.name})"
            ) from None


def dimension_problem(
    linear: nn.Module, quantizers: Mapping[str, Quantizer | None]
) -> tuple[str, str] | None:
    """The first operand whose quantizer cannot tile the last dimension it is blocked along, and why.

    ``linear`` is an ``nn.Linear`` or a ``QuantLinear`` (its sizes read through); a bias quantizer of a layer
    without a bias is never used, so it is not checked.
    """
    sizes = {
        "data_in": linear.in_features,
        "weight": linear.in_features,
        "bias": linear.out_features if linear.bias is not None else None,
        "data_out": linear.out_features,
    }
    for operand, quantizer in quantizers.items():
        if quantizer is None or sizes[operand] is None:
            continue
        problem = quantizer.check_last_dim(sizes[operand])
        if problem:
            return operand, problem
    return None


def quantized_layers(model: nn.Module) -> list[QuantLinear]:
    """The model's QuantLinear layers."""
    return [layer.module for layer in find_linear_layers(model) if isinstance(layer.module, QuantLinear)]


def _slot_bits(module: nn.Module, slot: str) -> float:
    """Storage bits per element of a linear layer's ``slot`` (``weight``, ``bias``, ``data_in``): its quantizer's
    for a ``QuantLinear``, its dtype's width for an ``nn.Linear``."""
    return module.slot_bits(slot) if isinstance(module, QuantLinear) else dtype_bits(module)


def weight_storage(model: nn.Module) -> dict[str, float]:
    """What storing ``model`` as it is now takes: the storage every run records of its model.

    * ``quant/avg_weight_bits``: mean storage bits per linear-layer weight element, weighted by element count over
      all linear layers (LoRA adapters excluded). An ``nn.Linear`` counts its dtype's width (32 for float32), a
      ``QuantLinear`` its weight quantizer's (block formats with the shared exponent: mxint8 = 8.25), a packed
      MXINT8 layer (:class:`~adls_lightning.mxint8.QLinearPacked`) the bytes its packed tensors hold: int8
      mantissas and one uint8 exponent per group, 8 + 8/group_size bits (8.25 for groups of 32).
    * ``quant/weight_bytes``: bytes to store every parameter used in the forward pass: linear weights and biases at
      their quantized widths, packed weights (linear layers, embedding tables) at their packed tensors' bytes,
      everything else (embeddings, norms, LoRA adapters, a packed layer's bias) at its dtype's width. PEFT's unused
      ``original_module`` copies are not counted.
    """
    # imported here: the packed layers' module registers the MXINT8 ops and loads their kernels, which a report of
    # a model that has no packed layer needs not
    from adls_lightning.mxint8.packed_weight import packed_weight_bytes
    from adls_lightning.mxint8.qembedding import QEmbeddingPacked
    from adls_lightning.mxint8.qlinear import QLinearPacked

    weight_bits = weight_elems = stored_bytes = 0.0
    counted: set[int] = set()  # the parameters stored at the widths counted here, not their dtype's
    for layer in find_linear_layers(model):
        module = layer.module
        linear = module.linear if isinstance(module, QuantLinear) else module
        n_weight = linear.in_features * linear.out_features
        bits = _slot_bits(module, "weight")
        weight_bits += bits * n_weight
        weight_elems += n_weight
        stored_bytes += bits * n_weight / 8
        if linear.bias is not None:
            stored_bytes += _slot_bits(module, "bias") * linear.bias.numel() / 8
        counted.update(id(p) for p in linear.parameters())
    unused = SKIPPED_NAME_PARTS | {UNUSED_COPY}
    for path, module in model.named_modules():
        if not isinstance(module, (QLinearPacked, QEmbeddingPacked)) or unused.intersection(path.split(".")):
            continue
        # the packed weight is buffers (int8 mantissas, uint8 exponents), which no parameter count sees
        packed = packed_weight_bytes(module)
        stored_bytes += packed
        if isinstance(module, QLinearPacked):
            weight_bits += 8 * packed
            weight_elems += module.weight_mantissa.numel()
    other_bytes = sum(
        p.numel() * p.element_size()
        for path, p in model.named_parameters()
        if id(p) not in counted and UNUSED_COPY not in path.split(".")
    )
    return {
        "quant/avg_weight_bits": weight_bits / weight_elems if weight_elems else 0.0,
        "quant/weight_bytes": stored_bytes + other_bytes,
    }


def quantization_report(model: nn.Module) -> dict[str, float]:
    """Average bit widths and weight storage of ``model``.

    * ``quant/avg_weight_bits`` and ``quant/weight_bytes``: :func:`weight_storage`.
    * ``quant/avg_act_bits``: storage bits per element of the linear layers' input activations (as
      ``quant/avg_weight_bits`` counts them), weighted by each layer's input features (elements per token).
    * ``quant/layers``: number of quantized linear layers.
    * ``quant/points``: number of quantized encoder points (attention products, softmax, GELU, LayerNorm, adds);
      present only when there is one.
    """
    act_bits = act_elems = 0.0
    quantized = 0
    for layer in find_linear_layers(model):
        module = layer.module
        in_features = module.in_features
        act_bits += _slot_bits(module, "data_in") * in_features
        act_elems += in_features
        quantized += isinstance(module, QuantLinear)
    storage = weight_storage(model)
    report = {
        "quant/avg_weight_bits": storage["quant/avg_weight_bits"],
        "quant/avg_act_bits": act_bits / act_elems if act_elems else 0.0,
        "quant/weight_bytes": storage["quant/weight_bytes"],
        "quant/layers": float(quantized),
    }
    points = quantized_points(model)
    if points:
        report["quant/points"] = float(len(points))
    return report
