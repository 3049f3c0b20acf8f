"""What a search is told on its command line and refuses before any study exists: a sweep override whose tag the
sweeper would not read (``tag(lgo, ...)``, ``log`` on a choice) or whose bounds hold no value, and a
``hydra.sweeper.settings_ignore`` key that is not a key of the config. Each is one ``error:`` line naming the key,
exit code 2, no study file. The subprocess tests run the toy Hydra app of ``tests/toy_sweeper.py`` (the project's
sweeper plugin) and ``search.py`` itself for the tutorial's key."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from optuna.distributions import FloatDistribution, IntDistribution

from adls_lightning.errors import ConfigError
from hydra_plugins.adls_optuna_sweeper._impl import sweep_distributions

RANGE_VALID = (
    "valid: range(start, stop[, step]) with stop above start for a positive step, below it for a negative one "
    "(stop excluded)"
)


@pytest.mark.parametrize(
    "override, line",
    [
        ("lr=tag(lgo, interval(1e-5, 1e-2))", "lr: unknown tag 'lgo' (valid: log)"),
        ("lr=tag(log, lgo, interval(1e-5, 1e-2))", "lr: unknown tag 'lgo' (valid: log)"),
        (
            "lr=interval(1e-2, 1e-5)",
            "lr: interval(0.01, 1e-05): low is above high; valid: interval(low, high) with low <= high",
        ),
        (
            "lr=tag(log, interval(0, 1e-2))",
            "lr: tag(log, interval(0.0, 0.01)): a log scale needs low > 0; valid: a positive low, or the interval "
            "without the tag (a linear scale)",
        ),
        ("r=tag(log, interval(-4, 64))", "r: tag(log, interval(-4.0, 64.0)): a log scale needs low > 0"),
        ("batch=range(32,8)", f"batch: range(32, 8, 1) holds no value; {RANGE_VALID}"),
        ("batch=range(8,32,-8)", "batch: range(8, 32, -8) holds no value"),
        ("batch=range(8,32,0)", "batch: range(8, 32, 0) holds no value"),
        ("batch=shuffle(range(4,4))", "batch: range(4, 4, 1) holds no value"),
        (
            "r=tag(log, range(1, 64))",
            "r: tag(log, ...) applies to interval(low, high) only, not to range(...)",
        ),
        (
            "r=tag(log, choice(4, 8))",
            "r: tag(log, ...) applies to interval(low, high) only, not to choice(...)",
        ),
    ],
)
def test_a_sweep_the_stock_parser_misreads_or_fails_on_is_refused_naming_its_key(override, line):
    with pytest.raises(ConfigError) as err:
        sweep_distributions(["fixed=1", override])
    assert str(err.value).startswith(line)
    assert "\n" not in str(err.value)


def test_good_sweeps_keep_the_stock_distributions():
    distributions, fixed, _ = sweep_distributions(
        ["lr=tag(log, interval(1e-5, 1e-2))", "r=tag(log, interval(1, 64))", "p=interval(0.1, 0.1)",
         "b=range(32, 8, -8)", "n=range(1, 3)", "fixed=1"]
    )  # fmt: skip
    assert distributions == {
        "lr": FloatDistribution(1e-5, 1e-2, log=True),
        "r": FloatDistribution(1.0, 64.0, log=True),
        "p": FloatDistribution(0.1, 0.1),
        "b": IntDistribution(16, 32, step=8),
        "n": IntDistribution(1, 2),
    }
    assert fixed == {"fixed": "1"}


def refused(proc: subprocess.CompletedProcess, sweep_dir: Path) -> list[str]:
    """The stderr lines of a refusal (exit code 2, no study file under ``sweep_dir``)."""
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    assert not sweep_dir.exists() or not list(sweep_dir.rglob("*.db")), list(sweep_dir.rglob("*"))
    return proc.stderr.strip().splitlines()


@pytest.mark.slow
@pytest.mark.parametrize(
    "overrides, line",
    [
        # before: the tag was dropped, and the study ran on a linear scale (exit 0)
        (["sleep=tag(lgo, interval(0.001, 0.002))"], "error: sleep: unknown tag 'lgo' (valid: log)"),
        # before: a traceback of Optuna's ValueError, exit 1
        (["seed=range(32,8)"], f"error: seed: range(32, 8, 1) holds no value; {RANGE_VALID}"),
        # before: accepted, and ignored nothing
        (
            ["hydra.sweeper.settings_ignore=[sleep,sleeep]"],
            "error: hydra.sweeper.settings_ignore=[sleep,sleeep]: sleeep is not a key of the config (did you mean "
            "sleep or seed?)",
        ),
        (
            ["hydra.sweeper.settings_ignore=[search.trail.number]"],
            "error: hydra.sweeper.settings_ignore=[search.trail.number]: search.trail.number is not a key of the "
            "config (did you mean search.trial.number?)",
        ),
        (
            ["hydra.sweeper.settings_ignore=[nothing_like_it]"],
            "error: hydra.sweeper.settings_ignore=[nothing_like_it]: nothing_like_it is not a key of the config "
            "(the command with --cfg job lists them)",
        ),
    ],
)
def test_a_bad_sweep_or_settings_ignore_key_is_one_line_exit_2_and_no_study(toy, tmp_path, overrides, line):
    proc = toy("hydra.sweeper.n_trials=1", *overrides)
    assert refused(proc, tmp_path / "sweep") == [line]


@pytest.mark.slow
def test_a_settings_ignore_key_of_the_config_or_added_by_the_command_is_taken(toy, tmp_path):
    # a whole node, a leaf under it, and a key the command adds (+note) are keys of the config
    proc = toy(
        "hydra.sweeper.n_trials=1", "+note=a", "hydra.sweeper.settings_ignore=[search.trial,sleep,note]"
    )
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "sweep" / "toy-tpe.db").exists()


@pytest.mark.slow
def test_search_py_refuses_a_misspelt_tag_and_a_misspelt_ignored_key(search, tmp_path):
    sweep_dir = tmp_path / "sweep"
    lr = "model.optimizer.lr=tag(lgo, interval(1e-5, 1e-2))"
    proc = search("search=hparams", "model=tiny_random", "model/lora=none", "logger=none", lr,
                  "hydra.sweeper.n_trials=2", "hydra.sweeper.study_name=typo")  # fmt: skip
    assert refused(proc, sweep_dir) == ["error: model.optimizer.lr: unknown tag 'lgo' (valid: log)"]
    proc = search("search=hparams", "model=tiny_random", "model/lora=none", "logger=none",
                  "model.optimizer.lr=tag(log, interval(1e-5, 1e-2))", "hydra.sweeper.n_trials=2",
                  "hydra.sweeper.study_name=ui", "hydra.sweeper.settings_ignore=[data.trian_size]")  # fmt: skip
    assert refused(proc, sweep_dir) == [
        "error: hydra.sweeper.settings_ignore=[data.trian_size]: data.trian_size is not a key of the config (did "
        "you mean data.train_size, data.val_size or data.truncation_side?)"
    ]
