"""Where a run writes, and what it never mixes into: ``overwrite=true`` replaces an earlier run rather than adding
to it, a folder of other files is not taken for a run folder, a basic sweep's jobs are checked before the first
one runs (a typo in one value, a folder of an earlier sweep), and a folder given as a checkpoint is named for what
it is. Each command is run as users type it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import ENV, TINY_OVERRIDES, assert_one_line_error, run_train, train_cmd

ROOT = Path(__file__).resolve().parent.parent
SMALL = ["trainer.max_epochs=1", "data.val_size=16", "data.test_size=16"]


def _snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    """Every file below ``folder``: (size, modification time in ns), to show that nothing was touched."""
    return {
        str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in folder.rglob("*")
        if p.is_file()
    }


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args], cwd=ROOT, env={**ENV, "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1"},
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip


@pytest.fixture(scope="module")
def earlier_run(tmp_path_factory, tiny_imdb_dir, cache_dir) -> Path:
    """A finished tiny run (32 training rows: 4 steps at batch 8) and a file of the user's beside its outputs."""
    out = tmp_path_factory.mktemp("runs") / "run"
    proc = run_train(tiny_imdb_dir, cache_dir, out, *SMALL, "data.train_size=32")
    assert proc.returncode == 0, proc.stderr[-3000:]
    (out / "notes.txt").write_text("the user's own notes\n")
    return out


def test_overwrite_refuses_to_remove_a_file_the_run_reads(earlier_run, tiny_imdb_dir, cache_dir):
    (best,) = (earlier_run / "checkpoints").glob("best-*.ckpt")
    before = _snapshot(earlier_run)
    proc = _run(
        *train_cmd(tiny_imdb_dir, cache_dir, earlier_run, *SMALL, "overwrite=true", f"init_ckpt={best}")[1:]
    )
    assert_one_line_error(proc, contains=f"overwrite=true: init_ckpt={best} is in the earlier run's outputs")
    assert _snapshot(earlier_run) == before


def test_a_run_folder_given_as_a_checkpoint_names_the_checkpoint_to_give(
    earlier_run, tiny_imdb_dir, cache_dir
):
    (best,) = (earlier_run / "checkpoints").glob("best-*.ckpt")
    new = earlier_run.parent / "from-folder"
    proc = _run(*train_cmd(tiny_imdb_dir, cache_dir, new, *SMALL, f"init_ckpt={earlier_run}")[1:])
    assert_one_line_error(proc, contains=f"init_ckpt={earlier_run}: a run folder, not a checkpoint file")
    assert f"e.g. init_ckpt={best}" in proc.stderr
    proc = _run("-m", "adls_lightning.export", f"ckpt={earlier_run}", f"out={new}")
    assert_one_line_error(proc, contains=f"ckpt={earlier_run}: a run folder, not a checkpoint file")
    assert not new.exists()


def test_overwrite_true_replaces_the_earlier_runs_outputs_and_keeps_the_rest(
    earlier_run, tiny_imdb_dir, cache_dir
):
    (first_best,) = (earlier_run / "checkpoints").glob("best-*.ckpt")
    first_log = (earlier_run / "train.log").read_text()
    proc = run_train(tiny_imdb_dir, cache_dir, earlier_run, *SMALL, "data.train_size=64", "overwrite=true")
    assert proc.returncode == 0, proc.stderr[-3000:]
    # one run's checkpoints, the new one's (8 steps): none of the earlier run's beside them, no last-v1.ckpt
    assert sorted(p.name for p in (earlier_run / "checkpoints").iterdir()) == [
        "best-epoch00-step8.ckpt",
        "last.ckpt",
    ]
    assert first_best.name != "best-epoch00-step8.ckpt"
    log = (earlier_run / "train.log").read_text()
    assert "overwrite=true: replaced the earlier run's" in log
    assert "train 64" in log and "train 32" not in log and not log.startswith(first_log)
    assert "data.train_size=64" in (earlier_run / ".hydra" / "overrides.yaml").read_text()
    assert (earlier_run / "notes.txt").read_text() == "the user's own notes\n"


def test_a_folder_of_files_no_run_wrote_is_not_a_run_folder(tmp_path, tiny_imdb_dir, cache_dir):
    export = tmp_path / "export"
    export.mkdir()
    (export / "export.json").write_text("{}")
    (export / "model.safetensors").write_bytes(b"weights")
    before = _snapshot(export)
    proc = _run(*train_cmd(tiny_imdb_dir, cache_dir, export, *SMALL)[1:])
    assert_one_line_error(proc, contains="holds files no run wrote (export.json, model.safetensors)")
    assert _snapshot(export) == before


def _sweep(
    tiny_imdb_dir: Path, cache_dir: Path, sweep_dir: Path, *overrides: str
) -> subprocess.CompletedProcess:
    paths = [f"data.data_dir={tiny_imdb_dir}", f"paths.cache_dir={cache_dir}", f"hydra.sweep.dir={sweep_dir}"]
    return _run("train.py", "-m", *TINY_OVERRIDES, *SMALL, *paths, *overrides)


def test_a_second_sweep_into_the_same_folder_is_refused_before_any_job(tmp_path, tiny_imdb_dir, cache_dir):
    """The basic sweeper numbers jobs from 0 again: job 0 of a second sweep would land in the first one's job 0."""
    sweep = tmp_path / "methods"
    (sweep / "0").mkdir(parents=True)
    (sweep / "multirun.yaml").write_text("the first sweep's record\n")
    (sweep / "0" / "metrics.json").write_text('{"test/acc": 0.5}')
    (sweep / "0" / "train.log").write_text("the first sweep's job 0\n")
    before = _snapshot(sweep)
    proc = _sweep(tiny_imdb_dir, cache_dir, sweep, "quant=none,int8")
    line = assert_one_line_error(proc, contains="job 0 (quant=none): hydra.sweep.dir=")
    assert f"{sweep / '0'}: holds an earlier run (metrics.json)" in line
    assert _snapshot(sweep) == before and sorted(p.name for p in sweep.iterdir()) == ["0", "multirun.yaml"]


@pytest.mark.parametrize(
    ("sweep", "message"),
    [
        (["quant=none,int8_scaeld"], "quant=int8_scaeld: no such preset"),
        (
            ["data.batch_size=8,-3"],
            "job 1 (data.batch_size=-3): data.batch_size=-3: must be a positive integer",
        ),
    ],
)
def test_a_bad_value_in_one_job_of_a_sweep_is_refused_before_any_job(
    tmp_path, tiny_imdb_dir, cache_dir, sweep, message
):
    proc = _sweep(tiny_imdb_dir, cache_dir, tmp_path / "sweep", *sweep)
    assert_one_line_error(proc, contains=message)
    assert not (tmp_path / "sweep").exists()  # no multirun.yaml, no job folder


def test_a_key_appended_that_no_object_takes_is_one_line(tmp_path, tiny_imdb_dir, cache_dir):
    out = tmp_path / "run"
    proc = _run(*train_cmd(tiny_imdb_dir, cache_dir, out, *SMALL, "+data.max_lenght=32")[1:])
    assert_one_line_error(proc, contains="data.max_lenght: unknown key; valid: ")
    assert "(did you mean max_length?)" in proc.stderr
    assert not out.exists()
