"""chop's config files in chop's own spelling: ``"NA"`` for None, ``by`` = type / name / regex_name with chop's
underscore layer names or dotted ones, keys chop defines for other formats, a fractional width above the width,
ternary statistics given as numbers -- for quantize and prune, each checked against values computed here.
"""

from __future__ import annotations

import logging

import pytest
import torch

from adls_lightning.app.training import run
from adls_lightning.callbacks.pruning import PruningCallback
from adls_lightning.errors import ConfigError
from adls_lightning.quant import quantize_model, quantized_layers
from tests.helpers import LAYER_NAMES
from tests.mase_examples import CHECKS, EXAMPLES, fixed_point, signs, toml_value

HEAD = 'model = "bert"\ndataset = "imdb"\n\n[passes.quantize]\nby = "{by}"\nreport = true\n\n'
NA_DEFAULT = '[passes.quantize.default.config]\nname = "NA"\n\n'


def table(header: str, keys: dict) -> str:
    return f"[{header}]\n" + "".join(f"{k} = {toml_value(v)}\n" for k, v in keys.items()) + "\n"


def chop_file(tmp_path, by: str, entries: dict[str, dict], default_na: bool = True):
    """A chop quantize config: ``by``, ``default.config.name = "NA"``, then one ``<key>.config`` table per entry."""
    text = HEAD.format(by=by) + (NA_DEFAULT if default_na else "")
    text += "".join(table(f"passes.quantize.'{key}'.config", keys) for key, keys in entries.items())
    path = tmp_path / "chop.toml"
    path.write_text(text)
    return path


def quantized_names(model) -> list[str]:
    return sorted(name for name, m in model.named_modules() if m in set(quantized_layers(model)))


INT8_3 = EXAMPLES["integer"]


@pytest.mark.parametrize("example", sorted(CHECKS))
def test_every_format_under_linear_with_an_NA_default(tiny_bert, example, tmp_path):
    """chop's usual shape: ``default.config.name = "NA"`` and the format under ``linear``."""
    path = chop_file(tmp_path, "type", {"linear": EXAMPLES[example]})
    model = tiny_bert(initializer_range=0.2).eval()
    assert quantize_model(model, path, key="quant.config") == LAYER_NAMES
    layer = quantized_layers(model)[0]
    x = torch.randn(3, 5, layer.in_features, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        CHECKS[example](layer, x)


def test_an_NA_default_alone_quantizes_nothing(tiny_bert, tmp_path):
    path = chop_file(tmp_path, "type", {})
    model = tiny_bert()
    quantize_model(model, path, key="quant.config")
    assert quantized_layers(model) == []


@pytest.mark.parametrize(
    ("by", "entries", "expected"),
    [
        ("name", {"bert_encoder_layer_0_attention_self_query": INT8_3}, ["bert.encoder.layer.0.attention.self.query"]),
        ("name", {"bert.encoder.layer.1.output.dense": INT8_3}, ["bert.encoder.layer.1.output.dense"]),
        ("regex_name", {"bert_encoder_layer_0_attention_self_.*": INT8_3},
         [f"bert.encoder.layer.0.attention.self.{p}" for p in ("key", "query", "value")]),
        ("regex_name", {r"bert\.encoder\.layer\.1\..*dense": INT8_3},
         [f"bert.encoder.layer.1.{p}" for p in ("attention.output.dense", "intermediate.dense", "output.dense")]),
    ],
)  # fmt: skip
def test_by_name_and_regex_name_match_both_spellings(tiny_bert, by, entries, expected, tmp_path):
    model = tiny_bert(initializer_range=0.2)
    quantize_model(model, chop_file(tmp_path, by, entries), key="quant.config")
    assert quantized_names(model) == expected
    weight = dict(model.named_modules())[expected[0]].weight_quantizer
    assert (weight.width, weight.frac_width) == (8, 3)


def test_keys_chop_defines_for_other_formats_are_ignored_with_one_note_each(tiny_bert, tmp_path, caplog):
    ternary = {**EXAMPLES["ternary"], "data_in_frac_width": 4, "floor": True}
    integer = {**INT8_3, "weight_exponent_width": 4, "binary_training": True}
    path = chop_file(tmp_path, "name", {"classifier": ternary, "bert_pooler_dense": integer})
    model = tiny_bert(initializer_range=0.2)
    with caplog.at_level(logging.INFO, logger="adls_lightning"):
        quantize_model(model, path, key="quant.config")
    layers = dict(model.named_modules())
    assert layers["classifier"].data_in_quantizer is None  # chop's ternary layer quantizes only the weight
    assert layers["classifier"].weight_quantizer.format_name == "ternary"
    assert layers["bert.pooler.dense"].weight_quantizer.format_name == "integer"
    notes = [r.getMessage() for r in caplog.records if ": ignored (" in r.getMessage()]
    for key in ("classifier.config.data_in_frac_width", "classifier.config.floor",
                "bert_pooler_dense.config.weight_exponent_width", "bert_pooler_dense.config.binary_training"):  # fmt: skip
        assert sum(key in n for n in notes) == 1, (key, notes)
    # a key chop does not know at all is still refused
    path = chop_file(tmp_path, "type", {"linear": {**INT8_3, "weight_frac_widht": 4}})
    with pytest.raises(
        ConfigError, match=r"linear.config.weight_frac_widht: not a parameter of format 'integer'"
    ):
        quantize_model(tiny_bert(), path, key="quant.config")


def test_frac_width_above_width_is_fixed_point_as_chop_computes_it(tiny_bert, tmp_path):
    keys = {
        "name": "integer",
        "weight_width": 8,
        "weight_frac_width": 9,
        "data_in_width": 8,
        "data_in_frac_width": 4,
    }
    model = tiny_bert(initializer_range=0.2)
    quantize_model(model, chop_file(tmp_path, "type", {"linear": keys}), key="quant.config")
    layer = quantized_layers(model)[0]
    w = layer.weight.detach()
    q = layer.weight_quantizer(w)
    assert torch.equal(q, fixed_point(w, 8, 9))  # steps of 2^-9 ...
    assert q.max() == 127 / 512 and q.min() == -128 / 512  # ... saturating at +-2^-2 (the 0.2-std weights do)
    assert torch.equal(q * 512, (q * 512).round())


@pytest.mark.parametrize(
    ("stats", "delta"),
    [({"weight_mean": 0.1}, 0.75 * 0.1), ({"weight_max": 1.0}, 0.05), ({"weight_median": 0.2}, 0.15)],
)
def test_ternary_statistics_given_as_numbers_set_the_threshold(tiny_bert, stats, delta, tmp_path):
    keys = {"name": "ternary", "weight_scaling_factor": False, **stats}
    model = tiny_bert(initializer_range=0.2)
    quantize_model(model, chop_file(tmp_path, "type", {"linear": keys}), key="quant.config")
    w = quantized_layers(model)[0].weight.detach()
    q = quantized_layers(model)[0].weight_quantizer(w)
    assert torch.equal(q, torch.where(w.abs() > delta, signs(w), torch.zeros_like(w)))
    assert delta != pytest.approx(0.75 * w.abs().mean().item(), rel=0.05)  # not the measured threshold


def test_binary_training_NA_is_off(tiny_bert, tmp_path):
    keys = {**EXAMPLES["binary_training"], "binary_training": "NA"}
    model = tiny_bert()
    quantize_model(model, chop_file(tmp_path, "type", {"linear": keys}), key="quant.config")
    layer = quantized_layers(model)[0]
    assert (
        layer.weight_quantizer is not None
        and layer.data_in_quantizer is None
        and layer.bias_quantizer is None
    )


def test_chop_prune_file_with_NA_values(tiny_bert, tmp_path):
    path = tmp_path / "prune.toml"
    path.write_text(
        '[passes.prune]\nactivation = "NA"\n\n[passes.prune.weight]\nsparsity = 0.5\nmethod = "l1-norm"\n'
        'scope = "NA"\ngranularity = "NA"\n'
    )
    callback = PruningCallback(config=str(path))
    assert callback.pruner.activation is None
    spec = callback.pruner.weight
    assert (spec.sparsity, spec.method, spec.scope) == (0.5, "l1", "local")  # "NA": chop's defaults
    model = tiny_bert(initializer_range=0.2)
    callback.pruner.prune(model)
    query = model.bert.encoder.layer[0].attention.self.query.weight
    assert int((query == 0).sum()) == query.numel() // 2


def test_chop_form_file_with_NA_default_and_regex_name_trains(compose_cfg, tmp_path):
    path = chop_file(tmp_path, "regex_name", {"bert_encoder_layer_0_attention_self_.*": INT8_3})
    metrics = run(compose_cfg(["quant=int8", f"quant.config={path}", "trainer.max_epochs=1"]))
    assert metrics["quant/layers"] == 3
    assert 0.0 <= metrics["test/acc"] <= 1.0


@pytest.mark.parametrize("text", ["", "# nothing\n", "[passes.quantize]\n"])
def test_an_empty_lab_file_is_refused_in_one_line(tiny_bert, text, tmp_path):
    path = tmp_path / "empty.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        quantize_model(tiny_bert(), path, key="quant.config")
    assert "empty" in str(info.value) and str(path) in str(info.value) and "\n" not in str(info.value)
    prune = tmp_path / "empty_prune.toml"
    prune.write_text(text.replace("quantize", "prune"))
    with pytest.raises(ConfigError, match="empty"):
        PruningCallback(config=str(prune))


# chop's own files that fit a BERT (issue 56's last three), as chop writes them: each loads and quantizes as chop
# computes it, checked against values computed here
FIXED_ACTIVATION_BINARY = {  # configs/tests/quantize/fixed_activation_binary.toml: widths chop ignores for binary
    "name": "binary", "binary_training": 1,
    "data_in_width": 32, "data_in_frac_width": 0, "data_in_stochastic": 0, "data_in_bipolar": 1,
    "weight_width": 1, "weight_frac_width": 0, "weight_stochastic": 0, "weight_bipolar": 1,
    "bias_width": 1, "bias_frac_width": 0, "bias_stochastic": 0, "bias_bipolar": 1,
}  # fmt: skip
BINARY_STOCHASTIC_KEY = {"name": "binary", "stochastic": False, "weight_width": 1, "weight_bipolar": True}
TERNARY_NEGATIVE_MEDIAN = {
    "name": "ternary", "weight_width": 2, "weight_scaling_factor": False,
    "weight_mean": "NA", "weight_median": -0.009714938700199127, "weight_max": "NA",
}  # fmt: skip


@pytest.mark.parametrize(
    ("keys", "ignored"),
    [(FIXED_ACTIVATION_BINARY, "data_in_width"), (BINARY_STOCHASTIC_KEY, "config.stochastic"),
     (TERNARY_NEGATIVE_MEDIAN, "weight_median")],
    ids=["binary-data_in_width-32", "binary-stochastic-key", "ternary-negative-median"],
)  # fmt: skip
def test_chops_last_three_files_load_and_quantize_as_chop_computes(
    tiny_bert, keys, ignored, tmp_path, caplog
):
    model = tiny_bert(initializer_range=0.2).eval()
    with caplog.at_level(logging.INFO, logger="adls_lightning"):
        assert (
            quantize_model(model, chop_file(tmp_path, "type", {"linear": keys}), key="quant.config")
            == LAYER_NAMES
        )
    notes = [r.getMessage() for r in caplog.records if ": ignored (" in r.getMessage()]
    assert any(ignored in n for n in notes), notes
    layer = quantized_layers(model)[0]
    x = torch.randn(3, 5, layer.in_features, generator=torch.Generator().manual_seed(0))
    w, b = layer.weight.detach(), layer.bias.detach()
    with torch.no_grad():
        out = layer(x)
    if keys is FIXED_ACTIVATION_BINARY:  # binary_training: input, weight and bias are signs
        expected = torch.nn.functional.linear(signs(x), signs(w), signs(b))
    elif keys is BINARY_STOCHASTIC_KEY:  # chop's LinearBinary: the weight's signs only
        expected = torch.nn.functional.linear(x, signs(w), b)
    else:  # the threshold measured from the tensor (TWN's 0.75 mean |w|), codes -1, 0, 1
        kept = w.abs() > 0.75 * w.abs().mean()
        expected = torch.nn.functional.linear(x, torch.where(kept, signs(w), torch.zeros_like(w)), b)
        assert (
            0 < int(kept.sum()) < w.numel()
        )  # a real ternary, not every weight kept as a negative one would
    assert torch.allclose(out, expected, atol=1e-5)
