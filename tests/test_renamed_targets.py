"""Configs recorded before the callbacks moved into the package (``_target_: callbacks.X``, from a run folder's
``.hydra/config.yaml``, a study's stored settings or a command line) still build today's callbacks, through
:func:`adls_lightning.build.current_target`; and no top-level ``callbacks`` package is installed any more."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from omegaconf import OmegaConf

from adls_lightning.build import build, current_target, upgrade_targets
from adls_lightning.errors import ConfigError

NEW, OLD = "_target_: adls_lightning.callbacks.", "_target_: callbacks."


def test_a_recorded_old_style_run_config_builds_the_same_callbacks(compose_cfg, tmp_path):
    from adls_lightning.app.preflight import check_callback_settings
    from adls_lightning.app.training import instantiate_callbacks

    cfg = compose_cfg(["quant=int8", "prune=l1_0.5"])
    today = OmegaConf.to_yaml(cfg)
    record = tmp_path / "config.yaml"
    # the run folder's record as a run before the move wrote it: every project callback under its old name
    record.write_text(today.replace(NEW, OLD))
    assert today.count(NEW) >= 4 and NEW not in record.read_text()
    recorded = OmegaConf.load(record)
    check_callback_settings(OmegaConf.to_container(recorded, resolve=True))
    built = instantiate_callbacks(recorded)
    expected = instantiate_callbacks(compose_cfg(["quant=int8", "prune=l1_0.5"]))
    assert [type(c) for c in built] == [type(c) for c in expected]
    assert {type(c).__module__.split(".")[0] for c in built} >= {"adls_lightning"}
    names = {type(c).__name__ for c in built}
    assert {"QuantizationCallback", "LastCheckpoint"} <= names


def test_an_old_style_node_is_refused_for_a_bad_setting_as_today():
    from adls_lightning.app.preflight import check_callback_settings

    def refusal(target: str) -> str:
        node = {"_target_": target, "dirpath": None, "every_n_train_steps": "often"}
        with pytest.raises(ConfigError) as err:
            check_callback_settings({"callbacks": {"last_checkpoint": node}})
        return str(err.value)

    today = refusal("adls_lightning.callbacks.last_checkpoint.LastCheckpoint")
    assert "callbacks.last_checkpoint.every_n_train_steps" in today
    assert refusal("callbacks.last_checkpoint.LastCheckpoint") == today


def test_build_renames_in_place_even_a_read_only_config():
    from adls_lightning.callbacks.timing import TrainThroughput

    node = OmegaConf.create({"_target_": "callbacks.timing.TrainThroughput"})
    OmegaConf.set_readonly(node, True)
    assert isinstance(build(node, "callbacks.throughput"), TrainThroughput)
    assert node._target_ == "adls_lightning.callbacks.timing.TrainThroughput"
    # nested and in lists; other targets and interpolations untouched
    plain = {
        "a": [{"_target_": "callbacks.x.Y"}, {"_target_": "${oc.env:T}"}],
        "_target_": "torch.optim.AdamW",
    }
    assert upgrade_targets(plain) == {
        "a": [{"_target_": "adls_lightning.callbacks.x.Y"}, {"_target_": "${oc.env:T}"}],
        "_target_": "torch.optim.AdamW",
    }
    assert current_target("adls_lightning.callbacks.x") == "adls_lightning.callbacks.x"
    assert current_target(None) is None


def test_a_recorded_logger_of_the_old_module_builds_todays_logger(tmp_path):
    """``adls_lightning.io_utils`` became ``adls_lightning.files.lightning_io``: a run recorded before the move
    names its CSV logger by the old module, and building it gives today's resumable logger."""
    from adls_lightning.files.lightning_io import ResumableCSVLogger

    old = OmegaConf.create(
        {"_target_": "adls_lightning.io_utils.ResumableCSVLogger", "save_dir": str(tmp_path), "name": "csv"}
    )
    logger = build(old, "logger.csv")
    assert type(logger) is ResumableCSVLogger
    assert old._target_ == "adls_lightning.files.lightning_io.ResumableCSVLogger"
    assert logger.save_dir == str(tmp_path)


def test_a_study_recorded_with_old_targets_resumes_and_other_settings_still_differ():
    from adls_lightning.search.identity import SETTINGS_ATTR, check_study_settings

    today = {
        "quant._target_": json.dumps("adls_lightning.callbacks.quantization.QuantizationCallback"),
        "seed": "42",
    }
    old = {**today, "quant._target_": json.dumps("callbacks.quantization.QuantizationCallback")}
    assert check_study_settings({SETTINGS_ATTR: old}, today, "s", "study.db") is True
    with pytest.raises(ConfigError, match="seed: 41 -> 42"):
        check_study_settings({SETTINGS_ATTR: {**old, "seed": "41"}}, today, "s", "study.db")


def test_no_top_level_callbacks_package_is_installed(tmp_path):
    probe = "import importlib.util as u; print(u.find_spec('callbacks'), u.find_spec('adls_lightning.callbacks').name)"
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["None", "adls_lightning.callbacks"]
