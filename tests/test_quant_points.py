"""The encoder's quantized functional points (adls_lightning/quant/points.py): attention's Q·Kᵀ and P·V, softmax,
GELU, LayerNorm and residual adds, addressed by chop's keys and by name, in every format, trainable and calibrated."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.nn.functional as F

from adls_lightning.errors import ConfigError
from adls_lightning.quant import QUANTIZERS, QuantRecipe, calibrate, quantization_report, quantize_model
from adls_lightning.quant.points import (
    ATTENTION_IMPLEMENTATION,
    QuantMatmul,
    find_points,
    quantized_points,
)
from adls_lightning.quant.scaled import ScaledIntegerQuantizer
from tests.helpers import FORMAT_PARAMS, build_module, train_run

#: formats whose straight-through mask passes |x| <= 1 only (and ternary's sparse codes): on every operand of every
#: point of a random model no gradient survives the chain, so only its finiteness is checked for them
SIGN_FORMATS = ("binary", "binary_scaling", "binary_residual", "ternary")
SCALED = {"format": "scaled_integer", "params": {"width": 8, "granularity": "tensor"}}
EVERY_KIND = {
    "matmul": {"data_in": SCALED, "weight": SCALED},
    "softmax": {"data_in": SCALED, "data_out": SCALED},
    "gelu": {"data_in": SCALED, "data_out": SCALED},
    "layer_norm": {"data_in": SCALED, "weight": SCALED, "bias": SCALED},
    "add": {"data_in": SCALED, "data_out": SCALED},
}


def _inputs(seed: int = 0, tokens: int = 16) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 100, (3, tokens), generator=g)
    mask = torch.ones(3, tokens, dtype=torch.long)
    mask[1, 9:] = 0  # padding: the masks SDPA and eager build reach the quantized attention
    return {"input_ids": ids, "attention_mask": mask}


def _kinds(model) -> Counter:
    return Counter(kind for _, kind, _ in quantized_points(model))


def test_every_registered_format_has_parameters_here():
    assert set(FORMAT_PARAMS) == set(QUANTIZERS)


@pytest.mark.parametrize("fmt", sorted(FORMAT_PARAMS))
def test_every_format_quantizes_every_point_and_trains_through_them(tiny_bert, fmt):
    """Each format on every operand of every kind: the logits change, the gradient reaches the weights before
    every point (straight-through), and nothing is NaN. Heads of 32 and 32 tokens: every block size (mxint8's 32)
    divides each reduction dimension."""
    model = tiny_bert(hidden_size=64, intermediate_size=128)
    operand = {"format": fmt, "params": FORMAT_PARAMS[fmt]}
    kinds = {kind: dict.fromkeys(ops, operand) for kind, ops in EVERY_KIND.items()}
    batch = _inputs(tokens=32)
    with torch.no_grad():
        reference = model(**batch).logits
    quantize_model(model, QuantRecipe(**kinds))
    # tiny_bert: 2 layers x (2 products + softmax + GELU + 2 adds + 2 LayerNorms) + the embeddings' LayerNorm
    assert _kinds(model) == {"matmul": 4, "softmax": 2, "gelu": 2, "add": 4, "layer_norm": 5}
    model.train()
    logits = model(**batch).logits
    assert torch.isfinite(logits).all() and not torch.allclose(logits, reference)
    logits.square().sum().backward()
    query = model.bert.encoder.layer[0].attention.self.query.weight
    assert query.grad is not None and torch.isfinite(query.grad).all()
    if fmt not in SIGN_FORMATS:
        assert query.grad.abs().sum() > 0


def test_a_point_passes_the_float_gradient_inside_its_range():
    """Straight-through: QuantMatmul's gradient is the float product's at the quantized operands."""
    from adls_lightning.quant import make_quantizer

    point = QuantMatmul({"data_in": make_quantizer("integer", width=8, frac_width=4)})
    a = (torch.randn(2, 4, 8) * 2).requires_grad_()
    b = torch.randn(2, 8, 5)
    grad_out = torch.randn(2, 4, 5)
    point(a, b).backward(grad_out)
    inside = (a.detach().abs() < 7.9).float()  # the 8/4 grid saturates at 127/16
    torch.testing.assert_close(a.grad, (grad_out @ b.transpose(-1, -2)) * inside)


def test_a_per_name_point_entry_is_recorded_and_exported_beside_the_layers(tiny_bert):
    """A recipe naming a point in ``layers`` (as a search trial's does) is read by the checkpoint's compression
    record and by the export's baking as by the quantization: it used to be refused there ("matches no linear
    layer or point"), failing the trial at its first checkpoint."""
    from adls_lightning.compression_record import quantization_record
    from adls_lightning.export.compressed import bake_quantized_layers

    softmax = "bert.encoder.layer.0.attention.self.softmax"
    recipe = QuantRecipe(
        key="quant.config",
        layers={softmax: {"data_in": SCALED}, "classifier": {"weight": SCALED}},
    )
    model = tiny_bert()
    assert quantization_record(model, recipe, "qat").layers.keys() == {"classifier"}  # before: as planned
    quantize_model(model, recipe)
    assert [name for name, _, _ in quantized_points(model)] == [softmax]
    assert quantization_record(model, recipe, "qat").layers.keys() == {"classifier"}  # after: as quantized
    bake_quantized_layers(model, recipe)
    assert [name for name, _, _ in quantized_points(model)] == [
        softmax
    ]  # baking touches the linear layers only


def test_chop_toml_quantizes_exactly_the_points_it_names(tiny_bert, tmp_path):
    """A chop config with [passes.quantize.matmul.config] and [passes.quantize.softmax.config]: the attention
    products and softmaxes are quantized, no GELU, LayerNorm or add; one named point is left alone."""
    toml = tmp_path / "lab.toml"
    toml.write_text(
        """
[passes.quantize]
by = "type"
[passes.quantize.default.config]
name = "NA"
[passes.quantize.matmul.config]
name = "integer"
data_in_width = 8
data_in_frac_width = 4
weight_width = 8
weight_frac_width = 4
[passes.quantize.softmax.config]
name = "integer"
data_in_width = 8
data_in_frac_width = 4
[passes.quantize.bert_encoder_layer_1_attention_self_softmax.config]
name = "NA"
"""
    )
    model = tiny_bert()
    linear = quantize_model(model, str(toml))
    assert linear == []
    assert _kinds(model) == {"matmul": 4, "softmax": 1}
    names = {name for name, _, _ in quantized_points(model)}
    assert "bert.encoder.layer.0.attention.self.softmax" in names
    assert "bert.encoder.layer.1.attention.self.softmax" not in names
    softmax = model.bert.encoder.layer[0].attention.self.softmax
    assert softmax.data_in_quantizer.format_name == "integer" and softmax.data_out_quantizer is None
    qk = model.bert.encoder.layer[0].attention.self.qk_matmul
    assert qk.weight_quantizer.frac_width == 4 and qk.data_out_quantizer is None
    # bmm names the same points (the attention's batched products)
    other = tiny_bert()
    quantize_model(other, {"bmm": {"config": {"name": "integer", "data_in_width": 8, "weight_width": 8}}})
    assert _kinds(other) == {"matmul": 4}


def test_points_by_name_and_type_with_linear_layers(tiny_bert):
    model = tiny_bert()
    recipe = QuantRecipe(
        default={"weight": SCALED},
        gelu={"data_in": SCALED},
        layers={"bert.encoder.layer.0.output.LayerNorm": {"data_in": SCALED}},
    )
    linear = quantize_model(model, recipe)
    assert len(linear) == len([n for n, m in model.named_modules() if type(m).__name__ == "QuantLinear"]) > 0
    assert _kinds(model) == {"gelu": 2, "layer_norm": 1}
    report = quantization_report(model)
    assert report["quant/points"] == 3


def test_points_are_calibrated_like_linear_inputs(tiny_bert):
    """calibrate() observes each point's static scale: the GELU's input range equals the range of the intermediate
    dense layer's output, recorded independently on the float model."""
    model = tiny_bert()
    batches = [_inputs(seed) for seed in range(3)]
    seen = []
    hook = model.bert.encoder.layer[0].intermediate.dense.register_forward_hook(
        lambda m, a, out: seen.append(out)
    )
    with torch.no_grad():
        for batch in batches:
            model(**batch)
    hook.remove()
    quantize_model(model, QuantRecipe(**EVERY_KIND))
    run = calibrate(model, batches, lambda batch: model(**batch), count=3)
    assert run == 3
    statics = [q for _, _, p in quantized_points(model) for q in p.quantizers().values()]
    assert statics and all(isinstance(q, ScaledIntegerQuantizer) and q.is_static for q in statics)
    gelu = model.bert.encoder.layer[0].intermediate.intermediate_act_fn.data_in_quantizer
    values = torch.cat([s.flatten() for s in seen])
    assert float(gelu.min_val) == pytest.approx(float(values.min()), rel=1e-5)
    assert float(gelu.max_val) == pytest.approx(float(values.max()), rel=1e-5)


def test_sdpa_stays_without_attention_points_and_fine_grids_match_float(tiny_bert):
    """Only the attention modules with a point switch to the quantized (eager) attention; on a 16-bit grid the
    quantized model computes the float model's logits, padding mask included."""
    model = tiny_bert()
    model.config._attn_implementation = "sdpa"
    batch = _inputs()
    with torch.no_grad():
        reference = model(**batch).logits
    quantize_model(model, QuantRecipe(gelu={"data_in": SCALED}, layer_norm={"data_in": SCALED}))
    implementations = {m.config._attn_implementation for n, m in model.named_modules() if n.endswith("self")}
    assert implementations == {"sdpa"}
    fine = {"format": "scaled_integer", "params": {"width": 16, "granularity": "tensor"}}
    fresh = tiny_bert()
    fresh.config._attn_implementation = "sdpa"
    quantize_model(
        fresh,
        QuantRecipe(
            layers={
                "bert.encoder.layer.0.attention.self.softmax": {"data_in": fine, "data_out": fine},
                "bert.encoder.layer.0.attention.self.qk_matmul": {"data_in": fine, "weight": fine},
            }
        ),
    )
    attention = [fresh.bert.encoder.layer[i].attention.self for i in range(2)]
    assert attention[0].config._attn_implementation == ATTENTION_IMPLEMENTATION
    assert attention[1].config._attn_implementation == "sdpa" and fresh.config._attn_implementation == "sdpa"
    with torch.no_grad():
        logits = fresh(**batch).logits
    torch.testing.assert_close(logits, reference, atol=2e-4 * reference.abs().max().item(), rtol=0)


def test_a_float_checkpoint_loads_into_the_quantized_model(tiny_bert):
    model = tiny_bert()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    quantize_model(model, QuantRecipe(**EVERY_KIND))
    model.load_state_dict(state)  # strict: every float key is where it was, quantizer state kept
    saved = model.state_dict()
    assert set(state) < set(saved)
    assert any(k.endswith("attention.output.add.data_in_1_quantizer.min_val") for k in saved)


@pytest.mark.parametrize(
    ("recipe", "message"),
    [
        (
            {"softmax": {"data_in": SCALED, "bias": SCALED}},
            "quant.config.softmax.bias: a softmax point has no bias",
        ),
        (
            {"matmul": {"data_in": SCALED, "kernel": "ibert"}},
            "quant.config.matmul.kernel='ibert': a matmul point",
        ),
        ({"gelu": {"data_in": {"format": "integer", "params": {"width": 8}}, "kernel": "ibert"}}, None),
        (
            {"gelu": {"data_in": {"format": "log", "params": {"width": 8}}, "kernel": "ibert"}},
            "quant.config.gelu.kernel=ibert: its data_in must be format scaled_integer",
        ),
        (
            {"layers": {"bert.encoder.layer.0.output.ad": {"data_in": SCALED}}},
            "output.ad: matches no linear layer or",
        ),
        (
            {"matmul": {"data_in": SCALED}, "bmm": {"data_in": SCALED}},
            "quant.config.bmm: names the same points",
        ),
        (
            {"default": {"weight": SCALED, "kernel": "ibert"}},
            "quant.config.default.kernel='ibert': linear layers",
        ),
        (
            {"matmul": {"data_in": {"format": "mxint8"}}},
            "quant.config.matmul.data_in: does not divide the dimension",
        ),
    ],
)
def test_bad_point_recipes_are_refused_in_one_line(tiny_bert, recipe, message):
    model = tiny_bert()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    if message is None:
        quantize_model(model, QuantRecipe(key="quant.config", **recipe))
        return
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(".", r"\.")) as err:
        quantize_model(model, QuantRecipe(key="quant.config", **recipe))
    assert "\n" not in str(err.value)
    assert not quantized_points(model) and model.state_dict().keys() == before.keys()


FAMILIES = {
    # model: {kind: points}, and the kinds refused with the family's name
    "tiny_roberta": ({"matmul": 4, "softmax": 2, "gelu": 2, "layer_norm": 5, "add": 4}, {}),
    "tiny_electra": ({"matmul": 4, "softmax": 2, "layer_norm": 5, "add": 4}, {}),
    "tiny_distilbert": ({"matmul": 4, "softmax": 2, "gelu": 2, "layer_norm": 5}, {"add": "distilbert"}),
    "tiny_albert": ({"matmul": 2, "softmax": 1, "gelu": 1, "layer_norm": 3}, {"add": "albert"}),
    "tiny_deberta": ({"gelu": 2, "add": 4}, {"matmul": "deberta", "softmax": "deberta"}),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_other_families(family):
    counts, refused = FAMILIES[family]
    model = build_module([f"model={family}"]).model.eval()
    batch = _inputs()
    batch["input_ids"] = batch["input_ids"] % 50
    quantize_model(model, QuantRecipe(**{kind: EVERY_KIND[kind] for kind in counts}))
    assert {k: v for k, v in _kinds(model).items() if k in counts} == counts
    with torch.no_grad():
        assert torch.isfinite(model(**batch).logits).all()
    for kind, name in refused.items():
        fresh = build_module([f"model={family}"]).model
        with pytest.raises(
            ConfigError, match=f"quant.config.{kind}: family '{name}' has no quantizable {kind}"
        ):
            quantize_model(fresh, QuantRecipe(key="quant.config", **{kind: EVERY_KIND[kind]}))


def test_train_with_int8_scaled_all(tmp_path, tiny_imdb_dir, cache_dir):
    """The user's path: train.py quant=int8_scaled_all (QAT, calibrated) quantizes every linear layer and point of
    the model, and reports them."""
    metrics = train_run(
        tmp_path / "run",
        ["quant=int8_scaled_all", "quant.calibration.batches=2", "+trainer.limit_train_batches=3",
         "+trainer.limit_val_batches=2", "+trainer.limit_test_batches=2"],
        tiny_imdb_dir,
        cache_dir,
    )  # fmt: skip
    model = build_module(["model=tiny_random"]).model
    expected = Counter(p.kind for p in find_points(model))
    assert metrics["quant/points"] == sum(expected.values()) == 17
    assert 0.0 <= metrics["test/acc"] <= 1.0


def test_float_softmax_of_the_point_is_torch_softmax():
    """The softmax point without quantizers: F.softmax with the mask applied (bool and additive)."""
    from adls_lightning.quant.points import QuantSoftmax

    point = QuantSoftmax({})
    scores = torch.randn(2, 2, 4, 6)
    keep = torch.ones(2, 1, 4, 6, dtype=torch.bool)
    keep[..., 4:] = False
    expected = F.softmax(scores.masked_fill(~keep, float("-inf")), dim=-1)
    torch.testing.assert_close(point(scores, keep), expected)
    additive = torch.zeros(2, 1, 4, 6).masked_fill(~keep, torch.finfo(torch.float32).min)
    torch.testing.assert_close(point(scores, additive), expected)


def test_sensitivity_measures_points_and_puts_the_model_back(tiny_bert):
    """The sensitivity command's groups include the encoder points (by=kind: one group per point kind per position);
    after each group the model is float again: same modules, same state keys, the shared config (SDPA)."""
    from adls_lightning.quant.sensitivity import layer_groups, layer_sensitivity, recipe_entries

    model = tiny_bert()
    model.config._attn_implementation = "sdpa"
    batch = _inputs()
    with torch.no_grad():
        reference = model(**batch).logits
    keys = set(model.state_dict())
    types = {name: type(m) for name, m in model.named_modules()}
    recipe = QuantRecipe(default={"weight": SCALED}, **EVERY_KIND)
    entries = recipe_entries(model, recipe)
    groups = layer_groups([n for n, entry in entries.items() if entry is not None], "kind")
    assert {"attention.self.softmax", "attention.self.qk_matmul", "output.add", "output.LayerNorm"} <= set(
        groups
    )
    seen: list[int] = []

    def evaluate(candidate):
        seen.append(len(quantized_points(candidate)))
        with torch.no_grad():
            return float(candidate(**batch).logits.sum())

    baseline, scores = layer_sensitivity(model, recipe, groups, evaluate)
    assert len(scores) == len(groups)
    # the float baseline, then one group at a time: a point kind quantizes its two blocks' points (two layers)
    assert seen[0] == 0 and seen[groups_index(groups, "attention.self.softmax") + 1] == 2
    assert set(model.state_dict()) == keys and {n: type(m) for n, m in model.named_modules()} == types
    assert all(m.config is model.config for n, m in model.named_modules() if n.endswith("attention.self"))
    with torch.no_grad():
        torch.testing.assert_close(model(**batch).logits, reference)


def groups_index(groups: dict, name: str) -> int:
    return list(groups).index(name)
