"""A study named by its name is found where search.py wrote it: under the working folder's (or $PROJECT_ROOT's)
outputs/search, else under this checkout's (``python /path/to/search.py`` from another folder writes there)."""

from __future__ import annotations

import optuna
import pytest

import adls_lightning.data.folder
from adls_lightning.errors import ConfigError
from adls_lightning.reports.study import load_study
from adls_lightning.reports.table import results_table
from tests.helpers import table_rows, write_run


@pytest.fixture
def elsewhere(tmp_path, monkeypatch):
    """A checkout (tmp/repo) holding a study by name, and the user's working folder elsewhere (tmp/work)."""
    checkout, work = tmp_path / "repo", tmp_path / "work"
    (checkout / "outputs" / "search" / "s").mkdir(parents=True)
    work.mkdir()
    monkeypatch.setattr(adls_lightning.data.folder, "PROJECT_ROOT", checkout)
    monkeypatch.delenv("PROJECT_ROOT", raising=False)
    monkeypatch.chdir(work)
    storage = f"sqlite:///{checkout / 'outputs' / 'search' / 's' / 's.db'}"
    study = optuna.create_study(storage=storage, study_name="s")
    for i, value in enumerate((0.7, 0.8)):
        run = write_run(
            checkout / "outputs" / "t" / str(i), [f"model.optimizer.lr=1e-{i + 3}"], {"val/acc": value}
        )
        study.add_trial(optuna.trial.create_trial(value=value, user_attrs={"output_dir": str(run)}))
    return checkout, work


def test_a_study_written_under_the_checkout_is_found_by_name_from_another_folder(elsewhere):
    checkout, _ = elsewhere
    study, shown = load_study("s")
    assert study.study_name == "s" and shown == f"sqlite:///{checkout / 'outputs' / 'search' / 's' / 's.db'}"
    rows = table_rows(results_table(["s"]))  # adls-table's lookup is the same one
    assert {k: v[:2] for k, v in rows.items()} == {"1e-3": ["1", "0.7000"], "1e-4": ["1", "0.8000"]}


def test_a_name_found_nowhere_names_both_folders(elsewhere):
    checkout, work = elsewhere
    with pytest.raises(ConfigError) as error:
        load_study("nope")
    message = str(error.value)
    assert message.startswith("source=nope: no such study file, and no study of that name in ")
    assert f"{work / 'outputs' / 'search'} or {checkout / 'outputs' / 'search'}" in message
