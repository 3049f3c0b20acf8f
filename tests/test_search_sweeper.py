"""The Optuna study sweeper on a toy Hydra app (trials take milliseconds, no training).

The app is written to a temporary folder and run as a subprocess, as a user runs ``search.py``: the sweeper is
found as a Hydra plugin, its config comes from the project's ``conf/hydra/sweeper``.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from tests.helpers import job_started, ok

# every test here starts training runs or processes (minutes in all): `make test-fast` skips them
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]


def load(sweep_dir: Path, name: str = "toy-tpe") -> optuna.Study:
    return optuna.load_study(study_name=name, storage=f"sqlite:///{sweep_dir / name}.db")


def first_trial_is_running(db: Path) -> bool:
    """Whether a trial with sampled parameters is running, read from ``db`` without Optuna: opening it through
    Optuna while the worker is still creating the schema would race the worker's own schema creation (both insert
    the version row, and one of them fails)."""
    if not db.exists():
        return False
    try:
        with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True)) as con:
            (running,) = con.execute(
                "SELECT count(*) FROM trials JOIN trial_params USING (trial_id)"
                " WHERE trials.state = 'RUNNING' AND trial_params.param_name = 'x'"
            ).fetchone()
    except sqlite3.OperationalError:  # no such table yet, or the database is locked
        return False
    return running > 0


def states(study: optuna.Study) -> list[str]:
    return [t.state.name for t in study.trials]


def test_runs_n_trials_into_sqlite_and_writes_the_best(toy, tmp_path):
    proc = ok(toy("hydra.sweeper.n_trials=6", "hydra/sweeper/sampler=random"))
    study = load(tmp_path / "sweep", "toy-random")
    done = [t for t in study.trials if t.state == TrialState.COMPLETE]
    assert len(study.trials) == 6
    # every completed trial returned its x, as sampled; odd x also sampled the conditional y, except x=7, which
    # the space rejects before it asks for y (that trial is PRUNED, with x alone)
    assert all(t.value == t.params["x"] for t in done)
    for t in study.trials:
        if t.params.get("x") == 7:
            assert t.state == TrialState.PRUNED and t.params == {"x": 7}
        elif "x" in t.params:
            assert ("y" in t.params) == (t.params["x"] % 2 == 1), t
    best = json.loads((tmp_path / "sweep" / "toy-random_best.json").read_text())
    assert best["best_trials"][0]["values"]["objective_0"] == max(t.value for t in done)
    assert f"Best trial {best['best_trials'][0]['number']} of study toy-random" in proc.stdout


def test_same_seed_same_trials_and_resume_does_not_repeat(toy, tmp_path):
    ok(toy("hydra.sweeper.n_trials=3", "hydra/sweeper/sampler=random", sweep_dir=tmp_path / "a"))
    first = load(tmp_path / "a", "toy-random").trials
    ok(toy("hydra.sweeper.n_trials=5", "hydra/sweeper/sampler=random", sweep_dir=tmp_path / "a"))
    ok(
        toy("hydra.sweeper.n_trials=5", "hydra/sweeper/sampler=random", sweep_dir=tmp_path / "a")
    )  # nothing left
    resumed = load(tmp_path / "a", "toy-random").trials
    assert [t.number for t in resumed] == [0, 1, 2, 3, 4]
    assert [(t.params, t.datetime_complete) for t in resumed[:3]] == [
        (t.params, t.datetime_complete) for t in first
    ]

    ok(toy("hydra.sweeper.n_trials=5", "hydra/sweeper/sampler=random", sweep_dir=tmp_path / "b"))
    fresh = load(tmp_path / "b", "toy-random").trials
    # the seed of trial n depends on (seed, n) only: a resumed study draws exactly what one run draws
    assert [t.params for t in fresh] == [t.params for t in resumed]
    ok(toy("hydra.sweeper.n_trials=5", "hydra/sweeper/sampler=random", "seed=1", sweep_dir=tmp_path / "c"))
    assert [t.params for t in load(tmp_path / "c", "toy-random").trials] != [t.params for t in fresh]


def test_two_workers_share_one_budget(toy, tmp_path):
    args = [
        "hydra.sweeper.n_trials=8",
        "hydra/sweeper/sampler=random",
        "sleep=0.3",
        f"log_pid={tmp_path / 'pids'}",
    ]
    workers = [toy(*args, wait=False) for _ in range(2)]
    outputs = [w.communicate(timeout=300)[0].decode() for w in workers]
    assert [w.returncode for w in workers] == [0, 0], outputs
    study = load(tmp_path / "sweep", "toy-random")
    ran = [t for t in study.trials if t.state in (TrialState.COMPLETE, TrialState.PRUNED)]
    assert len(ran) == 8
    assert all(t.state in (TrialState.COMPLETE, TrialState.PRUNED, TrialState.WAITING) for t in study.trials)
    pids = {p.read_text() for p in (tmp_path / "pids").iterdir()}
    assert len(pids) == 2, "both workers should have run trials"
    # different trial numbers draw different seeds, so the workers do not replay each other's samples
    assert len({t.params["x"] for t in ran}) > 2


def test_failed_trial_is_recorded_and_the_sweep_goes_on(toy, tmp_path):
    ok(
        toy(
            "hydra.sweeper.n_trials=8",
            "hydra.sweeper.max_failure_rate=1.0",
            "fail_at=[0,2,4,6,8]",
            "hydra/sweeper/sampler=random",
        )
    )
    study = load(tmp_path / "sweep", "toy-random")
    by_state = {s: [t for t in study.trials if t.state == s] for s in TrialState}
    assert len(study.trials) == 8
    assert by_state[TrialState.FAIL] and by_state[TrialState.COMPLETE]
    assert all(t.params["x"] % 2 == 0 for t in by_state[TrialState.FAIL])
    assert all(
        t.user_attrs["fail_reason"] == f"RuntimeError: toy failure at x={t.params['x']}"
        for t in by_state[TrialState.FAIL]
    )
    assert all(
        t.params["x"] == 7 and "x=7 is not allowed" in t.user_attrs["pruned_reason"]
        for t in by_state[TrialState.PRUNED]
    )


@pytest.mark.parametrize(("rate", "failures"), [(0.0, 1), (0.5, 5)])
def test_too_many_failures_stop_the_sweep(toy, tmp_path, rate, failures):
    # 8 trials may have at most rate * 8 failures: the one after that stops the sweep
    proc = toy(
        "hydra.sweeper.n_trials=8", f"hydra.sweeper.max_failure_rate={rate}", "fail_at=[0,1,2,3,4,5,6,8,9]"
    )
    assert proc.returncode != 0
    assert "toy failure" in proc.stderr
    assert states(load(tmp_path / "sweep")).count("FAIL") == failures
    assert states(load(tmp_path / "sweep"))[-1] == "FAIL"


def test_job_raising_trial_pruned_is_recorded_pruned(toy, tmp_path):
    ok(
        toy(
            "hydra.sweeper.n_trials=6",
            "report=true",
            "hydra/sweeper/sampler=random",
            "pruner._target_=optuna.pruners.ThresholdPruner",
            "++pruner.upper=10.0",
        )
    )
    study = load(tmp_path / "sweep", "toy-random")
    for t in study.trials:
        if t.params["x"] == 7:
            continue
        # values x, 2x, 3x are reported; the threshold pruner stops at the first step above 10
        over = [step for step in (1, 2, 3) if t.params["x"] * step > 10]
        assert t.state == (TrialState.PRUNED if over else TrialState.COMPLETE)
        assert max(t.intermediate_values) == (over[0] if over else 3)


def test_crashed_worker_trial_is_retried_with_its_parameters(toy, tmp_path):
    pids = tmp_path / "pids"
    worker = toy(
        "hydra.sweeper.n_trials=3", "sleep=60", "hydra/sweeper/sampler=random", f"log_pid={pids}", wait=False
    )
    db = tmp_path / "sweep" / "toy-random.db"
    deadline = time.time() + 120
    # its job started: the trial holds all its parameters (a kill between sampling x and y would leave x alone)
    while time.time() < deadline and not (first_trial_is_running(db) and job_started(pids)):
        time.sleep(0.5)
    os.kill(worker.pid, signal.SIGKILL)
    worker.wait()
    crashed = next(t for t in load(tmp_path / "sweep", "toy-random").trials if t.state == TrialState.RUNNING)
    time.sleep(4)  # past the 3 s grace period: its heartbeat is stale

    ok(toy("hydra.sweeper.n_trials=3", "hydra/sweeper/sampler=random"))
    trials = load(tmp_path / "sweep", "toy-random").trials
    assert trials[crashed.number].state == TrialState.FAIL
    (retry,) = [t for t in trials if t.system_attrs.get("failed_trial") == crashed.number]
    assert retry.params == crashed.params
    assert retry.state in (TrialState.COMPLETE, TrialState.PRUNED)
    # the crashed trial does not use up the budget: 3 trials ran besides it
    assert len([t for t in trials if t.state != TrialState.FAIL]) == 3


def test_grid_sampler_runs_the_explicit_grid_once(toy, tmp_path):
    ok(toy("hydra/sweeper/sampler=grid", "hydra.sweeper.grid={x:[1,2,4]}", "hydra.sweeper.n_trials=10"))
    study = load(tmp_path / "sweep", "toy-grid")
    assert sorted(t.params["x"] for t in study.trials) == [1, 2, 4]
    # y is not in the grid: it keeps its first choice and is recorded as fixed
    assert [t.user_attrs.get("fixed/y") for t in study.trials if t.params["x"] == 1] == [0]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["hydra/sweeper/sampler=grid"], "hydra/sweeper/sampler=grid needs an explicit grid"),
        (
            ["hydra/sweeper/sampler=grid", "hydra.sweeper.grid={z:[1]}"],
            "hydra.sweeper.grid.z: not a parameter",
        ),
        (["hydra/sweeper/sampler=grid", "hydra.sweeper.grid={x:[11]}"], "hydra.sweeper.grid: "),
        (
            ["hydra.sweeper.storage=sqlite:////nonexistent/dir/x.db"],
            "hydra.sweeper.storage=sqlite:////nonexistent",
        ),
        (
            ["hydra.sweeper.storage=nosuchdb://x"],
            "hydra.sweeper.storage=nosuchdb://x: unknown URL scheme 'nosuchdb'; valid: sqlite",
        ),
        (["hydra/sweeper/sampler=nosuch"], "Could not find 'hydra/sweeper/sampler/nosuch'"),
        (["hydra.sweeper.direction=up"], "hydra.sweeper.direction=up: must be maximize or minimize"),
        (["hydra.sweeper.keep_checkpoints=-1"], "hydra.sweeper.keep_checkpoints=-1: must be a whole number"),
    ],
)
def test_bad_input_fails_with_one_line(toy, tmp_path, overrides, message):
    proc = toy(*overrides)
    assert proc.returncode != 0
    # the error is one line (Hydra's own composition errors list the valid options after it), no traceback
    assert any(message in line for line in proc.stderr.splitlines()), proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("sampler", ["tpe", "random", "cmaes", "gp", "nsgaii", "qmc"])
def test_each_sampler_runs(toy, tmp_path, sampler):
    ok(toy(f"hydra/sweeper/sampler={sampler}", "hydra.sweeper.n_trials=4"))
    study = load(tmp_path / "sweep", f"toy-{sampler}")
    assert len(study.trials) == 4
    assert all(t.state in (TrialState.COMPLETE, TrialState.PRUNED) for t in study.trials)


def test_two_objectives_give_a_pareto_front(toy, tmp_path):
    ok(
        toy(
            "two_objectives=true",
            "hydra.sweeper.direction=[maximize,minimize]",
            "hydra.sweeper.n_trials=8",
            "hydra/sweeper/sampler=nsgaii",
        )
    )
    study = load(tmp_path / "sweep", "toy-nsgaii")
    front = json.loads((tmp_path / "sweep" / "toy-nsgaii_best.json").read_text())["best_trials"]
    done = [t for t in study.trials if t.state == TrialState.COMPLETE]
    # a trial is on the front iff no other trial has x >= and y <= with one strict (hand-written dominance)
    dominated = {
        t.number
        for t in done
        for o in done
        if o.values[0] >= t.values[0] and o.values[1] <= t.values[1] and o.values != t.values
    }
    assert sorted(f["number"] for f in front) == sorted(t.number for t in done if t.number not in dominated)


def test_random_and_tpe_draw_their_own_start_up_trials(toy, tmp_path):
    # TPE's first trials are random draws; with per-trial seeds they must not be the random sampler's draws.
    draws = {}
    for sampler in ("random", "tpe"):
        ok(toy(f"hydra/sweeper/sampler={sampler}", "hydra.sweeper.n_trials=10", sweep_dir=tmp_path / sampler))
        study = load(tmp_path / sampler, f"toy-{sampler}")
        draws[sampler] = [t.params.get("x") for t in sorted(study.trials, key=lambda t: t.number)]
    assert len(draws["random"]) == len(draws["tpe"]) == 10
    assert sum(a != b for a, b in zip(draws["random"], draws["tpe"])) >= 5, draws


def test_the_sweeper_loads_without_torch_or_lightning():
    """The sweeper's own process needs neither (each trial's run loads them where it runs): a search that refuses
    its input, waits on another worker or launches its trials elsewhere starts in a second, not after ~10 CPU-s of
    imports, and so does every toy app run here."""
    code = (
        "import sys, hydra_plugins.adls_optuna_sweeper._impl\n"
        "print([m for m in ('torch', 'lightning', 'transformers') if m in sys.modules])"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.stdout.strip() == "[]", proc.stdout + proc.stderr[-2000:]


def test_startup_trials_sets_the_samplers_random_start():
    from omegaconf import OmegaConf

    from hydra_plugins.adls_optuna_sweeper._impl import StudySweeper, trial_seed

    sampler = OmegaConf.create({"_target_": "optuna.samplers.TPESampler", "seed": 1, "n_startup_trials": 10})
    sweeper = StudySweeper(sampler=sampler, study_name="s", startup_trials=3)
    assert sweeper._make_sampler(5)._n_startup_trials == 3
    assert StudySweeper(sampler=sampler, study_name="s")._make_sampler(5)._n_startup_trials == 10
    assert trial_seed(1, 0, "a") != trial_seed(1, 0, "b") and trial_seed(1, 0, "a") == trial_seed(1, 0, "a")
    with pytest.raises(Exception, match=r"hydra.sweeper.startup_trials=0"):
        StudySweeper(sampler=sampler, study_name="s", startup_trials=0)
