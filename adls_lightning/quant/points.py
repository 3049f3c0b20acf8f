"""Quantized functional points of an encoder: attention's matrix products, softmax, GELU, LayerNorm, residual adds.

Beside its linear layers (:class:`~adls_lightning.quant.QuantLinear`), an encoder block computes in float
``softmax(Q·Kᵀ·s + mask)·V``, a GELU, LayerNorms and residual adds. Each of these is a *point* with a name and a kind
(chop's op names), quantized by the recipe's entry for its kind or by a per-name entry
(:class:`~adls_lightning.quant.QuantRecipe`: ``matmul``/``bmm``, ``softmax``, ``gelu``, ``layer_norm``, ``add``):

============  =========================================================  ======================================
kind          where (BERT's names; the other families' alike)            operands of its recipe
============  =========================================================  ======================================
matmul        ``<self-attention>.qk_matmul`` (Q·Kᵀ), ``.pv_matmul``       data_in = Q / P, weight = Kᵀ / V,
              (P·V); ``bmm`` names the same points                       data_out = the product
softmax       ``<self-attention>.softmax``                               data_in = the scaled scores (before
                                                                         the mask), data_out = the probabilities
gelu          every GELU activation module (``intermediate.              data_in, data_out
              intermediate_act_fn``)
layer_norm    every ``nn.LayerNorm`` (embeddings' and blocks')           data_in, weight (γ), bias (β), data_out
add           ``<attention.output | output>.add``: the residual add of   data_in (each summand, its own
              ``LayerNorm(dropout(dense(x)) + input)``                   quantizer), data_out = the sum
============  =========================================================  ======================================

The right operand of a product is quantized along its reduction dimension (Kᵀ as K, V as Vᵀ), so block formats share
their scales along the dimension the product sums over, as they do for a linear layer's input and weight.

How each point is put in (one implementation for every family whose modules have these layouts):

* attention: the Hugging Face attention module keeps its class and weights; it gets the point modules as children and
  its own copy of the model config with ``_attn_implementation = "adls_quantized"``, an attention function registered
  with transformers' ``AttentionInterface`` that runs the eager math with the points. Only modules with an attention
  point switch, so a run without one keeps SDPA. Families: bert, roberta, electra, distilbert, albert (their attention
  calls the interface); deberta's disentangled attention does not and is refused.
* gelu: the activation module is wrapped (:class:`QuantActivation`, the original as child ``act``).
* layer_norm: the ``nn.LayerNorm`` is replaced by :class:`QuantLayerNorm` holding the same parameters.
* add: the block's output module (``dense``, ``dropout``, ``LayerNorm``: BERT's ``BertSelfOutput`` / ``BertOutput``
  and the same layout in roberta, electra, deberta) is replaced by :class:`QuantResidualOutput` with the same children
  plus the ``add`` point. distilbert and albert add inside their block's forward and are refused.

State dicts keep every existing key (new keys only for the quantizers), and a state without quantizer keys (a
full-precision checkpoint) loads with the quantizers' current state. Every quantizer is an ordinary module of the
model, so calibration (:func:`adls_lightning.quant.calibrate`) observes the points' static scales like the linear
layers'. ``kernel: ibert`` on a gelu, softmax or layer_norm entry computes it with I-BERT's integer kernels
(:mod:`adls_lightning.quant.ibert`) on its ``data_in`` grid (symmetric ``scaled_integer`` per tensor, or ``integer``).
"""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from adls_lightning.quant import ibert
from adls_lightning.quant.formats.fixed_point import IntegerQuantizer
from adls_lightning.quant.quantizers import Quantizer
from adls_lightning.quant.scaled import ScaledIntegerQuantizer

#: The point kinds (chop's op names); ``bmm`` names the same points as ``matmul``.
KINDS = ("matmul", "softmax", "gelu", "layer_norm", "add")
#: The recipe keys of the kinds, as chop spells them.
KIND_KEYS = ("matmul", "bmm", "softmax", "gelu", "layer_norm", "add")
#: The operands each kind quantizes (a recipe giving another one is refused).
KIND_OPERANDS = {
    "matmul": ("data_in", "weight", "data_out"),
    "softmax": ("data_in", "data_out"),
    "gelu": ("data_in", "data_out"),
    "layer_norm": ("data_in", "weight", "bias", "data_out"),
    "add": ("data_in", "data_out"),
}
#: Kernels a point computes with, and the kinds that have each one.
KERNELS = {"float": KINDS, "ibert": ("softmax", "gelu", "layer_norm")}
#: The attention function the quantized attention modules select (registered with transformers below).
ATTENTION_IMPLEMENTATION = "adls_quantized"
#: Families whose self-attention calls transformers' attention interface with the eager math.
ATTENTION_CLASSES = {
    "BertSelfAttention": "bert",
    "RobertaSelfAttention": "roberta",
    "ElectraSelfAttention": "electra",
    "DistilBertSelfAttention": "distilbert",
    "AlbertAttention": "albert",
}
#: Output modules computing ``LayerNorm(dropout(dense(x)) + input)`` with those child names.
RESIDUAL_CLASSES = {
    f"{prefix}{suffix}": family
    for prefix, family in (
        ("Bert", "bert"),
        ("Roberta", "roberta"),
        ("Electra", "electra"),
        ("Deberta", "deberta"),
        ("DebertaV2", "deberta"),
    )
    for suffix in ("SelfOutput", "Output")
}
#: Which points each family has (a kind entry for a family without its points is refused, naming the family).
FAMILY_KINDS = {
    "bert": KINDS,
    "roberta": KINDS,
    "electra": KINDS,
    "distilbert": ("matmul", "softmax", "gelu", "layer_norm"),
    "albert": ("matmul", "softmax", "gelu", "layer_norm"),
    "deberta": ("gelu", "layer_norm", "add"),
}
_WHY_NOT = {
    ("distilbert", "add"): "its residual adds are inside TransformerBlock.forward",
    ("albert", "add"): "its residual adds are inside AlbertAttention/AlbertLayer.forward",
    ("deberta", "matmul"): "its disentangled attention does not use transformers' attention interface",
    ("deberta", "softmax"): "its disentangled attention does not use transformers' attention interface",
}


def why_unsupported(family: str, kind: str) -> str:
    """One line on why ``family`` has no ``kind`` points."""
    supported = [f for f, kinds in FAMILY_KINDS.items() if kind in kinds]
    why = _WHY_NOT.get((family, kind), "its modules are not known here")
    return (
        f"family {family!r} has no quantizable {kind} points yet ({why}; supported: {', '.join(supported)})"
    )


# ------------------------------------------------------------------------------------------------- point modules
class QuantPoint(nn.Module):
    """Base of the point modules: one optional quantizer per operand (``<operand>_quantizer``) and a kernel."""

    kind: ClassVar[str] = ""

    def __init__(self, quantizers: Mapping[str, Quantizer | None], kernel: str = "float") -> None:
        super().__init__()
        for operand in ("data_in", "weight", "bias", "data_out"):
            setattr(self, f"{operand}_quantizer", quantizers.get(operand))
        self.kernel = kernel
        self.register_load_state_dict_pre_hook(_keep_missing_quantizer_state)

    def quantizer(self, operand: str) -> Quantizer | None:
        return getattr(self, f"{operand}_quantizer", None)

    def q(self, operand: str, x: Tensor) -> Tensor:
        quantizer = self.quantizer(operand)
        return x if quantizer is None else quantizer(x)

    def quantizers(self) -> dict[str, Quantizer]:
        """The operands quantized here and their quantizers."""
        names = ("data_in", "data_in_1", "weight", "bias", "data_out")
        return {n: q for n in names if (q := self.quantizer(n)) is not None}

    def extra_repr(self) -> str:
        return f"kind={self.kind}" + (f", kernel={self.kernel}" if self.kernel != "float" else "")


class QuantMatmul(QuantPoint):
    """``q_out(q_in(a) @ q_w(b))``, ``b`` quantized along its reduction dimension (as ``bᵀ``)."""

    kind = "matmul"

    def forward(self, a: Tensor, b: Tensor) -> Tensor:
        a = self.q("data_in", a)
        if self.weight_quantizer is not None:
            b = self.weight_quantizer(b.transpose(-1, -2)).transpose(-1, -2)
        return self.q("data_out", torch.matmul(a, b))


class QuantSoftmax(QuantPoint):
    """Softmax over the last dimension of attention scores: ``data_in`` quantizes the scores before the mask (a
    masked position's -inf is no value of the scores), ``data_out`` the probabilities."""

    kind = "softmax"

    def forward(self, scores: Tensor, mask: Tensor | None) -> Tensor:
        x = self.q("data_in", scores)
        step = grid_step(self.data_in_quantizer, x) if self.kernel == "ibert" else None
        if step is not None:
            keep = (
                None
                if mask is None
                else (mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min / 2)
            )
            probs = ibert.ibert_softmax(x, step, keep)
        else:
            if mask is not None:
                x = x.masked_fill(~mask, torch.finfo(x.dtype).min) if mask.dtype == torch.bool else x + mask
            probs = F.softmax(x, dim=-1, dtype=torch.float32).to(x.dtype)
        return self.q("data_out", probs)


class QuantActivation(QuantPoint):
    """A GELU activation (the original module, kept as ``act``) with quantized input and output."""

    kind = "gelu"
    wrapped_child = "act"

    def __init__(
        self, act: nn.Module, quantizers: Mapping[str, Quantizer | None], kernel: str = "float"
    ) -> None:
        super().__init__(quantizers, kernel)
        self.act = act

    def forward(self, x: Tensor) -> Tensor:
        x = self.q("data_in", x)
        step = grid_step(self.data_in_quantizer, x) if self.kernel == "ibert" else None
        y = self.act(x) if step is None else ibert.ibert_gelu(x, step)
        return self.q("data_out", y)


class QuantLayerNorm(QuantPoint):
    """``nn.LayerNorm`` with quantized input, γ, β and output; holds the original's parameters (same state keys)."""

    kind = "layer_norm"

    def __init__(
        self, norm: nn.Module, quantizers: Mapping[str, Quantizer | None], kernel: str = "float"
    ) -> None:
        super().__init__(quantizers, kernel)
        self.normalized_shape = tuple(norm.normalized_shape)
        self.eps = norm.eps
        self.weight = norm.weight
        self.bias = norm.bias

    def forward(self, x: Tensor) -> Tensor:
        x = self.q("data_in", x)
        weight = None if self.weight is None else self.q("weight", self.weight)
        bias = None if self.bias is None else self.q("bias", self.bias)
        step = grid_step(self.data_in_quantizer, x) if self.kernel == "ibert" else None
        if step is None:
            y = F.layer_norm(x, self.normalized_shape, weight, bias, self.eps)
        else:
            y = ibert.ibert_layernorm(x, step, weight, bias, self.eps)
        return self.q("data_out", y)

    def as_layer_norm(self) -> nn.LayerNorm:
        """The plain ``nn.LayerNorm`` with these parameters."""
        norm = nn.LayerNorm(self.normalized_shape, eps=self.eps, elementwise_affine=self.weight is not None)
        norm.weight, norm.bias = self.weight, self.bias
        return norm


class QuantAdd(QuantPoint):
    """``q_out(q_in(a) + q_in_1(b))``: each summand on its own grid (their ranges differ), as chop's add."""

    kind = "add"

    def __init__(self, quantizers: Mapping[str, Quantizer | None], second: Quantizer | None) -> None:
        super().__init__(quantizers)
        self.data_in_1_quantizer = second

    def forward(self, a: Tensor, b: Tensor) -> Tensor:
        b = b if self.data_in_1_quantizer is None else self.data_in_1_quantizer(b)
        return self.q("data_out", self.q("data_in", a) + b)


class QuantResidualOutput(nn.Module):
    """``LayerNorm(add(dropout(dense(x)), input))``: BERT's ``BertSelfOutput``/``BertOutput`` layout (same children,
    same state keys) with the residual add a point."""

    def __init__(self, dense: nn.Module, dropout: nn.Module, norm: nn.Module, add: QuantAdd) -> None:
        super().__init__()
        self.dense = dense
        self.dropout = dropout
        self.LayerNorm = norm
        self.add = add

    def forward(self, hidden_states: Tensor, input_tensor: Tensor) -> Tensor:
        hidden_states = self.dropout(self.dense(hidden_states))
        return self.LayerNorm(self.add(hidden_states, input_tensor))


def grid_step(quantizer: Quantizer | None, x: Tensor) -> float | None:
    """The step of the per-tensor grid ``quantizer`` put ``x`` on (``x`` is its output); None while it calibrates
    (its input passes through unquantized, so the integer kernel has no grid yet: the float function runs)."""
    if isinstance(quantizer, IntegerQuantizer):
        return 2.0**-quantizer.frac_width
    if isinstance(quantizer, ScaledIntegerQuantizer):
        if quantizer.observing:
            return None
        if quantizer.step is not None and bool(quantizer.learned_ready):
            return float(quantizer.step.detach().abs().clamp(min=torch.finfo(torch.float32).tiny))
        return float(quantizer.grid(x)[0].reshape(-1)[0])
    raise TypeError(
        f"kernel ibert needs a per-tensor integer grid on data_in, got {type(quantizer).__name__}"
    )


def ibert_input_problem(quantizer: Quantizer | None) -> str | None:
    """Why ``quantizer`` cannot feed an I-BERT kernel (None when it can)."""
    if isinstance(quantizer, IntegerQuantizer):
        return None
    if isinstance(quantizer, ScaledIntegerQuantizer):
        if quantizer.granularity == "tensor" and quantizer.symmetric:
            return None
        return "its data_in must be symmetric with granularity tensor (one integer grid)"
    return "its data_in must be format scaled_integer (symmetric, granularity tensor) or integer"


def _keep_missing_quantizer_state(
    module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any
) -> None:
    """A state saved before quantization (no quantizer keys) loads; the quantizers keep their current state."""
    for key, value in module.state_dict(keep_vars=True).items():
        if "_quantizer." in key:
            state_dict.setdefault(prefix + key, value.detach())


# ---------------------------------------------------------------------------------------------- the attention
def quantized_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[Tensor, Tensor]:
    """transformers' eager attention (``softmax(Q Kᵀ s + mask) V``) through the module's points. The mask is the
    one the model built for its own implementation: additive float (eager) or bool, True = attend (SDPA)."""
    if scaling is None:
        scaling = query.size(-1) ** -0.5
    qk, pv, softmax = (getattr(module, name, None) for name in ("qk_matmul", "pv_matmul", "softmax"))
    key_t = key.transpose(-1, -2)
    scores = (torch.matmul(query, key_t) if qk is None else qk(query, key_t)) * scaling
    if attention_mask is not None and attention_mask.dim() == 4:
        attention_mask = attention_mask[..., : key.shape[-2]]
    if softmax is not None:
        probs = softmax(scores, attention_mask)
    else:
        if attention_mask is not None:
            if attention_mask.dtype == torch.bool:
                scores = scores.masked_fill(~attention_mask, torch.finfo(scores.dtype).min)
            else:
                scores = scores + attention_mask
        probs = F.softmax(scores, dim=-1)
    probs = F.dropout(probs, p=dropout, training=module.training)
    out = torch.matmul(probs, value) if pv is None else pv(probs, value)
    return out.transpose(1, 2).contiguous(), probs


def _register_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_IMPLEMENTATION, quantized_attention)


_register_attention()


# --------------------------------------------------------------------------------------------------- discovery
@dataclass
class Point:
    """A quantizable point of a model.

    Attributes:
        name: user-facing name (PEFT's ``base_model.model.`` dropped).
        kind: one of :data:`KINDS`.
        path: the full name in the model of the module the point lives in or replaces.
        module: that module (an attention module for matmul/softmax points).
        family: the model family (``bert``, ``distilbert``...).
    """

    name: str
    kind: str
    path: str
    module: nn.Module
    family: str


def model_family(model: nn.Module) -> str:
    """The family of ``model`` (its Hugging Face config's model type, deberta-v2 as deberta), or ``unknown``."""
    for module in model.modules():
        config = getattr(module, "config", None)
        model_type = getattr(config, "model_type", None)
        if isinstance(model_type, str):
            return "deberta" if model_type.startswith("deberta") else model_type
    return "unknown"


#: transformers' GELU modules (GELUActivation, NewGELUActivation, FastGELUActivation...) and torch's nn.GELU
_GELU_CLASS = re.compile(r"GELU(Activation)?$")


def _user_name(path: str) -> str:
    return path.removeprefix("base_model.model.")


def find_points(model: nn.Module) -> list[Point]:
    """The model's quantizable points, in module order (existing point modules included)."""
    family = model_family(model)
    points: list[Point] = []
    skip: set[int] = set()
    for path, module in model.named_modules():
        if id(module) in skip or "original_module" in path.split("."):
            continue
        name = _user_name(path)
        cls = type(module).__name__
        if cls in ATTENTION_CLASSES:
            for point, kind in (("qk_matmul", "matmul"), ("softmax", "softmax"), ("pv_matmul", "matmul")):
                points.append(Point(f"{name}.{point}", kind, path, module, ATTENTION_CLASSES[cls]))
            skip.update(
                id(getattr(module, p)) for p in ("qk_matmul", "pv_matmul", "softmax") if hasattr(module, p)
            )
        elif isinstance(module, QuantActivation) or _GELU_CLASS.search(cls):
            points.append(Point(name, "gelu", path, module, family))
            skip.update(id(m) for m in module.modules())
        elif isinstance(module, (nn.LayerNorm, QuantLayerNorm)):
            points.append(Point(name, "layer_norm", path, module, family))
            skip.update(id(m) for m in module.modules())
        elif isinstance(module, QuantResidualOutput) or cls in RESIDUAL_CLASSES:
            points.append(Point(f"{name}.add", "add", path, module, RESIDUAL_CLASSES.get(cls, family)))
            if isinstance(module, QuantResidualOutput):
                skip.add(id(module.add))
    return points


def point_dimension_problem(
    point: Point, quantizers: Mapping[str, Quantizer | None]
) -> tuple[str, str] | None:
    """The first operand of ``point`` whose quantizer cannot tile the dimension the model fixes for it, and why
    (None when every one can): the head size of Q·Kᵀ (P·V's runs along the sequence, known only at run time), the
    width of a LayerNorm."""
    sizes: dict[str, int] = {}
    if point.name.endswith("qk_matmul"):
        config = point.module.config
        head = (
            getattr(point.module, "attention_head_size", None)
            or config.hidden_size // config.num_attention_heads
        )
        sizes = {"data_in": head, "weight": head}
    elif point.kind == "layer_norm":
        width = int(point.module.weight.shape[-1]) if point.module.weight is not None else 0
        sizes = dict.fromkeys(("data_in", "weight", "bias", "data_out"), width)
    for operand, size in sizes.items():
        quantizer = quantizers.get(operand)
        problem = quantizer.check_last_dim(size) if quantizer is not None and size else None
        if problem:
            return operand, f"{problem} (point {point.name}: last dimension {size})"
    return None


def install(
    model: nn.Module,
    point: Point,
    quantizers: dict[str, Quantizer | None],
    kernel: str,
    second: Quantizer | None,
) -> None:
    """Put ``point``'s quantizers in ``model`` (replacing the point's current ones)."""
    from adls_lightning.layers import swap_module

    module = point.module
    if point.kind in ("matmul", "softmax"):
        cls = QuantSoftmax if point.kind == "softmax" else QuantMatmul
        attribute = point.name.rpartition(".")[2]
        module.add_module(attribute, cls(quantizers, kernel).to(_device(module)))
        if getattr(module.config, "_attn_implementation", None) != ATTENTION_IMPLEMENTATION:
            # this module's own config: the other modules keep their implementation (SDPA); the shared one is kept
            # (not as a child) for remove_points
            module.__dict__["_shared_config"] = module.config
            module.config = copy.copy(module.config)
            module.config._attn_implementation_internal = ATTENTION_IMPLEMENTATION
        return
    if point.kind == "gelu":
        act = module.act if isinstance(module, QuantActivation) else module
        new: nn.Module = QuantActivation(act, quantizers, kernel)
    elif point.kind == "layer_norm":
        new = QuantLayerNorm(module, quantizers, kernel)
    else:
        new = QuantResidualOutput(
            module.dense, module.dropout, module.LayerNorm, QuantAdd(quantizers, second)
        )
        # the module it replaces, kept (not as a child: no state of its own) for remove_points
        new.__dict__["original"] = module.__dict__.get("original", module)
    swap_module(model, point.path, new.to(_device(module)))


def remove_points(model: nn.Module) -> None:
    """Put every point of ``model`` back to full precision: the original modules, the shared config (SDPA)."""
    from adls_lightning.layers import swap_module

    for path, module in list(model.named_modules()):
        if isinstance(module, QuantResidualOutput):
            original = module.__dict__["original"]
            original.dense, original.dropout, original.LayerNorm = (
                module.dense,
                module.dropout,
                module.LayerNorm,
            )
            swap_module(model, path, original)
    for path, module in list(model.named_modules()):
        if isinstance(module, QuantActivation):
            swap_module(model, path, module.act)
        elif isinstance(module, QuantLayerNorm):
            swap_module(model, path, module.as_layer_norm())
        elif "_shared_config" in module.__dict__:
            for attribute in ("qk_matmul", "pv_matmul", "softmax"):
                if attribute in module._modules:
                    delattr(module, attribute)
            module.config = module.__dict__.pop("_shared_config")


def _device(module: nn.Module) -> torch.device:
    tensor = next(module.parameters(), None)
    return torch.device("cpu") if tensor is None else tensor.device


def quantized_points(model: nn.Module) -> list[tuple[str, str, QuantPoint]]:
    """``(name, kind, point module)`` of every quantized point of ``model``."""
    out = []
    for path, module in model.named_modules():
        if isinstance(module, QuantPoint):
            name = _user_name(path)
            out.append((name, module.kind, module))
    return out


def point_bits(model: nn.Module) -> float:
    """Mean bits of the quantized points' data_in operands (0 when there is none)."""
    bits = [
        q.bits_per_element(64)
        for _, _, point in quantized_points(model)
        if (q := point.quantizer("data_in")) is not None
    ]
    return sum(bits) / len(bits) if bits else 0.0


__all__ = [
    "KINDS",
    "KIND_KEYS",
    "Point",
    "QuantActivation",
    "QuantAdd",
    "QuantLayerNorm",
    "QuantMatmul",
    "QuantResidualOutput",
    "QuantSoftmax",
    "find_points",
    "point_dimension_problem",
    "remove_points",
    "quantized_points",
]
