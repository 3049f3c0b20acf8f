"""A study records the data its trials read, not the data folder as configured, nor where caches live.

IMDb's ``data.data_dir=auto`` reads ``$ADLS_IMDB_DIR``, ``../shared/data/imdb`` or the hub. Recorded as "auto", a
search on other data (another ``$ADLS_IMDB_DIR``, another machine) joined the study and its best trial compared
trials scored on different data. The other way round, a moved tokenized cache (``paths.cache_dir`` copied into
``data.cache_dir``) or the same files in another folder refused a resume. Now ``data.data_dir`` is recorded as the
files' content (or the hub data set), and ``*.cache_dir`` keys are not settings.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import optuna
import pytest

from adls_lightning.errors import ConfigError
from adls_lightning.search.identity import SETTINGS_ATTR, check_study_settings, study_settings
from tests.helpers import assert_one_line_error, compose_config, make_reviews

ROOT = Path(__file__).resolve().parent.parent
LR = "model.optimizer.lr=tag(log, interval(1e-5, 1e-2))"


def _distributions(overrides: list[str]) -> dict:
    from hydra_plugins.hydra_optuna_sweeper._impl import create_params_from_overrides

    return create_params_from_overrides(overrides)[0]


def _settings(*overrides: str) -> dict[str, str]:
    """The settings the sweeper records for ``search.py search=hparams LR <overrides>`` in this environment."""
    cfg = compose_config("search", ["search=hparams", *overrides], return_hydra_config=True)
    return study_settings(cfg, _distributions([LR]))


def _other_imdb(folder: Path) -> Path:
    """An IMDb-format folder with other reviews than the tiny one."""
    folder.mkdir()
    make_reviews(400, seed=5).to_parquet(folder / "train.parquet")
    make_reviews(200, seed=6).to_parquet(folder / "test.parquet")
    return folder


def _refusal(recorded: dict[str, str], settings: dict[str, str]) -> str:
    with pytest.raises(ConfigError) as refused:
        check_study_settings({SETTINGS_ATTR: recorded}, settings, "s", "db")
    return str(refused.value)


def test_auto_is_recorded_as_the_data_it_finds(monkeypatch, tmp_path, tiny_imdb_dir):
    monkeypatch.setenv("ADLS_IMDB_DIR", str(tiny_imdb_dir))
    first = _settings()
    assert json.loads(first["data.data_dir"]).startswith("sha256:")  # not "auto"
    # the same files named explicitly, or copied into another folder (another checkout or machine): a resume
    assert _settings(f"data.data_dir={tiny_imdb_dir}") == first
    copy = shutil.copytree(tiny_imdb_dir, tmp_path / "copy")
    monkeypatch.setenv("ADLS_IMDB_DIR", str(copy))
    assert check_study_settings({SETTINGS_ATTR: first}, _settings(), "s", "db") is True
    # other files found by the same "auto": another search, refused naming the key
    monkeypatch.setenv("ADLS_IMDB_DIR", str(_other_imdb(tmp_path / "other")))
    message = _refusal(first, _settings())
    assert message.count("data.data_dir: ") == 1 and "sha256:" in message, message
    # and a changed file in the same folder
    monkeypatch.setenv("ADLS_IMDB_DIR", str(copy))
    make_reviews(400, seed=9).to_parquet(copy / "train.parquet")
    assert "data.data_dir: " in _refusal(first, _settings())


def test_the_hub_is_another_source_than_a_folder(monkeypatch, tmp_path, tiny_imdb_dir):
    monkeypatch.setenv("ADLS_IMDB_DIR", str(tiny_imdb_dir))
    local = _settings()
    hub = _settings("data.data_dir=null")
    assert json.loads(hub["data.data_dir"]) == "hub:stanfordnlp/imdb"
    assert "data.data_dir: " in _refusal(local, hub)


def test_a_cache_folder_is_not_a_setting(monkeypatch, tiny_imdb_dir):
    monkeypatch.setenv("ADLS_IMDB_DIR", str(tiny_imdb_dir))
    base = _settings("search/objective=acc_latency", "hydra/sweeper/sampler=nsgaii")
    assert not any(key.endswith(".cache_dir") for key in base)
    assert (
        _settings("search/objective=acc_latency", "hydra/sweeper/sampler=nsgaii", "paths.cache_dir=/x")
        == base
    )
    monkeypatch.setenv("ADLS_CACHE_DIR", "/elsewhere")
    assert _settings("search/objective=acc_latency", "hydra/sweeper/sampler=nsgaii") == base


def test_a_study_recorded_before_resumes_on_the_same_data(monkeypatch, tmp_path, tiny_imdb_dir):
    """A study recorded with ``data.data_dir`` as configured (and its cache's folder) reads as the data that value
    reads now: the same command resumes it; a recorded folder holding other data than this command's is refused."""
    monkeypatch.setenv("ADLS_IMDB_DIR", str(tiny_imdb_dir))
    today = _settings()
    recorded_auto = {
        **today,
        "data.data_dir": json.dumps("auto"),
        "data.cache_dir": json.dumps("/old/.cache"),
    }
    assert check_study_settings({SETTINGS_ATTR: recorded_auto}, today, "s", "db") is True
    recorded_folder = {**today, "data.data_dir": json.dumps(str(tiny_imdb_dir))}
    assert check_study_settings({SETTINGS_ATTR: recorded_folder}, today, "s", "db") is True
    recorded_other = {**today, "data.data_dir": json.dumps(str(_other_imdb(tmp_path / "other")))}
    assert "data.data_dir: " in _refusal(recorded_other, today)


def _study_trials(sweep: Path) -> list[int]:
    (db,) = sweep.glob("*.db")
    (summary,) = optuna.get_all_study_summaries(f"sqlite:///{db}")
    study = optuna.load_study(study_name=summary.study_name, storage=f"sqlite:///{db}")
    return [t.number for t in study.get_trials(deepcopy=False)]


@pytest.mark.slow
def test_search_on_other_data_is_refused_and_moved_data_and_cache_resume(tmp_path, tiny_imdb_dir, cache_dir):
    """search.py as users type it, with IMDb's default data.data_dir=auto found through $ADLS_IMDB_DIR."""

    def search(imdb: Path, cache: Path, trials: int) -> subprocess.CompletedProcess:
        cmd = [
            sys.executable, str(ROOT / "search.py"), "search=hparams", LR, "model=tiny_random",
            f"hydra.sweep.dir={tmp_path / 'sweep'}", "trainer=cpu", "trainer.max_epochs=1",
            "callbacks.rich_progress_bar=null", "data.max_length=16", "data.batch_size=16", "data.train_size=32",
            "data.val_size=32", "data.test_size=32", f"hydra.sweeper.n_trials={trials}",
        ]  # fmt: skip
        env = {
            **os.environ,
            "PROJECT_ROOT": str(ROOT),
            "ADLS_IMDB_DIR": str(imdb),
            "ADLS_CACHE_DIR": str(cache),
        }
        return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)

    done = search(tiny_imdb_dir, cache_dir, 1)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    refused = search(_other_imdb(tmp_path / "other"), cache_dir, 2)
    assert_one_line_error(refused, "error: hydra.sweeper.study_name=", contains="data.data_dir: ")
    assert _study_trials(tmp_path / "sweep") == [0]
    # the same files in another folder, the tokenized cache moved: the study goes on
    moved = shutil.copytree(tiny_imdb_dir, tmp_path / "moved")
    resumed = search(moved, tmp_path / "new_cache", 2)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert _study_trials(tmp_path / "sweep") == [0, 1]


def test_a_study_recorded_before_is_told_once_and_then_keeps_to_its_data(toy, tmp_path, tiny_imdb_dir):
    """A study whose record names its data folder as configured (made before the data read was recorded) resumes
    as reading what that folder holds now, says so once, and records it: new files in the folder are then refused."""
    folder = shutil.copytree(tiny_imdb_dir, tmp_path / "imdb")
    data = ["+data._target_=adls_lightning.data.datamodule.IMDbDataModule", f"+data.data_dir={folder}"]
    command = ["hydra/sweeper/sampler=random", "hydra.sweeper.n_trials=1", *data]
    first = toy(*command)
    assert first.returncode == 0, first.stderr[-3000:]
    storage = f"sqlite:///{tmp_path / 'sweep' / 'toy-random.db'}"
    study = optuna.load_study(study_name="toy-random", storage=storage)
    settings = study.user_attrs[SETTINGS_ATTR]
    assert json.loads(settings["data.data_dir"]).startswith("sha256:")
    # as a study of before 2026-11-30 recorded it: the folder as configured
    study.set_user_attr(SETTINGS_ATTR, {**settings, "data.data_dir": json.dumps(str(folder))})

    resumed = toy(*command[:1], "hydra.sweeper.n_trials=2", *command[2:])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    output = resumed.stdout + resumed.stderr
    told = [line for line in output.splitlines() if "as configured, not the data its trials read" in line]
    assert len(told) == 1 and f"data.data_dir={folder}" in told[0], output[-3000:]
    recorded = optuna.load_study(study_name="toy-random", storage=storage).user_attrs[SETTINGS_ATTR]
    assert recorded == settings  # the data read, recorded in its place

    make_reviews(400, seed=9).to_parquet(folder / "train.parquet")  # other files in the same folder
    other = toy(*command[:1], "hydra.sweeper.n_trials=3", *command[2:])
    assert other.returncode == 2, other.stderr[-3000:]
    assert_one_line_error(other, "error: hydra.sweeper.study_name=toy-random: ", "data.data_dir: ")
    assert len(optuna.load_study(study_name="toy-random", storage=storage).trials) == 2
