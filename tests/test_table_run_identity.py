"""adls-table counts each run once and says what its n is: one folder named twice is one run, runs of a row that
share a seed are named (their spread is not a spread over seeds), and a job that left no metrics.json is named and
the row's n marked n/N."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from adls_lightning.tools.results_table import main
from tests.helpers import table, table_rows, write_sweep


def _cell(runs: list[dict], column: str) -> str:
    numbers = np.array([run[column] for run in runs])
    return f"{numbers.mean():.4f} ± {numbers.std(ddof=1):.4f}"


@pytest.fixture
def sweep(tmp_path) -> tuple[Path, dict]:
    return write_sweep(tmp_path / "sweep")


def test_one_folder_named_twice_is_one_run(sweep, tmp_path, capsys):
    root, values = sweep
    link = tmp_path / "link"
    link.symlink_to(root)
    # an absolute spelling, a symlinked one and a relative-looking one of job 0 beside the whole multirun
    assert main([str(root), str(link / "0"), str(root / "." / "1"), str(root.resolve() / "2")]) == 0
    rows = table_rows(capsys.readouterr().out)
    assert rows["l1_0.5"][:2] == ["3", _cell(values["l1_0.5"], "test/acc")]


def test_runs_of_one_seed_are_named_in_a_footnote(sweep, tmp_path, capsys):
    root, values = sweep
    copy = tmp_path / "copy" / "0"
    shutil.copytree(root / "0", copy)  # a copied run: the same seed as job 0
    assert main([str(root), str(copy.parent)]) == 0
    text = capsys.readouterr().out
    runs = values["l1_0.5"]
    assert table_rows(text)["l1_0.5"][:2] == ["4 [1]", _cell([*runs, runs[0]], "test/acc")]
    assert table_rows(text)["wanda_0.5"][0] == "3"  # three seeds: no note
    assert f"[1] {root / '0'}, {copy}: the same seed (seed=1), copies or reruns of one run" in text
    assert "not a spread over seeds" in text


def test_a_job_without_metrics_is_named_and_the_row_marked_n_of_N(sweep):
    root, values = sweep
    (root / "1" / "metrics.json").unlink()  # job 1 (l1_0.5, seed 2) failed or is still running
    proc = table(root)  # the command as a user types it
    assert proc.returncode == 0, proc.stderr
    rows = table_rows(proc.stdout)
    kept = [values["l1_0.5"][0], values["l1_0.5"][2]]
    assert rows["l1_0.5"][:2] == ["2/3 [1]", _cell(kept, "test/acc")]
    assert rows["wanda_0.5"][0] == "3"
    assert f"[1] {root / '1'}: no metrics.json (failed or unfinished); left out." in proc.stdout
    assert "n as n/N: n of the row's N runs finished" in proc.stdout


def test_a_configuration_whose_every_job_failed_keeps_its_row(sweep, capsys):
    root, _ = sweep
    for job in (3, 4, 5):
        (root / str(job) / "metrics.json").unlink()
    assert main([str(root)]) == 0
    text = capsys.readouterr().out
    assert table_rows(text)["wanda_0.5"][:2] == ["0/3 [1] [2] [3]", ""]
    assert f"[3] {root / '5'}: no metrics.json (failed or unfinished); left out." in text


def test_metrics_of_a_job_are_still_required_somewhere(tmp_path):
    job = tmp_path / "sweep" / "0" / ".hydra"
    job.mkdir(parents=True)
    (job / "overrides.yaml").write_text(json.dumps(["seed=1"]))
    assert main([str(tmp_path / "sweep")]) == 2  # no finished run at all: nothing to tabulate
