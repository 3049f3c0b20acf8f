"""The labs' quantization config (MASE's ``quantize_transform_pass`` arguments) -> :class:`QuantRecipe`.

This module is the one place the MASE vocabulary is read; everything after it works on the typed recipes of
:mod:`adls_lightning.quant.recipe`. A lab config is accepted as a dict, or as a TOML / YAML / JSON file (a whole
MASE config file gives its ``[passes.quantize]`` table, read by :mod:`adls_lightning.lab_config`):
``quant.config=path/to/lab.toml``.

.. code-block:: python

    {
        "by": "type",                                  # or "name" / "regex_name"
        "default": {"config": {"name": None}},         # fallback; name None = leave the layer alone
        "linear": {"config": {"name": "integer", "data_in_width": 8, "data_in_frac_width": 4,
                              "weight_width": 8, "weight_frac_width": 4,
                              "bias_width": 8, "bias_frac_width": 4}},
    }

* ``by: type``: ``linear`` configures every linear layer (``default`` too: it applies to linear layers only here).
  ``matmul`` (or ``bmm``: the same points), ``softmax``, ``gelu``, ``layer_norm`` and ``add`` configure the encoder's
  functional points of that kind (:mod:`adls_lightning.quant.points`; operands as chop's quantized ops: a matmul's
  ``data_in`` and ``weight`` are its two inputs, an add's ``data_in`` both summands, a layer_norm's ``weight`` and
  ``bias`` its γ and β). Any other key is a layer or point name whose entry is merged over the linear config.
* ``by: name``: keys are layer names (dotted, ``bert.encoder.layer.0.attention.self.query``, or MASE's FX
  spelling with underscores). ``by: regex_name``: keys are regexes matching a whole name, first match wins.
* A layer entry is ``{"config": {...}}`` (MASE) or the dict itself. An entry with ``name`` replaces the layer's
  config; one without is merged over it. ``{"name": None}`` or ``bypass: true`` leaves the layer alone. Nested
  dicts are read as dotted names (Hydra's ``+quant.config.bert.encoder.layer.0.attention.self.query.weight_width=4``).
* Layer keys: ``name``; ``{data_in,weight,bias,data_out}_<parameter>`` (``data_out`` quantizes the output, as
  MASE's ``fixed``); ``{operand}_name`` gives one operand another format (``null`` = full precision); ``floor``
  (integer: round down); ``binary_training`` (binary formats: binarise input, weight and bias, not only the
  weight). ``data_in`` and ``weight`` are quantized by default (only ``weight`` for binary, binary_scaling and
  ternary, as in MASE); ``bias`` and ``data_out`` when they have keys.
* MASE names mapped: ``fixed`` and ``integer_floor`` are ``integer`` (the latter with ``floor: true``).
  ``"NA"`` (chop's TOML spelling of None) is None everywhere: ``name = "NA"`` leaves the layer alone,
  ``binary_training = "NA"`` is off, ``weight_mean = "NA"`` measures the tensor.
  Ignored with a one-line note: the top-level ``report`` (metrics are always reported), ``*_skip_first_dim``
  (blocks never span tokens here), and any key chop defines that the chosen format does not use (a
  ``data_in_frac_width`` in a ternary layer, ``floor`` in a minifloat one, ``binary_training`` in an integer one),
  as chop ignores them. Anything else unknown (a typo) is refused with one line naming the key.

The caller's config is never modified (MASE's ``pass_args.pop("by")`` broke reuse across trials).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from adls_lightning.errors import ConfigError
from adls_lightning.lab_config import load_lab_config_at
from adls_lightning.quant.points import KIND_OPERANDS
from adls_lightning.quant.quantizers import QUANTIZERS, QuantizerParamError, quantizer_parameters
from adls_lightning.quant.recipe import OPERANDS, POINT_KEYS, LayerRecipe, OperandRecipe, QuantRecipe

log = logging.getLogger(__name__)

BY_OPTIONS = ("type", "name", "regex_name")
#: Keys of a layer config that are not operand parameters (besides a format's ``layer_params``).
_LAYER_KEYS = ("name", "bypass", "binary_training")
#: Formats ``binary_training`` applies to (MASE: binarise every operand, not only the weight).
_BINARY_FORMATS = ("binary", "binary_scaling", "binary_residual")
#: MASE accepts these per operand; blocks never span the token dimension here, so they change nothing.
_IGNORED_SUFFIXES = ("skip_first_dim",)
#: chop's operand parameters (``{data_in,weight,bias,data_out}_<param>``) over all its formats
#: (``QUANT_ARITH_ENTRIES``): one the chosen format does not use is ignored with a note, as chop ignores it;
#: anything else (a typo) is refused.
_CHOP_OPERAND_PARAMS = (
    "width", "frac_width", "exponent_width", "exponent_bias", "exponent_bias_width", "block_size",
    "skip_first_dim", "stochastic", "bipolar", "scaling_factor", "mean", "median", "max", "levels",
    "residual_sign", "parallelism", "name",
)  # fmt: skip
#: chop's layer keys besides the operands' (``floor`` of integer, ``binary_training`` of the binary formats), and the
#: binary keys chop reads only per operand (a layer-level ``stochastic`` is in chop's binary files; chop ignores it).
_CHOP_LAYER_KEYS = ("name", "bypass", "floor", "binary_training", "stochastic", "bipolar")
#: Formats whose elements are signs: chop ignores the widths its files give their operands (``data_in_width = 32``).
_SIGN_FORMATS = ("binary", "binary_scaling")
#: ternary's precomputed statistics: chop's profiler records the signed median (and mean) of x, which can be below
#: zero; chop's ternary op measures its threshold from the tensor anyway.
_TERNARY_STATS = ("mean", "median", "max")
#: chop's layers of these formats quantize only their fixed operands (the format's ``slots``; all but data_out
#: with ``binary_training``): other operands' keys change nothing there, and are ignored with a note.
_FIXED_OPERAND_FORMATS = (*_BINARY_FORMATS, "ternary")
#: Top-level keys of MASE's pass arguments that change nothing here, and why.
_IGNORED_TOP = {"report": "quant/* metrics are always written to metrics.json"}
#: MASE format names that are a format here, with the layer keys the name implies.
_ALIASES = {"fixed": ("integer", {}), "integer_floor": ("integer", {"floor": True})}
#: MASE format names with no counterpart here, and what to use instead.
_MASE_ONLY = {
    "mxint": "MASE's mxint scales blocks by ceil(log2 max) (it differs from OCP MXINT8 when a block's max is a "
    "power of two); use mxint8",
    "mxfp": "MX floating-point elements are not implemented; use mxint8 or block_minifloat",
    "mxint_hardware": "MASE's no-gradient hardware reference model; use mxint8 or block_fp",
    "lutnet": "LUT networks are not implemented",
    "logicnets": "LogicNets are not implemented",
    "flexround": "FlexRound is not implemented",
}
#: MASE op names other than linear and the encoder points (POINT_KEYS): a config for them cannot apply.
_OTHER_MASE_OPS = (
    "conv1d", "conv2d", "convtranspose2d", "mul", "relu", "sub", "batch_norm2d", "group_norm",
    "instance_norm2d", "rms_norm", "selu", "tanh", "softsign", "softplus", "grouped_query_attention",
)  # fmt: skip


def to_recipe(config: Any, key: str = "config") -> QuantRecipe:
    """The edge every quantization config passes: a :class:`QuantRecipe` as is, a :class:`LayerRecipe` for every
    linear layer, anything else (a MASE dict or a lab config file) through :func:`from_mase`."""
    if isinstance(config, QuantRecipe):
        return config
    if isinstance(config, LayerRecipe):
        return QuantRecipe(default=config, key=key)
    return from_mase(config, key)


def from_mase(config: Any, key: str = "config") -> QuantRecipe:
    """Convert a MASE-style config (a mapping or a file path, see the module docstring) to a :class:`QuantRecipe`.

    Every format and parameter is checked here (no model needed); ``config`` is not modified.

    Raises:
        ConfigError: naming the offending key, prefixed with ``key``.
    """
    config, key = load_lab_config_at(config or {}, "quantize", key)
    for name, why in _IGNORED_TOP.items():
        if config.pop(name, None) is not None:
            log.info("%s.%s: ignored (%s)", key, name, why)
    by = config.pop("by", "type")
    if by not in BY_OPTIONS:
        raise ConfigError(f"{key}.by={by!r}: must be one of {', '.join(BY_OPTIONS)}")
    base = default = _Entry.read(config.pop("default", {"config": {"name": None}}), f"{key}.default")
    default.recipe()  # checked even where `linear` replaces it
    layers: dict[str, LayerRecipe | None] = {}
    patterns: dict[str, LayerRecipe | None] = {}
    kinds: dict[str, LayerRecipe | None] = {}
    if by == "type":
        op = next((op for op in _OTHER_MASE_OPS if op in config), None)
        if op is not None:
            raise ConfigError(
                f"{key}.{op}: only linear layers are quantized, and the encoder points "
                f"{', '.join(POINT_KEYS)}; remove the '{op}' entry"
            )
        if "linear" in config:
            base = _Entry.read(config.pop("linear"), f"{key}.linear")
        for kind in POINT_KEYS:
            if kind in config:
                operands = KIND_OPERANDS["matmul" if kind == "bmm" else kind]
                kinds[kind] = _Entry.read(config.pop(kind), f"{key}.{kind}").recipe(operands)
    if by == "regex_name":
        patterns = {p: _Entry.read(value, f"{key}.{p}").recipe() for p, value in config.items()}
    else:
        for name, (path, value) in _flatten_names(config, key).items():
            layers[name] = base.merged(_Entry.read(value, path)).recipe()
    return QuantRecipe(default=base.recipe(), layers=layers, patterns=patterns, key=key, **kinds)


def _read_bools(fmt: str, params: dict[str, Any]) -> None:
    """MASE's TOML files write booleans as 0/1 (to keep arrays homogeneous): read those as booleans where the
    format's parameter is one."""
    if fmt not in QUANTIZERS:
        return
    signature = inspect.signature(QUANTIZERS[fmt].__init__).parameters
    for name, value in params.items():
        if (
            name in signature
            and isinstance(signature[name].default, bool)
            and type(value) is int
            and value in (0, 1)
        ):
            params[name] = bool(value)


def _frac_above_width(params: Mapping[str, Any]) -> bool:
    """Whether chop's integer operand asks for more fractional bits than bits (valid fixed point in chop)."""
    width, frac = params.get("width"), params.get("frac_width")
    return all(isinstance(v, int) and not isinstance(v, bool) for v in (width, frac)) and frac > width


def _is_layer_config(value: Mapping) -> bool:
    """True for a layer entry (``{"config": ...}`` or a dict of layer keys), False for a namespace of names."""
    if "config" in value:
        return True
    layer_params = {p for cls in QUANTIZERS.values() for p in cls.layer_params}
    return any(
        key in (*_LAYER_KEYS, *layer_params) or key.startswith(tuple(f"{o}_" for o in OPERANDS))
        for key in value
    )


def _flatten_names(entries: Mapping[str, Any], key: str, prefix: str = "") -> dict[str, tuple[str, Any]]:
    """``{"bert": {"encoder": {...: {"weight_width": 4}}}}`` -> ``{"bert.encoder...": (config key path, entry)}``."""
    out: dict[str, tuple[str, Any]] = {}
    for name, value in entries.items():
        full = f"{prefix}{name}"
        if not isinstance(value, Mapping):
            raise ConfigError(
                f"{key}.{full}={value!r}: expected a layer config (a mapping with 'name' and *_width keys)"
            )
        if _is_layer_config(value):
            out[full] = (f"{key}.{full}", value)
        else:
            out.update(_flatten_names(value, key, f"{full}."))
    return out


@dataclass
class _Entry:
    """One layer's MASE config: values plus, per key, the config path it came from (for messages)."""

    values: dict[str, Any]
    origins: dict[str, str]

    @classmethod
    def read(cls, value: Any, path: str) -> _Entry:
        """Unwrap ``{"config": {...}}`` and record where each key lives."""
        if not isinstance(value, Mapping):
            raise ConfigError(
                f"{path}={value!r}: expected a layer config such as {{config: {{name: integer, ...}}}}"
            )
        if "config" in value:
            extra = [k for k in value if k != "config"]
            if extra:
                raise ConfigError(f"{path}.{extra[0]}: unexpected key next to 'config'")
            value, path = value["config"], f"{path}.config"
            if not isinstance(value, Mapping):
                raise ConfigError(f"{path}={value!r}: expected a mapping")
        return cls(dict(value), {k: f"{path}.{k}" for k in value})

    def merged(self, override: _Entry) -> _Entry:
        if "name" in override.values:
            return override
        return _Entry({**self.values, **override.values}, {**self.origins, **override.origins})

    def where(self, key: str) -> str:
        """The config key of ``key``: where it was written, else where it would go (next to ``name``)."""
        if key in self.origins:
            return self.origins[key]
        layer_dir = self.origins.get("name", "").rpartition(".")[0]
        return f"{layer_dir}.{key}" if layer_dir else key

    def recipe(self, allowed: tuple[str, ...] = OPERANDS) -> LayerRecipe | None:
        """The typed recipe of this entry; None when the layer is left alone. ``allowed``: the operands the entry's
        target has (an encoder point's kind); the format's default operands outside them are not quantized.

        Raises:
            ConfigError: unknown format or key, missing or invalid parameter (named by its config path).
        """
        if self.values.get("bypass") is True:
            return None
        fmt = self.values.get("name")
        if fmt is None:
            extra = [key for key in self.values if key not in ("name", "bypass")]
            if extra:
                raise ConfigError(
                    f"{self.where(extra[0])}: has no effect, the layer has no format (set its 'name')"
                )
            return None
        fmt, implied = self._format(fmt)
        values = {**implied, **self.values}
        layer_params = QUANTIZERS[fmt].layer_params
        per_operand: dict[str, dict[str, Any]] = {operand: {} for operand in OPERANDS}
        for key, value in values.items():
            operand = next((o for o in OPERANDS if key.startswith(f"{o}_")), None)
            if operand is not None:
                if key[len(operand) + 1 :] not in _IGNORED_SUFFIXES:
                    per_operand[operand][key[len(operand) + 1 :]] = value
            elif key in ("stochastic", "bipolar") and key not in layer_params:
                self._ignore(key, f"chop reads only the operands' {{data_in,weight,bias}}_{key}")
            elif key in _CHOP_LAYER_KEYS and key not in (*_LAYER_KEYS, *layer_params):
                self._ignore(key, f"format {fmt!r} does not use it")
            elif key not in (*_LAYER_KEYS, *layer_params):
                valid = "|".join(quantizer_parameters(fmt))
                raise ConfigError(
                    f"{self.where(key)}: unknown key for format {fmt!r} "
                    f"(valid: name, bypass, {{data_in,weight,bias,data_out}}_<{valid}>)"
                )
        everything = self._binary_training(fmt, values.get("binary_training"))
        operands: dict[str, OperandRecipe | None] = {}
        origins: dict[str, str] = {}
        for operand, params in per_operand.items():
            if (
                fmt in _FIXED_OPERAND_FORMATS
                and "name" not in params
                and operand not in QUANTIZERS[fmt].slots
                and not (everything and operand != "data_out")
            ):
                for param in params:
                    self._ignore(f"{operand}_{param}", f"chop's {fmt} layer does not quantize {operand}")
                continue
            named = "name" in params
            operand_fmt = params.pop("name", fmt)
            if operand_fmt in QUANTIZERS:
                used = quantizer_parameters(operand_fmt)
                for param in [p for p in params if p not in used and p in _CHOP_OPERAND_PARAMS]:
                    self._ignore(f"{operand}_{param}", f"format {operand_fmt!r} does not use it")
                    del params[param]
            wanted = (
                named
                or bool(params)
                or (operand in QUANTIZERS[fmt].slots and operand in allowed)
                or (everything and operand != "data_out" and operand in allowed)
            )
            if operand_fmt is None or not wanted:
                continue
            shared = QUANTIZERS[operand_fmt].layer_params if operand_fmt in QUANTIZERS else ()
            params.update({p: values[p] for p in shared if p in values})
            _read_bools(operand_fmt, params)
            self._chop_ignores(operand, operand_fmt, params)
            if operand_fmt == "integer" and _frac_above_width(params):
                params["frac_above_width"] = True  # chop computes it: its grid inside (-1, 1)
            try:
                operands[operand] = OperandRecipe(operand_fmt, params)
            except QuantizerParamError as err:
                raise ConfigError(
                    f"{self.where(self._key(operand, err.param, shared))}{err.detail}"
                ) from None
            for param in quantizer_parameters(operand_fmt):
                origins[f"{operand}_{param}"] = self.where(self._key(operand, param, shared))
        return LayerRecipe(**operands, origins=origins)

    def _chop_ignores(self, operand: str, fmt: str, params: dict[str, Any]) -> None:
        """Values chop's own files give that chop computes past: a sign format's width (a binary operand with
        ``data_in_width = 32``: its elements are signs whatever the width) and a ternary statistic below zero (chop's
        profiler records the signed median; as a threshold of |x| it would keep every element, and chop's ternary
        op measures its threshold from the tensor instead, as this reader then does). Each dropped with a note."""
        if fmt in _SIGN_FORMATS and params.get("width") not in (None, 1):
            self._ignore(f"{operand}_width", f"{fmt} elements are signs, 1 bit; chop ignores the width")
            del params["width"]
        if fmt == "ternary":
            for stat in _TERNARY_STATS:
                value = params.get(stat)
                if isinstance(value, (int, float)) and not isinstance(value, bool) and value < 0:
                    self._ignore(
                        f"{operand}_{stat}",
                        "below zero, no threshold of |x|: measured from the tensor, as chop's ternary op does",
                    )
                    params[stat] = None

    def _ignore(self, key: str, why: str) -> None:
        """chop ignores a key its chosen format does not use: so does this reader, with a one-line note."""
        log.info("%s: ignored (%s)", self.where(key), why)

    @staticmethod
    def _key(operand: str, param: str, shared: tuple[str, ...]) -> str:
        return param if param in shared else f"{operand}_{param}"

    def _format(self, fmt: Any) -> tuple[str, dict[str, Any]]:
        """The format name here and the layer keys a MASE alias implies."""
        known = isinstance(fmt, str)
        if known and fmt in _ALIASES:
            return _ALIASES[fmt]
        if known and fmt in _MASE_ONLY:
            raise ConfigError(f"{self.where('name')}={fmt!r}: not available here ({_MASE_ONLY[fmt]})")
        if not known or fmt not in QUANTIZERS:
            raise ConfigError(
                f"{self.where('name')}={fmt!r}: unknown quantization format (valid: {', '.join(QUANTIZERS)})"
            )
        return fmt, {}

    def _binary_training(self, fmt: str, value: Any) -> bool:
        """MASE's ``binary_training`` (bool, or 0/1 in its TOML files): binarise every operand."""
        if value is None:
            return False
        if fmt not in _BINARY_FORMATS:
            self._ignore("binary_training", f"only {', '.join(_BINARY_FORMATS)} use it")
            return False
        if value not in (True, False, 0, 1):
            raise ConfigError(f"{self.where('binary_training')}={value!r}: must be true or false")
        return bool(value)
