"""The toy Hydra app of the sweeper tests (``tests/test_search_sweeper.py``, ``tests/test_scale_out.py``): its script,
its config and its search space. Trials take milliseconds. The app runs as a subprocess with ``tests/`` on its
``PYTHONPATH``, so its config names the space as ``toy_sweeper.ToySpace`` (the ``toy`` fixture in conftest.py
writes and runs it)."""

from __future__ import annotations

import optuna

APP = """
import json, os, sys, time
from pathlib import Path
import hydra

@hydra.main(config_path=".", config_name="toy", execution_whitelist=["toy_sweeper.*", "optuna.pruners.*"])
def main(cfg):
    x = cfg.x
    if cfg.log_pid:
        Path(cfg.log_pid).mkdir(exist_ok=True)
        (Path(cfg.log_pid) / f"{cfg.search.trial.number}").write_text(str(os.getpid()))
    if cfg.until:  # sleep until the file exists (at most cfg.sleep seconds)
        deadline = time.time() + cfg.sleep
        while time.time() < deadline and not Path(cfg.until).exists():
            time.sleep(0.1)
    else:
        time.sleep(cfg.sleep)
    if x in cfg.fail_at:
        raise RuntimeError(f"toy failure at x={x}")
    if x in cfg.constant_at:  # a regression run whose predictions do not vary: its correlation is nan
        from adls_lightning.app.objective import trial_result
        return trial_result({"val/pearson": float("nan"), "x": float(x)}, ["val/pearson"])
    if cfg.report:  # a job that reports per-step values to its trial and is pruned like a Lightning run
        from adls_lightning.search.storage import open_trial
        from hydra.utils import instantiate
        t = cfg.search.trial
        trial = open_trial(t.storage, t.study_name, t.number, instantiate(cfg.pruner))
        for step in range(1, 4):
            trial.report(float(x) * step, step)
            if trial.should_prune():
                import optuna
                raise optuna.TrialPruned(f"pruned at step {step}")
    if cfg.two_objectives:
        return [float(x), float(cfg.y)]
    return float(x)

if __name__ == "__main__":
    main()
"""


CONFIG = """
defaults:
  - override hydra/sweeper: optuna_study
  - _self_
seed: 0
x: 0
y: 0
sleep: 0.0
until: null
fail_at: []
constant_at: []
report: false
two_objectives: false
log_pid: null
pruner: {_target_: optuna.pruners.NopPruner}
search:
  name: toy
  trial: {study_name: null, storage: null, number: null}
hydra:
  searchpath: ["file://ROOT/conf"]
  mode: MULTIRUN
  sweep:
    dir: ???
    subdir: ${hydra.job.num}
  sweeper:
    study_name: toy-${hydra:runtime.choices.hydra/sweeper/sampler}
    n_trials: 6
    max_failure_rate: 0.0
    heartbeat_interval: 1
    grace_period: 3
    settings_ignore: [sleep, until, log_pid]  # the test's own knobs: a resuming worker may set them otherwise
    search_space:
      _target_: toy_sweeper.ToySpace
"""


class ToySpace:
    """x in 0..9, and y in 0..3 only when x is odd (a conditional parameter); x == 7 is rejected."""

    def __call__(self, trial):
        x = trial.suggest_categorical("x", list(range(10)))
        if x == 7:
            raise optuna.TrialPruned("rejected: x=7 is not allowed")
        out = {"x": x}
        if x % 2:
            out["y"] = trial.suggest_categorical("y", [0, 1, 2, 3])
        return out
