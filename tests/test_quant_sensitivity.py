"""Per-layer sensitivity (``python -m adls_lightning.quant.sensitivity``): the groups against names written here,
each group's score against the same layers quantized by hand, the model float again afterwards, and the command on
a trained tiny checkpoint: its full-precision row is the run's own validation score, its files and its refusals."""

from __future__ import annotations

import copy
import csv
import re

import pytest
import torch

from adls_lightning.quant import LayerRecipe, OperandRecipe, QuantRecipe, quantize_model
from adls_lightning.quant.sensitivity import (
    CSV_FILE,
    FIGURE_FILE,
    SEARCH_FILE,
    GroupScore,
    layer_groups,
    layer_sensitivity,
)
from adls_lightning.quant.transform import find_linear_layers, quantized_layers
from adls_lightning.tools.sensitivity import main, search_command
from tests.helpers import SHORT_RUN, TINY_LINEARS, call, train_run

NAMES = [
    "bert.encoder.layer.0.attention.self.query",
    "bert.encoder.layer.0.output.dense",
    "bert.encoder.layer.1.attention.self.query",
    "bert.encoder.layer.1.output.dense",
    "bert.pooler.dense",
    "classifier",
]


def test_groups_by_layer_kind_and_block():
    assert list(layer_groups(NAMES, "layer")) == NAMES
    assert layer_groups(NAMES, "kind") == {
        "attention.self.query": [NAMES[0], NAMES[2]],
        "output.dense": [NAMES[1], NAMES[3]],
        "bert.pooler.dense": [NAMES[4]],
        "classifier": [NAMES[5]],
    }
    assert layer_groups(NAMES, "block") == {
        "bert.encoder.layer.0": NAMES[:2],
        "bert.encoder.layer.1": NAMES[2:4],
        "bert.pooler.dense": [NAMES[4]],
        "classifier": [NAMES[5]],
    }


def test_search_command_searches_the_most_sensitive_layers_and_fixes_the_rest(tmp_path):
    import shlex

    from hydra.core.override_parser.overrides_parser import OverridesParser

    scores = [GroupScore("kind", (NAMES[0], NAMES[2]), 0.6, 0.3), GroupScore("c", (NAMES[5],), 0.8, 0.1)]
    scores.append(GroupScore("o", (NAMES[1], NAMES[3]), 0.9, 0.0))
    default = {"weight": {"format": "integer", "params": {"width": 8, "frac_width": 4}}}
    ckpt = tmp_path / "a run" / "checkpoints" / "best.ckpt"  # a space in the path: quoted for the shell
    words = shlex.split(search_command(default, scores, 2, ckpt, ["model=tiny_random"]))
    assert words[:2] == ["python", "search.py"]
    overrides = {o.key_or_group: o.value() for o in OverridesParser.create().parse_overrides(words[2:])}
    assert overrides["search"] == "mixed_precision" and overrides["search.precision"] == "integer"
    assert overrides["init_ckpt"] == str(ckpt) and overrides["model"] == "tiny_random"
    regex = overrides["hydra.sweeper.search_space.layers"]
    assert [n for n in NAMES if re.fullmatch(regex, n)] == [NAMES[0], NAMES[2], NAMES[5]]
    assert overrides["quant.config.default"] == default


def test_the_search_command_starts_from_the_analysed_run_and_composes(tmp_path, tiny_imdb_dir, cache_dir):
    """The printed command as search.py's pre-flight composes it: init_ckpt is the analysed checkpoint, and the
    model and data are its run's (Hydra's record beside it) with the command's own overrides, not the defaults;
    the run's quant=none, its folder and its seed-free settings do not undo the search's quantization."""
    import shlex

    import yaml
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    from adls_lightning.app.preflight import check_composed_config, check_run_inputs
    from adls_lightning.export.compressed import run_overrides
    from adls_lightning.overrides import merge_overrides
    from tests.helpers import compose_config

    run = tmp_path / "fp"
    (run / ".hydra").mkdir(parents=True)
    (run / "checkpoints").mkdir()
    ckpt = run / "checkpoints" / "best.ckpt"
    torch.save(
        {"state_dict": {}, "pytorch-lightning_version": "2.5.0"}, ckpt
    )  # what the pre-flight reads of it
    model_and_data = [
        "model=tiny_random",
        "model/lora=none",
        f"data.data_dir={tiny_imdb_dir}",
        "data.max_length=64",
    ]
    recorded = [*model_and_data, "quant=none", f"hydra.run.dir={run}", "trainer.max_epochs=1"]
    (run / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(recorded))
    run_args = merge_overrides(run_overrides(ckpt), ["data.val_size=30"])  # as run_sensitivity composes them
    default = {"weight": {"format": "integer", "params": {"width": 8, "frac_width": 4}}}
    scores = [GroupScore("q", (NAMES[0], NAMES[2]), 0.6, 0.3), GroupScore("c", (NAMES[5],), 0.8, 0.1)]
    words = shlex.split(search_command(default, scores, 1, ckpt, run_args))
    assert words[:3] == ["python", "search.py", "search=mixed_precision"]
    here = [f"paths.cache_dir={cache_dir}", f"hydra.sweep.dir={tmp_path / 'sweep'}"]
    try:
        trained = compose_config("train", [*model_and_data, "data.val_size=30", here[0]])
        search = compose_config("search", [*words[2:], *here], return_hydra_config=True)
        job = check_composed_config(search, multirun=True)
        check_run_inputs(job)  # init_ckpt: a checkpoint there
    finally:
        GlobalHydra.instance().clear()
    assert job["init_ckpt"] == str(ckpt)
    assert job["model"] == OmegaConf.to_container(trained.model, resolve=True)
    assert job["data"] == OmegaConf.to_container(trained.data, resolve=True)
    assert job["trainer"]["max_epochs"] == 1
    assert (
        job["quant"]["config"]["default"] == default
    )  # the search quantizes: the run's quant=none is left out
    assert OmegaConf.select(search, "hydra.sweeper.search_space.layers") == "|".join(scores[0].layers)


def test_each_score_is_that_group_quantized_alone_and_the_model_ends_float(tiny_bert):
    torch.manual_seed(0)
    model = tiny_bert().eval()
    inputs = torch.randint(0, model.config.vocab_size, (4, 12))
    with torch.no_grad():
        reference = model(input_ids=inputs).logits

    def evaluate(candidate):  # closeness to the float logits: higher is better, 0 for the float model
        with torch.no_grad():
            return -float((candidate(input_ids=inputs).logits - reference).square().mean())

    coarse = LayerRecipe(weight=OperandRecipe("integer", {"width": 4, "frac_width": 2}))
    recipe = QuantRecipe(default=coarse)
    groups = layer_groups([layer.name for layer in find_linear_layers(model)], "kind")
    baseline, scores = layer_sensitivity(model, recipe, groups, evaluate)
    assert baseline == 0.0
    assert not quantized_layers(model)
    with torch.no_grad():
        assert torch.equal(model(input_ids=inputs).logits, reference)
    assert [s.drop for s in scores] == sorted((s.drop for s in scores), reverse=True)
    for score in scores:
        by_hand = copy.deepcopy(model)
        quantize_model(by_hand, QuantRecipe(layers={name: coarse for name in score.layers}))
        assert len(quantized_layers(by_hand)) == len(score.layers)
        assert score.metric == evaluate(by_hand)
        assert score.drop == baseline - score.metric


@pytest.fixture(scope="module")
def float_ckpt(tmp_path_factory, tiny_imdb_dir, cache_dir):
    out = tmp_path_factory.mktemp("sensitivity_run")
    metrics = train_run(out, [*SHORT_RUN, "model=tiny_random", "model/lora=none"], tiny_imdb_dir, cache_dir)
    ckpt = next((out / "checkpoints").glob("best-*.ckpt"))
    return ckpt, torch.load(ckpt, weights_only=False), metrics


def test_command_writes_the_sorted_table_from_the_runs_own_validation_score(float_ckpt, tmp_path):
    ckpt, checkpoint, _ = float_ckpt
    code, stdout, stderr = call(main, f"ckpt={ckpt}", "quant=int8", "by=block", f"out={tmp_path / 's'}")
    assert code == 0, stderr[-3000:]
    rows = list(csv.DictReader((tmp_path / "s" / CSV_FILE).open()))
    assert (tmp_path / "s" / FIGURE_FILE).stat().st_size > 0
    best = next(v for v in checkpoint["callbacks"].values() if "best_model_score" in v)["best_model_score"]
    assert float(rows[0]["metric"]) == pytest.approx(
        float(best), abs=1e-6
    )  # full precision = the run's val/acc
    # the tiny model's 2 encoder blocks, its pooler and classifier, most sensitive first
    assert sorted(r["group"] for r in rows[1:]) == sorted(
        ["bert.encoder.layer.0", "bert.encoder.layer.1", "bert.pooler.dense", "classifier"]
    )
    drops = [float(r["drop"]) for r in rows[1:]]
    assert drops == sorted(drops, reverse=True)
    assert "drop (pt)" in stdout and "bert.encoder.layer.0" in stdout
    # the search over the more sensitive half of the groups (2 of 4), the rest at the preset's format
    command = (tmp_path / "s" / SEARCH_FILE).read_text()
    searched = re.search(r'layers="([^"]*)"', command).group(1).split("|")
    assert searched == [name for row in rows[1:3] for name in row["layers"].split()]
    assert command.startswith(
        f"python search.py search=mixed_precision init_ckpt={ckpt.absolute()} model=tiny_random"
    )
    assert "+quant.config.default={data_in: {format: integer, params: {width: 8, frac_width: 4}}" in command


def test_command_refuses_bad_input_in_one_line_and_keeps_earlier_output(float_ckpt, tmp_path):
    ckpt, _, _ = float_ckpt
    out = tmp_path / "earlier"
    out.mkdir()
    (out / CSV_FILE).write_text("kept\n")
    for args, message in [
        ((f"ckpt={ckpt}", f"out={out}"), f"error: out={out}: already holds files"),
        ((f"ckpt={ckpt}", "by=head"), "error: by=head: must be one of layer, kind, block"),
        ((f"ckpt={tmp_path / 'none.ckpt'}",), "error: ckpt="),
        (
            (f"ckpt={ckpt}", "prune=l1_0.5"),
            "error: compress= / prune=: sensitivity measures quantization alone",
        ),
    ]:
        code, _, stderr = call(main, *args)
        assert code == 2 and stderr.startswith(message) and stderr.count("\n") == 1, stderr
    assert (out / CSV_FILE).read_text() == "kept\n"


def test_the_written_search_runs_over_the_sensitive_layers_with_the_rest_fixed(
    float_ckpt, tmp_path, tiny_imdb_dir, cache_dir
):
    import shlex

    import optuna

    from tests.helpers import run_studies, tiny_run

    ckpt, _, _ = float_ckpt
    code, _, stderr = call(main, f"ckpt={ckpt}", "by=kind", "search_top=1", f"out={tmp_path / 's'}")
    assert code == 0, stderr[-3000:]
    words = shlex.split((tmp_path / "s" / SEARCH_FILE).read_text())
    assert words[:2] == ["python", "search.py"]
    sweep = tmp_path / "sweep"
    assert (
        "model=tiny_random" in words and f"init_ckpt={ckpt.absolute()}" in words
    )  # the run's, not the default
    overrides = [*tiny_run(tiny_imdb_dir, cache_dir), "hydra.sweeper.n_trials=1"]
    run_studies([[*words[2:], *overrides, f"hydra.sweep.dir={sweep}"]])
    storage = f"sqlite:///{sweep / 'mixed_precision-integer-acc-tpe'}.db"
    (trial,) = optuna.load_study(study_name="mixed_precision-integer-acc-tpe", storage=storage).trials
    searched = {name.split("/")[0] for name in trial.params}
    regex = re.search(r'layers="([^"]*)"', " ".join(words)).group(1)
    rows = list(csv.DictReader((tmp_path / "s" / CSV_FILE).open()))
    assert searched == set(regex.split("|")) == set(rows[1]["layers"].split())  # the most sensitive group's
    # every layer is quantized but the searched ones the trial put at fp32: the rest are fixed at int8
    at_fp32 = sum(trial.params[f"{name}/format"] == "fp32" for name in searched)
    assert trial.user_attrs["metrics"]["quant/layers"] == TINY_LINEARS - at_fp32
