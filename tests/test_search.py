"""search.py end to end on tiny models and synthetic data: each space, storage contents, resume, pruning, bad input.

The sweeper's mechanics (workers, crashes, samplers, failure rates) are covered on a toy app in
test_search_sweeper.py; here every trial is a real training run of the training core.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from tests.helpers import (
    FORMATS,
    TINY_NAS,
    expected_param_count,
    linear_layers,
    ok,
    run_studies,
    tiny_run,
)

# every test here starts training runs or processes (minutes in all): `make test-fast` skips them
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
MINILM_VOCAB, POSITIONS = 30522, 512
GRID = "hydra.sweeper.grid={num_hidden_layers:[1,2,4],hidden_size:[32,64]}"
SAMPLERS = {
    "random": ["hydra/sweeper/sampler=random"],
    "tpe": ["hydra/sweeper/sampler=tpe"],
    "grid": ["hydra/sweeper/sampler=grid", GRID],
}


def studies_commands(root: Path, data: list[str]) -> dict[str, list[str]]:
    """search.py's overrides of every study this module inspects, by sweep folder (``root/<key>``)."""
    nas = ["search=nas", "hydra.sweeper.n_trials=3", *TINY_NAS]
    commands = {
        # one 1-trial study per search.precision (the 12 formats and all) on the tiny model
        **{
            f"precision/{p}": ["search=mixed_precision", "model=tiny_random", "hydra.sweeper.n_trials=1",
                               f"search.precision={p}"]
            for p in (*FORMATS, "all")
        },  # fmt: skip
        "nas": nas,
        # a threshold above any accuracy prunes every trial at its first validation
        "pruned": ["search=nas", "hydra.sweeper.n_trials=2", "trainer.max_epochs=3", *TINY_NAS,
                   "search.pruner._target_=optuna.pruners.ThresholdPruner", "++search.pruner.lower=1.01"],
        "acc_bits": ["search=mixed_precision", "model=tiny_random", "search/objective=acc_bits",
                     "hydra/sweeper/sampler=nsgaii", "hydra.sweeper.n_trials=2"],
        "nas_compression": ["search=nas_compression", "compress.post_epochs=0", "hydra.sweeper.n_trials=1",
                            *TINY_NAS],
        # The CPU lab preset's NAS space and sampler settings (startup_trials=3), trials cut to seconds. Six
        # trials: three start-up draws and three of TPE's model.
        **{
            f"samplers/{s}": ["search=nas", "search/preset=cpu", "hydra.sweeper.n_trials=6", *extra]
            for s, extra in SAMPLERS.items()
        },
        # Lab 3 from Lab 2's best: a study of its own, named after where it started (after "nas": it reads it)
        "lab3": ["search=mixed_precision", f"init_from_study={root / 'nas' / 'nas-acc-tpe.db'}",
                 "hydra.sweeper.n_trials=1"],
    }  # fmt: skip
    return {key: [*data, f"hydra.sweep.dir={root / key}", *overrides] for key, overrides in commands.items()}


@pytest.fixture(scope="module")
def studies(tmp_path_factory, tiny_imdb_dir, cache_dir) -> Path:
    """Every study the tests below inspect, made by search.py's entry point in one Python process: a process's
    start-up (Lightning's imports, ~15 CPU-s) costs several times a tiny trial (~2), and what these tests check
    is in the studies, not in the command. The command itself runs where it is the subject (the NAS study's
    resume, the refusals). Their root folder, one sweep folder per key of :func:`studies_commands`."""
    root = tmp_path_factory.mktemp("studies")
    # room for 40 trials on a loaded machine
    run_studies(list(studies_commands(root, tiny_run(tiny_imdb_dir, cache_dir)).values()), timeout=3600)
    return root


def study_in(folder: Path, name: str) -> optuna.Study:
    return optuna.load_study(study_name=name, storage=f"sqlite:///{folder / name}.db")


def search_py(*overrides: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PROJECT_ROOT": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(ROOT / "search.py"), *overrides]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)


def test_nas_trials_build_the_sampled_architectures_and_resume(studies, tiny_imdb_dir, cache_dir):
    study = study_in(studies / "nas", "nas-acc-tpe")
    assert [t.state for t in study.trials] == [TrialState.COMPLETE] * 3
    finished = [(t.number, t.datetime_complete) for t in study.trials]  # read now: a Study reads its storage
    for t in study.trials:
        p, metrics = t.params, t.user_attrs["metrics"]
        identities = sum(v == "identity" for k, v in p.items() if k.startswith("bert."))
        # each knob reached the model: its parameter count is the hand-derived one for the sampled architecture
        assert metrics["params/total"] == expected_param_count(
            p["num_hidden_layers"],
            p["hidden_size"],
            p["intermediate_size"],
            identities,
            MINILM_VOCAB,
            POSITIONS,
        )
        assert t.value == metrics["val/acc"]
        assert Path(t.user_attrs["output_dir"], "metrics.json").is_file()
        # one validation during fit, reported to the trial at step 1 (the best checkpoint is that epoch's)
        assert list(t.intermediate_values) == [1]
        assert t.intermediate_values[1] == pytest.approx(metrics["val/acc"])
    best = json.loads((studies / "nas" / "nas-acc-tpe_best.json").read_text())
    assert best["best_trials"][0]["values"]["val/acc"] == max(t.value for t in study.trials)

    # the same command again, as a user types it: nothing to do
    ok(search_py(*studies_commands(studies, tiny_run(tiny_imdb_dir, cache_dir))["nas"]))
    assert [
        (t.number, t.datetime_complete) for t in study_in(studies / "nas", "nas-acc-tpe").trials
    ] == finished


def test_pruner_stops_lightning_trials_and_they_are_recorded_pruned(studies):
    study = study_in(studies / "pruned", "nas-acc-tpe")
    assert [t.state for t in study.trials] == [TrialState.PRUNED] * 2
    for t in study.trials:
        assert list(t.intermediate_values) == [1]
        assert t.user_attrs["train/epochs"] == 1.0  # stopped after 1 of 3 epochs
        assert "pruned at validation 1" in t.user_attrs["pruned_reason"]


def test_mixed_precision_trials_quantize_each_layer_as_sampled(studies):
    study = study_in(studies / "acc_bits", "mixed_precision-integer-acc_bits-nsgaii")
    sizes = linear_layers(hidden=32, intermediate=64, layers=2)
    assert [t.state for t in study.trials] == [TrialState.COMPLETE] * 2
    for t in study.trials:
        assert {k.split("/")[0] for k in t.params} == set(sizes)  # one format choice per linear layer
        bits = {
            layer: t.params[f"{layer}/integer.width"] if t.params[f"{layer}/format"] == "integer" else 32
            for layer in sizes
        }
        expected = sum(bits[n] * sizes[n] for n in sizes) / sum(sizes.values())
        assert t.values[1] == pytest.approx(expected)
        quantized = sum(t.params[f"{n}/format"] == "integer" for n in sizes)
        assert t.user_attrs["metrics"]["quant/layers"] == quantized


def test_the_registry_holds_the_twelve_formats_and_each_has_a_search_space():
    from adls_lightning.quant.quantizers import QUANTIZERS

    built_in = {
        name for name, cls in QUANTIZERS.items() if cls.__module__.startswith("adls_lightning.quant.formats.")
    }
    assert built_in == set(FORMATS)  # (a test may have registered a plugin format of its own)
    assert all(QUANTIZERS[f].search_space is not None for f in FORMATS)


@pytest.mark.parametrize("precision", [*FORMATS, "all"])
def test_every_precision_completes_a_trial(studies, precision):
    # an all-formats study is named as such
    (trial,) = study_in(studies / "precision" / precision, f"mixed_precision-{precision}-acc-tpe").trials
    assert trial.state == TrialState.COMPLETE, trial.user_attrs
    formats = [v for k, v in trial.params.items() if k.endswith("/format")]
    assert len(formats) == len(linear_layers(hidden=32, intermediate=64, layers=2))
    allowed = {"fp32", *FORMATS} if precision == "all" else {"fp32", precision}
    assert set(formats) <= allowed
    # every layer whose sampled format is not fp32 was quantized in the trained model
    assert trial.user_attrs["metrics"]["quant/layers"] == sum(f != "fp32" for f in formats)


def test_samplers_draw_different_trials_at_the_lab_preset(studies):
    # Before each sampler had its own random stream, TPE's start-up trials were the random sampler's very draws.
    trials = {
        s: sorted(study_in(studies / "samplers" / s, f"nas-acc-{s}").trials, key=lambda t: t.number)
        for s in SAMPLERS
    }
    assert [len(trials[s]) for s in SAMPLERS] == [6, 6, 6]  # the grid has 6 points
    knobs = ("num_hidden_layers", "num_attention_heads", "hidden_size", "intermediate_size")
    for a, b in zip(trials["random"], trials["tpe"]):
        assert a.params != b.params, (a.number, a.params)
    # the architectures too (not only the per-layer choices): most of the 6 differ
    arch = {s: [tuple(t.params.get(k) for k in knobs) for t in trials[s]] for s in ("random", "tpe")}
    assert sum(x != y for x, y in zip(arch["random"], arch["tpe"])) >= 4, arch
    # the grid visits each of its 6 points once, in an order unlike the random draws
    grid = [(t.params["num_hidden_layers"], t.params["hidden_size"]) for t in trials["grid"]]
    assert sorted(grid) == [(n, h) for n in (1, 2, 4) for h in (32, 64)]
    assert grid != [(t.params["num_hidden_layers"], t.params["hidden_size"]) for t in trials["random"]]


def test_compression_aware_nas_scores_after_compression(studies):
    (trial,) = study_in(studies / "nas_compression", "nas_compression-post0-acc-tpe").trials
    metrics = trial.user_attrs["metrics"]
    assert trial.state == TrialState.COMPLETE
    assert trial.value == metrics["val/acc"] == pytest.approx(metrics["compress/val_acc_after_compression"])
    assert metrics["prune/weight_sparsity"] == pytest.approx(0.5, abs=0.05)


def train(*overrides: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PROJECT_ROOT": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(ROOT / "train.py"), "logger=none", *overrides]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def test_runs_start_from_the_best_trial_of_a_study(studies, tmp_path, tiny_imdb_dir, cache_dir):
    db = studies / "nas" / "nas-acc-tpe.db"
    best = study_in(studies / "nas", "nas-acc-tpe").best_trial
    data = tiny_run(tiny_imdb_dir, cache_dir)  # the data the study's trials read
    # evaluation only: the rebuilt architecture with the trial's best weights scores exactly what the trial did
    ok(train(f"init_from_study={db}", "train=false", f"hydra.run.dir={tmp_path / 'eval'}", *data))
    metrics = json.loads((tmp_path / "eval" / "metrics.json").read_text())
    trial_metrics = best.user_attrs["metrics"]
    assert metrics["params/total"] == trial_metrics["params/total"]
    assert metrics["val/loss"] == pytest.approx(trial_metrics["val/loss"], abs=1e-6)
    recorded = (tmp_path / "eval" / ".hydra" / "overrides.yaml").read_text()
    assert (
        "- model=nas_bert" in recorded
        and f"- model.backbone.hidden_size={best.params['hidden_size']}" in recorded
    )
    assert f"- init_ckpt={Path(best.user_attrs['output_dir']).resolve()}/checkpoints/best" in recorded

    # Lab 3 from Lab 2's best: a study of its own, named after where it started
    (trial,) = study_in(studies / "lab3", "mixed_precision-integer-from-nas-acc-tpe-acc-tpe").trials
    assert trial.state == TrialState.COMPLETE
    assert trial.user_attrs["metrics"]["params/total"] == trial_metrics["params/total"]


def test_init_from_study_refuses_a_study_without_a_usable_trial(tmp_path):
    empty = f"sqlite:///{tmp_path / 'empty.db'}"
    study = optuna.create_study(study_name="lab2", storage=empty, direction="maximize")
    study.add_trial(optuna.trial.create_trial(state=TrialState.PRUNED))
    run_dir = tmp_path / "run"
    # an experiment file that sets it: only the command line is expanded, so the run would silently ignore it
    (tmp_path / "conf" / "experiment").mkdir(parents=True)
    (tmp_path / "conf" / "experiment" / "from_study.yaml").write_text(
        f"# @package _global_\ninit_from_study: {tmp_path / 'empty.db'}\n"
    )
    in_a_file = [f"hydra.searchpath=[file://{tmp_path / 'conf'}]", "experiment=from_study"]
    for overrides, message in [
        ([f"init_from_study={tmp_path / 'nothing.db'}"], "init_from_study=" + str(tmp_path / "nothing.db")),
        ([f"init_from_study={tmp_path / 'empty.db'}"], "study lab2 has no completed trial (1 PRUNED)"),
        (in_a_file, "set in a config file, where it is not read"),
    ]:
        proc = train(*overrides, f"hydra.run.dir={run_dir}")
        assert proc.returncode != 0
        assert [line for line in proc.stderr.splitlines() if line.startswith("error: ")] == [
            next(line for line in proc.stderr.splitlines() if message in line)
        ], proc.stderr
        assert "Traceback" not in proc.stderr
        assert not run_dir.exists() or not any(run_dir.iterdir())  # nothing written


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["search=nosuch"], "search=nosuch: no such preset; valid: "),
        (["hydra/sweeper/sampler=nosuch"], "hydra/sweeper/sampler=nosuch: no such preset; valid: "),
        (["hydra/sweeper/sampler=grid"], "hydra/sweeper/sampler=grid needs an explicit grid"),
        (
            ["hydra.sweeper.storage=postgresql://nobody@localhost:1/none"],
            "hydra.sweeper.storage=postgresql://",
        ),
        (  # refused before the first trial, not once per trial
            ["data=glue", "data.task=rte", "data.swap_pairs=true"],
            "error: data.swap_pairs=true: GLUE rte's label depends on the order of its texts",
        ),
    ],
)
def test_bad_input_is_one_line(search, overrides, message):
    proc = search(*overrides)
    assert proc.returncode != 0
    # the error is one line (Hydra's own composition errors list the valid options after it), no traceback
    assert any(message in line for line in proc.stderr.splitlines()), proc.stderr
    assert "Traceback" not in proc.stderr
