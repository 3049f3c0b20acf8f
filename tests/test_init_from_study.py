"""``init_from_study=STUDY`` rebuilds the best trial's model, all of it, and finds a study where its search wrote it.

A full fine-tune study's trials ran with ``model/lora=none``; the expansion took only ``model=`` and ``model.*``, so
the run built the default LoRA model around a full checkpoint and died with a state_dict key-list traceback. Every
``model/<group>=`` choice is now carried, and a checkpoint loaded into a model with or without LoRA adapters unlike
its own is refused in one line. A study name is looked up under the command's own ``paths.log_dir`` (the search
wrote ``${paths.log_dir}/search/<study>``), not only under the project's ``outputs/search``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import optuna
import pytest
import yaml

from adls_lightning.errors import ConfigError
from adls_lightning.search.from_study import expand_command_line
from tests.helpers import assert_one_line_error, run_entry_points, tiny_run

ROOT = Path(__file__).resolve().parent.parent
NAME = "hparams-acc-tpe"


def _study(log_dir: Path, choices: dict[str, str | None], overrides: list[str]) -> Path:
    """A study ``NAME`` in ``log_dir/search/NAME`` as search.py leaves it: one completed trial whose folder holds its
    run record and a best checkpoint."""
    sweep = log_dir / "search" / NAME
    trial_dir = sweep / "trial_0"
    (trial_dir / ".hydra").mkdir(parents=True)
    (trial_dir / "checkpoints").mkdir()
    (trial_dir / "checkpoints" / "best-epoch00-step1.ckpt").write_bytes(b"")
    (trial_dir / ".hydra" / "hydra.yaml").write_text(
        yaml.safe_dump({"hydra": {"runtime": {"choices": choices}}})
    )
    (trial_dir / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    study = optuna.create_study(study_name=NAME, storage=f"sqlite:///{sweep / NAME}.db", direction="maximize")
    trial = study.ask()
    trial.set_user_attr("output_dir", str(trial_dir))
    study.tell(trial, 0.75)
    return trial_dir


FULL_FINE_TUNE = {
    "model": "tiny_random", "model/backbone": "tiny", "model/lora": "none", "model/optimizer": "adamw",
    "model/scheduler": "linear_warmup", "data": "imdb", "search": "hparams", "hydra/sweeper/sampler": "tpe",
    "debug": None,
}  # fmt: skip
TRIAL_OVERRIDES = ["search=hparams", "model=tiny_random", "model/lora=none", "data.train_size=200",
                   "model.optimizer.lr=1.1e-05", "++search.trial.number=0"]  # fmt: skip


def test_every_model_group_choice_of_the_trial_is_carried(tmp_path, capsys):
    trial_dir = _study(tmp_path / "logs", FULL_FINE_TUNE, TRIAL_OVERRIDES)
    args = [f"init_from_study={NAME}", f"paths.log_dir={tmp_path / 'logs'}", "train=false"]
    expanded = expand_command_line(args)
    checkpoint = f"init_ckpt={(trial_dir / 'checkpoints' / 'best-epoch00-step1.ckpt').resolve()}"
    assert expanded == [
        "model=tiny_random", "model/backbone=tiny", "model/lora=none", "model/optimizer=adamw",
        "model/scheduler=linear_warmup", "model.optimizer.lr=1.1e-05", checkpoint, *args,
    ]  # fmt: skip
    assert "model/lora=none" in capsys.readouterr().out  # the line saying what was taken
    # the command line's own group choice wins over the study's, as its model.* values do
    own = expand_command_line([*args, "model/lora=default"])
    assert "model/lora=none" not in own and own[-1] == "model/lora=default"


def test_a_study_name_is_found_under_the_commands_log_dir(tmp_path, monkeypatch):
    _study(tmp_path / "logs", FULL_FINE_TUNE, TRIAL_OVERRIDES)
    monkeypatch.setenv("PROJECT_ROOT", str(tmp_path / "project"))
    monkeypatch.chdir(tmp_path)
    assert "model/lora=none" in expand_command_line([f"init_from_study={NAME}", "paths.log_dir=logs"])
    # without it, the project's outputs/search, which the refusal names
    with pytest.raises(
        ConfigError, match=f"no study of that name in {tmp_path / 'project' / 'outputs' / 'search'}"
    ):
        expand_command_line([f"init_from_study={NAME}"])


def _train(*overrides: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PROJECT_ROOT": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(ROOT / "train.py"), "logger=none", *overrides]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


# search.py's, then train.py's entry point with their command lines, in one Python process (as the scripts run
# them: tests.helpers.run_entry_points): the search and the run it starts are the audit's, and one process
# start-up is saved. The refusal, whose one line and exit code are the subject, runs as train.py itself.


@pytest.mark.slow
def test_a_full_fine_tune_study_starts_a_run_and_its_checkpoint_is_refused_by_a_lora_model(
    tmp_path, tiny_imdb_dir, cache_dir
):
    """The audit's commands: a full fine-tune search with paths.log_dir, then train.py init_from_study=NAME with the
    same paths.log_dir; and its checkpoint given as init_ckpt to the default (LoRA) model."""
    data = tiny_run(tiny_imdb_dir, cache_dir)
    search = ["search.py", "search=hparams", "model=tiny_random", "model/lora=none",
              "model.optimizer.lr=tag(log, interval(1e-5, 1e-2))", "hydra.sweeper.n_trials=1",
              f"paths.log_dir={tmp_path / 'logs'}", *data]  # fmt: skip
    evaluate = ["train.py", "logger=none", f"init_from_study={NAME}", f"paths.log_dir={tmp_path / 'logs'}",
                "train=false", f"hydra.run.dir={tmp_path / 'eval'}", *data]  # fmt: skip
    run_entry_points([search, evaluate])
    study = optuna.load_study(
        study_name=NAME, storage=f"sqlite:///{tmp_path / 'logs' / 'search' / NAME / NAME}.db"
    )
    best = study.best_trial

    metrics = json.loads((tmp_path / "eval" / "metrics.json").read_text())
    assert metrics["model/lora_params"] == 0
    assert metrics["val/loss"] == pytest.approx(best.user_attrs["metrics"]["val/loss"], abs=1e-6)

    (checkpoint,) = (Path(best.user_attrs["output_dir"]) / "checkpoints").glob("best*.ckpt")
    refused = _train("model=tiny_random", f"init_ckpt={checkpoint}", "train=false",
                     f"hydra.run.dir={tmp_path / 'lora'}", *data)  # fmt: skip
    assert_one_line_error(
        refused, f"error: init_ckpt={checkpoint}: a full fine-tune checkpoint", "model/lora=none"
    )
