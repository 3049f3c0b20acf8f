"""Write a per-layer mixed assignment as an export folder (``format=mixed``; :mod:`adls_lightning.export.mixed`
describes the files and loads them): what ``adls-budget out=`` and ``benchmarks/bench_cost_model.py`` write.

The writer is a module of its own so that the format's loader, which the export's folder loading imports, imports
nothing of the folder loading back (``scripts/import_graph.py``: no circles).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from adls_lightning.errors import ConfigError
from adls_lightning.export.mixed import FORMAT, FORMAT_VERSION, MIXED_CONFIG_FILE, dynamic_int8_class


def layer_spec(module: nn.Module, choice: str) -> dict[str, Any]:
    """What rebuilds the layer: its choice and the shape it runs at (a structured width's smaller one)."""
    if isinstance(module, dynamic_int8_class()):
        weight, bias = module._weight_bias()
        out_features, in_features = weight.shape
        has_bias = bias is not None
    else:
        in_features, out_features = int(module.in_features), int(module.out_features)
        has_bias = getattr(module, "bias", None) is not None
    return {
        "choice": choice,
        "in_features": int(in_features),
        "out_features": int(out_features),
        "bias": has_bias,
    }


def mixed_state(model: nn.Module, int8_layers: list[str]) -> dict[str, torch.Tensor]:
    """The model's tensors, each int8 layer's packed state as plain tensors (the int8 weight, its per-tensor scale
    and zero point, the float bias; :data:`adls_lightning.export.mixed.INT8_TENSORS`)."""
    state = {}
    skip = tuple(name + "." for name in int8_layers)
    for key, value in model.state_dict().items():
        if not key.startswith(skip) and isinstance(value, torch.Tensor):
            state[key] = value.detach().contiguous()
    for name in int8_layers:
        weight, bias = model.get_submodule(name)._weight_bias()
        state[f"{name}.weight_int8"] = weight.int_repr().contiguous()
        state[f"{name}.weight_scale"] = torch.tensor([weight.q_scale()], dtype=torch.float64)
        state[f"{name}.weight_zero_point"] = torch.tensor([weight.q_zero_point()], dtype=torch.int64)
        if bias is not None:
            state[f"{name}.bias"] = bias.detach().float().contiguous()
    return state


def save_mixed(
    model: nn.Module,
    assignment: Mapping[str, str],
    out: str | Path,
    inputs: Mapping[str, Any] | None = None,
    tokenizer: str | None = None,
    run_overrides: list[str] | None = None,
    note: str | None = None,
) -> nn.Module:
    """Write ``model`` (an fp32 sequence classifier) with ``assignment`` (layer -> choice; absent: fp32) to
    ``out``; returns the mixed model as written (each layer in its runtime).

    ``inputs``: how the run fed texts (:func:`adls_lightning.export.folder.task_inputs`), into ``config.json``;
    ``tokenizer``: its name, saved beside the model when it loads offline; ``run_overrides``: the run's overrides,
    into the export recipe (``adls-evaluate`` composes the run's test split from them).

    Raises:
        ConfigError: a layer the model does not have, or a choice it has no runtime for.
    """
    from adls_lightning.export import WEIGHTS_FILE
    from adls_lightning.export.folder import save_tokenizer, write_config
    from adls_lightning.export.recipe import ExportRecipe
    from adls_lightning.search.cost import MXINT8_GROUP, apply_assignment, linear_layers

    out = Path(out)
    layers = linear_layers(model)
    unknown = [name for name in assignment if name not in layers]
    if unknown:
        raise ConfigError(f"{unknown[0]}: not a linear layer of the model (layers: {', '.join(layers)})")
    mixed = apply_assignment(model, assignment)
    specs = {name: layer_spec(mixed.get_submodule(name), assignment.get(name, "fp32")) for name in layers}
    int8_layers = [name for name, spec in specs.items() if spec["choice"] == "int8"]
    out.mkdir(parents=True, exist_ok=True)
    save_file(mixed_state(mixed, int8_layers), str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    config = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "architecture": type(model).__name__,
        "mxint8_group_size": MXINT8_GROUP,
        "layers": specs,
        "runtime": "PyTorch eager: fp32 nn.Linear, bf16 Bf16Linear, int8 torch's dynamic int8 linear, "
        "mxint8 QLinearPacked, w75/w50 smaller fp32 layers",
    }
    if note:
        config["note"] = note
    (out / MIXED_CONFIG_FILE).write_text(json.dumps(config, indent=1) + "\n")
    # a copy: write_config records the inputs on the config it is given, not on the caller's model
    write_config(copy.deepcopy(model.config), out, dict(inputs) if inputs is not None else None)
    ExportRecipe(run_overrides=list(run_overrides or [])).write(out, {})
    if tokenizer:
        save_tokenizer(tokenizer, out)
    return mixed


__all__ = ["layer_spec", "mixed_state", "save_mixed"]
