"""The recipe file of a compressed export: what acts on the activations, read without importing torch.

:mod:`adls_lightning.export.compressed` writes it and puts it back on a loaded model
(:func:`~adls_lightning.export.compressed.apply_recipe`); here is only the file, so the export's readers
(``adls-predict``, ``adls-evaluate``) refuse a damaged recipe before they import torch.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from adls_lightning.errors import ConfigError
from adls_lightning.overrides import override_key

if TYPE_CHECKING:
    import torch

    from adls_lightning.prune import Pruner

RECIPE_FILE = "compression.json"
ACTIVATION_STATE_FILE = "compression.safetensors"
RECIPE_VERSION = 1
#: override keys whose value is a path, read relative to the folder the process runs in
PATH_KEYS = ("data.data_dir",)


def absolute_paths(overrides: Sequence[str], base: Path) -> list[str]:
    """``overrides`` with each relative path of :data:`PATH_KEYS` made absolute against ``base`` (the folder it was
    given in) where it names something there; every other token as given. An export keeps the run's overrides,
    which ``adls-evaluate`` composes again from whatever folder it runs in: a relative data folder would be another
    one there, or none."""
    found = []
    for token in overrides:
        key, sep, value = token.partition("=")
        if sep and value and override_key(token) in PATH_KEYS and not Path(value).is_absolute():
            path = base / value
            if path.exists():
                token = f"{key}={os.path.normpath(path.absolute())}"
        found.append(token)
    return found


@dataclass
class ExportRecipe:
    """What :data:`RECIPE_FILE` holds: the run it came from and what acts on activations."""

    run_overrides: list[str] = field(default_factory=list)
    activation_quant: dict[str, dict[str, Any]] = field(default_factory=dict)
    activation_prune: dict[str, Any] | None = None
    baked: dict[str, int] = field(default_factory=dict)
    version: int = RECIPE_VERSION
    #: layers whose activation quantizer works in SmoothQuant's space (its factors are in the activation state)
    smoothed: list[str] = field(default_factory=list)

    @staticmethod
    def prune_spec(pruner: Pruner | None) -> dict[str, Any] | None:
        if pruner is None or pruner.activation is None:
            return None
        spec = {k: v for k, v in dataclasses.asdict(pruner.activation).items() if k != "key"}
        return {"activation": spec, "include": pruner.include, "exclude": pruner.exclude, "seed": pruner.seed}

    def write(self, out: Path, state: Mapping[str, torch.Tensor]) -> None:
        """:data:`RECIPE_FILE` (a relative data path as the export read it: from its working folder) and the
        activation quantizers' ``state``."""
        recipe = dataclasses.asdict(self)
        recipe["run_overrides"] = absolute_paths(self.run_overrides, Path.cwd())
        (out / RECIPE_FILE).write_text(json.dumps(recipe, indent=1) + "\n")
        if state:
            from safetensors.torch import save_file

            save_file(dict(state), str(out / ACTIVATION_STATE_FILE), metadata={"format": "pt"})

    @classmethod
    def read(cls, folder: Path) -> ExportRecipe | None:
        """The folder's recipe, or None for a folder written without one (older exports, other tools)."""
        path = folder / RECIPE_FILE
        if not path.is_file():
            return None
        try:
            data = json.loads(path.read_text())
            recipe = cls(**data)
        except (ValueError, TypeError) as error:
            raise ConfigError(f"{path}: damaged export recipe ({str(error).splitlines()[0][:200]})") from None
        if recipe.version != RECIPE_VERSION:
            raise ConfigError(f"{path}: recipe version {recipe.version}; this project reads {RECIPE_VERSION}")
        return recipe
