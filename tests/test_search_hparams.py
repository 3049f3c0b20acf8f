"""``search=hparams``: a plain hyperparameter study (no architecture space), the stock sweeper's override grammar on
any key, with this project's storage, resume, pruner and best-trial record -- the command of docs/search.md on the
tiny model."""

from __future__ import annotations

import json
import math

import optuna
import pytest
from omegaconf import OmegaConf
from optuna.distributions import CategoricalDistribution, FloatDistribution
from optuna.trial import TrialState

from tests.helpers import PG_PASSWORD, load_study, ok

LR = "model.optimizer.lr=tag(log, interval(1e-5, 1e-2))"
RANK = "model.lora.r=choice(4, 8, 16)"
TINY = ["model=tiny_random", "hydra/sweeper/sampler=random"]
STUDY = "hparams-acc-random"


def trial_config(trial) -> dict:
    return OmegaConf.to_container(OmegaConf.load(f"{trial.user_attrs['output_dir']}/.hydra/config.yaml"))


@pytest.mark.slow
def test_lr_and_lora_rank_study_trains_what_it_samples_records_the_best_and_resumes(search, tmp_path):
    proc = ok(search("search=hparams", LR, RANK, *TINY, "hydra.sweeper.n_trials=2", "search/pruner=median"))
    study = load_study(tmp_path, STUDY)
    assert [t.state for t in study.trials] == [TrialState.COMPLETE] * 2
    for t in study.trials:
        assert t.distributions["model.optimizer.lr"] == FloatDistribution(1e-5, 1e-2, log=True)
        assert t.distributions["model.lora.r"] == CategoricalDistribution([4, 8, 16])
        cfg = trial_config(t)  # the sampled values reached the trial's run config
        assert math.isclose(cfg["model"]["optimizer"]["lr"], t.params["model.optimizer.lr"])
        assert cfg["model"]["lora"]["r"] == t.params["model.lora.r"]
        assert t.value == t.user_attrs["metrics"]["val/acc"]
        assert list(t.intermediate_values) == [1]  # reported to the pruner after each validation
    best = json.loads((tmp_path / "sweep" / f"{STUDY}_best.json").read_text())
    top = best["best_trials"][0]
    assert top["values"]["val/acc"] == max(t.value for t in study.trials)
    assert f"Best trial {top['number']} of study {STUDY}" in proc.stdout
    # the same command with a larger budget resumes the study: one more trial, the first two kept
    first = [t.params for t in study.trials]
    ok(search("search=hparams", LR, RANK, *TINY, "hydra.sweeper.n_trials=3", "search/pruner=median"))
    resumed = load_study(tmp_path, STUDY).trials
    assert len(resumed) == 3 and [t.params for t in resumed[:2]] == first


def test_hparams_without_a_sweep_override_is_one_line(search, tmp_path):
    proc = search("search=hparams", *TINY, "hydra.sweeper.n_trials=1")
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "search=hparams" in errors[0] and "interval(" in errors[0], proc.stderr[
        -2000:
    ]
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "sweep").exists()


# -- no secret on disk: a password in search.storage.url, against a real PostgreSQL server -------------------------


@pytest.mark.slow
@pytest.mark.postgres
def test_password_in_the_storage_url_is_in_no_file_and_no_printed_line(
    search,
    postgres,
    tmp_path,
    monkeypatch,
):
    url = postgres
    monkeypatch.delenv("ADLS_OPTUNA_STORAGE", raising=False)
    proc = ok(
        search("search=hparams", LR, *TINY, "hydra.sweeper.n_trials=1", "logger=csv",
               "hydra.sweeper.study_name=hparams-secret", "search/storage=postgresql", f"search.storage.url={url}")
    )  # fmt: skip
    study = optuna.load_study(study_name="hparams-secret", storage=url)
    assert [t.state for t in study.trials] == [
        TrialState.COMPLETE
    ]  # the job reached the study without the URL
    written = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert any(p.name == "overrides.yaml" for p in written) and any(p.name == "hparams.yaml" for p in written)
    leaks = [str(p) for p in written if PG_PASSWORD.encode() in p.read_bytes()]
    assert leaks == []
    assert PG_PASSWORD not in proc.stdout + proc.stderr
    assert "adls:***@127.0.0.1" in (tmp_path / "sweep" / "trial_0" / ".hydra" / "overrides.yaml").read_text()
    attrs = [study.user_attrs] + [a for t in study.trials for a in (t.user_attrs, t.system_attrs)]
    assert PG_PASSWORD not in json.dumps(attrs, default=str)
