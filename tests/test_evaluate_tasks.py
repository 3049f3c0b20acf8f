"""``adls-evaluate`` scores an export on the data of the task its model was trained on, with that task's own
metrics: an STS-B export's ``test/pearson`` and ``test/spearman``, an MRPC export's ``test/f1`` first, each equal to
its run's ``metrics.json``; data of another task (or labels, or pairs for single texts) is refused in one line, and
so are several folders whose runs' test splits differ (they are compared row by row on one split).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from adls_lightning.tools.evaluate import main as evaluate_main
from adls_lightning.tools.export import main as export_main
from tests.glue_layouts import write_glue_tasks
from tests.helpers import ENV, ROOT, TINY_OVERRIDES, assert_one_line_error, call, train_run

# a full fine-tune for one epoch, evaluated in fp32 as the exported folders run (no bf16 cast to tell apart)
RUN = ["model/lora=none", "trainer.max_epochs=1", "trainer.precision=32-true", "data.batch_size=16"]
GLUE_RUN = [*RUN, "data=glue", "data.val_size=20"]


@pytest.fixture(scope="module")
def glue_root(tmp_path_factory) -> Path:
    return write_glue_tasks(tmp_path_factory.mktemp("glue"), "mrpc", "stsb")


def run_and_export(out: Path, overrides: list[str], tiny_imdb_dir, cache_dir) -> tuple[Path, dict]:
    """A tiny run in ``out`` and its best checkpoint exported as ``format=hf`` to ``out/hf``: (folder, metrics)."""
    metrics = train_run(out, overrides, tiny_imdb_dir, cache_dir)
    ckpt = next((out / "checkpoints").glob("best-*.ckpt"))
    settings = [*TINY_OVERRIDES, f"data.data_dir={tiny_imdb_dir}", f"paths.cache_dir={cache_dir}", *overrides]
    code, _, stderr = call(export_main, f"ckpt={ckpt}", f"out={out / 'hf'}", "format=hf", *settings)
    assert code == 0, stderr[-3000:]
    return out / "hf", metrics


@pytest.fixture(scope="module")
def mrpc(tmp_path_factory, glue_root, tiny_imdb_dir, cache_dir):
    overrides = [*GLUE_RUN, "data.task=mrpc", f"data.data_dir={glue_root}"]
    return run_and_export(tmp_path_factory.mktemp("mrpc"), overrides, tiny_imdb_dir, cache_dir)


@pytest.fixture(scope="module")
def stsb(tmp_path_factory, glue_root, tiny_imdb_dir, cache_dir):
    overrides = [*GLUE_RUN, "data.task=stsb", f"data.data_dir={glue_root}"]
    return run_and_export(tmp_path_factory.mktemp("stsb"), overrides, tiny_imdb_dir, cache_dir)


@pytest.fixture(scope="module")
def imdb(tmp_path_factory, tiny_imdb_dir, cache_dir):
    overrides = [*RUN, "data.train_size=48", "data.val_size=16", "data.test_size=40", "data.max_length=24"]
    return run_and_export(tmp_path_factory.mktemp("imdb"), overrides, tiny_imdb_dir, cache_dir)


def scores(line: str) -> dict[str, float]:
    return {name: float(value) for name, value in re.findall(r"(test/\w+) (-?[0-9.]+|nan)", line)}


def test_a_regression_export_is_scored_with_the_runs_pearson_and_spearman(stsb):
    folder, metrics = stsb
    code, stdout, stderr = call(evaluate_main, str(folder))
    assert code == 0, stderr[-3000:]
    line = stdout.strip()
    # the task's main metric first, then its other one; pairs, not "reviews"; no argmax "accuracy" of one output
    assert line.startswith(f"{folder}: test/pearson "), line
    assert line.endswith("on 40 pairs"), line  # the 40 dev pairs write_glue_task gives
    assert "accuracy" not in line and "test/acc" not in line
    printed = scores(line)
    assert list(printed) == ["test/pearson", "test/spearman"]
    # Spearman (ranks) to the printed digits; Pearson to 2e-3: a tiny model's regression outputs spread by ~1e-5
    # around the mean, where the run's batch-by-batch sums and one pass over the split round apart in float32
    # (the export's outputs equal the checkpoint's to the bit; a trained STS-B run agrees to 1e-4)
    assert printed["test/spearman"] == pytest.approx(metrics["test/spearman"], abs=1e-4)
    assert printed["test/pearson"] == pytest.approx(metrics["test/pearson"], abs=2e-3)


def test_an_f1_task_prints_f1_first_and_both_equal_the_runs(mrpc):
    folder, metrics = mrpc
    code, stdout, stderr = call(evaluate_main, str(folder))
    assert code == 0, stderr[-3000:]
    line = stdout.strip()
    assert line.startswith(f"{folder}: test/f1 "), line
    printed = scores(line)
    assert list(printed) == ["test/f1", "test/acc"]
    for name, value in printed.items():
        assert value == pytest.approx(metrics[name], abs=1e-4), name


def test_another_tasks_data_or_labels_are_refused_and_the_same_tasks_overrides_kept(
    imdb, glue_root, tmp_path
):
    folder, metrics = imdb
    code, stdout, stderr = call(
        evaluate_main, str(folder), "data=glue", "data.task=mrpc", f"data.data_dir={glue_root}"
    )
    assert code == 2 and not stdout, stdout + stderr[-3000:]
    assert stderr.strip() == (
        f"error: {folder}: its model was trained on imdb, the data given is glue/mrpc; valid: the data of imdb "
        "(overrides that keep its task: data.test_size, data.max_length, data.data_dir of imdb), or the export of "
        "a glue/mrpc run"
    )
    code, stdout, stderr = call(evaluate_main, str(folder), "data.label_names=[bad,good]")
    assert code == 2 and not stdout, stdout + stderr[-3000:]
    assert "its model's labels are negative, positive, the data's are bad, good" in stderr
    # an export written before exports recorded their task: its labels still tell it is not an MRPC model
    old = tmp_path / "old"
    shutil.copytree(folder, old)
    config = json.loads((old / "config.json").read_text())
    del config["adls_inputs"]
    (old / "config.json").write_text(json.dumps(config))
    code, stdout, stderr = call(
        evaluate_main, str(old), "data=glue", "data.task=mrpc", f"data.data_dir={glue_root}"
    )
    assert code == 2 and not stdout, stdout + stderr[-3000:]
    assert stderr.strip().startswith(
        f"error: {old}: its model's labels are negative, positive, the data's are not_equivalent, equivalent; "
        "valid: the data of its run's task"
    ), stderr
    # the run's own split: its metrics.json; another size of the same task's split: scored, on that many texts
    code, stdout, stderr = call(evaluate_main, str(folder))
    assert code == 0, stderr[-3000:]
    assert scores(stdout)["test/acc"] == pytest.approx(metrics["test/acc"], abs=1e-4)
    code, stdout, stderr = call(evaluate_main, str(folder), "data.test_size=20", "data.max_length=16")
    assert code == 0, stderr[-3000:]
    assert stdout.strip().startswith(f"{folder}: test/acc ") and stdout.strip().endswith("on 20 texts")


def test_folders_of_runs_with_other_test_splits_are_refused_naming_both(imdb, mrpc, tmp_path):
    imdb_folder, _ = imdb
    mrpc_folder, _ = mrpc
    code, stdout, stderr = call(evaluate_main, str(mrpc_folder), str(imdb_folder))
    assert code == 2 and not stdout, stdout + stderr[-3000:]
    assert stderr.strip().startswith(
        f"error: {imdb_folder}: its run's test split is not {mrpc_folder}'s ({mrpc_folder}: glue/mrpc, "
        f"{imdb_folder}: imdb)"
    ), stderr
    # the same task, but the run took another test subset (an export of a run with data.test_size=20)
    other = tmp_path / "other"
    shutil.copytree(imdb_folder, other)
    recipe = json.loads((other / "compression.json").read_text())
    recipe["run_overrides"].append("data.test_size=20")
    (other / "compression.json").write_text(json.dumps(recipe))
    code, stdout, stderr = call(evaluate_main, str(imdb_folder), str(other))
    assert code == 2 and not stdout, stdout + stderr[-3000:]
    assert f"{imdb_folder} has data.test_size=40; {other} has data.test_size=20" in stderr, stderr
    # two folders of one run's data: scored on one split and compared row by row
    same = tmp_path / "same"
    shutil.copytree(imdb_folder, same)
    code, stdout, stderr = call(evaluate_main, str(imdb_folder), str(same))
    assert code == 0, stderr[-3000:]
    lines = stdout.strip().splitlines()
    assert lines[1].endswith(f"on 40 texts, same label as {imdb_folder}: 100.00%"), lines


def test_the_command_refuses_another_tasks_data_in_one_line(imdb, glue_root):
    folder, _ = imdb
    command = [sys.executable, "-m", "adls_lightning.export.evaluate", str(folder), "data=glue"]
    command += ["data.task=stsb", f"data.data_dir={glue_root}"]
    proc = subprocess.run(command, capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=300)
    assert_one_line_error(
        proc, f"error: {folder}: its model was trained on imdb, the data given is glue/stsb"
    )
    assert not proc.stdout
