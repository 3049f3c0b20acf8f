"""Scores of exported folders on the test split: ``adls-evaluate DIR [DIR ...] [data overrides]`` (also
``python -m adls_lightning.export.evaluate``).

Each ``DIR`` is a folder written by ``python -m adls_lightning.export`` (``format=mxint8``, loaded with
:func:`~adls_lightning.export.load_packed`; ``format=hf``, loaded with ``from_pretrained``; ``format=onnx``, run
in ONNX Runtime on the CPU: the folder's ``model.onnx``, or the ``.onnx`` file named, e.g.
``DIR/model_int8.onnx``; :mod:`adls_lightning.export.folder`); the test split
is the one the exporting run used (its overrides are kept in the folder's ``compression.json``; data overrides
given here replace them, e.g. ``experiment=cpu`` for its 2,000 reviews at 256 tokens), scored with the task's own
metrics, its main metric first (IMDb ``test/acc``, ``test/f1``; MRPC ``test/f1``, ``test/acc``; STS-B
``test/pearson``, ``test/spearman``), so the numbers compare with the run's ``metrics.json``. A compressed run's
folder computes what the run evaluated: its quantized and pruned
weights are in the file, and the recipe puts back what acted on activations
(:mod:`adls_lightning.export.compressed`). Prints one line per folder and how often each folder predicts the
same label as the first (a regression: the mean difference of their outputs). The linear layers run on the GEMM
backend and in the precision the folder's run itself resolved
(``runtime.gemm``, ``trainer.precision``: recorded in its checkpoint and so in the folder; a folder of an older
checkpoint, or ``runtime.gemm=auto`` given here, times the backends on the folder's linear shapes, docs/gemm.md);
an ONNX graph runs on ONNX Runtime's.

The data must be the task the model was trained on (the folder's ``config.json`` records it: ``adls_inputs`` and
the label names): data overrides that change the task, the labels, or pairs of texts for single ones (``data=glue
data.task=mrpc`` on an IMDb export) are refused in one line; those that keep it (``data.test_size``,
``data.max_length``, the same task's ``data.data_dir``) are not. Several folders are compared row by row on one
test split: their runs must have recorded the same test rows (the formats of one checkpoint, or runs of one
data config); folders of runs with other data are refused in one line naming both.

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
    """The command (for :func:`main`): every folder loaded, each one's run data built and checked against the task
    its model was trained on, the folders' test splits held to be one, then each folder scored on it."""
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
    # what can be seen without loading, before torch is imported (seconds)
    exports = [check_folder(folder, USAGE) for folder in folders]
    # imported once the command line and the folders are checked: torch takes seconds
    from omegaconf import OmegaConf

    from adls_lightning.app.preflight import validate_model_settings
    from adls_lightning.export.evaluate import check_data_fits_export, evaluation_data
    from adls_lightning.export.folder import load_folder
    from adls_lightning.gemm import validate as validate_gemm

    # every folder before the data: a damaged one is refused before the test split is tokenized
    models = [load_folder(folder, recipe, USAGE) for folder, recipe in zip(folders, recipes, strict=True)]
    # each folder's own run gives its data, batch size and length, the command line on top (a folder written
    # without a recipe: the first recorded run's)
    first_run = next((recipe.run_overrides for recipe in recipes if recipe is not None), [])
    runs = [
        tuple(merge_overrides(first_run if recipe is None else recipe.run_overrides, overrides))
        for recipe in recipes
    ]
    composed = {}
    for run in dict.fromkeys(runs):
        data, cfg = evaluation_data(run, options=[])
        validate_gemm(cfg.runtime.gemm)
        validate_model_settings(
            {"model": OmegaConf.to_container(cfg.model, resolve=True)}
        )  # as train.py checks them
        composed[run] = data, cfg
    setups = [composed[run] for run in runs]
    for folder, export, (data, _) in zip(folders, exports, setups, strict=True):
        check_data_fits_export(folder, export.config, data)  # its task and labels: nothing tokenized yet
    first_data, first_cfg = setups[0]
    # the folders are compared row by row ("same label as" the first): one test split for all, the first's
    for folder, (data, _) in zip(folders[1:], setups[1:], strict=True):
        if data.task.name != first_data.task.name:
            _refuse_other_data(
                folder, folders[0], f"{folders[0]}: {first_data.task.name}, {folder}: {data.task.name}"
            )
    for data, _ in composed.values():
        data.setup("test")
    for folder, export, (data, _) in zip(folders, exports, setups, strict=True):
        check_data_fits_export(folder, export.config, data)  # now that the data says: pairs or single texts
    # the test rows compared only where the folders' runs composed other data (one run: one split, read once)
    rows = {id(first_data): _test_rows(first_data)} if len(composed) > 1 else {}
    for folder, (data, cfg) in zip(folders[1:], setups[1:], strict=True):
        if data is first_data:
            continue
        if id(data) not in rows:
            rows[id(data)] = _test_rows(data)
        if rows[id(data)] != rows[id(first_data)]:
            _refuse_other_data(folder, folders[0], _data_difference(first_cfg, cfg, folders[0], folder))
    for folder, export in zip(folders, exports, strict=True):
        note = export.graph_note(folder)
        if note is not None:
            print(note, file=sys.stderr)
    _score_folders(folders, models, [cfg for _, cfg in setups], first_data)


def _score_folders(folders: list[Path], models: list, configs: list, data) -> None:
    """Each folder's scores on ``data``'s test split(s) with the task's own metrics, its main metric first (the
    run's ``test/<name>``), and how often it predicts as the first folder does; one line per folder."""
    import torch

    from adls_lightning.export.evaluate import folder_predictions, task_scores
    from adls_lightning.export.folder import task_inputs

    task = data.task
    loaders = data.test_dataloader()
    loaders = loaders if isinstance(loaders, list) else [loaders]
    unit = {True: "pairs", False: "texts"}.get(task_inputs(data)["text_pair"], "rows")
    first = None
    for folder, model, cfg in zip(folders, models, configs, strict=True):
        results = folder_predictions(folder, model, loaders, cfg, task.is_regression)
        scored = []
        for split, (predicted, labels) in zip(task.test_splits, results, strict=True):
            scores = task_scores(predicted, labels, task)
            named = ", ".join(f"{split}/{name} {value:.4f}" for name, value in scores.items())
            scored.append(f"{named} on {len(labels)} {unit}")
        predicted = torch.cat([values for values, _ in results])
        if first is None:
            first, agree = predicted, ""
        elif task.is_regression:  # a score, not a label: how far the outputs are apart
            agree = f", mean |difference| from {folders[0]}: {(predicted - first).abs().mean():.4g}"
        else:
            agree = f", same label as {folders[0]}: {(predicted == first).float().mean():.2%}"
        print(f"{folder}: {'; '.join(scored)}{agree}")


def _refuse_other_data(folder: Path, first: Path, difference: str) -> None:
    raise ConfigError(
        f"{folder}: its run's test split is not {first}'s ({difference}), and the folders are scored and "
        f"compared row by row on one split; valid: folders exported from runs of the same test data (the formats "
        f"of one checkpoint), the others in an adls-evaluate command of their own"
    )


def _test_rows(data) -> list:
    """The rows of ``data``'s test split(s) (set up), as the model is given them: token ids, token types and
    label per row, sorted (the loader's order follows the batch size)."""
    loaders = data.test_dataloader()
    rows = []
    for loader in loaders if isinstance(loaders, list) else [loaders]:
        for batch in loader:
            kept = batch["attention_mask"].bool()
            types = batch.get("token_type_ids")
            for i in range(len(batch["labels"])):
                ids = tuple(batch["input_ids"][i][kept[i]].tolist())
                pair = () if types is None else tuple(types[i][kept[i]].tolist())
                rows.append((ids, pair, float(batch["labels"][i])))
    return sorted(rows)


#: data settings that do not change which rows the test split holds nor their tokens
_LOADER_ONLY = ("batch_size", "num_workers", "cache_dir", "group_by_length", "pad_to_multiple_of")


def _data_difference(first_cfg, cfg, first: Path, folder: Path) -> str:
    """The data settings of two composed configs that differ, as ``A has data.KEY=..; B has data.KEY=..``."""
    from omegaconf import OmegaConf

    ours, theirs = (OmegaConf.to_container(c.data, resolve=True) for c in (first_cfg, cfg))
    keys = [
        key
        for key in sorted(set(ours) | set(theirs))
        if key not in _LOADER_ONLY and ours.get(key) != theirs.get(key)
    ]
    if not keys:
        return "the same data settings give other rows"
    settings = [", ".join(f"data.{key}={values.get(key)}" for key in keys) for values in (ours, theirs)]
    return f"{first} has {settings[0]}; {folder} has {settings[1]}"


if __name__ == "__main__":
    sys.exit(main())
