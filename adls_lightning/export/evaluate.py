"""Accuracy of exported folders on the test split: ``python -m adls_lightning.export.evaluate DIR [DIR ...]
[data overrides]``.

Each ``DIR`` is a folder written by ``python -m adls_lightning.export`` (``format=mxint8``, loaded with
:func:`~adls_lightning.export.load_packed`, or ``format=hf``, loaded with ``from_pretrained``); the test split
is the one ``train.py`` uses for the same data overrides (e.g. ``experiment=cpu`` for its 2,000 reviews at
256 tokens), so the numbers compare with a run's ``test/acc``. Prints one accuracy per folder and how often
each folder predicts the same label as the first.
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path

import torch

from adls_lightning.errors import ConfigError
from adls_lightning.export import CONFIG_FILE, load_packed
from adls_lightning.export.__main__ import CONF_DIR, PROJECT_ROOT


def load_folder(folder: Path):
    if (folder / CONFIG_FILE).is_file():
        return load_packed(folder)
    from transformers import AutoModelForSequenceClassification

    return AutoModelForSequenceClassification.from_pretrained(folder).eval()


@torch.inference_mode()
def predictions(model, loader) -> tuple[torch.Tensor, torch.Tensor]:
    predicted, labels = [], []
    for batch in loader:
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        predicted.append(logits.argmax(-1))
        labels.append(batch["labels"])
    return torch.cat(predicted), torch.cat(labels)


def evaluation_loader(overrides: Sequence[str]):
    from hydra import compose, initialize_config_dir

    from adls_lightning.build import build

    os.environ.setdefault("PROJECT_ROOT", str(PROJECT_ROOT))
    with warnings.catch_warnings(), initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        warnings.simplefilter("ignore")
        cfg = compose("train", overrides=list(overrides), return_hydra_config=True)
    data = build(cfg.data, "data")
    data.setup("test")
    return data.test_dataloader()


def main(argv: Sequence[str]) -> int:
    folders = [Path(a) for a in argv if "=" not in a]
    overrides = [a for a in argv if "=" in a]
    missing = [f for f in folders if not f.is_dir()]
    if not folders or missing:
        print(f"error: {missing[0] if missing else 'DIR'}: expected an exported folder", file=sys.stderr)
        return 2
    try:
        loader = evaluation_loader(overrides)
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    first = None
    for folder in folders:
        predicted, labels = predictions(load_folder(folder), loader)
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
