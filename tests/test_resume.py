"""Kill-and-resume: a run killed mid-epoch and resumed with ``ckpt_path=last`` trains on exactly the batches an
uninterrupted run of the same seed trains on and ends with the same metrics (bit-for-bit on CPU); checkpoint and metrics writes never destroy the
previous good file.

The runs are real ``train.py`` subprocesses (a tiny random BERT, 64 training rows, 8 steps per epoch, 2 epochs).
Two callbacks from this module ride along through ``ADLS_EXTRA_TARGETS``: one records a fingerprint of every
training batch per global step, one kills the process (``os._exit``, no clean-up) at a given step.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import lightning as L
import pytest
import torch

from adls_lightning.io_utils import AtomicCheckpointIO, atomic_write_json

ROOT = Path(__file__).resolve().parent.parent
STEPS_PER_EPOCH = 8  # 64 rows / batch 8
KILL_AT_STEP = 11  # second epoch, two steps after the last.ckpt of step 9
COMPARED_METRICS = ("train/loss", "val/loss", "val/acc", "test/loss", "test/acc", "test/f1")


class RecordBatches(L.Callback):
    """Append ``{"step": global_step, "rows": [crc32 of each row's tokens]}`` per training batch to a file."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        rows = [zlib.crc32(row[row != 0].numpy().tobytes()) for row in batch["input_ids"]]
        with self.path.open("a") as handle:
            handle.write(json.dumps({"step": trainer.global_step, "rows": rows}) + "\n")


class KillAtStep(L.Callback):
    """``os._exit`` (as SIGKILL would: no checkpoint, no clean-up) when the given global step is about to run."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            os._exit(17)


def _train(run_dir: Path, data_dir: Path, cache_dir: Path, extra: list[str]) -> subprocess.CompletedProcess:
    overrides = [
        "model=tiny_random",
        "logger=csv",
        "trainer=cpu",
        "trainer.max_epochs=2",
        "trainer.log_every_n_steps=1",
        "data.max_length=32",
        "data.batch_size=8",
        "data.train_size=64",
        "data.val_size=16",
        "data.test_size=16",
        f"data.data_dir={data_dir}",
        f"paths.cache_dir={cache_dir}",
        f"hydra.run.dir={run_dir}",
        "callbacks.rich_progress_bar=null",
        "callbacks.last_checkpoint.every_n_train_steps=3",
        f"+callbacks.record._target_={__name__}.RecordBatches",
        f"+callbacks.record.path={run_dir.parent / (run_dir.name + '-batches.jsonl')}",
        *extra,
    ]
    env = {
        **os.environ,
        "ADLS_EXTRA_TARGETS": f"{__name__}.*",
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")]),
        "WANDB_MODE": "offline",
    }
    return subprocess.run(
        [sys.executable, str(ROOT / "train.py"), *overrides],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def _batches(run_dir: Path) -> dict[int, list[int]]:
    """Step -> row fingerprints; a step trained twice (before the kill and again after) keeps its last record."""
    lines = (run_dir.parent / (run_dir.name + "-batches.jsonl")).read_text().splitlines()
    return {rec["step"]: rec["rows"] for rec in map(json.loads, lines)}


def _kill_and_resume(tmp_path: Path, data_dir: Path, cache_dir: Path, preset: list[str]) -> dict:
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    with ThreadPoolExecutor(2) as pool:  # the uninterrupted run and the run to be killed, side by side
        whole_run = pool.submit(_train, whole, data_dir, cache_dir, preset)
        kill_run = pool.submit(
            _train,
            killed,
            data_dir,
            cache_dir,
            [
                *preset,
                f"+callbacks.kill._target_={__name__}.KillAtStep",
                f"+callbacks.kill.step={KILL_AT_STEP}",
            ],
        )
        whole_result, kill_result = whole_run.result(), kill_run.result()
    assert whole_result.returncode == 0, whole_result.stderr[-3000:]
    assert kill_result.returncode == 17, kill_result.stderr[-3000:]
    resumed = _train(killed, data_dir, cache_dir, [*preset, "ckpt_path=last"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    return {
        "whole": (whole, json.loads((whole / "metrics.json").read_text())),
        "resumed": (killed, json.loads((killed / "metrics.json").read_text())),
        "stderr": resumed.stderr,
    }


@pytest.mark.parametrize("preset", [[], ["quant=int8"], ["prune=l1_0.5"]], ids=["plain", "int8", "l1_0.5"])
def test_killed_run_resumes_exactly(tmp_path, tiny_imdb_dir, cache_dir, preset):
    runs = _kill_and_resume(tmp_path, tiny_imdb_dir, cache_dir, preset)
    whole_dir, whole_metrics = runs["whole"]
    killed_dir, resumed_metrics = runs["resumed"]
    # The same batches at every step: two full epochs, none repeated or skipped.
    whole_batches, resumed_batches = _batches(whole_dir), _batches(killed_dir)
    assert sorted(whole_batches) == list(range(2 * STEPS_PER_EPOCH))
    assert resumed_batches == whole_batches
    # Lightning's warning about a loader it cannot resume is gone.
    assert "not resumable" not in runs["stderr"]
    # The same result, bit for bit (same seed, CPU, same batches, the RNG state restored for dropout).
    for key in COMPARED_METRICS:
        assert resumed_metrics[key] == whole_metrics[key], key
    # Not asserted yet: the CSV log's pre-kill rows. Lightning's CSV writer deletes an existing metrics.csv when
    # it opens its folder (_ExperimentWriter._check_log_dir_exists), so a resumed run keeps only its own rows.
    # No temporary file of any checkpoint or metrics write was left behind.
    assert not [p for p in killed_dir.rglob("*.tmp")]
    assert oct((killed_dir / "metrics.json").stat().st_mode & 0o777) == oct(0o666 & ~_umask())


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_checkpoint_write_never_goes_through_tmpdir(tmp_path, monkeypatch):
    """Written beside the target and renamed: a $TMPDIR that does not even exist is never used."""
    monkeypatch.setenv("TMPDIR", str(tmp_path / "no-such-tmpdir"))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)
    target = tmp_path / "ckpts" / "last.ckpt"
    AtomicCheckpointIO().save_checkpoint({"state_dict": {"w": torch.ones(3)}}, target)
    assert torch.equal(torch.load(target, weights_only=True)["state_dict"]["w"], torch.ones(3))
    assert [p.name for p in target.parent.iterdir()] == ["last.ckpt"]


_KILL_DURING_WRITE = """
import os, sys, torch
from adls_lightning import io_utils
real_fsync = os.fsync
def dying_fsync(fd):  # the new bytes are out, not yet renamed over the target: die here
    os._exit(9)
os.fsync = dying_fsync
target = sys.argv[1]
if target.endswith(".json"):
    io_utils.atomic_write_json(target, {"new": list(range(100000))})
else:
    io_utils.AtomicCheckpointIO().save_checkpoint({"state_dict": {"w": torch.zeros(100000)}}, target)
"""


@pytest.mark.parametrize("name", ["last.ckpt", "metrics.json"])
def test_kill_during_write_keeps_previous_file(tmp_path, name):
    target = tmp_path / name
    if name.endswith(".json"):
        atomic_write_json(target, {"old": 1})
    else:
        AtomicCheckpointIO().save_checkpoint({"state_dict": {"w": torch.ones(3)}}, target)
    before = target.read_bytes()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    died = subprocess.run([sys.executable, "-c", _KILL_DURING_WRITE, str(target)], env=env, timeout=300)
    assert died.returncode == 9
    assert target.read_bytes() == before  # the previous good file is whole
    stale = [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    assert len(stale) == 1  # the killed write's temporary file ...
    atomic_write_json(target, {"again": 2}) if name.endswith(
        ".json"
    ) else AtomicCheckpointIO().save_checkpoint({"state_dict": {"w": torch.ones(3)}}, target)
    assert [
        p for p in tmp_path.iterdir() if p.name.endswith(".tmp")
    ] == []  # ... is cleaned by the next write
