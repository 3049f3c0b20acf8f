"""QuantLinear, quantize_model (MASE config vocabulary, PEFT LoRA models) and the bit-width report."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from peft import LoraConfig, get_peft_model
from torch import nn
from torch.nn.utils import parametrize

from adls_lightning.errors import ConfigError
from adls_lightning.quant import (
    QuantLinear,
    find_linear_layers,
    make_quantizer,
    quantization_report,
    quantize_model,
    quantized_layers,
)
from tests.helpers import LAYER_NAMES

INT8 = {
    "name": "integer",
    "data_in_width": 8,
    "data_in_frac_width": 4,
    "weight_width": 8,
    "weight_frac_width": 4,
    "bias_width": 8,
    "bias_frac_width": 4,
}
TUTORIAL_3 = {"by": "type", "default": {"config": {"name": None}}, "linear": {"config": INT8}}


def lora(model: nn.Module) -> nn.Module:
    config = LoraConfig(
        task_type="SEQ_CLS",
        r=4,
        target_modules=["query", "key", "value", "output.dense", "intermediate.dense"],
        modules_to_save=["classifier", "pooler"],
    )
    return get_peft_model(model, config)


def batch(seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "input_ids": torch.randint(0, 100, (3, 12), generator=g),
        "attention_mask": torch.ones(3, 12, dtype=torch.long),
    }


class ZeroEvery(nn.Module):
    """A pruning-style parametrization: zeroes every second input column of the weight."""

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        mask = torch.ones_like(weight)
        mask[:, ::2] = 0
        return weight * mask


# --------------------------------------------------------------------------------------------------
# QuantLinear
# --------------------------------------------------------------------------------------------------
def int8_quantizers():
    return [make_quantizer("integer", width=8, frac_width=4) for _ in range(3)]


def test_quant_linear_quantizes_input_weight_and_bias_and_wraps_the_layer():
    linear = nn.Linear(16, 8)
    nn.init.normal_(linear.bias, std=3.0)  # biases outside int8.4's range, so the bias quantizer is visible
    q_in, q_w, q_b = int8_quantizers()
    layer = QuantLinear(linear, q_in, q_w, q_b)
    x = torch.randn(4, 5, 16) * 4
    expected = F.linear(q_in(x), q_w(linear.weight), q_b(linear.bias))
    assert torch.equal(layer(x), expected)
    assert not torch.equal(layer(x), F.linear(q_in(x), q_w(linear.weight), linear.bias))  # bias is quantized
    assert layer.linear is linear and layer.weight is linear.weight and layer.bias is linear.bias
    with torch.no_grad():
        linear.weight.mul_(2)  # the layer is wrapped, not copied
    assert torch.equal(layer(x), F.linear(q_in(x), q_w(linear.weight), q_b(linear.bias)))
    assert (layer.in_features, layer.out_features) == (16, 8)


def test_quant_linear_without_quantizers_is_the_plain_layer():
    linear = nn.Linear(16, 8)
    x = torch.randn(3, 16)
    assert torch.equal(QuantLinear(linear)(x), linear(x))


@pytest.mark.parametrize("prune_first", [True, False])
def test_pruning_parametrization_applies_before_or_after_wrapping(prune_first):
    linear = nn.Linear(16, 8)
    dense = linear.weight.detach().clone()
    if prune_first:
        parametrize.register_parametrization(linear, "weight", ZeroEvery())
    q_in, q_w, q_b = int8_quantizers()
    layer = QuantLinear(linear, q_in, q_w, q_b)
    if not prune_first:
        parametrize.register_parametrization(layer.linear, "weight", ZeroEvery())
    x = torch.randn(4, 16)
    pruned = dense.clone()
    pruned[:, ::2] = 0
    assert torch.equal(layer(x), F.linear(q_in(x), q_w(pruned), q_b(linear.bias)))
    assert torch.all(q_w(layer.linear.weight)[:, ::2] == 0)  # pruned weights stay exactly zero


def test_state_dict_of_the_plain_layer_loads_into_the_quantized_one():
    source = nn.Linear(16, 8)
    target = QuantLinear(nn.Linear(16, 8), *int8_quantizers())
    target.load_state_dict(source.state_dict())  # strict: keys are remapped under linear.
    assert torch.equal(target.linear.weight, source.weight) and torch.equal(target.linear.bias, source.bias)
    # quantizer state missing from a full-precision checkpoint keeps its value
    residual = QuantLinear(nn.Linear(16, 8), make_quantizer("binary_residual"), None, None)
    residual.data_in_quantizer.scales.data.fill_(0.3)
    residual.load_state_dict(source.state_dict())
    assert torch.all(residual.data_in_quantizer.scales == 0.3)
    # a pruned plain layer's checkpoint loads into a quantized pruned layer
    parametrize.register_parametrization(source, "weight", ZeroEvery())
    pruned_target = QuantLinear(nn.Linear(16, 8))
    parametrize.register_parametrization(pruned_target.linear, "weight", ZeroEvery())
    pruned_target.load_state_dict(source.state_dict())
    assert torch.equal(pruned_target.linear.weight, source.weight)


# --------------------------------------------------------------------------------------------------
# quantize_model on plain and PEFT models
# --------------------------------------------------------------------------------------------------
def test_tutorial_3_config_quantizes_every_linear_and_is_not_mutated(tiny_bert):
    model = tiny_bert()
    config = copy.deepcopy(TUTORIAL_3)
    names = quantize_model(model, config)
    assert config == TUTORIAL_3
    assert quantize_model(tiny_bert(), config) == names  # reusable (MASE's pass_args.pop("by") was not)
    assert names == LAYER_NAMES
    assert (
        all(isinstance(m, QuantLinear) for m in quantized_layers(model))
        and len(quantized_layers(model)) == 14
    )
    reference = tiny_bert()
    inputs = batch()
    with torch.no_grad():
        out, ref = model(**inputs).logits, reference(**inputs).logits
    assert not torch.equal(out, ref) and torch.allclose(out, ref, atol=0.3)  # quantized, but close


def test_peft_model_quantizes_base_layers_and_head_not_adapters(tiny_bert):
    plain = tiny_bert()
    quantize_model(plain, TUTORIAL_3)
    peft_model = lora(tiny_bert())
    names = quantize_model(peft_model, TUTORIAL_3)
    assert names == LAYER_NAMES  # the same user-facing names with and without LoRA
    modules = dict(peft_model.named_modules())
    query = modules["base_model.model.bert.encoder.layer.0.attention.self.query"]
    assert isinstance(query.base_layer, QuantLinear)
    assert type(query.lora_A["default"]) is nn.Linear and type(query.lora_B["default"]) is nn.Linear
    head = modules["base_model.model.classifier"]
    assert isinstance(head.modules_to_save["default"], QuantLinear)
    assert type(head.original_module) is nn.Linear  # PEFT's unused copy is left alone
    # LoRA's B starts at zero, so the quantized PEFT model computes exactly what the quantized plain model does
    inputs = batch()
    with torch.no_grad():
        assert torch.equal(peft_model(**inputs).logits, plain(**inputs).logits)


def test_by_name_regex_and_per_layer_overrides(tiny_bert):
    only_classifier = {"by": "name", "classifier": {"config": INT8}}
    assert quantize_model(tiny_bert(), only_classifier) == ["classifier"]
    mase_spelling = {"by": "name", "bert_pooler_dense": {"config": INT8}}  # MASE's FX node names
    assert quantize_model(tiny_bert(), mase_spelling) == ["bert.pooler.dense"]
    regex = {"by": "regex_name", r"bert\.encoder\.layer\.\d+\.attention\.self\..*": {"config": INT8}}
    assert quantize_model(lora(tiny_bert()), regex) == [n for n in LAYER_NAMES if ".self." in n]
    # the nested form Hydra builds from +quant.config.bert.encoder.layer.0.attention.self.query.weight_width=4
    override = copy.deepcopy(TUTORIAL_3)
    override["bert"] = {"encoder": {"layer": {"0": {"attention": {"self": {"query": {"weight_width": 4}}}}}}}
    override["classifier"] = {"name": None}
    model = tiny_bert()
    names = quantize_model(model, override)
    assert "classifier" not in names and len(names) == 13
    query = model.bert.encoder.layer[0].attention.self.query
    assert (query.weight_quantizer.width, query.weight_quantizer.frac_width) == (4, 4)  # merged over linear
    assert query.data_in_quantizer.width == 8
    assert model.bert.encoder.layer[1].attention.self.query.weight_quantizer.width == 8


def test_per_operand_format_and_default_operands(tiny_bert):
    weight_only = {"linear": {"config": {**INT8, "data_in_name": None, "bias_name": None}}}
    model = tiny_bert()
    quantize_model(model, weight_only)
    layer = quantized_layers(model)[0]
    assert (
        layer.data_in_quantizer is None
        and layer.bias_quantizer is None
        and layer.weight_quantizer is not None
    )
    binary = tiny_bert()
    quantize_model(binary, {"linear": {"config": {"name": "binary"}}})
    layer = quantized_layers(binary)[0]
    assert layer.data_in_quantizer is None and layer.bias_quantizer is None  # MASE: binary weights only
    mixed = tiny_bert()
    quantize_model(mixed, {"linear": {"config": {"name": "mxint8", "bias_name": "integer", "bias_width": 8}}})
    layer = quantized_layers(mixed)[0]
    assert layer.bias_quantizer.format_name == "integer" and layer.weight_quantizer.format_name == "mxint8"


def test_requantizing_replaces_quantizers_and_keeps_the_layer(tiny_bert):
    model = tiny_bert()
    quantize_model(model, TUTORIAL_3)
    linear = quantized_layers(model)[0].linear
    quantize_model(model, {"linear": {"config": {"name": "mxint8"}}})
    first = quantized_layers(model)[0]
    assert first.linear is linear and first.weight_quantizer.format_name == "mxint8"
    assert len(find_linear_layers(model)) == 14  # no nested wrappers


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"by": "type", "linear": {"config": {**INT8, "weight_frac_width": 65}}},
         "config.linear.config.weight_frac_width=65: must be an integer in [0, 64]"),
        ({"linear": {"config": {**INT8, "data_in_width": 0}}}, "config.linear.config.data_in_width=0"),
        ({"linear": {"config": {"name": "integer8"}}}, "config.linear.config.name='integer8': unknown quantization format"),
        ({"linear": {"config": {"name": "integer", "weight_width": 8}}}, "config.linear.config.data_in_width: missing"),
        ({"linear": {"config": {**INT8, "weight_widht": 8}}}, "config.linear.config.weight_widht: not a parameter"),
        ({"linear": {"config": {**INT8, "colour": 1}}}, "config.linear.config.colour: unknown key"),
        ({"by": "types", "linear": {"config": INT8}}, "config.by='types': must be one of type, name, regex_name"),
        ({"by": "name", "bert.encoder.layer.7.output.dense": {"config": INT8}},
         "config.bert.encoder.layer.7.output.dense: matches no linear layer"),
        ({"by": "regex_name", r".*\.querry": {"config": INT8}}, r"config..*\.querry: matches no linear layer"),
        ({"by": "name", "classifier": {"weight_width": 4}}, "config.classifier.weight_width: has no effect"),
        ({"conv2d": {"config": INT8}}, "config.conv2d: only linear layers are quantized"),
        ({"linear": {"config": {"name": "mxint8", "weight_block_size": 24}}},
         "config.linear.config.weight_block_size=24 does not divide the dimension of size 32"),
    ],
)  # fmt: skip
def test_bad_configs_fail_with_one_line_naming_the_key(config, message, tiny_bert):
    model = tiny_bert()
    before = copy.deepcopy(config)
    with pytest.raises(ConfigError) as info:
        quantize_model(model, config)
    assert message in str(info.value) and "\n" not in str(info.value)
    assert config == before
    assert not quantized_layers(model)  # nothing is swapped when the config is bad


def test_mxint8_block_error_names_the_key_and_the_layer(tiny_bert):
    config = {"linear": {"config": {"name": "mxint8", "data_in_block_size": 64}}}
    with pytest.raises(ConfigError) as info:
        quantize_model(tiny_bert(), config, key="quant.config")
    assert str(info.value) == (
        "quant.config.linear.config.data_in_block_size=64 does not divide the dimension of size 32 "
        "(MXINT8 blocks must tile it exactly) in layer bert.encoder.layer.0.attention.self.query "
        "(in_features=32; valid: 1, 2, 4, 8, 16, 32)"
    )
    # the default block size (no key in the config) is named where the key would go
    with pytest.raises(
        ConfigError,
        match=r"^quant.config.linear.config.bias_block_size=32 .* in layer classifier \(out_features=2; valid: 1, 2\)$",
    ):
        quantize_model(
            tiny_bert(), {"linear": {"config": {"name": "mxint8", "bias_name": "mxint8"}}}, key="quant.config"
        )


# --------------------------------------------------------------------------------------------------
# Bit-width accounting
# --------------------------------------------------------------------------------------------------
# tiny BERT linear weights: 2 x (4 x 32x32 + 64x32 + 32x64) + pooler 32x32 + classifier 2x32
TINY_WEIGHTS = 2 * (4 * 1024 + 2 * 2048) + 1024 + 64
TINY_IN_FEATURES = 2 * (5 * 32 + 64) + 32 + 32


def test_report_int8_and_mxint8(tiny_bert):
    model = tiny_bert()
    quantize_model(model, TUTORIAL_3)
    report = quantization_report(model)
    assert report["quant/avg_weight_bits"] == 8.0 and report["quant/avg_act_bits"] == 8.0
    assert report["quant/layers"] == 14
    mx = tiny_bert()
    # classifier: out_features 2, so its biases stay float
    quantize_model(mx, {"linear": {"config": {"name": "mxint8"}}, "classifier": {"bias_name": None}})
    assert quantization_report(mx)["quant/avg_weight_bits"] == 8.25


def test_report_counts_unquantized_layers_at_32_bits_element_weighted(tiny_bert):
    model = tiny_bert()
    quantize_model(
        model,
        {"by": "name", "classifier": {"config": INT8}, "bert.pooler.dense": {"config": {"name": "binary"}}},
    )
    report = quantization_report(model)
    expected_w = (64 * 8 + 1024 * 1 + (TINY_WEIGHTS - 64 - 1024) * 32) / TINY_WEIGHTS
    expected_a = (32 * 8 + 32 * 32 + (TINY_IN_FEATURES - 64) * 32) / TINY_IN_FEATURES  # binary: inputs float
    assert report["quant/avg_weight_bits"] == pytest.approx(expected_w)
    assert report["quant/avg_act_bits"] == pytest.approx(expected_a)
    total_bytes = sum(p.numel() * 4 for p in tiny_bert().parameters())
    # classifier: 64 weights at 1 byte + 2 biases at 1 byte instead of 4+4; pooler weights at 1 bit, bias float
    saved = 64 * 3 + 2 * 3 + 1024 * (4 - 1 / 8)
    assert report["quant/weight_bytes"] == pytest.approx(total_bytes - saved)


def test_report_ignores_lora_adapters_and_peft_copies(tiny_bert):
    peft_model = lora(tiny_bert())
    quantize_model(peft_model, TUTORIAL_3)
    report = quantization_report(peft_model)
    assert report["quant/avg_weight_bits"] == 8.0  # adapters are not counted as linear layers
    adapters = sum(p.numel() for n, p in peft_model.named_parameters() if "lora_" in n)
    plain = tiny_bert()
    quantize_model(plain, TUTORIAL_3)
    assert report["quant/weight_bytes"] == quantization_report(plain)["quant/weight_bytes"] + 4 * adapters


# --------------------------------------------------------------------------------------------------
# One QAT step per format (the real conf/quant presets) on a tiny BERT
# --------------------------------------------------------------------------------------------------
FORMAT_PRESETS = [
    "int4", "int8", "int16", "int32", "minifloat_ieee", "minifloat_denorm", "log", "block_fp", "block_minifloat",
    "block_log", "binary", "binary_scaling", "binary_residual", "ternary", "mxint8",
]  # fmt: skip


@pytest.mark.parametrize("preset", FORMAT_PRESETS)
def test_one_qat_step_per_preset(preset, compose_cfg, tiny_bert):
    from dataclasses import replace

    from hydra.utils import instantiate

    recipe = instantiate(compose_cfg([f"quant={preset}"]).quant.config)
    # weights large enough that int4 does not round them all to 0
    model = tiny_bert(initializer_range=0.2).train()
    # classifier outputs 2 features; MXINT8 blocks must tile them, so its bias stays float there
    recipe = replace(recipe, layers={"classifier": replace(recipe.default, bias=None)})
    quantize_model(model, recipe, key="quant.config")
    params = [p for p in model.parameters() if p.requires_grad]
    before = [p.detach().clone() for p in params]
    optimizer = torch.optim.SGD(params, lr=0.1)
    loss = model(**batch(), labels=torch.tensor([0, 1, 1])).loss
    loss.backward()
    optimizer.step()
    assert torch.isfinite(loss)
    encoder_query = model.bert.encoder.layer[1].attention.self.query
    assert (
        encoder_query.linear.weight.grad is not None
        and torch.count_nonzero(encoder_query.linear.weight.grad) > 0
    )
    changed = sum(not torch.equal(b, p) for b, p in zip(before, params))
    assert changed >= len(params) // 2
