"""Refusals before expensive work: the model and its options, the monitored metrics and the data's columns are
checked before any split is tokenized (minutes on all of IMDb), ``debug=`` presets tokenize only the batches they
run, and a run refused inside the task leaves no empty run folder behind.

The refusals are real ``train.py`` subprocesses on the tiny models and data (run side by side from one module
fixture); what the run builds in order is checked in-process, with tokenization made to fail if it is reached.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from adls_lightning.app.training import _checked_objects
from adls_lightning.data.datamodule import TextDataModule, stratified_subset
from adls_lightning.errors import ConfigError
from adls_lightning.runs.folder import entries, remove_unused_run_folder
from adls_lightning.runs.record import RUN_RECORD_DIR
from tests.helpers import TINY_OVERRIDES, assert_one_line_error, make_reviews

ROOT = Path(__file__).resolve().parent.parent
WORKERS = 3


@dataclass(frozen=True)
class Case:
    id: str
    args: tuple[str, ...]
    names: tuple[str, ...]  # what stderr's last line must contain: the key or file, and what would be valid
    data: str = "tiny"  # the data folder: tiny (conftest's), or pairs_train_only
    run_dir: str = "fresh"  # fresh (made by Hydra), empty_before / user_file (made before the process)


CASES = [
    # DistilBERT names its attention projections q_lin / v_lin: BERT's names match nothing
    Case(
        "lora-target-of-another-family",
        ("model=tiny_distilbert", "model.lora.target_modules=[query,value]"),
        ("model.lora.target_modules: query, value match no layer", "attention.q_lin"),
    ),
    Case(
        "lora-targets-empty",
        ("model=tiny_random", "model.lora.target_modules=[]"),
        ("model.lora.target_modules=[]", "attention.self.query", "model/lora=none"),
    ),
    Case(
        "main-metric-not-logged",
        ("model=tiny_random", "main_metric=val/mcc"),
        ("main_metric=val/mcc", "val/acc, val/f1"),
    ),
    Case(
        "optimized-metric-not-recorded",
        ("model=tiny_random", "optimized_metric=val/pearson"),
        ("optimized_metric=val/pearson", "val/acc, val/f1, val/loss, test/acc"),
    ),
    Case(
        "text-pair-in-train-only",
        ("model=tiny_random", "data=folder", "data.val_size=20"),
        ("test.csv: lacks column 'text_pair'", "train.csv"),
        data="pairs_train_only",
    ),
    # refused inside the run: a folder made before this process, or holding a user's file, stays as it was
    Case(
        "earlier-empty-folder-kept",
        ("model=tiny_distilbert", "model.lora.target_modules=[query]"),
        ("model.lora.target_modules",),
        run_dir="empty_before",
    ),
    Case(
        "folder-with-a-file-kept",
        ("overwrite=true", "model=tiny_distilbert", "model.lora.target_modules=[query]"),
        ("model.lora.target_modules",),
        run_dir="user_file",
    ),
    # a typo in a preset or a key, refused as Hydra composes: the group's presets (not the bases they share, such as
    # quant/_base) or the keys at that level, with the closest ones; Hydra's "+" advice only where nothing is close
    Case(
        "preset-typo",
        ("experiment=cpux",),
        ("experiment=cpux: no such preset; valid: cpu, ", "(did you mean cpu?)"),
    ),
    Case(
        "preset-typo-beside-a-base",
        ("quant=int9",),
        ("quant=int9: no such preset; valid: binary, ", "(did you mean int8, int4 or int32?)"),
    ),
    Case(
        "key-typo",
        ("data.max_lenght=64",),
        ("error: data.max_lenght: no such key (did you mean data.max_length?)",),
    ),
    Case(
        "key-typo-in-its-parent",
        ("dat.max_length=64",),
        ("error: dat.max_length: no such key (did you mean data.max_length?)",),
    ),
    Case(
        "key-nothing-close",
        ("callbacks.evaluator=1",),
        (
            "callbacks.evaluator: no such key; callbacks has best_checkpoint, last_checkpoint, ",
            "(a new key is added with +callbacks.evaluator=1)",
        ),
    ),
    # a setting of a group left empty (compile=none) is read by nothing: refused, with the presets to choose
    Case(
        "key-of-a-group-without-preset",
        ("compile.backend=inductr",),
        (
            "error: compile.backend: no compile= preset is chosen, so compile has no keys; choose one first "
            "(valid: compile=aot_eager, compile=inductor), then set compile.backend",
        ),
    ),
]


def _pairs_train_only(folder: Path) -> Path:
    """train.csv with text and text_pair, test.csv with text alone."""
    folder.mkdir(parents=True)
    train = make_reviews(60, seed=0)
    train["text_pair"] = train["text"].str[::-1]
    train.to_csv(folder / "train.csv", index=False)
    make_reviews(20, seed=1).to_csv(folder / "test.csv", index=False)
    return folder


def _run(case: Case, base: Path, tiny_imdb_dir: Path) -> tuple[subprocess.CompletedProcess, Path, Path]:
    out, cache = base / case.id / "run", base / case.id / "cache"
    data = _pairs_train_only(base / case.id / "data") if case.data == "pairs_train_only" else tiny_imdb_dir
    if case.run_dir != "fresh":
        out.mkdir(parents=True)
        if case.run_dir == "user_file":
            (out / "notes.txt").write_text("mine\n")
        time.sleep(2)  # born well before the process (whose start time is known to the second)
    cmd = [
        sys.executable,
        str(ROOT / "train.py"),
        *(o for o in TINY_OVERRIDES if not o.startswith("model=")),
        f"data.data_dir={data}",
        f"paths.cache_dir={cache}",
        f"hydra.run.dir={out}",
        *case.args,
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    return proc, out, cache


@pytest.fixture(scope="module")
def results(tmp_path_factory, tiny_imdb_dir):
    base = tmp_path_factory.mktemp("early")
    with ThreadPoolExecutor(WORKERS) as pool:
        futures = {case.id: pool.submit(_run, case, base, tiny_imdb_dir) for case in CASES}
        return {name: future.result() for name, future in futures.items()}


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_refused_in_one_line_before_any_data_is_tokenized(case, results):
    proc, out, cache = results[case.id]
    line = assert_one_line_error(proc)
    for name in case.names:
        assert name in line, line
    # nothing written: no tokenized split in the cache, no run folder (or the earlier one as it was)
    assert not (cache / "tokenized").exists(), sorted(p.name for p in (cache / "tokenized").iterdir())
    if case.run_dir == "fresh":
        assert not out.exists(), sorted(p.name for p in out.rglob("*"))
    elif case.run_dir == "empty_before":
        assert out.is_dir() and not any(out.iterdir())
    else:
        assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]
        assert (out / "notes.txt").read_text() == "mine\n"


@pytest.fixture
def no_tokenizing(monkeypatch):
    """Tokenizing a split fails the test: a refusal must come before it."""

    def tokenized(self, *args, **kwargs):
        raise AssertionError("a split was tokenized before the refusal")

    monkeypatch.setattr(TextDataModule, "_tokenized", tokenized)


@pytest.mark.parametrize(
    "overrides, match",
    [
        (["model=tiny_distilbert", "model.lora.target_modules=[query,value]"], "model.lora.target_modules"),
        (["model.lora.target_modules=[]"], r"model.lora.target_modules=\[\]"),
        (["model.lora.target_modules=[query,3]"], "model.lora.target_modules: 3 is not a layer name"),
        (["main_metric=val/spearman"], r"main_metric=val/spearman: .* give one of val/acc, val/f1"),
        (["main_metric=acc"], "main_metric=acc: not a validation metric"),
        (["optimized_metric=f1"], "optimized_metric=f1: not a metric this run records"),
        (["data.max_length=4096"], "data.max_length=4096"),
    ],
)
def test_model_and_metric_checks_come_before_tokenization(compose_cfg, no_tokenizing, overrides, match):
    with pytest.raises(ConfigError, match=match):
        _checked_objects(compose_cfg(overrides))


@pytest.mark.parametrize(
    "preset, rows",
    [
        ("fdr", {"train": 8, "val": 8, "test": 8}),  # one batch of each (data.batch_size=8)
        ("limit", {"train": 5 * 8, "val": 3 * 8, "test": 3 * 8}),  # limit_*_batches: 5, 3, 3; one epoch
    ],
)
def test_debug_presets_tokenize_only_the_batches_they_run(compose_cfg, tmp_path, preset, rows):
    cfg = compose_cfg([f"debug={preset}", f"paths.cache_dir={tmp_path / 'cache'}"])
    datamodule = _checked_objects(cfg)[0]
    assert {split: len(rows) for split, rows in datamodule.splits.items()} == rows
    for split in datamodule.splits.values():  # stratified: both classes, as in the source
        assert set(split.with_format(None)["label"]) == {0, 1}
    train = {tuple(r) for r in datamodule.splits["train"].with_format(None)["input_ids"]}
    val = {tuple(r) for r in datamodule.splits["val"].with_format(None)["input_ids"]}
    assert not train & val  # val is still carved out of train before the subsets are drawn


def test_epochs_and_unlimited_splits_read_what_they_reach(compose_cfg, tmp_path):
    cfg = compose_cfg(
        [
            "+trainer.limit_train_batches=4",
            "trainer.max_epochs=2",
            "+trainer.limit_val_batches=0.5",  # a fraction: left to Lightning, all rows tokenized
            f"paths.cache_dir={tmp_path / 'cache'}",
        ]
    )
    datamodule = _checked_objects(cfg)[0]
    # two epochs of 4 batches of 8, each drawn anew; val (fraction) and test (no limit) whole
    assert {split: len(rows) for split, rows in datamodule.splits.items()} == {
        "train": 2 * 4 * 8,
        "val": 100,
        "test": 200,
    }


def test_a_subset_smaller_than_the_classes_is_drawn_unstratified():
    labels = np.array([0, 1] * 10)
    for size in (1, 19):  # one side of the cut has fewer rows than there are classes
        chosen = stratified_subset(labels, size, seed=0)
        assert len(chosen) == size and len(set(chosen)) == size


def _record(folder: Path) -> None:
    (folder / RUN_RECORD_DIR).mkdir()
    for name in ("config.yaml", "hydra.yaml", "overrides.yaml"):
        (folder / RUN_RECORD_DIR / name).write_text("{}\n")


def test_unused_run_folder_goes_with_its_record_and_log(tmp_path):
    (tmp_path / "other-run").mkdir()  # the folder above holds another run: it stays
    folder = tmp_path / "runs" / "run"
    folder.mkdir(parents=True)  # as Hydra makes it, with the folder above it (made in this process, emptied)
    at_start = entries(folder)
    _record(folder)
    handler = logging.FileHandler(folder / "train.log")
    logging.getLogger().addHandler(handler)
    try:
        logging.getLogger(__name__).warning("a record of the refused run")
        assert remove_unused_run_folder(folder, at_start)
    finally:
        logging.getLogger().removeHandler(handler)
        handler.close()
    assert not folder.exists() and not folder.parent.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other-run"]


@pytest.mark.parametrize("content", ["checkpoints", "metrics.json", "notes.txt", ".hydra/extra.txt"])
def test_a_run_folder_holding_anything_else_stays(tmp_path, content):
    folder = tmp_path / "run"
    folder.mkdir()
    at_start = entries(folder)
    _record(folder)
    if content == "checkpoints":
        (folder / "checkpoints").mkdir()
        (folder / "checkpoints" / "last.ckpt").write_bytes(b"weights")
    else:
        (folder / content).write_text("kept\n")
    assert not remove_unused_run_folder(folder, at_start)
    assert (folder / content).exists() and (folder / RUN_RECORD_DIR / "config.yaml").exists()


def test_a_folder_that_held_something_when_the_task_started_stays(tmp_path):
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "old.txt").write_text("earlier\n")
    at_start = entries(folder)
    (folder / "old.txt").unlink()  # even emptied meanwhile: it was not this run's to remove
    assert not remove_unused_run_folder(folder, at_start)
    assert folder.is_dir()


def test_birth_time_is_not_moved_by_an_entry_made_and_removed(tmp_path):
    from adls_lightning.runs.folder import birth_time

    folder = tmp_path / "run"
    folder.mkdir()
    born = birth_time(folder)
    if born is None:
        pytest.skip("this file system keeps no birth time")
    time.sleep(0.05)
    (folder / "probe").mkdir()  # as the pre-flight's writability probe does
    (folder / "probe").rmdir()
    assert birth_time(folder) == born < folder.stat().st_ctime


def test_a_setting_nothing_reads_is_said_not_refused():
    """A setting of a group left empty (+compile.backend=aot_eager with compile=none), or a callbacks leaf that is
    no callback, is read by nothing: said in a warning (a multirun's quant=none job carries ++quant.mode=ptq on
    purpose), with the presets that would read it."""
    from adls_lightning.app.preflight import callback_nodes

    cfg = {
        "callback_order": ["callbacks", "compile"],
        "callbacks": {"kept": {"_target_": "lightning.pytorch.callbacks.Timer"}, "evaluator": 1},
        "compile": {"backend": "aot_eager"},
    }
    with pytest.warns(UserWarning) as caught:
        built = callback_nodes(cfg)
    assert [key for key, _ in built] == ["callbacks.kept"]
    assert [str(w.message) for w in caught] == [
        "callbacks.evaluator=1: not a callback, so nothing reads it (a leaf of callbacks is a node with _target_, "
        "or null to turn it off)",
        "compile.backend=aot_eager: no compile= preset is chosen, so nothing reads this setting (the run goes on "
        "without it); to use it, choose one (valid: compile=aot_eager, compile=inductor)",
    ]
