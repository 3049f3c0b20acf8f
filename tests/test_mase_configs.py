"""The labs' (MASE's) quantize and prune configs, pasted as they are.

The TOML texts below are written for this test from the key lists of chop's quantize pass (``QUANT_ARITH_ENTRIES``,
``MASE_OP_TO_ENTRIES``) and of its example configs' shape (``model``, ``dataset``, ``[passes.quantize]`` with
``by``, ``report`` and a ``default.config`` table), as ``../shared/docs/reference-mase.md`` lists them. Each one
either loads unchanged and quantizes a tiny BERT as its format says (checked against values computed here another
way: closed formulas, ``torch.float8_e4m3fn``, brute-force nearest grid points), or fails with one line naming the
key. The pruning configs use MASE's ``l1-norm`` / ``random``, ``local`` / ``global`` and ``granularity``.
"""

from __future__ import annotations

import logging

import pytest
import torch
from hydra.utils import instantiate

from adls_lightning.app.training import run
from adls_lightning.build import build
from adls_lightning.callbacks.compression import CompressionCallback
from adls_lightning.callbacks.pruning import PruningCallback
from adls_lightning.callbacks.quantization import QuantizationCallback
from adls_lightning.errors import ConfigError
from adls_lightning.prune import num_to_prune
from adls_lightning.quant import (
    LayerRecipe,
    OperandRecipe,
    QuantRecipe,
    quantize_model,
    quantized_layers,
    to_recipe,
)
from tests.helpers import LAYER_NAMES
from tests.mase_examples import CHECKS, EXAMPLES, lab_toml


@pytest.mark.parametrize("example", list(EXAMPLES))
def test_lab_quantize_config_loads_unchanged_and_quantizes_as_its_format_says(
    example, tmp_path, caplog, tiny_bert
):
    path = tmp_path / f"{example}.toml"
    text = lab_toml(EXAMPLES[example])
    path.write_text(text)
    model = tiny_bert(initializer_range=0.2).eval()
    with caplog.at_level(logging.INFO, logger="adls_lightning"):
        names = quantize_model(model, path, key="quant.config")
    assert path.read_text() == text
    assert names == LAYER_NAMES  # `default` applies to every linear layer (the only quantized op here)
    notes = [r.getMessage() for r in caplog.records]
    assert any("report: ignored" in n for n in notes) and any("model, dataset" in n for n in notes)
    layer = quantized_layers(model)[0]
    x = torch.randn(3, 5, layer.in_features, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        CHECKS[example](layer, x)


REFUSED = [
    ('name = "binary"\nweight_bipolar = false', "passes.quantize.default.config.weight_bipolar=False: only bipolar"),
    ('name = "mxint"\nweight_width = 8\nweight_block_size = 32', "default.config.name='mxint': not available here"),
    ('name = "mxint_hardware"\nweight_parallelism = [1, 4]', "default.config.name='mxint_hardware': not available"),
    ('name = "integer"\nweight_width = 8\ndata_in_width = 8\nnoparse = true', "default.config.noparse: unknown key"),
    ('name = "integer"\ndata_in_width = 8\nweight_width = 8\ndata_in_levles = 2',
     "default.config.data_in_levles: not a parameter of format 'integer'"),
    ('name = "integer"\ndata_in_width = 8\nweight_width = 8\nbinary_trainig = true',
     "default.config.binary_trainig: unknown key for format 'integer'"),
    ('name = "integer"\ndata_in_width = 8\nweight_width = 8\nweight_frac_width = 65', "weight_frac_width=65: must be an integer"),
    ('name = "integer"\ndata_in_width = 8\nweight_width = 8\n[passes.quantize.relu.config]\nname = "integer"',
     "passes.quantize.relu: only linear layers are quantized"),
]  # fmt: skip


@pytest.mark.parametrize(("body", "message"), REFUSED)
def test_lab_keys_without_a_meaning_here_fail_with_one_line_naming_them(body, message, tmp_path, tiny_bert):
    path = tmp_path / "lab.toml"
    path.write_text(lab_toml(body))
    model = tiny_bert()
    with pytest.raises(ConfigError) as info:
        quantize_model(model, path)
    assert message in str(info.value) and "\n" not in str(info.value)
    assert str(info.value).startswith(f"{path}:passes.quantize.")
    assert not quantized_layers(model)


@pytest.mark.slow
def test_lab_file_through_quant_config_trains(compose_cfg, tmp_path):
    path = tmp_path / "integer.toml"
    path.write_text(lab_toml(EXAMPLES["integer"]))
    cfg = compose_cfg(["quant=int8", f"quant.config={path}"])
    callback = instantiate(cfg.quant, _convert_="partial")
    weight = callback.recipe.default.weight
    assert (weight.format, weight.params) == ("integer", {"width": 8, "frac_width": 3})
    metrics = run(cfg)
    assert metrics["quant/layers"] == 14 and metrics["quant/avg_weight_bits"] == 8.0


def test_bad_lab_file_is_one_line(tmp_path):
    broken = tmp_path / "broken.toml"
    broken.write_text("[passes.quantize\nby = 1")
    for source, message in [
        (tmp_path / "missing.toml", "missing.toml: no such file"),
        (broken, "broken.toml: cannot be read"),
    ]:
        with pytest.raises(ConfigError) as info:
            QuantizationCallback(config=str(source))
        assert message in str(info.value) and "\n" not in str(info.value)
    no_quantize = tmp_path / "prune_only.toml"
    no_quantize.write_text('[passes.prune.weight]\nsparsity = 0.5\nmethod = "l1-norm"\n')
    with pytest.raises(ConfigError, match=r"passes: has no 'quantize' table"):
        QuantizationCallback(config=str(no_quantize))


# --------------------------------------------------------------------------------------------------
# The same recipes, typed, as Hydra builds them from _target_ leaves
# --------------------------------------------------------------------------------------------------
TYPED_PRESET = """
defaults: [_base]
config:
  _target_: adls_lightning.quant.QuantRecipe
  default:
    _target_: adls_lightning.quant.LayerRecipe
    data_in: {_target_: adls_lightning.quant.OperandRecipe, format: integer, params: {width: 8, frac_width: 3}}
    weight: {_target_: adls_lightning.quant.OperandRecipe, format: integer, params: {width: 8, frac_width: 3}}
    bias: {_target_: adls_lightning.quant.OperandRecipe, format: integer, params: {width: 8, frac_width: 3}}
  layers:
    classifier: null
"""


def test_typed_preset_is_the_lab_config(compose_cfg, tmp_path, tiny_bert):
    (tmp_path / "conf" / "quant").mkdir(parents=True)
    (tmp_path / "conf" / "quant" / "typed_int8.yaml").write_text(TYPED_PRESET)
    cfg = compose_cfg(["quant=typed_int8", f"hydra.searchpath=[file://{tmp_path / 'conf'}]"])
    callback = instantiate(cfg.quant, _convert_="partial")
    assert isinstance(callback.recipe, QuantRecipe)
    lab = to_recipe({"default": {"config": {"name": "integer", **{
        f"{slot}_{p}": v for slot in ("data_in", "weight", "bias") for p, v in (("width", 8), ("frac_width", 3))
    }}}, "classifier": {"name": None}})  # fmt: skip
    assert callback.recipe == lab  # the typed leaf and the pasted dict are the same recipe
    model = tiny_bert()
    assert quantize_model(model, callback.recipe) == LAYER_NAMES[:-1]
    # a bad value is refused when Hydra builds the object, naming the parameter
    bad = compose_cfg(
        [
            "quant=typed_int8",
            f"hydra.searchpath=[file://{tmp_path / 'conf'}]",
            "quant.config.default.weight.params.width=0",
        ]
    )
    with pytest.raises(ConfigError, match=r"width=0: must be an integer in \[1, 32\]"):
        instantiate(bad.quant, _convert_="partial")
    # built as train.py builds it, the one line also names where the value sits in the config
    with pytest.raises(ConfigError) as err:
        build(bad.quant, "quant", _convert_="partial")
    assert str(err.value) == "quant.config.default.weight: width=0: must be an integer in [1, 32]"
    assert LayerRecipe.uniform("binary") == LayerRecipe(weight={"format": "binary"})  # weights only, as MASE


# --------------------------------------------------------------------------------------------------
# Pruning configs
# --------------------------------------------------------------------------------------------------
PRUNE_HEADER = 'model = "toy"\ndataset = "toy-tiny"\n\n'


def prune_toml(weight: str, activation: str = "") -> str:
    text = PRUNE_HEADER + "[passes.prune.weight]\n" + weight.strip() + "\n"
    if activation:
        text += "\n[passes.prune.activation]\n" + activation.strip() + "\n"
    return text


def pruned_linears(model):
    return {
        name: module
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and name != "classifier"
    }


def test_l1_norm_local_prunes_the_smallest_half_of_every_layer(tmp_path, tiny_bert):
    path = tmp_path / "prune.toml"
    elementwise = 'sparsity = 0.5\nmethod = "l1-norm"\nscope = "local"\ngranularity = "elementwise"'
    path.write_text(prune_toml(elementwise, elementwise))
    callback = PruningCallback(config=str(path))
    model = tiny_bert(initializer_range=0.2)
    before = {name: m.weight.detach().clone() for name, m in pruned_linears(model).items()}
    callback.pruner.prune(model)
    assert callback.pruner.activation is not None and callback.pruner.activation.method == "l1"
    for name, module in pruned_linears(model).items():
        zero = module.weight == 0
        assert int(zero.sum()) == module.weight.numel() // 2, name
        assert before[name][zero].abs().max() <= before[name][~zero].abs().min()


def test_random_global_prunes_an_exact_share_over_all_layers(tmp_path, tiny_bert):
    path = tmp_path / "prune.toml"
    path.write_text(prune_toml('sparsity = 0.3\nmethod = "random"\nscope = "global"'))
    callback = PruningCallback(config=str(path))
    model = tiny_bert()
    callback.pruner.prune(model)
    layers = pruned_linears(model).values()
    total = sum(m.weight.numel() for m in layers)
    zeros = [int((m.weight == 0).sum()) for m in layers]
    assert sum(zeros) == num_to_prune(total, 0.3)
    assert len(set(round(z / m.weight.numel(), 2) for z, m in zip(zeros, layers))) > 1  # not per layer


@pytest.mark.parametrize(
    ("weight", "message"),
    [
        ('sparsity = 0.5\nmethod = "l1-norm"\ngranularity = "channel"',
         "prune.weight.granularity='channel': only elementwise is implemented"),
        ('method = "l1-norm"\n[passes.prune.weight.sparsity]\n"bert.pooler.dense" = 0.5',
         "prune.weight.sparsity: a per-layer mapping is not supported"),
        ('sparsity = 0.5\nmethod = "l2-norm"', "prune.weight.method='l2-norm': must be one of l1, random"),
        ('sparsity = 0.5\ncriterion = "l1-norm"', "prune.weight.criterion: unknown key"),
    ],
)  # fmt: skip
def test_prune_keys_without_a_meaning_here_fail_with_one_line(weight, message, tmp_path):
    path = tmp_path / "prune.toml"
    path.write_text(prune_toml(weight))
    with pytest.raises(ConfigError) as info:
        PruningCallback(config=str(path))
    assert message in str(info.value) and "\n" not in str(info.value)


def test_lab_prune_file_through_prune_config(compose_cfg, tmp_path, tiny_bert):
    path = tmp_path / "prune.toml"
    path.write_text(prune_toml('sparsity = 0.2\nmethod = "l1-norm"\nscope = "global"'))
    callback = instantiate(compose_cfg(["prune=l1_0.5", f"prune.config={path}"]).prune, _convert_="partial")
    spec = callback.pruner.weight
    assert (spec.sparsity, spec.method, spec.scope) == (0.2, "l1", "global")
    assert (
        callback.pruner.activation is None
    )  # the lab file has no activation table: it replaces the preset's
    assert len(callback.pruner.targets(tiny_bert())) == 13  # every linear layer but the classifier


def test_lab_files_through_compress(tmp_path):
    path = tmp_path / "integer.toml"
    path.write_text(lab_toml(EXAMPLES["integer"]))
    callback = CompressionCallback(quant=str(path), prune={"weight": {"sparsity": 0.5, "method": "l1-norm"}})
    assert callback.quant.default.weight == OperandRecipe("integer", {"width": 8, "frac_width": 3})
    assert callback.pruner.weight.method == "l1"
