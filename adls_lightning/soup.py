"""A uniform "model soup" (Wortsman et al. 2022): the element-wise mean of the weights of models fine-tuned from the
same start (:func:`average_state_dicts`), written as a checkpoint (:func:`make_soup`). The command is
``python -m adls_lightning.soup`` (:mod:`adls_lightning.tools.soup`, where what is averaged and what must agree is
described).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from adls_lightning.checkpoints import read_checkpoint
from adls_lightning.errors import ConfigError

USAGE = "python -m adls_lightning.soup ckpts=A.ckpt,B.ckpt out=SOUP.ckpt"
# the parts of a Lightning checkpoint a soup leaves out: one run's training state (a soup resumes no run). The rest
# is the first checkpoint's: the module's and the data module's hyper-parameters and the data module's entry under
# its class's name (the task train.py's and the export's checks read: data.datamodule.checkpoint_task), the
# compression record and what the run resolved on its machine
TRAINING_STATE_KEYS = (
    "state_dict",
    "optimizer_states",
    "lr_schedulers",
    "loops",
    "callbacks",
    "epoch",
    "global_step",
)
MASK_SUFFIX = ".mask"
TOO_FEW = f"give at least two checkpoints to average, comma-separated (usage: {USAGE})"


def average_state_dicts(
    state_dicts: Sequence[Mapping[str, Any]], names: Sequence[str], key: str = "ckpts"
) -> dict[str, Any]:
    """The element-wise mean of ``state_dicts``' floating-point tensors (computed in float64, stored in each
    tensor's own dtype); every other entry, and pruning masks, taken from the first after checking they agree.

    ``names`` names each state (its file) in errors.

    Raises:
        ConfigError: ``KEY=NAME: ...`` for fewer than two states, a LoRA state, keys or shapes that differ, or
            masks or integer tensors that differ.
    """
    import torch

    if len(state_dicts) < 2:
        raise ConfigError(f"{key}: {TOO_FEW}")
    first, first_name = state_dicts[0], names[0]
    for state, name in zip(state_dicts, names):
        if lora := next((k for k in state if ".lora_A." in k), None):
            raise ConfigError(
                f"{key}={name}: a LoRA checkpoint ({lora}): the mean of LoRA's A and B factors is not the mean of "
                "the models; average full fine-tunes (model/lora=none)"
            )
    for state, name in zip(state_dicts[1:], names[1:]):
        if missing := next((k for k in first if k not in state), None) or next(
            (k for k in state if k not in first), None
        ):
            raise ConfigError(
                f"{key}={name}: key {missing} is in one of {first_name} and {name} only (checkpoints of "
                "different models or compressions cannot be averaged)"
            )
        for name_k, ours in first.items():
            theirs = state[name_k]
            if not isinstance(ours, torch.Tensor):
                continue
            if theirs.shape != ours.shape or theirs.dtype != ours.dtype:
                raise ConfigError(
                    f"{key}={name}: key {name_k} is {tuple(theirs.shape)} {theirs.dtype} there and "
                    f"{tuple(ours.shape)} {ours.dtype} in {first_name} (another architecture or task)"
                )
            if (not ours.is_floating_point() or name_k.endswith(MASK_SUFFIX)) and not torch.equal(
                ours, theirs
            ):
                what = "pruning mask" if name_k.endswith(MASK_SUFFIX) else f"{ours.dtype} tensor"
                raise ConfigError(
                    f"{key}={name}: {what} {name_k} differs from {first_name}'s (only floating-point weights are "
                    "averaged; the rest must be the same in every checkpoint)"
                )
    averaged: dict[str, Any] = {}
    for name_k, ours in first.items():
        if isinstance(ours, torch.Tensor) and ours.is_floating_point() and not name_k.endswith(MASK_SUFFIX):
            total = torch.zeros(ours.shape, dtype=torch.float64)
            for state in state_dicts:
                total += state[name_k].to(torch.float64)
            averaged[name_k] = (total / len(state_dicts)).to(ours.dtype)
        else:
            averaged[name_k] = ours
    return averaged


# what a soup's checkpoints must share (the rest, such as the seed, learning rate, batch size or epochs, may differ):
# the data they were fine-tuned on, from the checkpoint's datamodule hyper-parameters ...
RECIPE_DATA_KEYS = ("data_dir", "labels", "label_names", "tokenizer")
# ... and, from the run record beside a run's checkpoint (runs.record.read_run_config), the model they started from


def recipe(checkpoint: Mapping[str, Any], path: Path) -> dict[str, Any]:
    """What ``checkpoint`` (read from ``path``) must share with the other checkpoints of a soup: ``data.task`` (as
    adls-table names a run's task: ``imdb``, ``glue/mrpc``), ``data.<key>`` of :data:`RECIPE_DATA_KEYS`, and
    ``model.backbone.<key>`` from ``<run>/.hydra/config.yaml`` when the checkpoint sits in a run's ``checkpoints/``."""
    import os

    from adls_lightning.data.datamodule import checkpoint_task
    from adls_lightning.runs.record import read_run_config

    data = checkpoint.get("datamodule_hyper_parameters") or {}
    found: dict[str, Any] = {}
    task = checkpoint_task(
        checkpoint
    )  # as train.py's own check reads it: imdb, glue/mrpc (a folder task: None)
    if task is not None:
        found["data.task"] = task
    for key in RECIPE_DATA_KEYS:
        if key in data:
            value = data[key]
            found[f"data.{key}"] = (
                os.path.normpath(value) if key == "data_dir" and isinstance(value, str) else value
            )
    if path.parent.name == "checkpoints":
        try:
            backbone = (read_run_config(path.parent.parent).get("model") or {}).get("backbone") or {}
        except (ValueError, AttributeError):
            backbone = {}  # an unreadable record: the weights' shapes are still compared
        if isinstance(backbone, dict):
            found.update(
                {f"model.backbone.{k}": v for k, v in backbone.items() if not isinstance(v, (dict, list))}
            )
    return found


def check_one_recipe(
    checkpoints: Sequence[Mapping[str, Any]], paths: Sequence[Path], key: str = "ckpts"
) -> None:
    """Refuse checkpoints whose :func:`recipe` differs (another task, data, labels, tokenizer or model): their mean
    is no model of either. A key that only one of them records is not compared.

    Raises:
        ConfigError: ``KEY=PATH: <key> is A there and B in FIRST``.
    """
    first = recipe(checkpoints[0], paths[0])
    for checkpoint, path in zip(checkpoints[1:], paths[1:]):
        theirs = recipe(checkpoint, path)
        for name in first:  # in recipe order: the task first
            if name in theirs and theirs[name] != first[name]:
                raise ConfigError(
                    f"{key}={path}: {name} is {theirs[name]} there and {first[name]} in {paths[0]}; valid: "
                    "checkpoints of one recipe (same task, data, labels, tokenizer and model) that differ in seed "
                    "or training settings"
                )


def best_checkpoint(path: Path) -> Path:
    """``path`` itself, or for a run folder its one ``checkpoints/best*.ckpt``; raises ConfigError for none or several."""
    if not path.is_dir():
        return path
    found = sorted((path / "checkpoints").glob("best*.ckpt"))
    if len(found) != 1:
        what = "no checkpoints/best*.ckpt" if not found else f"{len(found)} checkpoints/best*.ckpt files"
        raise ConfigError(f"ckpts={path}: a folder with {what} (name the checkpoint file)")
    return found[0]


def make_soup(ckpts: Sequence[Path], out: Path) -> dict[str, Any]:
    """Average ``ckpts`` (:func:`average_state_dicts`) and write the soup to ``out`` atomically; returns it."""
    import torch

    from adls_lightning.export.compressed import RUN_OVERRIDES_KEY, run_overrides
    from adls_lightning.files.atomic import atomic_write

    checkpoints = [
        read_checkpoint(path, "ckpts", mmap=True) for path in ckpts
    ]  # the optimizer states stay unread
    check_one_recipe(checkpoints, ckpts)
    state = average_state_dicts([c["state_dict"] for c in checkpoints], [str(p) for p in ckpts])
    soup = {k: v for k, v in checkpoints[0].items() if k not in TRAINING_STATE_KEYS}
    soup["state_dict"] = state
    # the first run's model, data and compression, for an export of the soup wherever it is written (its run record
    # is beside the run's checkpoint, not beside the soup)
    if overrides := run_overrides(ckpts[0]):
        soup[RUN_OVERRIDES_KEY] = overrides
    soup["soup"] = [str(p) for p in ckpts]  # where the weights came from
    atomic_write(out, lambda tmp: torch.save(soup, tmp))
    return soup


if __name__ == "__main__":  # `python -m adls_lightning.soup`, the spelling the docs use
    from adls_lightning.tools.soup import main

    sys.exit(main())
