"""Typed quantization recipes: which number format each operand of each linear layer gets.

Three frozen dataclasses, each checking itself when it is built (in Python, or by Hydra from a ``_target_`` leaf):

* :class:`OperandRecipe` ``(format, params)``: one operand's format; building it builds the quantizer once, so an
  unknown format or parameter, a missing one, or a bad value fails right there.
* :class:`LayerRecipe` ``(data_in, weight, bias, data_out)``: one layer's operands; ``None`` keeps that operand at
  full precision (``data_out`` quantizes the layer's output, MASE's ``data_out_*``).
* :class:`QuantRecipe` ``(default, layers, patterns)``: which layers get which :class:`LayerRecipe`.

A Hydra leaf building one (``quant.config`` may be this instead of a MASE dict)::

    _target_: adls_lightning.quant.QuantRecipe
    default:
      _target_: adls_lightning.quant.LayerRecipe
      weight: {_target_: adls_lightning.quant.OperandRecipe, format: integer, params: {width: 8, frac_width: 4}}
    layers:
      classifier: null          # keep the head at full precision

The labs' MASE dicts are converted to these objects by :func:`adls_lightning.quant.mase.from_mase`, the one
place that vocabulary is read.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from adls_lightning.errors import ConfigError, did_you_mean
from adls_lightning.quant.linear import SLOTS
from adls_lightning.quant.quantizers import QUANTIZERS, Quantizer, QuantizerParamError, make_quantizer

#: Operands a layer recipe may quantize: the stored operands plus the output.
OPERANDS = (*SLOTS, "data_out")
#: The recipe's entries for the encoder's functional points, by kind (chop's op names).
POINT_KEYS = ("matmul", "bmm", "softmax", "gelu", "layer_norm", "add")


def _plain(value: Any) -> Any:
    """Hydra hands nested nodes over as DictConfig/ListConfig; the recipes hold plain containers."""
    if isinstance(value, (DictConfig, ListConfig)):
        return OmegaConf.to_container(value, resolve=True)
    return value


@dataclass(frozen=True)
class OperandRecipe:
    """One operand's number format.

    Args:
        format: a registered format name (:data:`adls_lightning.quant.QUANTIZERS`).
        params: the format's constructor parameters (``width``, ``frac_width``, ``block_size``...).

    Raises:
        QuantizerParamError: unknown format or parameter, a missing parameter or a bad value (names the parameter).
    """

    format: str
    params: Mapping[str, Any] = field(default_factory=dict)
    # The quantizer built to check the recipe, handed out by the first build(): a recipe of one layer (a search
    # trial's) builds its quantizer once, not once to check and once to use.
    _checked: list[Quantizer] = field(default_factory=list, init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "params", dict(_plain(self.params) or {}))
        if (
            self.format not in QUANTIZERS
        ):  # named by the recipe's key, format (make_quantizer's argument is name)
            close = did_you_mean(difflib.get_close_matches(str(self.format), list(QUANTIZERS)))
            raise QuantizerParamError(
                "format",
                f"={self.format!r}: unknown quantization format (valid: {', '.join(QUANTIZERS)}){close}",
            )
        self._checked.append(make_quantizer(self.format, **self.params))

    @classmethod
    def check_settings(cls, key: str, settings: Mapping[str, Any]) -> None:
        """Pre-flight: the types of ``params`` against the constructor of the ``format`` named next to them."""
        from adls_lightning.typed_settings import check_call

        fmt, params = settings.get("format"), settings.get("params")
        if isinstance(fmt, str) and fmt in QUANTIZERS and isinstance(params, Mapping):
            check_call(f"{key}.params", QUANTIZERS[fmt], params)

    def build(self) -> Quantizer:
        """A quantizer module of this format, a new one for each call (the first is the one the check built)."""
        return self._checked.pop() if self._checked else make_quantizer(self.format, **self.params)


@dataclass(frozen=True)
class LayerRecipe:
    """The operands of one linear layer; ``None`` keeps an operand at full precision.

    ``origins`` maps ``"<operand>_<param>"`` to the config key it was read from (the MASE adapter fills it), so
    an error found later, e.g. a block size that does not divide a layer's width, names the key the user wrote.

    Raises:
        ConfigError: an operand that is neither an :class:`OperandRecipe`, a mapping of its fields, nor null.
    """

    data_in: OperandRecipe | None = None
    weight: OperandRecipe | None = None
    bias: OperandRecipe | None = None
    data_out: OperandRecipe | None = None
    origins: Mapping[str, str] = field(default_factory=dict, compare=False, repr=False)
    #: how an encoder point computes (``float``, or ``ibert``: I-BERT's integer kernels for gelu, softmax and
    #: layer_norm points, :mod:`adls_lightning.quant.points`); linear layers are always ``float``
    kernel: str = "float"

    def __post_init__(self) -> None:
        if self.kernel not in ("float", "ibert"):
            raise ConfigError(f"kernel={self.kernel!r}: must be one of float, ibert")
        for operand in OPERANDS:
            value = _plain(getattr(self, operand))
            if isinstance(value, Mapping):
                if set(value) != {"format", "params"} and set(value) != {"format"}:
                    raise ConfigError(
                        f"{operand}={value!r}: expected {{format: ..., params: {{...}}}} or null"
                    )
                try:
                    value = OperandRecipe(**value)
                except ConfigError as err:
                    raise ConfigError(f"{operand}: {err}") from None
            if value is not None and not isinstance(value, OperandRecipe):
                raise ConfigError(f"{operand}={value!r}: expected {{format: ..., params: {{...}}}} or null")
            object.__setattr__(self, operand, value)

    @classmethod
    def uniform(cls, format: str, **params: Any) -> LayerRecipe:
        """``format`` with the same ``params`` on the operands the format quantizes by default (its ``slots``)."""
        slots = QUANTIZERS[format].slots if format in QUANTIZERS else ("data_in", "weight")
        return cls(**{slot: OperandRecipe(format, params) for slot in slots})

    def quantizers(self) -> dict[str, Quantizer | None]:
        """A new quantizer per operand (``None`` where the operand stays at full precision)."""
        return {operand: (r.build() if (r := getattr(self, operand)) else None) for operand in OPERANDS}

    def key_of(self, operand: str, param: str) -> str:
        """The config key a parameter came from (or would go), for messages."""
        return self.origins.get(f"{operand}_{param}", f"{operand}.params.{param}")


@dataclass(frozen=True)
class QuantRecipe:
    """Which linear layers, and which encoder points, are quantized how.

    The encoder's functional points (:mod:`adls_lightning.quant.points`: attention's ``matmul`` products, ``softmax``,
    ``gelu``, ``layer_norm``, residual ``add``) are quantized only where an entry names them: their kind's entry
    (``matmul``... ``add``; ``bmm`` is the same points as ``matmul``, as the attention products are batched) or
    their name in ``layers`` (``bert.encoder.layer.0.attention.self.softmax``). ``default`` and ``patterns`` apply to
    linear layers only, so a config without point entries quantizes what it always did.

    A layer named in ``layers`` (its canonical dotted name, or MASE's FX spelling with underscores) gets that
    entry; otherwise the first of ``patterns`` that matches the whole name in either spelling (``re.fullmatch``); otherwise
    ``default``. A ``None`` entry leaves the layer at full precision.

    Args:
        default: the recipe of layers nothing else names; ``None`` = full precision.
        layers: per-layer recipes by name.
        patterns: per-layer recipes by regular expression, first match wins.
        key: the config key this recipe was read from, for messages.

    Raises:
        ConfigError: a pattern that is not a regular expression, or an entry that is not a :class:`LayerRecipe`.
    """

    default: LayerRecipe | None = None
    layers: Mapping[str, LayerRecipe | None] = field(default_factory=dict)
    patterns: Mapping[str, LayerRecipe | None] = field(default_factory=dict)
    key: str = field(default="quant.config", compare=False)
    matmul: LayerRecipe | None = None
    bmm: LayerRecipe | None = None
    softmax: LayerRecipe | None = None
    gelu: LayerRecipe | None = None
    layer_norm: LayerRecipe | None = None
    add: LayerRecipe | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "default", _layer_recipe(self.default, f"{self.key}.default"))
        for kind in POINT_KEYS:
            object.__setattr__(self, kind, _layer_recipe(getattr(self, kind), f"{self.key}.{kind}"))
        if self.matmul is not None and self.bmm is not None:
            raise ConfigError(
                f"{self.key}.bmm: names the same points as {self.key}.matmul (the attention's Q·Kᵀ and P·V); "
                "give one of them"
            )
        for attr in ("layers", "patterns"):
            entries = dict(_plain(getattr(self, attr)) or {})
            if attr == "layers":
                entries = _dotted_names(entries)
            object.__setattr__(
                self, attr, {k: _layer_recipe(v, f"{self.key}.{k}") for k, v in entries.items()}
            )
        for pattern in self.patterns:
            try:
                re.compile(pattern)
            except re.error as err:
                raise ConfigError(f"{self.key}.{pattern}: not a valid regular expression ({err})") from None

    @classmethod
    def settings_view(cls, settings: Mapping[str, Any]) -> dict[str, Any]:
        """Pre-flight: the recipe's mapping with ``layers`` by dotted name, as the recipe reads it."""
        layers = settings.get("layers")
        if isinstance(layers, Mapping):
            return {**settings, "layers": _dotted_names(layers)}
        return dict(settings)

    def for_layers(self, names: list[str], points: Sequence[str] = ()) -> dict[str, LayerRecipe | None]:
        """Each linear layer's recipe (``points``: the model's point names, which ``layers`` may name too).

        Raises:
            ConfigError: a name or pattern that matches no layer (a typo would otherwise quantize nothing).
        """
        unmatched = [p for p in self.patterns if not any(_matches(p, n) for n in names)]
        unmatched += [k for k in self.layers if not any(_names(k, n) for n in (*names, *points))]
        if unmatched:
            where = _examples(names) + (f"; points are e.g. {', '.join(points[:2])}" if points else "")
            raise ConfigError(f"{self.key}.{unmatched[0]}: matches no linear layer or point ({where})")
        return {name: self._recipe(name) for name in names}

    @property
    def has_points(self) -> bool:
        """Whether any entry can quantize an encoder point (a kind entry, or a per-name one)."""
        return any(getattr(self, kind) is not None for kind in POINT_KEYS) or bool(self.layers)

    def for_point(self, name: str, kind: str) -> tuple[LayerRecipe | None, str]:
        """The recipe of point ``name`` of ``kind`` and its config key: its per-name entry, else its kind's."""
        for key, recipe in self.layers.items():
            if _names(key, name):
                return recipe, f"{self.key}.layers.{key}"
        if kind == "matmul" and self.bmm is not None:
            return self.bmm, f"{self.key}.bmm"
        return getattr(self, kind), f"{self.key}.{kind}"

    def where(self, name: str) -> str:
        """The config key of the entry layer ``name`` gets (``quant.config.layers.classifier``, ``...default``)."""
        for key in self.layers:
            if _names(key, name):
                return f"{self.key}.layers.{key}"
        for pattern in self.patterns:
            if _matches(pattern, name):
                return f"{self.key}.patterns.{pattern}"
        return f"{self.key}.default"

    def _recipe(self, name: str) -> LayerRecipe | None:
        for key, recipe in self.layers.items():
            if _names(key, name):
                return recipe
        for pattern, recipe in self.patterns.items():
            if _matches(pattern, name):
                return recipe
        return self.default


def _names(key: str, name: str) -> bool:
    """Whether a per-layer key names the layer: its dotted name, or MASE's FX spelling with underscores."""
    return key in (name, name.replace(".", "_"))


def _dotted_names(entries: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Per-layer entries by dotted name. Hydra turns ``layers.bert.encoder.layer.0.output.dense=...`` (a command
    line override, or a search trial's) into nested mappings; a mapping whose keys are not operands is a name
    prefix."""
    out: dict[str, Any] = {}
    for name, value in entries.items():
        dotted = f"{prefix}{name}"
        if isinstance(value, Mapping) and value and not set(value) <= {*OPERANDS, "origins", "kernel"}:
            out.update(_dotted_names(value, f"{dotted}."))
        else:
            out[dotted] = value
    return out


def _matches(pattern: str, name: str) -> bool:
    """Whether a regex matches the whole layer name in either spelling (dotted, or chop's FX underscores)."""
    return any(re.fullmatch(pattern, spelling) for spelling in (name, name.replace(".", "_")))


def _layer_recipe(value: Any, key: str) -> LayerRecipe | None:
    value = _plain(value)
    if isinstance(value, Mapping):
        unknown = next((k for k in value if k not in (*OPERANDS, "origins", "kernel")), None)
        if unknown is not None:
            raise ConfigError(f"{key}.{unknown}: not an operand (operands: {', '.join(OPERANDS)}; or kernel)")
        try:
            value = LayerRecipe(**value)
        except ConfigError as err:  # named from the recipe's key: quant.config.default.weight: width=0: ...
            raise ConfigError(f"{key}.{err}") from None
    if value is not None and not isinstance(value, LayerRecipe):
        raise ConfigError(
            f"{key}={value!r}: expected a LayerRecipe {{data_in, weight, bias, data_out}} or null"
        )
    return value


def _examples(names: list[str]) -> str:
    shown = ", ".join(names[:3])
    return f"layers are e.g. {shown}" + (f" ... ({len(names)} in all)" if len(names) > 3 else "")
