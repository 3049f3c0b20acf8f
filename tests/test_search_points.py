"""The mixed-precision search space over the encoder's points (search=mixed_precision_points): each attention
product, softmax, GELU, LayerNorm and residual add is a searched name like a linear layer, and a trial's config
quantizes exactly the points it sampled, at the sampled widths."""

from __future__ import annotations

import copy
from collections import Counter

import optuna
import pytest
from optuna.trial import TrialState

from adls_lightning.build import build
from adls_lightning.errors import ConfigError
from adls_lightning.quant import quantize_model
from adls_lightning.quant.points import find_points, quantized_points
from adls_lightning.search.spaces import MixedPrecisionSpace
from hydra_plugins.adls_optuna_sweeper._impl import format_override_value
from tests.helpers import build_module, compose_config, ok

optuna.logging.set_verbosity(optuna.logging.WARNING)

INTEGER = {"fp32": {}, "integer": {"params": {"width": [4, 8], "frac_width": [2]}}}
#: the points of a BERT of 2 blocks: per block Q·Kᵀ and P·V, one softmax, one GELU, two LayerNorms and two residual
#: adds, and the embeddings' LayerNorm
TWO_BLOCKS = {"matmul": 4, "softmax": 2, "gelu": 2, "layer_norm": 5, "add": 4}
#: the operands a searched point's entry quantizes, by kind (the format's slots data_in, weight, bias that the
#: kind has); an add's data_in entry quantizes both summands (data_in and data_in_1)
QUANTIZED_OPERANDS = {
    "matmul": {"data_in", "weight"},
    "softmax": {"data_in"},
    "gelu": {"data_in"},
    "layer_norm": {"data_in", "weight", "bias"},
    "add": {"data_in", "data_in_1"},
}


@pytest.fixture(scope="module")
def two_block_bert(tiny_bert):
    return tiny_bert()  # hidden 32, 2 blocks, 2 heads of 16


def _sampled_format(trial: optuna.Trial, name: str) -> str:
    return trial.params[f"{name}/format"]


def test_points_all_searches_every_point_of_the_model(two_block_bert):
    space = MixedPrecisionSpace(two_block_bert, INTEGER, use=["fp32", "integer"], points="all")
    assert Counter(p.kind for p in space.points.values()) == TWO_BLOCKS
    assert "bert.encoder.layer.1.attention.self.qk_matmul" in space.points
    assert "bert.embeddings.LayerNorm" in space.points
    assert (
        len(space.layers) == 14
    )  # the linear layers are searched as before (6 per block, pooler, classifier)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_trials_config_quantizes_exactly_the_points_it_sampled(two_block_bert, seed):
    """The trial's overrides on search.py's command line (search=mixed_precision_points) compose into the recipe the
    quantization callback gets; it quantizes the sampled points (no other) with the sampled width on each operand
    their kind has, and the sampled linear layers."""
    cfg = compose_config("search", ["search=mixed_precision_points"], return_hydra_config=True)
    assert cfg.hydra.sweeper.search_space.points == "all"
    space = MixedPrecisionSpace(two_block_bert, INTEGER, use=["fp32", "integer"], points="all")
    trial = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed)).ask()
    overrides = space(trial)
    sampled = {n for n in space.points if _sampled_format(trial, n) == "integer"}
    assert 0 < len(sampled) < len(space.points)  # these seeds sample a mix
    cfg = compose_config(
        "search",
        ["search=mixed_precision_points", *(f"{k}={format_override_value(v)}" for k, v in overrides.items())],
        return_hydra_config=True,
    )
    model = copy.deepcopy(two_block_bert)
    linears = quantize_model(model, build(cfg.quant.config, "quant.config"), key="quant.config")
    assert sorted(linears) == sorted(n for n in space.layers if _sampled_format(trial, n) == "integer")
    points = {name: (kind, module) for name, kind, module in quantized_points(model)}
    assert set(points) == sampled
    for name, (kind, module) in points.items():
        assert space.points[name].kind == kind
        assert set(module.quantizers()) == QUANTIZED_OPERANDS[kind], name
        width = trial.params[f"{name}/integer.width"]
        assert {q.width for q in module.quantizers().values()} == {width}
        assert {q.frac_width for q in module.quantizers().values()} == {2}


def test_points_can_be_a_list_of_kinds_bmm_naming_the_products(two_block_bert):
    space = MixedPrecisionSpace(two_block_bert, INTEGER, use=["fp32", "integer"], points=["bmm", "softmax"])
    assert Counter(p.kind for p in space.points.values()) == {"matmul": 4, "softmax": 2}
    trial = optuna.create_study(sampler=optuna.samplers.RandomSampler(0)).ask()
    space(trial)
    assert {k.split("/")[0] for k in trial.params} == set(space.layers) | set(space.points)


def test_bad_points_are_refused_in_one_line(two_block_bert):
    with pytest.raises(
        ConfigError, match=r"search_space.points=\['sigmoid'\]: choices must be among \['matmul'"
    ):
        MixedPrecisionSpace(two_block_bert, INTEGER, points=["sigmoid"])
    distilbert = build_module(["model=tiny_distilbert"]).model
    with pytest.raises(
        ConfigError, match="search_space.points: family 'distilbert' has no quantizable add points"
    ):
        MixedPrecisionSpace(distilbert, INTEGER, points=["add"])
    # its other kinds are searched, and all = the kinds it has
    space = MixedPrecisionSpace(distilbert, INTEGER, points="all")
    assert set(p.kind for p in space.points.values()) == {"matmul", "softmax", "gelu", "layer_norm"}


def test_a_block_that_does_not_tile_the_head_size_prunes_the_trial(two_block_bert):
    """MXINT8's 32-element blocks cannot tile Q·Kᵀ's head size of 16: such a trial is rejected before training."""
    space = MixedPrecisionSpace(
        two_block_bert, precision="mxint8", layers=r"classifier|.*_matmul", points=["matmul"]
    )
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(0))
    reasons = []
    for _ in range(8):
        trial = study.ask()
        try:
            space(trial)
        except optuna.TrialPruned as reason:
            reasons.append(str(reason))
    assert any("qk_matmul: mxint8 data_in: " in r and "last dimension 16" in r for r in reasons), reasons


def test_search_py_trains_the_sampled_points(search, tmp_path):
    """The user's path: a search=mixed_precision_points trial reports as many quantized points as it sampled."""
    ok(search("search=mixed_precision_points", "model=tiny_random", "hydra.sweeper.n_trials=1"))
    name = "mixed_precision_points-integer-acc-tpe"
    study = optuna.load_study(study_name=name, storage=f"sqlite:///{tmp_path / 'sweep' / name}.db")
    (trial,) = study.trials
    assert trial.state == TrialState.COMPLETE, trial.user_attrs
    points = [p.name for p in find_points(build_module(["model=tiny_random"]).model)]
    assert len(points) == sum(TWO_BLOCKS.values())
    sampled = sum(trial.params[f"{p}/format"] == "integer" for p in points)
    assert trial.user_attrs["metrics"].get("quant/points", 0) == sampled


def test_the_layers_expression_names_linear_layers_and_points_alike(two_block_bert):
    """One regular expression (what the sensitivity command writes for its most sensitive groups) selects both."""
    space = MixedPrecisionSpace(
        two_block_bert, INTEGER, points="all", layers=r".*\.output\.(LayerNorm|add|dense)"
    )
    assert space.layers == [
        f"bert.encoder.layer.{i}.{m}.dense" for i in (0, 1) for m in ("attention.output", "output")
    ]
    assert sorted(space.points) == sorted(
        f"bert.encoder.layer.{i}.{m}.{p}"
        for i in (0, 1)
        for m in ("attention.output", "output")
        for p in ("LayerNorm", "add")
    )
    only_points = MixedPrecisionSpace(two_block_bert, INTEGER, points=["softmax"], layers=r".*softmax")
    assert only_points.layers == [] and len(only_points.points) == 2
    with pytest.raises(ConfigError, match="layers=nothing: matches no linear layer or searched point"):
        MixedPrecisionSpace(two_block_bert, INTEGER, points="all", layers="nothing")


def test_search_py_refuses_an_unknown_point_kind_in_one_line(search, tmp_path):
    proc = search(
        "search=mixed_precision_points", "model=tiny_random", "hydra.sweeper.search_space.points=[sigmoid]"
    )
    assert proc.returncode == 2
    (line,) = proc.stderr.strip().splitlines()
    assert line.lower().startswith("error: ")
    assert line.partition(": ")[2] == (
        "hydra.sweeper.search_space.points=['sigmoid']: choices must be among "
        "['matmul', 'bmm', 'softmax', 'gelu', 'layer_norm', 'add']"
    )
    assert not (tmp_path / "sweep").exists()


def test_search_py_refuses_a_misspelt_format_parameter_before_any_study(search, tmp_path):
    """A parameter the format does not take is static config: refused up front, as an unknown format in ``use``
    is, instead of pruning every trial of a study that then holds nothing."""
    proc = search(
        "search=mixed_precision",
        "model=tiny_random",
        "hydra.sweeper.n_trials=2",
        "+hydra.sweeper.search_space.formats={fp32:{},integer:{params:{widht:[4,8]}}}",
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    (line,) = proc.stderr.strip().splitlines()
    assert line == (
        "error: hydra.sweeper.search_space.formats.integer.params.widht: unknown key; "
        "valid: width, frac_width, floor, frac_above_width (did you mean width?)"
    )
    assert not (tmp_path / "sweep").exists()
