"""Accuracy of exported folders on the test split: ``python -m adls_lightning.export.evaluate DIR [DIR ...]
[data overrides]``.

Each ``DIR`` is a folder written by ``python -m adls_lightning.export`` (``format=mxint8``, loaded with
:func:`~adls_lightning.export.load_packed`, or ``format=hf``, loaded with ``from_pretrained``); the test split
is the one the exporting run used (its overrides are kept in the folder's ``compression.json``; data overrides
given here replace them, e.g. ``experiment=cpu`` for its 2,000 reviews at 256 tokens), so the numbers compare
with the run's ``test/acc``. A compressed run's folder computes what the run evaluated: its quantized and pruned
weights are in the file, and the recipe puts back what acted on activations
(:mod:`adls_lightning.export.compressed`). Prints one accuracy per folder and how often each folder predicts the
same label as the first. The linear layers run on the GEMM backend ``runtime.gemm`` picks, as in the run's own
evaluation (``auto`` by default: timed on each folder's linear shapes, docs/gemm.md).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from adls_lightning.errors import ConfigError
from adls_lightning.export import CONFIG_FILE, load_packed
from adls_lightning.export.__main__ import compose_train_config
from adls_lightning.export.compressed import ExportRecipe, apply_recipe, merge_overrides
from adls_lightning.gemm import batch_rows, gemm_for
from adls_lightning.gemm import validate as validate_gemm
from adls_lightning.logs import configure_tool

#: the batch keys a sequence classifier takes (token types: sentence pairs of the families that use them)
MODEL_INPUTS = ("input_ids", "attention_mask", "token_type_ids")


def load_folder(folder: Path, recipe: ExportRecipe | None = None):
    """The folder's model, with its compression recipe applied (activation quantizers and pruning)."""
    if (folder / CONFIG_FILE).is_file():
        model = load_packed(folder)
    else:
        from adls_lightning.prune.structured import load_pretrained_structured

        # from_pretrained, or the sizes a structurally pruned export records in its config rebuilt first
        model = load_pretrained_structured(folder).eval()
    return apply_recipe(model, folder, recipe) if recipe is not None else model


@torch.inference_mode()
def predictions(model, loader) -> tuple[torch.Tensor, torch.Tensor]:
    predicted, labels = [], []
    for batch in loader:
        inputs = {key: batch[key] for key in MODEL_INPUTS if key in batch}
        logits = model(**inputs).logits
        predicted.append(logits.argmax(-1))
        labels.append(batch["labels"])
    return torch.cat(predicted), torch.cat(labels)


def evaluation_loader(overrides: Sequence[str]):
    return evaluation_setup(overrides)[0]


def evaluation_setup(overrides: Sequence[str]):
    """The run's test loader and its composed config (for ``runtime.gemm`` and the cache folder)."""
    from adls_lightning.build import build

    cfg = compose_train_config(overrides, return_hydra_config=True)
    data = build(cfg.data, "data")
    data.setup("test")
    return data.test_dataloader(), cfg


def main(argv: Sequence[str]) -> int:
    folders = [Path(a) for a in argv if "=" not in a]
    overrides = [a for a in argv if "=" in a]
    configure_tool()
    missing = [f for f in folders if not f.is_dir()]
    if not folders or missing:
        print(f"error: {missing[0] if missing else 'DIR'}: expected an exported folder", file=sys.stderr)
        return 2
    try:
        recipes = [ExportRecipe.read(folder) for folder in folders]
        # the first folder's run gives the test split (its data, batch size and length), the command line on top
        run = next((recipe.run_overrides for recipe in recipes if recipe is not None), [])
        loader, cfg = evaluation_setup(merge_overrides(run, overrides))
        validate_gemm(cfg.runtime.gemm)
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    first = None
    rows, cache_dir = batch_rows(cfg.data), cfg.paths.get("cache_dir")
    for folder, recipe in zip(folders, recipes, strict=True):
        model = load_folder(folder, recipe)
        with gemm_for(cfg.runtime.gemm, model, rows, cache_dir):
            predicted, labels = predictions(model, loader)
        agree = (
            ""
            if first is None
            else f", same label as {folders[0]}: {(predicted == first).float().mean():.2%}"
        )
        first = predicted if first is None else first
        print(
            f"{folder}: test accuracy {(predicted == labels).float().mean():.4f} on {len(labels)} reviews{agree}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
