"""What a resumed study's command may change, on the toy app (tests/toy_sweeper.py; trials take milliseconds), run as
a user runs a search: ``hydra.sweeper.settings_ignore`` leaves its keys out of the study's identity on both sides,
and choosing the other storage kind in the same sweep folder is refused instead of starting a second study there.
"""

from __future__ import annotations

from pathlib import Path

import optuna
import pytest
from optuna.storages import JournalStorage
from optuna.storages.journal import JournalFileBackend

from tests.helpers import assert_one_line_error, ok

# every test here runs the toy search several times (seconds each): `make test-fast` skips them
pytestmark = pytest.mark.slow

NAME = "toy-tpe"  # the toy's study: toy-<sampler>
# the toy ignores its own knobs (sleep, until, log_pid); these tests set the list themselves
NO_IGNORE = "hydra.sweeper.settings_ignore=[]"
IGNORE_NOTE = "hydra.sweeper.settings_ignore=[note]"
STORAGES = {"sqlite": ".db", "journal": ".journal"}


def _trials(path: Path) -> list[tuple[int, str, dict]]:
    storage = (
        JournalStorage(JournalFileBackend(str(path))) if path.suffix == ".journal" else f"sqlite:///{path}"
    )
    study = optuna.load_study(study_name=NAME, storage=storage)
    return [(t.number, t.state.name, t.params) for t in study.trials]


def _files(folder: Path) -> dict[str, int]:
    return {str(p.relative_to(folder)): p.stat().st_size for p in sorted(folder.rglob("*")) if p.is_file()}


def test_adding_settings_ignore_on_a_resume_resumes_whatever_the_ignored_key_is(toy, tmp_path):
    db = tmp_path / "sweep" / f"{NAME}.db"
    ok(toy(NO_IGNORE, "+note=a", "hydra.sweeper.n_trials=1"))
    # the identical command with the key now ignored, then with another value of it: the same study goes on
    ok(toy(IGNORE_NOTE, "+note=a", "hydra.sweeper.n_trials=2"))
    ok(toy(IGNORE_NOTE, "+note=b", "hydra.sweeper.n_trials=3"))
    assert [number for number, _, _ in _trials(db)] == [0, 1, 2]
    # not ignored, another value is another search: refused naming the values as given, never "(unset)"
    line = assert_one_line_error(
        toy(NO_IGNORE, "+note=c", "hydra.sweeper.n_trials=4"),
        "error: hydra.sweeper.study_name=toy-tpe:",
        contains='note: "a" -> "c"',
    )
    assert "(unset)" not in line
    assert len(_trials(db)) == 3


def test_a_study_made_ignoring_a_key_never_compares_it(toy, tmp_path):
    ok(toy(IGNORE_NOTE, "+note=a", "hydra.sweeper.n_trials=1"))
    # the study records the list it was made with: a resume that does not repeat it still goes on
    ok(toy(NO_IGNORE, "+note=b", "hydra.sweeper.n_trials=2"))
    assert len(_trials(tmp_path / "sweep" / f"{NAME}.db")) == 2


@pytest.mark.parametrize(("made", "chosen"), [("sqlite", "journal"), ("journal", "sqlite")])
def test_another_storage_kind_on_a_resume_is_refused_and_creates_nothing(toy, tmp_path, made, chosen):
    sweep = tmp_path / "sweep"
    ok(toy("hydra.sweeper.n_trials=1", f"hydra.sweeper.storage={{kind:{made}}}"))
    study_file = sweep / f"{NAME}{STORAGES[made]}"
    before, files = _trials(study_file), _files(sweep)

    line = assert_one_line_error(
        toy("hydra.sweeper.n_trials=2", f"hydra.sweeper.storage={{kind:{chosen}}}"),
        f"error: search/storage={chosen}: study {NAME} is in {study_file}, not in ",
        contains=f"choose search/storage={made} to resume it",
    )
    assert str(sweep / f"{NAME}{STORAGES[chosen]}") in line
    assert (
        _files(sweep) == files
    )  # no second storage file, no trial folder, the first study's files as they were
    assert _trials(study_file) == before

    ok(
        toy("hydra.sweeper.n_trials=2", f"hydra.sweeper.storage={{kind:{made}}}")
    )  # the storage it names resumes
    assert len(_trials(study_file)) == 2
