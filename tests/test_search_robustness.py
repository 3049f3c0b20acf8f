"""A search meets what goes wrong around its trials: a regression trial whose predictions do not vary, a Ctrl-C, a
misspelt sweep key, a storage URL that cannot work. Each ends as the project's one line (or is scored and the study
goes on), not a traceback. The subprocess tests run the toy Hydra app of ``tests/toy_sweeper.py`` (the project's
sweeper plugin, trials of milliseconds)."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
from omegaconf import OmegaConf
from optuna.trial import TrialState

from adls_lightning.app.objective import objective_values, trial_result
from adls_lightning.errors import ConfigError
from adls_lightning.search.storage import storage_spec
from tests.helpers import job_started, ok

ROOT = Path(__file__).resolve().parents[1]
NAN = float("nan")


# -- a regression trial whose predictions do not vary --------------------------------------------------------------


def test_a_correlation_of_constant_predictions_scores_zero_with_a_note():
    run = {"val/pearson": NAN, "val/spearman": NAN, "quant/avg_weight_bits": 4.0}
    result = trial_result(run, ["val/pearson"])
    assert result.values == (0.0,)
    assert result.notes == ("val/pearson is nan (the predictions do not vary): scored 0, no correlation",)
    assert math.isnan(result.metrics["val/pearson"])  # the run's metric is kept as logged
    # in a weighted objective the correlation is 0 and the other terms count
    weighted = trial_result(run, ["val/spearman", "quant/avg_weight_bits"], [1.0, -0.01])
    assert weighted.values == pytest.approx((-0.04,)) and len(weighted.notes) == 1
    # a learning model is scored as logged, without a note
    assert trial_result({"val/pearson": 0.3}, ["val/pearson"]) == trial_result(
        {"val/pearson": 0.3}, ["val/pearson"]
    )
    assert trial_result({"val/pearson": 0.3}, ["val/pearson"]).notes == ()
    # nan of any other metric (a diverged loss) is not a correlation: left for the sweeper to fail
    assert math.isnan(objective_values({"val/loss": NAN}, ["val/loss"])[0])


@pytest.mark.slow
def test_constant_prediction_trials_complete_and_the_study_goes_on(toy, tmp_path):
    # no failure allowed: before, the first such trial failed ("objective is NaN") and stopped the study
    ok(toy("hydra.sweeper.n_trials=4", "hydra/sweeper/sampler=random", "constant_at=[0,1,2,3,4,5,6,8,9]"))
    study = optuna.load_study(
        study_name="toy-random", storage=f"sqlite:///{tmp_path / 'sweep'}/toy-random.db"
    )
    completed = [t for t in study.trials if t.state == TrialState.COMPLETE]
    assert len(completed) == 4 - sum(t.state == TrialState.PRUNED for t in study.trials)
    assert all(t.values == [0.0] for t in completed)
    assert all("the predictions do not vary" in t.user_attrs["objective_note"] for t in completed)


# -- too many failures: one line ------------------------------------------------------------------------------------


@pytest.mark.slow
def test_too_many_failures_stop_the_study_in_one_line(toy):
    proc = toy("hydra.sweeper.n_trials=4", "hydra/sweeper/sampler=random", "fail_at=[0,1,2,3,4,5,6,8,9]")
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, proc.stderr
    assert errors[0].startswith("error: study toy-random stopped: 1 trial(s) failed, more than ")
    assert "RuntimeError: toy failure at x=" in errors[0] and "re-run the same command" in errors[0]


# -- Ctrl-C ---------------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_ctrl_c_in_a_trial_ends_in_one_line_exit_130_and_the_same_command_resumes(toy, tmp_path):
    pids = tmp_path / "pids"
    command = [sys.executable, str(tmp_path / "app" / "toy.py"), f"hydra.sweep.dir={tmp_path / 'sweep'}"]
    command += ["hydra.sweeper.n_trials=3", "hydra/sweeper/sampler=random"]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")]),
        "ADLS_EXTRA_TARGETS": "toy_sweeper.*",
    }
    worker = subprocess.Popen(
        [*command, "sleep=120", f"log_pid={pids}"],
        env=env,
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # as from a terminal: pytest-xdist's workers ignore SIGINT, and a child would inherit that
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    deadline = time.time() + 120
    while time.time() < deadline and not job_started(pids):
        time.sleep(0.2)
    worker.send_signal(signal.SIGINT)
    _, stderr = worker.communicate(timeout=120)
    assert worker.returncode == 130, stderr
    assert "Traceback" not in stderr, stderr
    (number,) = [int(p.name) for p in pids.iterdir()]
    assert stderr.strip().splitlines()[-1] == (
        f"interrupted: study toy-random, trial {number} re-queued with its parameters; "
        "re-run the same command to resume"
    )
    study = optuna.load_study(
        study_name="toy-random", storage=f"sqlite:///{tmp_path / 'sweep'}/toy-random.db"
    )
    interrupted = study.trials[number]
    assert interrupted.state == TrialState.FAIL
    assert interrupted.user_attrs["stopped"] == "interrupted (Ctrl-C)"  # what the dashboard shows of it
    (retry,) = [t for t in study.trials if t.system_attrs.get("failed_trial") == number]
    assert retry.state == TrialState.WAITING and retry.params == interrupted.params

    ok(subprocess.run(command, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300))
    trials = optuna.load_study(
        study_name="toy-random", storage=f"sqlite:///{tmp_path / 'sweep'}/toy-random.db"
    ).trials
    assert trials[retry.number].state in (TrialState.COMPLETE, TrialState.PRUNED)
    assert len([t for t in trials if t.state != TrialState.FAIL]) == 3


@pytest.mark.parametrize("script", ["search.py", "train.py"])
def test_ctrl_c_while_the_command_starts_is_one_line_exit_130(script, tiny_imdb_dir, cache_dir, tmp_path):
    """Ctrl-C in the seconds before a run (or the study) begins, as the pre-flight check composes and checks the
    config: one line, exit 130, and, where the line says nothing was written, no folder was."""
    sweep, run = tmp_path / "sweep", tmp_path / "run"
    command = [
        sys.executable, str(ROOT / script), f"hydra.sweep.dir={sweep}", f"hydra.run.dir={run}",
        f"data.data_dir={tiny_imdb_dir}", f"paths.cache_dir={cache_dir}", "trainer=cpu", "model=tiny_random",
        "trainer.max_epochs=1", "callbacks.rich_progress_bar=null", "data.max_length=16", "data.train_size=32", "data.val_size=16",
    ]  # fmt: skip
    proc = subprocess.Popen(
        command,
        cwd=ROOT,
        env={**os.environ, "PROJECT_ROOT": str(ROOT)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # as from a terminal
    )
    time.sleep(3)  # past Python loading the command (under a second), inside the pre-flight check (seconds)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr, stderr
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("interrupted: "), stderr
    if "nothing was written" in last:
        what = "the search opened its study" if script == "search.py" else "the run began"
        assert last == f"interrupted: stopped before {what}; nothing was written, run the command again"
        assert not sweep.exists() and not run.exists()


# -- a misspelt key in a sweep override -----------------------------------------------------------------------------


@pytest.mark.slow
def test_a_misspelt_sweep_key_is_one_line_exit_2_before_any_trial(toy, tmp_path):
    proc = toy("yy=choice(1, 2)")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == ["error: yy=choice(1, 2): no such key (did you mean y?)"]
    assert not (tmp_path / "sweep").exists() or not any((tmp_path / "sweep").iterdir())


# -- a storage URL that cannot work ---------------------------------------------------------------------------------


def test_an_explicit_sqlite_url_names_its_key_and_the_cause(tmp_path):
    missing = tmp_path / "nope" / "dir" / "s.db"
    with pytest.raises(ConfigError) as err:
        storage_spec({"kind": "sqlite", "url": f"sqlite:///{missing}"}, tmp_path / "sweep", "s")
    assert str(err.value) == (
        f"search.storage.url=sqlite:///{missing}: folder {missing.parent} does not exist; create it, or leave "
        "search.storage.url null (<hydra.sweep.dir>/<study_name>.db)"
    )
    assert not missing.parent.exists()
    with pytest.raises(
        ConfigError, match=r"^search\.storage\.url=sqlit:///x\.db: unknown URL scheme 'sqlit'; valid: "
    ):
        storage_spec({"kind": "sqlite", "url": "sqlit:///x.db"}, tmp_path, "s")
    # set as hydra.sweeper.storage, the key is that one
    with pytest.raises(ConfigError, match=r"^hydra\.sweeper\.storage=nosuchdb://x: unknown URL scheme"):
        storage_spec("nosuchdb://x", tmp_path, "s")
    # an existing folder, or the default file (whose folder is made), is fine
    assert storage_spec({"kind": "sqlite", "url": f"sqlite:///{tmp_path}/s.db"}, tmp_path, "s") == (
        f"sqlite:///{tmp_path}/s.db"
    )
    assert storage_spec(
        OmegaConf.to_container(OmegaConf.create({"kind": "sqlite", "url": None})), tmp_path / "new", "s"
    )


@pytest.mark.slow
def test_a_storage_url_in_a_missing_folder_is_one_line_exit_2(toy, tmp_path):
    missing = tmp_path / "nope" / "s.db"
    proc = toy(f"hydra.sweeper.storage={{kind:sqlite,url:'sqlite:///{missing}'}}")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"error: search.storage.url=sqlite:///{missing}: folder {missing.parent} does not exist; create it, or "
        "leave search.storage.url null (<hydra.sweep.dir>/<study_name>.db)"
    ]
    assert not missing.parent.exists()
