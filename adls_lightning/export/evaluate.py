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

Every folder is read and loaded before the test split is built: a folder that is not such an export (an ONNX
export, weights as a pickle such as ``pytorch_model.bin``, which is never unpickled) or a damaged one (a cut
``model.safetensors``, a config that is not JSON) is refused in one line naming the file, exit code 2.
``--help``: this text.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from adls_lightning.errors import ConfigError
from adls_lightning.export import CONFIG_FILE, WEIGHTS_FILE, load_packed
from adls_lightning.export.__main__ import compose_train_config
from adls_lightning.export.compressed import (
    ACTIVATION_STATE_FILE,
    ExportRecipe,
    apply_recipe,
    merge_overrides,
)
from adls_lightning.gemm import batch_rows, gemm_for
from adls_lightning.gemm import validate as validate_gemm
from adls_lightning.logs import configure_tool
from adls_lightning.tool_options import run_tool, split_options

#: the batch keys a sequence classifier takes (token types: sentence pairs of the families that use them)
MODEL_INPUTS = ("input_ids", "attention_mask", "token_type_ids")
USAGE = "python -m adls_lightning.export.evaluate DIR [DIR ...] [data overrides]"
#: a ``format=hf`` folder's Hugging Face config
HF_CONFIG_FILE = "config.json"
#: weights files a folder may hold that are pickles: never read here (a pickle can run code when loaded)
PICKLED_WEIGHTS = ("pytorch_model.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl")


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as error:
        raise ConfigError(f"{path}: not a JSON file ({str(error).splitlines()[0][:200]})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a JSON {type(data).__name__}, expected an object (a damaged export)")
    return data


def _check_safetensors(path: Path) -> None:
    from safetensors import safe_open

    try:
        with safe_open(str(path), "pt") as handle:
            handle.keys()
    except Exception as error:  # noqa: BLE001 - safetensors' own error type: a damaged or cut file, named
        raise ConfigError(
            f"{path}: not a readable safetensors file ({str(error).splitlines()[0][:200]}); export the "
            "checkpoint again"
        ) from None


def check_folder(folder: Path) -> None:
    """What :func:`load_folder` reads, checked without building a model: ``format=mxint8`` (its config and
    weights) or ``format=hf`` (``config.json`` and ``model.safetensors``), nothing pickled, nothing damaged.

    Raises:
        ConfigError: naming the folder or the file, and what would be valid.
    """
    if not folder.is_dir():
        raise ConfigError(f"{folder}: expected an exported folder ({USAGE})")
    if (folder / CONFIG_FILE).is_file():
        config = _read_json(folder / CONFIG_FILE)
        missing = [
            k for k in ("hf_config", "group_size", "packed_linear", "packed_embeddings") if k not in config
        ]
        if missing:
            raise ConfigError(f"{folder / CONFIG_FILE}: no {missing[0]!r} (not written by format=mxint8)")
    elif (folder / HF_CONFIG_FILE).is_file():
        _read_json(folder / HF_CONFIG_FILE)
    else:
        onnx = sorted(p.name for p in folder.glob("*.onnx"))
        what = (
            f"an ONNX export ({onnx[0]}): run it with ONNX Runtime (docs/inference.md)"
            if onnx
            else f"no {CONFIG_FILE} or {HF_CONFIG_FILE}"
        )
        raise ConfigError(f"{folder}: {what}; valid: folders of format=mxint8 or format=hf")
    weights = folder / WEIGHTS_FILE
    if not weights.is_file():
        pickled = sorted(p.name for pattern in PICKLED_WEIGHTS for p in folder.glob(pattern))
        found = f"its weights are a pickle ({pickled[0]}), which is not loaded" if pickled else "no weights"
        raise ConfigError(f"{folder}: {found}; valid: {WEIGHTS_FILE}, as the export writes it")
    _check_safetensors(weights)
    if (folder / ACTIVATION_STATE_FILE).is_file():
        _check_safetensors(folder / ACTIVATION_STATE_FILE)


def load_folder(folder: Path, recipe: ExportRecipe | None = None):
    """The folder's model, with its compression recipe applied (activation quantizers and pruning).

    Raises:
        ConfigError: the folder is not an export or is damaged (:func:`check_folder`), or its files do not
            build a model.
    """
    check_folder(folder)
    try:
        if (folder / CONFIG_FILE).is_file():
            model = load_packed(folder)
        else:
            from adls_lightning.prune.structured import load_pretrained_structured

            # from_pretrained, or the sizes a structurally pruned export records in its config rebuilt first
            model = load_pretrained_structured(folder).eval()
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RuntimeError) as error:
        # a config or weights that do not build the model it describes (edited, mixed from two exports)
        raise ConfigError(
            f"{folder}: its files do not load as a model ({type(error).__name__}: "
            f"{str(error).splitlines()[0][:200] if str(error) else ''}); export the checkpoint again"
        ) from None
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


def evaluation_setup(overrides: Sequence[str], options: Sequence[str] | None = None):
    """The run's test loader and its composed config (for ``runtime.gemm`` and the cache folder); ``options``:
    the calling tool's own keys, named when an override sets a key the config lacks."""
    from adls_lightning.build import build

    cfg = compose_train_config(overrides, return_hydra_config=True, options=options)
    data = build(cfg.data, "data")
    data.setup("test")
    return data.test_dataloader(), cfg


def main(argv: Sequence[str]) -> int:
    configure_tool()
    return run_tool(lambda: evaluate_folders(argv), __doc__)


def evaluate_folders(argv: Sequence[str]) -> None:
    """The command (for :func:`main`): every folder loaded, then the test split built, then each evaluated."""
    options, overrides = split_options(argv, {}, f"{USAGE}, e.g. outputs/export/run1", positional="folders")
    folders = [Path(a) for a in options["folders"]]
    if not folders:
        raise ConfigError(f"DIR: expected an exported folder ({USAGE})")
    recipes = [ExportRecipe.read(folder) if folder.is_dir() else None for folder in folders]
    # every folder before the data: a damaged one is refused before the test split is tokenized
    models = [load_folder(folder, recipe) for folder, recipe in zip(folders, recipes, strict=True)]
    # the first folder's run gives the test split (its data, batch size and length), the command line on top
    run = next((recipe.run_overrides for recipe in recipes if recipe is not None), [])
    loader, cfg = evaluation_setup(merge_overrides(run, overrides), options=[])
    validate_gemm(cfg.runtime.gemm)
    first = None
    rows, cache_dir = batch_rows(cfg.data), cfg.paths.get("cache_dir")
    for folder, model in zip(folders, models, strict=True):
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


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
