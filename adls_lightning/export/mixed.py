"""A per-layer mixed assignment as an export folder (``format=mixed``): each linear layer in its own runtime.

The cost model (:mod:`adls_lightning.search.cost`) prices every linear layer in one of its runtime choices (fp32,
bf16, torch's dynamic int8, MXINT8 packed, structured widths of a feed-forward pair); ``adls-budget`` and the
searches choose a mix of them. No single-format export holds such a mix (the ONNX int8 graph holds int8 and fp32
layers only, ``format=mxint8`` packs every layer alike), so the mix is written as it runs
(:func:`adls_lightning.export.mixed_save.save_mixed`):

* ``model.safetensors``: the mixed model's tensors, each layer in its format -- fp32 and structured-width layers
  as float32 (a width's smaller shape), bf16 layers as bfloat16, MXINT8 layers as their int8 mantissas and uint8
  scales (:class:`~adls_lightning.mxint8.QLinearPacked`'s state), int8 layers as the int8 weight
  (``<layer>.weight_int8``), its per-tensor scale and zero point and the float bias (torch's own int8 state is
  a packed object, not a tensor safetensors can hold); everything that is not a linear layer in float32;
* :data:`MIXED_CONFIG_FILE`: the format, its version, and per linear layer its choice and the shape it runs at;
* ``config.json`` (the Hugging Face config with the task's label names and how the run fed it texts), the
  tokenizer and the export recipe (``compression.json``: the run's overrides, so ``adls-evaluate`` scores the
  run's test split), as every export folder holds.

:func:`load_mixed` rebuilds the model from the folder alone: ``from_config``, each linear layer replaced by an
empty module of its runtime and shape, the tensors loaded strictly (every tensor of the file used, every tensor of
the model given). :func:`adls_lightning.export.folder.check_folder` recognises the folder by
:data:`MIXED_CONFIG_FILE`, so ``adls-evaluate DIR`` and ``adls-predict DIR`` run it like any export.

Weights as a pickle are never written or read.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from adls_lightning.errors import ConfigError

if TYPE_CHECKING:  # imported where used: the export's readers check a folder before they import torch
    from torch import nn

MIXED_CONFIG_FILE = "mixed_config.json"
FORMAT = "mixed"
FORMAT_VERSION = 1
#: the tensors an int8 layer is stored as (torch's dynamic int8 linear keeps a packed object, not tensors)
INT8_TENSORS = ("weight_int8", "weight_scale", "weight_zero_point")


def dynamic_int8_class() -> type[nn.Module]:
    from torch.ao.nn.quantized.dynamic import Linear as DynamicInt8Linear

    return DynamicInt8Linear


def read_mixed_config(folder: Path) -> dict[str, Any]:
    """:data:`MIXED_CONFIG_FILE` read and checked (one line naming the file and the key)."""
    from adls_lightning.search.cost import CHOICES

    path = folder / MIXED_CONFIG_FILE
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as error:
        raise ConfigError(f"{path}: not a JSON file ({str(error).splitlines()[0][:200]})") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{path}: a JSON {type(config).__name__}, expected an object (a damaged export)")
    if config.get("format") != FORMAT:
        raise ConfigError(f"{path}: format {config.get('format')!r}, expected {FORMAT!r}")
    if config.get("format_version") != FORMAT_VERSION:
        raise ConfigError(
            f"{path}: format_version {config.get('format_version')}; this project reads {FORMAT_VERSION}"
        )
    layers = config.get("layers")
    if not isinstance(layers, dict) or not layers:
        raise ConfigError(f"{path}: no 'layers' (a mixed export names each linear layer's choice)")
    for name, spec in layers.items():
        if not isinstance(spec, dict) or spec.get("choice") not in CHOICES:
            choice = spec.get("choice") if isinstance(spec, dict) else spec
            raise ConfigError(f"{path}: layer {name}: choice {choice!r} (valid: {', '.join(CHOICES)})")
        for key in ("in_features", "out_features"):
            if not isinstance(spec.get(key), int) or spec[key] < 1:
                raise ConfigError(
                    f"{path}: layer {name}: {key} {spec.get(key)!r}, expected a positive integer"
                )
    return config


def empty_layer(spec: Mapping[str, Any], group_size: int) -> nn.Module:
    """A module of the layer's runtime and shape, its tensors to be loaded."""
    import torch
    from torch import nn

    from adls_lightning.mxint8.qlinear import QLinearPacked
    from adls_lightning.search.cost import Bf16Linear

    choice, n_in, n_out, bias = (
        spec["choice"],
        spec["in_features"],
        spec["out_features"],
        bool(spec.get("bias")),
    )
    if choice == "identity":
        return nn.Identity()
    if choice == "mxint8":
        return QLinearPacked(n_in, n_out, bias, group_size)
    if choice == "int8":
        with (
            warnings.catch_warnings()
        ):  # torch.ao's deprecation notice: it is still the int8 linear that mixes
            warnings.simplefilter("ignore", UserWarning)
            return dynamic_int8_class()(n_in, n_out, bias_=bias, dtype=torch.qint8)
    linear = nn.Linear(n_in, n_out, bias=bias)
    return Bf16Linear(linear) if choice == "bf16" else linear


def load_mixed(folder: str | Path) -> nn.Module:
    """The mixed model of ``folder`` (eval mode, CPU), from the folder alone.

    Raises:
        ConfigError: the folder is not a mixed export, or its tensors do not fit the layers it names.
    """
    import torch
    from safetensors.torch import load_file
    from torch import nn
    from transformers import AutoConfig, AutoModelForSequenceClassification

    from adls_lightning.export import WEIGHTS_FILE
    from adls_lightning.search.cost import _set_module

    folder = Path(folder)
    config = read_mixed_config(folder)
    hf_config = AutoConfig.from_pretrained(str(folder))
    model = AutoModelForSequenceClassification.from_config(hf_config)
    group_size = int(config.get("mxint8_group_size", 32))
    int8_layers: dict[str, nn.Module] = {}
    for name, spec in config["layers"].items():
        try:
            model.get_submodule(name)
        except AttributeError:
            raise ConfigError(
                f"{folder / MIXED_CONFIG_FILE}: layer {name} is not in the model config.json builds"
            ) from None
        layer = empty_layer(spec, group_size)
        if spec["choice"] == "int8":
            # loaded from its own tensors below; in the model after the strict load of the rest
            int8_layers[name] = layer
            layer = nn.Identity()
        _set_module(model, name, layer)
    state = load_file(str(folder / WEIGHTS_FILE))
    for name, layer in int8_layers.items():
        try:
            weight_int8, scale, zero_point = (state.pop(f"{name}.{key}") for key in INT8_TENSORS)
        except KeyError as missing:
            raise ConfigError(
                f"{folder / WEIGHTS_FILE}: no {missing.args[0]} for the int8 layer {name}"
            ) from None
        bias = state.pop(f"{name}.bias", None)
        shape = (config["layers"][name]["out_features"], config["layers"][name]["in_features"])
        if tuple(weight_int8.shape) != shape:
            raise ConfigError(
                f"{folder / WEIGHTS_FILE}: {name}.weight_int8 of shape {tuple(weight_int8.shape)}, the layer is "
                f"{shape[0]} x {shape[1]}; export the model again"
            )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            weight = torch._make_per_tensor_quantized_tensor(weight_int8, float(scale), int(zero_point))
            layer.set_weight_bias(weight, bias)
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as error:  # a tensor missing, one too many, or of another shape than its layer
        lines = [line.strip() for line in str(error).splitlines()[1:] if line.strip()]
        raise ConfigError(
            f"{folder / WEIGHTS_FILE}: does not fit {MIXED_CONFIG_FILE} ({(lines or [str(error)])[0][:200]}); "
            "export the model again"
        ) from None
    for name, layer in int8_layers.items():
        _set_module(model, name, layer)
    return model.eval()


__all__ = ["FORMAT", "INT8_TENSORS", "MIXED_CONFIG_FILE", "empty_layer", "load_mixed", "read_mixed_config"]
