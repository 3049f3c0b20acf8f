"""Reports of studies whose trials did not all run: adls-table names what a skipped trial lacks, and the study
report of a study with no completed trial still labels its objectives by their metrics."""

from __future__ import annotations

import subprocess
import sys

import optuna
from optuna.trial import TrialState

from tests.helpers import table, write_run

STUDY = "mixed_precision-integer-acc_minus_bits-tpe"


def test_reports_of_a_study_whose_every_trial_was_pruned(search, tmp_path):
    # width 0 is a valid setting that the integer format refuses: every trial is pruned before it trains
    proc = search(
        "search=mixed_precision",
        "model=tiny_random",
        "hydra.sweeper.n_trials=2",
        "hydra.sweeper.search_space.use=[integer]",
        "+hydra.sweeper.search_space.formats={integer:{params:{width:[0]}}}",
        # a weighted objective: its one name is the sum's (nothing of a completed trial names it)
        "search/objective=acc_minus_bits",
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    db = tmp_path / "sweep" / f"{STUDY}.db"
    study = optuna.load_study(study_name=STUDY, storage=f"sqlite:///{db}")
    assert [t.state for t in study.trials] == [TrialState.PRUNED] * 2

    report = subprocess.run(
        [sys.executable, "-m", "adls_lightning.reports.study", str(db), f"out={tmp_path / 'report'}"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert report.returncode == 0, report.stderr[-2000:]
    page = (tmp_path / "report" / "index.html").read_text()
    assert "<tr><th>objectives</th><td>1*val/acc + -0.005*quant/avg_weight_bits (maximize)</td></tr>" in page
    assert "objective_0" not in page

    listed = table(db)
    skipped = [line for line in listed.stderr.splitlines() if line.startswith("skipping")]
    assert skipped == [f"skipping trial {i} of {db} (pruned): no run folder recorded" for i in (0, 1)]


def test_adls_table_names_the_folder_of_a_trial_whose_run_is_gone(tmp_path):
    storage = f"sqlite:///{tmp_path / 's.db'}"
    study = optuna.create_study(storage=storage, study_name="s")
    kept = write_run(tmp_path / "runs" / "0", ["model.optimizer.lr=1e-3"], {"val/acc": 0.7})
    study.add_trial(optuna.trial.create_trial(value=0.7, user_attrs={"output_dir": str(kept)}))
    gone = tmp_path / "runs" / "1"
    study.add_trial(optuna.trial.create_trial(value=0.8, user_attrs={"output_dir": str(gone)}))
    listed = table(tmp_path / "s.db")
    assert listed.returncode == 0, listed.stderr
    assert (
        listed.stderr.strip()
        == f"skipping trial 1 of {tmp_path / 's.db'} (complete): no metrics.json in {gone}"
    )
