"""A study records the settings of the search that made it, and another search never joins it.

Two searches with the same study name (``<space>-<objective>-<sampler>``) used to share one study: the docs'
second ``search=hparams`` example ran in the first one's study and reported its trial as best. The settings are
compared key by key (:mod:`adls_lightning.search.identity`), in-process for each space kind, and end to end through
``search.py`` as the docs give the commands: the second search is refused (exit 2, one line), the first's study is
unchanged, and the first command resumes its study.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import optuna
import pytest
from omegaconf import OmegaConf

from adls_lightning.errors import ConfigError
from adls_lightning.search.identity import (
    SETTINGS_ATTR,
    check_study_settings,
    settings_digest,
    settings_record,
    study_settings,
)
from tests.helpers import assert_one_line_error, compose_config, tiny_run

ROOT = Path(__file__).resolve().parent.parent
TINY_NAS = [
    "hydra.sweeper.search_space.num_hidden_layers=[1,2]",
    "hydra.sweeper.search_space.num_attention_heads=[2,4]",
    "hydra.sweeper.search_space.hidden_size=[16,32]",
    "hydra.sweeper.search_space.intermediate_size=[32,64]",
]
LR = "model.optimizer.lr=tag(log, interval(1e-5, 1e-2))"
R = "model.lora.r=choice(4, 8, 16)"
# For each space kind: (the first search, a search that differs from it, a key the refusal must name).
SPACE_KINDS = {
    "hparams": (
        ["search=hparams", LR, R],  # the docs' first example
        ["search=hparams", "model.lora.lora_dropout=interval(0.0, 0.3)", "data.batch_size=choice(16, 32)",
         "search/pruner=median"],  # the docs' second example: same study name, another space and pruner
        "hydra.sweep.model.lora.lora_dropout",
    ),
    "mixed_precision": (
        ["search=mixed_precision", "model=tiny_bert"],
        ["search=mixed_precision", "model=tiny_electra"],
        "model.",
    ),
    "nas": (
        ["search=nas", *TINY_NAS],
        ["search=nas", *TINY_NAS[:-1], "hydra.sweeper.search_space.intermediate_size=[32,128]"],
        "hydra.sweeper.search_space.intermediate_size",
    ),
    "nas_compression": (
        ["search=nas_compression", "compress.post_epochs=0", *TINY_NAS],
        ["search=nas_compression", "compress.post_epochs=0", *TINY_NAS, "seed=7"],
        "seed",
    ),
}  # fmt: skip


def _distributions(overrides: list[str]) -> dict:
    from hydra_plugins.hydra_optuna_sweeper._impl import create_params_from_overrides

    distributions, _, _ = create_params_from_overrides(overrides)
    return distributions


def _settings(overrides: list[str], ignore: tuple[str, ...] = ()) -> dict[str, str]:
    """The settings the sweeper records for ``search.py <overrides>`` (sweep overrides split off as it does)."""
    sweeps = [o for o in overrides if "(" in o]
    cfg = compose_config("search", [o for o in overrides if o not in sweeps], return_hydra_config=True)
    return study_settings(cfg, _distributions(sweeps), ignore)


@pytest.mark.parametrize("kind", SPACE_KINDS)
def test_each_space_kind_tells_another_search_from_a_resume(kind):
    first, other, named = SPACE_KINDS[kind]
    settings = _settings(first)
    assert _settings(first) == settings  # the same command: a resume
    # the budget, the storage and the workers are not settings: a larger n_trials extends the study
    assert _settings(
        [*first, "hydra.sweeper.n_trials=50", "hydra.sweeper.n_jobs=2", "search/storage=journal"]
    ) == (settings)
    assert check_study_settings({SETTINGS_ATTR: settings}, settings, "s", "db") is True
    differing = _settings(other)
    assert differing != settings
    with pytest.raises(ConfigError) as refused:
        check_study_settings({SETTINGS_ATTR: settings}, differing, "s", "db")
    message = str(refused.value)
    assert named in message, message
    assert f"hydra.sweeper.study_name=s-{settings_digest(differing)}" in message


def test_a_study_without_recorded_settings_records_them():
    assert check_study_settings({}, {"seed": "1"}, "s", "db") is False


def test_settings_ignore_leaves_a_key_out_of_both_the_record_and_the_resume():
    epochs = ("trainer.max_epochs",)
    made = _settings(["search=hparams", LR, "trainer.max_epochs=1"])  # the study, made without the list
    stored = {SETTINGS_ATTR: made}
    # adding the list on a resume: the identical command and one changing only the ignored key resume
    for value in (1, 2):
        resumed = _settings(["search=hparams", LR, f"trainer.max_epochs={value}"], epochs)
        assert check_study_settings(stored, resumed, "s", "db", epochs) is True
    # without it, the changed key is refused with both values as given
    with pytest.raises(ConfigError, match=r"\(trainer\.max_epochs: 1 -> 2\)"):
        check_study_settings(stored, _settings(["search=hparams", LR, "trainer.max_epochs=2"]), "s", "db")
    # a study made with the list records it: a resume without the list does not compare the key either
    made_ignoring = settings_record(_settings(["search=hparams", LR, "trainer.max_epochs=1"], epochs), epochs)
    assert check_study_settings(made_ignoring, made, "s", "db") is True
    # the ignored key leaves only that key out: another search is still refused
    with pytest.raises(ConfigError, match=r"\(hydra\.sweep\.model\.lora\.r: \(unset\) -> "):
        check_study_settings(made_ignoring, _settings(["search=hparams", LR, R]), "s", "db", epochs)


def test_sweep_override_order_does_not_matter():
    assert _settings(["search=hparams", LR, R]) == _settings(["search=hparams", R, LR])


def test_where_outputs_go_is_not_a_setting():
    base = _settings(["search=hparams", LR])
    assert _settings(["search=hparams", LR, "paths.log_dir=/elsewhere", "logger=csv"]) == base


@pytest.fixture
def search(tmp_path, tiny_imdb_dir, cache_dir):
    """``search(*overrides)``: search.py as users type it, on tiny data, one trial, sweep dir ``tmp_path/sweep``."""

    def run(*overrides: str) -> subprocess.CompletedProcess:
        cmd = [
            sys.executable, str(ROOT / "search.py"), f"hydra.sweep.dir={tmp_path / 'sweep'}",
            f"data.data_dir={tiny_imdb_dir}", f"paths.cache_dir={cache_dir}", "trainer=cpu",
            "trainer.max_epochs=1", "callbacks.rich_progress_bar=null", "data.max_length=16",
            "data.batch_size=16", "data.train_size=32", "data.val_size=32", "data.test_size=32",
            "hydra.sweeper.n_trials=1", *overrides,
        ]  # fmt: skip
        env = {**os.environ, "PROJECT_ROOT": str(ROOT)}
        return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)

    return run


def _only_study(sweep: Path) -> optuna.Study:
    (db,) = sweep.glob("*.db")
    storage = f"sqlite:///{db}"
    (summary,) = optuna.get_all_study_summaries(storage)
    return optuna.load_study(study_name=summary.study_name, storage=storage)


def _snapshot(study: optuna.Study) -> tuple:
    return (
        [(t.number, t.state.name, t.params, t.values) for t in study.get_trials(deepcopy=False)],
        study.user_attrs,
    )


# Three search.py runs (about 45 s): the docs' examples, as users type them. The other kinds' settings are told
# apart in-process above, by the function the sweeper calls; `make test-fast` skips this.
@pytest.mark.slow
def test_a_second_search_is_refused_and_the_first_resumes(search, tmp_path):
    first, other, named = SPACE_KINDS["hparams"]
    extra = ["model=tiny_random"]
    done = search(*extra, *first)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    before = _snapshot(_only_study(tmp_path / "sweep"))
    assert len(before[0]) == 1 and before[1][SETTINGS_ATTR]
    trial_dirs = sorted(p.name for p in (tmp_path / "sweep").iterdir())

    refused = search(*extra, *other)
    assert_one_line_error(refused, "error: hydra.sweeper.study_name=", contains=named)
    assert _snapshot(_only_study(tmp_path / "sweep")) == before  # trial count, trials and record unchanged
    assert sorted(p.name for p in (tmp_path / "sweep").iterdir()) == trial_dirs

    # the first command again, with a larger budget: the same study goes on
    resumed = search(*extra, *first, "hydra.sweeper.n_trials=2")
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    trials = _snapshot(_only_study(tmp_path / "sweep"))[0]
    assert len(trials) == 2 and trials[0] == before[0][0]


# search.py's entry point run with each argv in turn in one Python process (as search.py runs it): its exit code,
# its stderr, then the sweep folder's study (trials, user attributes) and listing, as JSON.
IN_TURN_APP = """
import contextlib, io, json, sys
from pathlib import Path
import optuna
from hydra.core.global_hydra import GlobalHydra
from adls_lightning.app.cli import search
conf, sweep, runs = Path(sys.argv[1]), Path(sys.argv[2]), json.loads(sys.argv[3])
results = []
for argv in runs:
    sys.argv = ["search.py", *argv]
    GlobalHydra.instance().clear()
    code, err = 0, io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            search(conf)
        except SystemExit as exit:
            code = exit.code
    (db,) = sweep.glob("*.db")
    storage = f"sqlite:///{db}"
    (summary,) = optuna.get_all_study_summaries(storage)
    study = optuna.load_study(study_name=summary.study_name, storage=storage)
    trials = [[t.number, t.state.name, t.params, t.values] for t in study.get_trials(deepcopy=False)]
    listing = sorted(p.name for p in sweep.iterdir())
    results.append({"code": code, "stderr": err.getvalue(), "trials": trials, "attrs": study.user_attrs,
                    "listing": listing})
print("RESULTS", json.dumps(results))
"""


@pytest.mark.slow
def test_a_second_nas_compression_search_is_refused_and_the_first_resumes(tmp_path, tiny_imdb_dir, cache_dir):
    """The same three commands for the kind with the most settings (the architecture space of
    ``hydra.sweeper.search_space``, the compression, the seed), run by search.py's entry point in turn in one Python
    process: what the command line promises (exit 2, one line, no traceback) the test above checks through the same
    sweeper code; what this kind adds is the settings a real search of a search_space kind records and compares.
    One process instead of three: a search process's start-up (~15 CPU-s) costs more than its tiny trial."""
    first, other, named = SPACE_KINDS["nas_compression"]
    sweep = tmp_path / "sweep"
    data = [f"hydra.sweep.dir={sweep}", *tiny_run(tiny_imdb_dir, cache_dir), "hydra.sweeper.n_trials=1"]
    runs = [[*data, *first], [*data, *other], [*data, *first, "hydra.sweeper.n_trials=2"]]
    env = {**os.environ, "PROJECT_ROOT": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", IN_TURN_APP, str(ROOT / "conf"), str(sweep), json.dumps(runs)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    done, refused, resumed = json.loads(proc.stdout.split("RESULTS ", 1)[1])
    assert done["code"] == 0, done["stderr"][-3000:]
    assert len(done["trials"]) == 1 and done["attrs"][SETTINGS_ATTR]

    as_run = subprocess.CompletedProcess(runs[1], refused["code"], "", refused["stderr"])
    assert_one_line_error(as_run, "error: hydra.sweeper.study_name=", contains=named)
    # trial count, trials, record and trial folders unchanged
    assert (refused["trials"], refused["attrs"]) == (done["trials"], done["attrs"])
    assert refused["listing"] == done["listing"]

    # the first command again, with a larger budget: the same study goes on
    assert resumed["code"] == 0, resumed["stderr"][-3000:]
    assert len(resumed["trials"]) == 2 and resumed["trials"][0] == done["trials"][0]


def test_settings_are_plain_json_text():
    settings = _settings(["search=hparams", LR])
    assert all(isinstance(v, str) for v in settings.values())
    assert OmegaConf.create(settings)  # storable as a study user attribute (JSON)


@pytest.mark.parametrize(
    "command",
    [
        ["train.py", "init_from_study=sqlite:///{missing}"],
        ["-m", "adls_lightning.reports.study", "sqlite:///{missing}", "out={tmp}/report"],
    ],
    ids=["init_from_study", "study-report"],
)
def test_a_reader_of_a_study_never_creates_its_file(tmp_path, command):
    missing = tmp_path / "no_such" / "study.db"
    args = [a.format(missing=missing, tmp=tmp_path) for a in command]
    script = [str(ROOT / args[0])] if args[0].endswith(".py") else args[:2]
    rest = args[1:] if args[0].endswith(".py") else args[2:]
    proc = subprocess.run(
        [sys.executable, *script, *rest], cwd=tmp_path, capture_output=True, text=True, timeout=300,
        env={**os.environ, "PROJECT_ROOT": str(ROOT)},
    )  # fmt: skip
    assert_one_line_error(proc, contains="no such study file")
    assert not missing.exists() and not missing.parent.exists()
    assert not (tmp_path / "report").exists()
