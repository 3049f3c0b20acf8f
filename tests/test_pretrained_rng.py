"""A model read from pretrained files is read once per process, and every later read draws from torch's RNG what
the first drew (Hugging Face initialises the head the checkpoint lacks while reading it): a multirun's jobs and a
search's trials start exactly as the same run alone."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from adls_lightning import models
from adls_lightning.models import load_pretrained, packaged_model_dir

ROOT = Path(__file__).resolve().parents[1]


def seeded_load(folder: Path, num_labels: int = 2) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """The model a seeded run builds from ``folder``, and the next draw of the RNG (what LoRA's init would take)."""
    torch.manual_seed(7)
    model = load_pretrained(str(folder), num_labels=num_labels)
    return model.state_dict(), torch.rand(8)


def assert_same(first, second):
    (state1, draw1), (state2, draw2) = first, second
    assert state1.keys() == state2.keys()
    assert all(torch.equal(state1[k], state2[k]) for k in state1)
    assert torch.equal(draw1, draw2)


@pytest.fixture
def folders(tiny_bert, tmp_path) -> dict[str, Path]:
    """A base model without a head (as MiniLM's package), another task's model, and a model with this task's head."""
    paths = {name: tmp_path / name for name in ("base", "other_task", "same_task")}
    tiny_bert(seed=1).bert.save_pretrained(paths["base"])
    tiny_bert(seed=2, num_labels=1).save_pretrained(paths["other_task"])
    tiny_bert(seed=3).save_pretrained(paths["same_task"])
    return paths


@pytest.mark.parametrize("kind", ["base", "other_task", "same_task"])
def test_a_second_load_in_one_process_builds_what_the_first_built(folders, kind, monkeypatch):
    models._TEMPLATES.clear()
    reads = []
    read = models._read_pretrained
    monkeypatch.setattr(models, "_read_pretrained", lambda *args: reads.append(args) or read(*args))
    first = seeded_load(folders[kind])
    assert_same(first, seeded_load(folders[kind]))
    assert len(reads) == 1  # the second came from the process's copy
    if kind != "same_task":  # a new head: drawn at random, not the folder's
        assert not torch.equal(
            first[0]["classifier.weight"], seeded_load(folders["same_task"])[0]["classifier.weight"]
        )


def test_a_read_whose_draws_are_not_the_heads_is_read_again(folders, monkeypatch):
    models._TEMPLATES.clear()
    reads = []
    read = models._read_pretrained

    def read_and_draw(*args):  # a family whose loading draws more than its head's initialisation
        reads.append(args)
        torch.rand(3)
        return read(*args)

    monkeypatch.setattr(models, "_read_pretrained", read_and_draw)
    assert_same(seeded_load(folders["base"]), seeded_load(folders["base"]))
    assert len(reads) == 2


def test_a_multirun_job_is_the_same_run_alone(tiny_bert, tmp_path, tiny_imdb_dir, cache_dir):
    """The user's path: ``train.py -m seed=2,2`` over a pretrained folder (LoRA, a new head) gives the second job the
    metrics of the first and of ``train.py seed=2`` alone."""
    folder = tmp_path / "pretrained"
    tiny_bert(seed=1, vocab_size=30522).bert.save_pretrained(folder)
    AutoTokenizer.from_pretrained(packaged_model_dir()).save_pretrained(folder)
    common = [
        sys.executable, str(ROOT / "train.py"), f"model.backbone.name_or_path={folder}", "logger=none",
        "trainer=cpu", "trainer.max_epochs=1", "trainer.precision=32-true", "data.max_length=64",
        "data.batch_size=8", "data.val_size=100", "callbacks.rich_progress_bar=null",
        f"data.data_dir={tiny_imdb_dir}", f"paths.cache_dir={cache_dir}",
    ]  # fmt: skip
    for extra in (
        ["-m", "seed=2,2", f"hydra.sweep.dir={tmp_path / 'multi'}"],
        ["seed=2", f"hydra.run.dir={tmp_path / 'alone'}"],
    ):
        proc = subprocess.run([*common, *extra], cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]

    def scores(run: Path) -> dict[str, float]:
        metrics = json.loads((run / "metrics.json").read_text())
        return {
            k: v
            for k, v in metrics.items()
            if k.split("/")[0] in ("train", "val", "test") and "per_sec" not in k
        }

    alone = scores(tmp_path / "alone")
    assert {"train/loss", "val/acc", "test/acc"} <= alone.keys()
    assert scores(tmp_path / "multi" / "0") == alone
    assert scores(tmp_path / "multi" / "1") == alone
