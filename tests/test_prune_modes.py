"""One pruning callback class per mode (once, one-shot, scheduled, structured): each prune= preset names its mode's
class, the settings choose the class whatever the target (so user-facing keys keep working), every mode keys its
checkpoint state as the one class of earlier releases, and a study recorded with that class still resumes."""

from __future__ import annotations

import copy
import inspect
import json
import pickle

import pytest

from adls_lightning.callbacks import pruning
from adls_lightning.callbacks.pruning import (
    OncePruning,
    OneShotPruning,
    PruningCallback,
    ScheduledPruning,
    StructuredPruning,
)

PRESET_MODES = {
    "l1_0.5": OncePruning,
    "random_0.3": OncePruning,
    "l1_2of4": OncePruning,
    "wanda_0.5": OneShotPruning,
    "sparsegpt_0.5": OneShotPruning,
    "movement_0.9": ScheduledPruning,
    "movement_adam_0.9": ScheduledPruning,
    "structured_0.5": StructuredPruning,
}


@pytest.mark.parametrize("preset", sorted(PRESET_MODES))
def test_each_preset_names_and_builds_its_mode_class(compose_cfg, preset):
    from adls_lightning.app.training import instantiate_callbacks

    cfg = compose_cfg([f"prune={preset}"])
    named = cfg.prune._target_.rpartition(".")[2]
    built = [c for c in instantiate_callbacks(cfg) if isinstance(c, PruningCallback)]
    assert [type(c) for c in built] == [PRESET_MODES[preset]]
    assert named == PRESET_MODES[preset].__name__


@pytest.mark.parametrize(
    ("overrides", "mode"),
    [
        (["prune=l1_0.5", "prune.schedule={warmup: 0.1}"], ScheduledPruning),  # gradual magnitude pruning
        (
            [
                "prune=l1_0.5",
                "prune.activation=null",
                "prune.weight.method=wanda",
                "prune.calibration.batches=2",
            ],
            OneShotPruning,
        ),  # fmt: skip
        (["prune=wanda_0.5", "prune.weight.method=l1"], OncePruning),
        (
            ["prune=structured_0.5", "prune.structured=null", "prune.weight={method: l1, sparsity: 0.5}"],
            OncePruning,
        ),
    ],
)
def test_the_settings_choose_the_mode_whatever_the_preset_names(compose_cfg, overrides, mode):
    from adls_lightning.app.training import instantiate_callbacks

    built = [c for c in instantiate_callbacks(compose_cfg(overrides)) if isinstance(c, PruningCallback)]
    assert [type(c) for c in built] == [mode]


def test_the_base_builds_the_mode_and_every_mode_keeps_the_old_state_key():
    cases = {
        OncePruning: {"weight": {"method": "l1", "sparsity": 0.5}, "at": 2},
        OneShotPruning: {"weight": {"method": "sparsegpt", "sparsity": 0.5}, "calibration": {"batches": 1}},
        ScheduledPruning: {"weight": {"method": "movement", "sparsity": 0.5}},
        StructuredPruning: {"structured": {"heads": 0.5, "neurons": 0.25}},
    }
    for mode, settings in cases.items():
        callback = PruningCallback(**settings)
        assert type(callback) is mode
        assert callback.state_key == "PruningCallback"  # checkpoints of earlier releases restore its state
        assert type(copy.deepcopy(callback)) is mode and type(pickle.loads(pickle.dumps(callback))) is mode
        # a mode class called with another mode's settings builds that mode, initialised once
        other = next(m for m in cases if m is not mode and not issubclass(m, mode))
        assert type(other(**settings)) is mode
    # the pre-flight's type checks read the constructor's arguments for every class
    for mode in (PruningCallback, *cases):
        assert (
            list(inspect.signature(mode).parameters)
            == list(inspect.signature(PruningCallback.__init__).parameters)[1:]
        )


def test_a_mode_refuses_what_it_refused_as_one_class():
    with pytest.raises(
        pruning.ConfigError, match=r"prune.at=2: prune.schedule prunes from the fit's first step"
    ):
        PruningCallback(weight={"method": "l1", "sparsity": 0.5}, schedule={}, at=2)
    with pytest.raises(
        pruning.ConfigError, match=r"prune.distill=true: distils into a structurally pruned model"
    ):
        OncePruning(weight={"method": "l1", "sparsity": 0.5}, distill=True)
    with pytest.raises(
        pruning.ConfigError, match=r"prune.calibration.batches=0: prune.structured.method=gradient"
    ):
        StructuredPruning(structured={"heads": 0.5, "method": "gradient"})


def test_a_study_recorded_with_the_one_pruning_class_resumes_with_its_mode_class():
    from adls_lightning.errors import ConfigError
    from adls_lightning.search.identity import SETTINGS_ATTR, check_study_settings

    today = {"prune._target_": json.dumps("adls_lightning.callbacks.pruning.ScheduledPruning"), "seed": "1"}
    for old in ("callbacks.pruning.PruningCallback", "adls_lightning.callbacks.pruning.PruningCallback"):
        recorded = {**today, "prune._target_": json.dumps(old)}
        assert check_study_settings({SETTINGS_ATTR: recorded}, today, "s", "study.db") is True
    # a class that does not choose its subclass by its settings is a real difference
    ckpt = {"callbacks.last._target_": json.dumps("adls_lightning.callbacks.last_checkpoint.LastCheckpoint")}
    recorded = {"callbacks.last._target_": json.dumps("lightning.pytorch.callbacks.ModelCheckpoint")}
    with pytest.raises(ConfigError, match="made by another search"):
        check_study_settings({SETTINGS_ATTR: recorded}, ckpt, "s", "study.db")
