"""``quantize_model``: swap a model's linear layers for :class:`QuantLinear` from a MASE-style config.

Config vocabulary (MASE's ``quantize_transform_pass``, so lab configs can be pasted):

.. code-block:: python

    {
        "by": "type",                                  # or "name" / "regex_name"
        "default": {"config": {"name": None}},         # fallback; name None = leave the layer alone
        "linear": {"config": {"name": "integer", "data_in_width": 8, "data_in_frac_width": 4,
                              "weight_width": 8, "weight_frac_width": 4,
                              "bias_width": 8, "bias_frac_width": 4}},
    }

* ``by: type``: the key ``linear`` configures every linear layer. Any other key is a layer name
  whose entry is merged over the config that layer would get (a per-layer override).
* ``by: name``: keys are layer names (dotted, ``bert.encoder.layer.0.attention.self.query``, or
  MASE's FX spelling with underscores).
* ``by: regex_name``: keys are regular expressions that must match a whole layer name
  (``re.fullmatch``, as MASE); the first matching key wins.
* A layer entry is ``{"config": {...}}`` (MASE) or the dict itself. An entry with ``name`` replaces
  the layer's config; one without is merged over it. ``{"name": None}`` or ``bypass: true`` leaves
  the layer alone. Nested dicts are read as dotted names, so the Hydra override
  ``+quant.config.bert.encoder.layer.0.attention.self.query.weight_width=4`` works.
* Keys of a layer config: ``name``; ``{data_in,weight,bias}_<parameter>`` for the format's
  parameters (``weight_width``, ``data_in_frac_width``, ``bias_block_size``, ...); optional
  ``{slot}_name`` to give one operand another format (``null`` = keep it at full precision);
  ``floor`` (integer). ``data_in`` and ``weight`` are quantized by default (only ``weight`` for
  binary, binary_scaling and ternary, as in MASE); ``bias`` when it has keys.

Layer names are the user-facing module names: for a PEFT model the ``base_model.model.`` prefix,
``.base_layer`` and ``.modules_to_save.<adapter>`` are dropped, so ``classifier`` and
``bert.encoder.layer.0.attention.self.query`` name the same layers with and without LoRA. LoRA
adapters (``lora_A``/``lora_B``) are never quantized; PEFT's ``base_layer`` is, and PEFT's unused
``original_module`` copies are skipped.

The caller's config is never modified (MASE's ``pass_args.pop("by")`` broke reuse across trials).
"""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from torch import nn

from adls_lightning.config import ConfigError
from adls_lightning.layers import FilterFn, swap_module, target_layers
from adls_lightning.quant.linear import SLOTS, QuantLinear, dtype_bits
from adls_lightning.quant.quantizers import (
    QUANTIZERS,
    Quantizer,
    QuantizerParamError,
    make_quantizer,
    quantizer_parameters,
)

BY_OPTIONS = ("type", "name", "regex_name")
#: Keys of a layer config that are not per-operand parameters (besides a format's ``layer_params``).
_LAYER_KEYS = ("name", "bypass")
#: MASE accepts these; blocks never span the token dimension here, so they change nothing.
_IGNORED_SUFFIXES = ("skip_first_dim",)
#: MASE op names other than linear: a config for them cannot apply (only linear layers are swapped).
_OTHER_MASE_OPS = (
    "add", "bmm", "conv1d", "conv2d", "convtranspose2d", "matmul", "mul", "relu", "sub", "batch_norm2d",
    "layer_norm", "group_norm", "instance_norm2d", "rms_norm", "selu", "tanh", "gelu", "softsign",
    "softplus", "grouped_query_attention",
)  # fmt: skip


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


def _is_layer_config(value: Mapping) -> bool:
    """True for a layer entry (``{"config": ...}`` or a dict of layer keys), False for a namespace of names."""
    if "config" in value:
        return True
    return any(key in _layer_keys() or key.startswith(tuple(f"{s}_" for s in SLOTS)) for key in value)


def _layer_keys() -> set[str]:
    """Keys a layer config may hold besides ``{slot}_<parameter>``: name, bypass, every format's layer_params."""
    return {*_LAYER_KEYS, *(p for cls in QUANTIZERS.values() for p in cls.layer_params)}


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


def _layer_entry(value: Any, path: str) -> tuple[dict[str, Any], str]:
    """Unwrap ``{"config": {...}}``; return the plain config and the key path its keys live under."""
    if not isinstance(value, Mapping):
        raise ConfigError(
            f"{path}={value!r}: expected a layer config such as {{config: {{name: integer, ...}}}}"
        )
    if "config" in value:
        extra = [k for k in value if k != "config"]
        if extra:
            raise ConfigError(f"{path}.{extra[0]}: unexpected key next to 'config'")
        inner = value["config"]
        if not isinstance(inner, Mapping):
            raise ConfigError(f"{path}.config={inner!r}: expected a mapping")
        return dict(inner), f"{path}.config"
    return dict(value), path


@dataclass
class _ResolvedConfig:
    """One layer's config: values plus, per key, the config path it came from (for error messages)."""

    values: dict[str, Any]
    origins: dict[str, str]

    @classmethod
    def from_entry(cls, value: Any, path: str) -> _ResolvedConfig:
        values, where = _layer_entry(value, path)
        return cls(values, {k: f"{where}.{k}" for k in values})

    def merged(self, override: _ResolvedConfig) -> _ResolvedConfig:
        if "name" in override.values:
            return override
        return _ResolvedConfig({**self.values, **override.values}, {**self.origins, **override.origins})

    def origin(self, key: str) -> str:
        return self.origins.get(key, key)


@dataclass
class QuantConfig:
    """A parsed quantization config (see the module docstring for the vocabulary)."""

    by: str
    default: _ResolvedConfig
    linear: _ResolvedConfig | None
    patterns: dict[str, _ResolvedConfig]
    names: dict[str, _ResolvedConfig]
    key: str

    @classmethod
    def parse(cls, config: Mapping[str, Any] | None, key: str = "config") -> QuantConfig:
        """Check the structure of ``config`` and every format/parameter it names (no model needed).

        Raises:
            ConfigError: naming the offending key, prefixed with ``key``.
        """
        config = copy.deepcopy(dict(config or {}))
        by = config.pop("by", "type")
        if by not in BY_OPTIONS:
            raise ConfigError(f"{key}.by={by!r}: must be one of {', '.join(BY_OPTIONS)}")
        default_value = config.pop("default", {"config": {"name": None}})
        default = _ResolvedConfig.from_entry(default_value, f"{key}.default")
        linear, patterns, names = None, {}, {}
        if by == "type":
            for op in _OTHER_MASE_OPS:
                if op in config:
                    raise ConfigError(
                        f"{key}.{op}: only linear layers are quantized; remove the '{op}' entry"
                    )
            if "linear" in config:
                linear = _ResolvedConfig.from_entry(config.pop("linear"), f"{key}.linear")
        if by == "regex_name":
            for pattern, value in config.items():
                try:
                    re.compile(pattern)
                except re.error as err:
                    raise ConfigError(f"{key}.{pattern}: not a valid regular expression ({err})") from None
                patterns[pattern] = _ResolvedConfig.from_entry(value, f"{key}.{pattern}")
        else:
            for name, (path, value) in _flatten_names(config, key).items():
                names[name] = _ResolvedConfig.from_entry(value, path)
        parsed = cls(by, default, linear, patterns, names, key)
        parsed._check_formats()
        return parsed

    def _check_formats(self) -> None:
        """Build every config once so bad formats and values fail before any model exists."""
        for config in [self.default, self.linear, *self.patterns.values()]:
            if config is not None:
                build_quantizers(config)
        for override in self.names.values():  # per-name entries apply over linear (by type) or default
            build_quantizers((self.linear or self.default).merged(override))

    def for_layers(self, names: list[str]) -> dict[str, _ResolvedConfig]:
        """Each layer's resolved config.

        Raises:
            ConfigError: a per-name key or regex that matches no layer.
        """
        by_name = {name: self._base_config(name) for name in names}
        for pattern in self.patterns:
            if not any(re.fullmatch(pattern, name) for name in names):
                raise ConfigError(f"{self.key}.{pattern}: matches no linear layer ({_examples(names)})")
        for key, override in self.names.items():
            matched = [name for name in names if key in (name, name.replace(".", "_"))]
            if not matched:
                raise ConfigError(f"{self.key}.{key}: matches no linear layer ({_examples(names)})")
            for name in matched:
                by_name[name] = by_name[name].merged(override)
        return by_name

    def _base_config(self, name: str) -> _ResolvedConfig:
        if self.linear is not None:
            return self.linear
        for pattern, config in self.patterns.items():
            if re.fullmatch(pattern, name):
                return config
        return self.default


def _examples(names: list[str]) -> str:
    shown = ", ".join(names[:3])
    return f"layers are e.g. {shown}" + (f" ... ({len(names)} in all)" if len(names) > 3 else "")


def build_quantizers(config: _ResolvedConfig) -> dict[str, Quantizer | None] | None:
    """Quantizers per operand for one layer config; None when the layer is left alone.

    Raises:
        ConfigError: unknown format or key, missing or invalid parameter (named by its config path).
    """
    values = config.values
    fmt = values.get("name")
    if values.get("bypass") is True:
        return None
    if fmt is None:
        extra = [key for key in values if key not in ("name", "bypass")]
        if extra:
            raise ConfigError(
                f"{config.origin(extra[0])}: has no effect, the layer has no format (set its 'name')"
            )
        return None
    if fmt not in QUANTIZERS:
        raise ConfigError(
            f"{config.origin('name')}={fmt!r}: unknown quantization format (valid: {', '.join(QUANTIZERS)})"
        )
    fmt_class = QUANTIZERS[fmt]
    per_slot: dict[str, dict[str, Any]] = {slot: {} for slot in SLOTS}
    for key, value in values.items():
        slot = next((s for s in SLOTS if key.startswith(f"{s}_")), None)
        if slot is not None:
            param = key[len(slot) + 1 :]
            if param not in _IGNORED_SUFFIXES:
                per_slot[slot][param] = value
        elif key not in (*_LAYER_KEYS, *fmt_class.layer_params):
            valid = "|".join(quantizer_parameters(fmt))
            raise ConfigError(
                f"{config.origin(key)}: unknown key for format {fmt!r} (valid: name, bypass, {{data_in,weight,bias}}_<{valid}>)"
            )
    layer_dir = config.origin("name").rpartition(".")[0]
    quantizers: dict[str, Quantizer | None] = {}
    for slot in SLOTS:
        params = per_slot[slot]
        wanted = bool(params) or slot in fmt_class.slots  # {slot}_name counts as a key
        slot_fmt = params.pop("name", fmt)
        if slot_fmt is None or not wanted:
            quantizers[slot] = None
            continue
        shared = QUANTIZERS[slot_fmt].layer_params if slot_fmt in QUANTIZERS else ()
        params.update({p: values[p] for p in shared if p in values})
        try:
            quantizers[slot] = make_quantizer(slot_fmt, **params)
        except QuantizerParamError as err:
            key = err.param if err.param in shared else f"{slot}_{err.param}"
            where = config.origins.get(key, f"{layer_dir}.{key}" if layer_dir else key)
            raise ConfigError(f"{where}{err.detail}") from None
    return quantizers


def quantize_model(
    model: nn.Module, config: Mapping[str, Any] | QuantConfig, *, key: str = "config"
) -> list[str]:
    """Swap ``model``'s linear layers for :class:`QuantLinear` in place, following ``config``.

    Already-quantized layers get new quantizers (their wrapped linear is reused). Works on plain
    Hugging Face models and on PEFT LoRA models (see the module docstring for names).

    Args:
        model: the model to quantize in place.
        config: MASE-style config (not modified) or a parsed :class:`QuantConfig`.
        key: the config's path, used in error messages (``quant.config`` from the callback).

    Returns:
        The user-facing names of the layers that were quantized.

    Raises:
        ConfigError: bad config, a per-name key matching no layer, or a block size that does not
            divide a layer's dimension. The model is not modified when this is raised.
    """
    parsed = config if isinstance(config, QuantConfig) else QuantConfig.parse(config, key)
    layers = find_linear_layers(model)
    configs = parsed.for_layers([layer.name for layer in layers])
    planned: list[tuple[LinearLayer, dict[str, Quantizer | None]]] = []
    for layer in layers:
        quantizers = build_quantizers(configs[layer.name])
        if quantizers is None:
            continue
        _check_dims(layer, quantizers, configs[layer.name])
        planned.append((layer, quantizers))
    for layer, quantizers in planned:
        linear = layer.module.linear if isinstance(layer.module, QuantLinear) else layer.module
        new = QuantLinear(linear, quantizers["data_in"], quantizers["weight"], quantizers["bias"])
        new.to(device=linear.weight.device)
        swap_module(model, layer.path, new)
    return [layer.name for layer, _ in planned]


def _check_dims(layer: LinearLayer, quantizers: dict[str, Quantizer | None], config: _ResolvedConfig) -> None:
    module = layer.module
    dims = {"data_in": module.in_features, "weight": module.in_features, "bias": module.out_features}
    for slot, quantizer in quantizers.items():
        if quantizer is None or (slot == "bias" and module.bias is None):
            continue
        problem = quantizer.check_last_dim(dims[slot])
        if problem:
            key = f"{slot}_block_size"
            where = config.origins.get(key, f"{config.origin('name').rpartition('.')[0]}.{key}")
            raise ConfigError(
                f"{where}={getattr(quantizer, 'block_size', '?')} {problem} in layer {layer.name}"
            )


def quantized_layers(model: nn.Module) -> list[QuantLinear]:
    """The model's QuantLinear layers."""
    return [layer.module for layer in find_linear_layers(model) if isinstance(layer.module, QuantLinear)]


def quantization_report(model: nn.Module) -> dict[str, float]:
    """Average bit widths and weight storage of ``model``.

    * ``quant/avg_weight_bits``: mean storage bits per linear-layer weight element, weighted by
      element count over all linear layers (LoRA adapters excluded); an unquantized layer counts its
      dtype's width (32 for float32). Block formats include the shared exponent (mxint8 = 8.25).
    * ``quant/avg_act_bits``: the same for the linear layers' input activations, weighted by each
      layer's input features (elements per token).
    * ``quant/weight_bytes``: bytes to store every parameter used in the forward pass: linear
      weights and biases at their quantized widths, everything else (embeddings, norms, LoRA
      adapters) at its dtype's width. PEFT's unused ``original_module`` copies are not counted.
    * ``quant/layers``: number of quantized linear layers.
    """
    layers = find_linear_layers(model)
    weight_bits = weight_elems = act_bits = act_elems = 0.0
    linear_params: set[int] = set()
    linear_bytes = 0.0
    quantized = 0
    for layer in layers:
        module = layer.module
        linear = module.linear if isinstance(module, QuantLinear) else module
        is_quant = isinstance(module, QuantLinear)
        w_bits, a_bits, b_bits = (
            module.slot_bits(s) if is_quant else dtype_bits(linear) for s in ("weight", "data_in", "bias")
        )
        quantized += is_quant
        n_weight = linear.in_features * linear.out_features
        weight_bits += w_bits * n_weight
        weight_elems += n_weight
        act_bits += a_bits * linear.in_features
        act_elems += linear.in_features
        linear_bytes += w_bits * n_weight / 8
        if linear.bias is not None:
            linear_bytes += b_bits * linear.bias.numel() / 8
        linear_params.update(id(p) for p in linear.parameters())
    other_bytes = sum(
        p.numel() * p.element_size()
        for path, p in model.named_parameters()
        if id(p) not in linear_params and "original_module" not in path.split(".")
    )
    return {
        "quant/avg_weight_bits": weight_bits / weight_elems if weight_elems else 0.0,
        "quant/avg_act_bits": act_bits / act_elems if act_elems else 0.0,
        "quant/weight_bytes": linear_bytes + other_bytes,
        "quant/layers": float(quantized),
    }
