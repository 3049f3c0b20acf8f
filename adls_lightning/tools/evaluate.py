"""Accuracy of exported folders on the test split: ``adls-evaluate DIR [DIR ...] [data overrides]`` (also
``python -m adls_lightning.export.evaluate``).

Each ``DIR`` is a folder written by ``python -m adls_lightning.export`` (``format=mxint8``, loaded with
:func:`~adls_lightning.export.load_packed`; ``format=hf``, loaded with ``from_pretrained``; ``format=onnx``, run
in ONNX Runtime on the CPU: the folder's ``model.onnx``, or the ``.onnx`` file named, e.g.
``DIR/model_int8.onnx``; :mod:`adls_lightning.export.folder`); the test split
is the one the exporting run used (its overrides are kept in the folder's ``compression.json``; data overrides
given here replace them, e.g. ``experiment=cpu`` for its 2,000 reviews at 256 tokens), so the numbers compare
with the run's ``test/acc``. A compressed run's folder computes what the run evaluated: its quantized and pruned
weights are in the file, and the recipe puts back what acted on activations
(:mod:`adls_lightning.export.compressed`). Prints one accuracy per folder and how often each folder predicts the
same label as the first. The linear layers run on the GEMM backend and in the precision the run itself resolved
(``runtime.gemm``, ``trainer.precision``: recorded in its checkpoint and so in the folder; a folder of an older
checkpoint, or ``runtime.gemm=auto`` given here, times the backends on the folder's linear shapes, docs/gemm.md);
an ONNX graph runs on ONNX Runtime's.

Every folder is read and loaded before the test split is built: a folder that is not such an export (weights
as a pickle such as ``pytorch_model.bin``, which is never unpickled; an ONNX export without ``config.json``) or a
damaged one (a cut ``model.safetensors`` or graph, a config that is not JSON) is refused in one line naming the
file, exit code 2.
``--help``: this text.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from adls_lightning.errors import ConfigError
from adls_lightning.logs import configure_tool
from adls_lightning.overrides import merge_overrides
from adls_lightning.tools.options import run_tool, split_options

USAGE = "python -m adls_lightning.export.evaluate DIR [DIR ...] [data overrides]"


def main(argv: Sequence[str] | None = None) -> int:
    """``adls-evaluate`` and ``python -m adls_lightning.export.evaluate``."""
    configure_tool()
    argv = sys.argv[1:] if argv is None else argv
    return run_tool(lambda: evaluate_folders(argv), __doc__)


def evaluate_folders(argv: Sequence[str]) -> None:
    """The command (for :func:`main`): every folder loaded, then the test split built, then each evaluated."""
    options, overrides = split_options(argv, {}, f"{USAGE}, e.g. outputs/export/run1", positional="folders")
    folders = [Path(a) for a in options["folders"]]
    if not folders:
        raise ConfigError(f"DIR: expected an exported folder ({USAGE})")
    from adls_lightning.export.folder import check_folder
    from adls_lightning.export.recipe import ExportRecipe

    # each recipe first (a damaged one is named before the files it describes); an ONNX graph's is its folder's
    recipes = [
        ExportRecipe.read(folder if folder.is_dir() else folder.parent) if folder.exists() else None
        for folder in folders
    ]
    for folder in folders:  # what can be seen without loading, before torch is imported (seconds)
        check_folder(folder, USAGE)
    # imported once the command line and the folders are checked: torch takes seconds
    from omegaconf import OmegaConf

    from adls_lightning.app.preflight import validate_model_settings
    from adls_lightning.export.evaluate import evaluation_setup, folder_predictions
    from adls_lightning.export.folder import load_folder
    from adls_lightning.gemm import validate as validate_gemm

    # every folder before the data: a damaged one is refused before the test split is tokenized
    models = [load_folder(folder, recipe, USAGE) for folder, recipe in zip(folders, recipes, strict=True)]
    # the first folder's run gives the test split (its data, batch size and length), the command line on top
    run = next((recipe.run_overrides for recipe in recipes if recipe is not None), [])
    loader, cfg = evaluation_setup(merge_overrides(run, overrides), options=[])
    validate_gemm(cfg.runtime.gemm)
    validate_model_settings(
        {"model": OmegaConf.to_container(cfg.model, resolve=True)}
    )  # as train.py checks them
    first = None
    for folder, model in zip(folders, models, strict=True):
        predicted, labels = folder_predictions(folder, model, loader, cfg)
        agree = (
            ""
            if first is None
            else f", same label as {folders[0]}: {(predicted == first).float().mean():.2%}"
        )
        first = predicted if first is None else first
        print(
            f"{folder}: test accuracy {(predicted == labels).float().mean():.4f} on {len(labels)} reviews{agree}"
        )


if __name__ == "__main__":
    sys.exit(main())
