"""Kill-and-resume: a run killed mid-epoch and resumed with ``ckpt_path=last`` trains on exactly the batches an
uninterrupted run of the same seed trains on, ends with the same metrics (bit-for-bit on CPU) and the same CSV log;
checkpoint and metrics writes never destroy the previous good file.

The killed, resumed and uninterrupted runs are real ``train.py`` subprocesses (a tiny random BERT, 64 training rows,
8 steps per epoch, 2 epochs), killed at a fixed step by ``tests.helpers.KillAtStep`` (see
:func:`tests.helpers.kill_and_resume`); evaluations of a checkpoint run in this process.
"""

from __future__ import annotations

import csv
import json
import os
import shlex
import shutil
import signal
from pathlib import Path

import lightning as L
import pytest
import torch

from adls_lightning.files.atomic import atomic_write_json
from adls_lightning.files.lightning_io import AtomicCheckpointIO, ResumableCSVWriter
from tests.helpers import kill_and_resume, recorded_batches, recording, run_train, train_cmd, train_run

ROOT = Path(__file__).resolve().parent.parent
STEPS_PER_EPOCH = 8  # 64 rows / batch 8
KILL_AT_STEP = 11  # second epoch, two steps after the last.ckpt of step 9
COMPARED_METRICS = ("train/loss", "val/loss", "val/acc", "test/loss", "test/acc", "test/f1")
# Columns of the CSV log that measure the process, not the training: wall times and what this process trained.
PROCESS_COLUMNS = ("final/time/", "final/train/samples_per_sec", "final/train/samples_seen")
SMALL_RUN = [
    "logger=csv",
    "trainer.max_epochs=2",
    "trainer.log_every_n_steps=1",
    "data.max_length=32",
    "data.batch_size=8",
    "data.train_size=64",
    "data.val_size=16",
    "data.test_size=16",
    "callbacks.last_checkpoint.every_n_train_steps=3",
]


class InterruptAtStep(L.Callback):
    """Ctrl-C: SIGINT to this process when the given global step is about to run (as ``tests.helpers.KillAtStep``
    kills, so the interrupt lands at the same step on every machine)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            signal.raise_signal(signal.SIGINT)


#: how the train.py subprocess imports it (pytest imports this file as ``test_resume``: tests/ is no package)
INTERRUPT_TARGET = "tests.test_resume.InterruptAtStep"


def _csv_rows(run_dir: Path) -> list[dict[str, str]]:
    with (run_dir / "csv" / "metrics.csv").open(newline="") as handle:
        return [
            {k: v for k, v in row.items() if not k.startswith(PROCESS_COLUMNS)}
            for row in csv.DictReader(handle)
        ]


def _train_steps(rows: list[dict[str, str]]) -> list[int]:
    return [int(row["step"]) for row in rows if row.get("train/loss")]


@pytest.fixture(scope="module")
def plain_fit(tmp_path_factory, tiny_imdb_dir, cache_dir) -> Path:
    """One uninterrupted ``train.py`` run of SMALL_RUN (batches recorded beside its folder), shared: it is the plain
    kill-and-resume's reference run and the finished fit whose last.ckpt is read, evaluated and resumed (the same
    overrides: RecordBatches writes outside the run folder and changes no training). Nobody writes into it."""
    out = tmp_path_factory.mktemp("plain_fit") / "whole"
    fit = run_train(tiny_imdb_dir, cache_dir, out, *SMALL_RUN, *recording(out))
    assert fit.returncode == 0, fit.stderr[-3000:]
    return out


# The plain run is `make test-fast`'s kill-and-resume test; the compressed ones are slow (3 runs each).
@pytest.mark.parametrize(
    "preset",
    [
        pytest.param([], id="plain"),
        pytest.param(["quant=int8"], id="int8", marks=pytest.mark.slow),
        pytest.param(["prune=l1_0.5"], id="l1_0.5", marks=pytest.mark.slow),
        pytest.param(
            ["quant=int8", "model.merge_lora_before_compress=false"],
            id="int8-unmerged",
            marks=pytest.mark.slow,
        ),
    ],
)
def test_killed_run_resumes_exactly(request, tmp_path, tiny_imdb_dir, cache_dir, preset):
    logged_before_resume: list[list[dict[str, str]]] = []
    # the plain run's uninterrupted reference is the module's plain_fit (shared with the finished-fit test)
    plain = not preset
    runs = kill_and_resume(
        tiny_imdb_dir,
        cache_dir,
        tmp_path,
        [*SMALL_RUN, *preset],
        KILL_AT_STEP,
        uninterrupted=not plain,
        on_killed=lambda folder: logged_before_resume.append(_csv_rows(folder)),
    )
    whole_dir = request.getfixturevalue("plain_fit") if plain else runs["whole"]
    killed_dir = runs["killed"]
    assert runs["resumed_from_step"] == 9  # mid-epoch: the last.ckpt of step 9, two steps before the kill
    # The same batches at every step: two full epochs, none repeated or skipped.
    whole_batches, resumed_batches = recorded_batches(whole_dir), recorded_batches(killed_dir)
    assert sorted(whole_batches) == list(range(2 * STEPS_PER_EPOCH))
    assert resumed_batches == whole_batches
    # Lightning's warning about a loader it cannot resume is gone.
    assert "not resumable" not in runs["resumed_stderr"]
    # The same result, bit for bit (same seed, CPU, same batches, the RNG state restored for dropout).
    whole_metrics = json.loads((whole_dir / "metrics.json").read_text())
    resumed_metrics = json.loads((killed_dir / "metrics.json").read_text())
    for key in COMPARED_METRICS:
        assert resumed_metrics[key] == whole_metrics[key], key
    # The resumed process counts only what it trained: steps 9 to 15, 7 batches of 8.
    assert resumed_metrics["train/samples_seen"] == (2 * STEPS_PER_EPOCH - 9) * 8
    # The CSV log holds the killed run's rows up to the checkpoint and the resumed run's after it: row for row
    # the uninterrupted run's log (the rows the killed run logged after its checkpoint were not kept twice).
    # The killed run had logged every step it trained, also the two after its checkpoint (9, 10).
    assert _train_steps(logged_before_resume[0]) == list(range(KILL_AT_STEP))
    whole_rows, resumed_rows = _csv_rows(whole_dir), _csv_rows(killed_dir)
    assert _train_steps(whole_rows) == list(range(2 * STEPS_PER_EPOCH))
    assert resumed_rows == whole_rows
    # No temporary file of any checkpoint, metrics or log write was left behind.
    assert not [p for p in killed_dir.rglob("*.tmp")]
    assert oct((killed_dir / "metrics.json").stat().st_mode & 0o777) == oct(0o666 & ~_umask())


def _write_log(folder: Path, steps: list[int], tail: str = "") -> None:
    folder.mkdir(parents=True, exist_ok=True)
    rows = "".join(f"0,{step},{step / 10}\n" for step in steps)
    (folder / "metrics.csv").write_text("epoch,step,train/loss\n" + rows + tail)


def test_csv_writer_keeps_rows_before_the_resume_step_and_drops_a_cut_line(tmp_path):
    # Written independently of the writer: rows of steps 0..5, then a line a kill cut in the middle.
    _write_log(tmp_path, list(range(6)), tail="0,6,0.")
    writer = ResumableCSVWriter(str(tmp_path))
    writer.log_metrics(
        {"train/loss": 0.25, "val/acc": 0.5}, step=4
    )  # resumed at step 4: rows 4, 5 logged again
    writer.save()
    with (tmp_path / "metrics.csv").open(newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert [row["step"] for row in rows] == ["0", "1", "2", "3", "4"]
    assert rows[2] == {"epoch": "0", "step": "2", "train/loss": "0.2", "val/acc": ""}
    assert rows[4] == {"epoch": "", "step": "4", "train/loss": "0.25", "val/acc": "0.5"}


def test_csv_writer_of_a_fresh_run_starts_an_empty_log(tmp_path):
    _write_log(tmp_path, [0, 1, 2])
    writer = ResumableCSVWriter(str(tmp_path))
    assert (tmp_path / "metrics.csv").exists()  # nothing is deleted before the run logs
    writer.log_metrics({"train/loss": 1.0}, step=0)
    writer.save()
    assert (tmp_path / "metrics.csv").read_text().splitlines() == ["step,train/loss", "0,1.0"]


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


def _die_while_writing(target: Path) -> int:
    """Write ``target`` (a new checkpoint or metrics.json) in a child process that dies inside the write, its new
    bytes out but not yet renamed over the target (``os._exit`` in fsync: no clean-up runs); its exit code. The
    child is forked from this process: a real process dying mid-write, without a Python start-up and Lightning's
    imports."""
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        try:
            os.fsync = lambda fd: os._exit(9)
            if target.name.endswith(".json"):
                atomic_write_json(target, {"new": list(range(100000))})
            else:
                AtomicCheckpointIO().save_checkpoint({"state_dict": {"w": torch.zeros(100000)}}, target)
        finally:
            os._exit(1)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["last.ckpt", "metrics.json"])
def test_kill_during_write_keeps_previous_file(tmp_path, name):
    target = tmp_path / name
    if name.endswith(".json"):
        atomic_write_json(target, {"old": 1})
    else:
        AtomicCheckpointIO().save_checkpoint({"state_dict": {"w": torch.ones(3)}}, target)
    before = target.read_bytes()
    assert _die_while_writing(target) == 9
    assert target.read_bytes() == before  # the previous good file is whole
    stale = [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    assert len(stale) == 1  # the killed write's temporary file ...
    atomic_write_json(target, {"again": 2}) if name.endswith(
        ".json"
    ) else AtomicCheckpointIO().save_checkpoint({"state_dict": {"w": torch.ones(3)}}, target)
    assert [
        p for p in tmp_path.iterdir() if p.name.endswith(".tmp")
    ] == []  # ... is cleaned by the next write


def _last_fit_validation(run_dir: Path) -> dict[str, float]:
    """The fit's last in-fit validation row of the CSV log (the row after it is the post-fit validation of best)."""
    with (run_dir / "csv" / "metrics.csv").open(newline="") as handle:
        rows = [row for row in csv.DictReader(handle) if row.get("val/loss")]
    assert len(rows) >= 2, rows
    return {key: float(rows[-2][key]) for key in ("val/loss", "val/acc")}


@pytest.mark.parametrize(
    "preset",
    [pytest.param([], id="plain"), pytest.param(["compress=l1_0.5"], id="compress", marks=pytest.mark.slow)],
)
def test_last_checkpoint_of_a_finished_fit_holds_its_final_weights(
    request, tmp_path, tiny_imdb_dir, cache_dir, preset
):
    # 16 steps (more with compress's recovery epoch), last.ckpt every 3: the fit ends between two periodic saves.
    # The plain fit is the module's train.py run plain_fit (the plain kill-and-resume's reference); the compressed
    # one and both evaluations run in this process (what the checkpoint holds is the subject, not the command line).
    eval_dir, more_dir = tmp_path / "eval", tmp_path / "more"
    if preset:
        fit_dir = tmp_path / "fit"
        train_run(fit_dir, [*SMALL_RUN, *preset], tiny_imdb_dir, cache_dir)
    else:
        fit_dir = request.getfixturevalue("plain_fit")
    fit_metrics = json.loads((fit_dir / "metrics.json").read_text())
    steps = fit_metrics["train/samples_seen"] // 8
    last = fit_dir / "checkpoints" / "last.ckpt"
    assert steps % 3 != 0
    assert torch.load(last, map_location="cpu", weights_only=True)["global_step"] == steps

    # Evaluating last.ckpt alone gives exactly what the fit's last validation logged.
    train_run(eval_dir, [*SMALL_RUN, *preset, "train=false", f"ckpt_path={last}"], tiny_imdb_dir, cache_dir)
    eval_metrics = json.loads((eval_dir / "metrics.json").read_text())
    assert {key: eval_metrics[key] for key in ("val/loss", "val/acc")} == pytest.approx(
        _last_fit_validation(fit_dir), rel=1e-6
    )
    if preset:
        return
    # Resuming the finished fit to a third epoch trains that epoch only, not the steps after the last periodic save;
    # Ctrl-C in it (step 22, after the last.ckpt of step 21) ends it with the shell's code for SIGINT and, as its
    # last line, the command that resumes it: the run's own overrides, its folder and ckpt_path=last.
    shutil.copytree(fit_dir, more_dir)
    interrupt = [f"+callbacks.interrupt._target_={INTERRUPT_TARGET}", "+callbacks.interrupt.step=22"]
    resume = [*SMALL_RUN, "trainer.max_epochs=3", *recording(more_dir), *interrupt]
    more = run_train(
        tiny_imdb_dir, cache_dir, more_dir, *resume, "ckpt_path=last",
        env={"ADLS_EXTRA_TARGETS": f"tests.helpers.*,{INTERRUPT_TARGET}"}, ctrl_c=True,
    )  # fmt: skip
    assert more.returncode == 130, more.stderr[-3000:]
    assert sorted(recorded_batches(more_dir)) == list(range(2 * STEPS_PER_EPOCH, 23))
    hint = more.stderr.strip().splitlines()[-1]
    assert hint.startswith("interrupted: resume with "), more.stderr[-3000:]
    given = train_cmd(tiny_imdb_dir, cache_dir, more_dir, *resume)[2:]
    assert shlex.split(hint.removeprefix("interrupted: resume with ")) == [
        "python", str(ROOT / "train.py"),
        *[arg for arg in given if not arg.startswith("hydra.run.dir=")], f"hydra.run.dir={more_dir}", "ckpt_path=last",
    ]  # fmt: skip
    assert "Traceback" not in more.stderr


def test_last_checkpoint_keeps_the_state_key_of_the_plain_model_checkpoint(tmp_path):
    # so a checkpoint written before LastCheckpoint replaced ModelCheckpoint still restores the callback's state
    from lightning.pytorch.callbacks import ModelCheckpoint

    from adls_lightning.callbacks.last_checkpoint import LastCheckpoint

    args = {"dirpath": tmp_path, "save_top_k": 0, "save_last": True, "every_n_train_steps": 25}
    assert LastCheckpoint(**args).state_key == ModelCheckpoint(**args).state_key
    assert LastCheckpoint(**args).state_key != ModelCheckpoint(**{**args, "every_n_train_steps": 5}).state_key
