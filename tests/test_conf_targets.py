"""Every option of every config group under conf/ composes and passes the ``_target_`` allow-list with no extra
environment: the project's own configs (launchers, sweepers, samplers, loggers, ...) are never refused.

The groups and options are listed from Hydra's config repository, so a config added under conf/ is covered
without touching this test.
"""

from __future__ import annotations

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from adls_lightning.build import EXTRA_TARGETS_ENV, check_config_targets, iter_targets
from adls_lightning.errors import ConfigError
from tests.helpers import CONF_DIR

# Groups whose options are not configs of their own: quant/config holds the labs' TOML-recipe presets that a
# quant=... config composes into itself (composed with quant=int8 below).
NEEDS = {
    "quant/config": ["quant=int8"],
    "model/backbone": ["model=tiny_bert"],
    "hydra/sweeper/sampler": ["hydra/sweeper=optuna_study"],
}
# hydra-optuna-sweeper keeps a `motpe` leaf only to say Optuna removed it: it composes with its own sweeper
NEEDS_OPTION = {("hydra/sweeper/sampler", "motpe"): ["hydra/sweeper=optuna"]}
# Hydra's own primary config (hydra/config.yaml of hydra-core), listed beside conf/hydra/default.yaml: not an option.
NOT_OPTIONS = {("hydra", "config")}
# Groups outside the defaults list, added with `+` (the GLUE table's methods: `+method=int8_qat`)
ADDED_GROUPS = {"method"}


def _groups() -> list[tuple[str, str]]:
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR)):
        loader = GlobalHydra.instance().config_loader()

        def walk(parent: str) -> list[str]:
            found = []
            for name in loader.list_groups(parent):
                full = f"{parent}/{name}" if parent else name
                found += [full, *walk(full)]
            return found

        options = [
            (group, option)
            for group in walk("")
            for option in loader.get_group_options(group)
            if (group, option) not in NOT_OPTIONS
        ]
    GlobalHydra.instance().clear()
    return options


OPTIONS = _groups()


@pytest.fixture(scope="module")
def hydra_conf():
    """Hydra initialised on conf/ once for the module (composing is then ~0.1 s an option)."""
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR)):
        yield
    GlobalHydra.instance().clear()


def _compose(root: str, overrides: list[str]):
    return compose(root, overrides, return_hydra_config=True)


def test_the_listing_reaches_the_launchers_samplers_and_every_project_group():
    groups = {group for group, _ in OPTIONS}
    assert {
        "model",
        "quant",
        "prune",
        "search",
        "search/storage",
        "hydra/launcher",
        "hydra/sweeper/sampler",
    } <= groups
    launchers = {option for group, option in OPTIONS if group == "hydra/launcher"}
    assert {"parallel", "slurm", "submitit_local", "submitit_slurm", "joblib", "basic"} <= launchers
    assert len(OPTIONS) > 100


@pytest.mark.parametrize(("group", "option"), OPTIONS, ids=[f"{g}={o}" for g, o in OPTIONS])
def test_every_option_of_every_group_is_allowed(group, option, monkeypatch, hydra_conf):
    monkeypatch.delenv(EXTRA_TARGETS_ENV, raising=False)
    # the search groups in search.py's root (train.yaml plus a space), every other group in train.py's
    root = "search" if group.startswith("search") else "train"
    needs = NEEDS_OPTION.get((group, option), NEEDS.get(group, []))
    added = "+" if group in ADDED_GROUPS else ""
    cfg = _compose(root, [*needs, f"{added}{group}={option}"])
    check_config_targets(cfg)  # raises ConfigError naming the first refused target
    if group == "hydra/launcher" and option != "basic":
        assert cfg.hydra.launcher._target_.startswith("hydra_plugins.")


def test_graph_root_is_allowed(monkeypatch, hydra_conf):
    monkeypatch.delenv(EXTRA_TARGETS_ENV, raising=False)
    check_config_targets(_compose("graph", []))


def test_a_foreign_target_is_still_refused(monkeypatch, hydra_conf):
    monkeypatch.delenv(EXTRA_TARGETS_ENV, raising=False)
    cfg = _compose("search", ["hydra/launcher=parallel", "+hydra.launcher.evil={_target_:os.system}"])
    assert ("hydra.launcher.evil._target_", "os.system") in list(
        iter_targets(cfg.hydra.launcher, "hydra.launcher")
    )
    with pytest.raises(ConfigError, match=r"hydra.launcher.evil._target_=os.system: not an allowed target"):
        check_config_targets(cfg)
    # a launcher class is allowed only as the launcher: the same target anywhere else is refused
    cfg = _compose(
        "train", ["+x={_target_:hydra_plugins.hydra_joblib_launcher.joblib_launcher.JoblibLauncher}"]
    )
    with pytest.raises(ConfigError, match=r"^x._target_=hydra_plugins.hydra_joblib_launcher"):
        check_config_targets(cfg)


# -- the documented launcher commands, through search.py, with no extra environment (docs/scale-out.md) ---------

TINY_SEARCH = [
    "trainer=cpu", "trainer.max_epochs=1", "callbacks.rich_progress_bar=null", "data.max_length=32",
    "data.batch_size=16", "data.val_size=64", "data.train_size=128", "data.test_size=64",
    "hydra.sweeper.search_space.num_hidden_layers=[1]", "hydra.sweeper.search_space.num_attention_heads=[2]",
    "hydra.sweeper.search_space.hidden_size=[16]", "hydra.sweeper.search_space.intermediate_size=[32]",
    "hydra.sweeper.n_trials=2",
]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["submitit_local", "parallel"])
def test_documented_launcher_search_runs_with_no_extra_environment(
    launcher, tmp_path, tiny_imdb_dir, cache_dir
):
    import os
    import subprocess
    import sys

    import optuna
    from optuna.trial import TrialState

    from tests.helpers import ROOT

    env = {k: v for k, v in os.environ.items() if k != EXTRA_TARGETS_ENV}
    cmd = [sys.executable, str(ROOT / "search.py"), "search=nas", f"hydra/launcher={launcher}",
           "hydra.sweeper.n_jobs=2", f"hydra.sweep.dir={tmp_path / 'sweep'}", f"data.data_dir={tiny_imdb_dir}",
           f"paths.cache_dir={cache_dir}", *TINY_SEARCH]  # fmt: skip
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    study = optuna.load_study(
        study_name="nas-acc-tpe", storage=f"sqlite:///{tmp_path / 'sweep' / 'nas-acc-tpe.db'}"
    )
    assert [t.state for t in study.trials] == [TrialState.COMPLETE] * 2
    assert "Best trial" in proc.stdout
    if launcher == "submitit_local":
        assert (tmp_path / "sweep" / ".submitit").is_dir()
