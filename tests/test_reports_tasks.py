"""The sweep page and adls-table agree on what they compare: the runs of one task (one implementation of the task
check, adls_lightning.reports.table.check_one_task)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from adls_lightning.errors import ConfigError
from adls_lightning.reports.sweep import read_jobs
from adls_lightning.reports.table import results_table
from tests.helpers import ROOT, assert_one_line_error, write_run

MRPC = {
    "_target_": "adls_lightning.data.GLUEDataModule",
    "task": "mrpc",
    "main_metric": "${task_main_metric:mrpc}",
}


@pytest.fixture
def mixed(tmp_path):
    """A folder of runs of two tasks (a sweep over data.task, or runs gathered by hand)."""
    root = tmp_path / "mix"
    write_run(root / "0", ["data=imdb", "seed=1"], {"val/acc": 0.5, "val/f1": 0.0})
    write_run(root / "1", ["data=glue", "data.task=mrpc", "seed=1"], {"val/acc": 0.7, "val/f1": 0.81}, MRPC)
    return root


def test_the_sweep_page_refuses_runs_of_different_tasks_as_the_table_does(mixed, tmp_path):
    with pytest.raises(ConfigError) as table_error:
        results_table([str(mixed)])
    with pytest.raises(ConfigError) as sweep_error:
        read_jobs(mixed)
    assert str(sweep_error.value) == str(table_error.value)
    assert str(sweep_error.value).startswith(f"runs of different tasks: {mixed / '0'} is stanfordnlp/imdb, ")
    out = tmp_path / "page"
    command = [sys.executable, "-m", "adls_lightning.reports.sweep", f"sweep={mixed}", f"out={out}"]
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert_one_line_error(proc, contains=f"{mixed / '1'} is mrpc; give the runs of one task")
    assert not out.exists()


def test_the_sweep_of_one_task_is_read_with_a_job_that_has_no_config(mixed):
    (mixed / "1" / ".hydra" / "config.yaml").unlink()  # an old job: its task unknown, not another task
    jobs = read_jobs(mixed)
    assert [(job.folder.name, job.task) for job in jobs] == [("0", "stanfordnlp/imdb"), ("1", None)]
