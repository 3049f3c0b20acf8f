"""The family x feature matrix: every feature of the framework on the tiny random model of each BERT-class family.

Each family's LoRA fine-tune runs once (in-process, a few steps on the synthetic reviews) and its best checkpoint
feeds the cells that start from a trained model (merge + QAT, export). The mixed-precision searches of all six
families run in one search.py process. What each cell showed is in docs/results.md ("Model families").
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import AutoModelForSequenceClassification

from adls_lightning.app.training import run
from adls_lightning.export import load_packed, pack_for_export
from adls_lightning.graph import capture, dropout_nodes, example_inputs, remove_dropout
from adls_lightning.lora import merge_lora
from adls_lightning.tools.export import main as export_main
from tests.helpers import (
    CountDropoutCalls,
    build_module,
    load_study,
    run_studies,
    tiny_run,
)

# preset -> (model_type, LoRA-adapted linears per layer, layers holding their own weights, head modules trained
# in full), written from each family's architecture; the tests compare the built models against it.
FAMILIES = {
    "tiny_bert": (
        "bert",
        6,
        2,
        ("classifier", "pooler"),
    ),  # query key value attention.output.dense + FFN pair
    "tiny_roberta": ("roberta", 2, 2, ("classifier",)),  # query value; head = classifier.dense + out_proj
    "tiny_distilbert": ("distilbert", 2, 2, ("pre_classifier", "classifier")),  # q_lin v_lin
    "tiny_deberta": ("deberta-v2", 2, 2, ("pooler", "classifier")),  # query_proj value_proj
    "tiny_electra": ("electra", 2, 2, ("classifier",)),  # query value
    "tiny_albert": ("albert", 2, 1, ("pooler", "classifier")),  # query value of the one shared layer
}
# A few optimizer steps on the synthetic reviews: 48 training rows in batches of 16.
FAST = [
    "trainer.max_epochs=1",
    "data.train_size=48",
    "data.val_size=32",
    "data.test_size=32",
    "data.batch_size=16",
    "data.max_length=32",
    "callbacks.last_checkpoint=null",
    "trainer.num_sanity_val_steps=0",
    "test=false",
]
LORA_R = 8


@pytest.fixture(scope="module")
def family_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("families")


# preset -> (metrics, best checkpoint) of its LoRA fine-tune, shared by the cells that start from a trained model
_RUNS: dict[str, tuple[dict, Path]] = {}


@pytest.fixture
def fine_tuned(compose_cfg, family_dir):
    """``fine_tuned(preset) -> (metrics, best checkpoint)``: the family's LoRA fine-tune, run once per module."""

    def get(preset: str) -> tuple[dict, Path]:
        out = family_dir / preset / "lora"
        if preset not in _RUNS:
            metrics = run(compose_cfg([f"model={preset}", *FAST], output_dir=out))
            _RUNS[preset] = (metrics, next((out / "checkpoints").glob("best-*.ckpt")))
        return _RUNS[preset]

    return get


def linear_names(module: nn.Module) -> list[str]:
    return [name for name, m in module.named_modules() if isinstance(m, nn.Linear)]


@pytest.mark.parametrize("preset", FAMILIES)
def test_family_lora_fine_tune_adapts_the_familys_linears_and_trains_its_head(preset, fine_tuned):
    model_type, per_layer, own_layers, head = FAMILIES[preset]
    metrics, ckpt = fine_tuned(preset)
    state = torch.load(ckpt, map_location="cpu", weights_only=True)["state_dict"]
    module = build_module([f"model={preset}"])
    assert module.model.config.model_type == model_type
    hidden = module.model.config.hidden_size
    # q and v (and BERT's k, attention output) are hidden x hidden; BERT's FFN pair is hidden <-> intermediate.
    lora_a = {k: v for k, v in state.items() if ".lora_A." in k}
    assert len(lora_a) == per_layer * own_layers
    expected = LORA_R * 2 * hidden * per_layer * own_layers
    if model_type == "bert":
        intermediate = module.model.config.intermediate_size
        expected = own_layers * LORA_R * (4 * 2 * hidden + 2 * (hidden + intermediate))
    assert metrics["model/lora_params"] == expected
    # Trained: the zero-initialised B matrices moved; the head trains in full (a modules_to_save copy per module).
    assert all(v.abs().sum() > 0 for k, v in state.items() if ".lora_B." in k)
    trainable = {n for n, p in module.named_parameters() if p.requires_grad}
    for name in trainable:
        assert ".lora_" in name or any(f".{h}.modules_to_save." in name for h in head), name
    for h in head:
        assert any(f".{h}.modules_to_save." in n for n in trainable), h
    assert metrics["params/trainable"] == sum(
        p.numel() for n, p in module.named_parameters() if n in trainable
    )


@pytest.mark.parametrize("preset", FAMILIES)
def test_family_lora_merge_then_int8_qat(preset, fine_tuned, compose_cfg, family_dir):
    _, ckpt = fine_tuned(preset)
    out = family_dir / preset / "qat"
    metrics = run(compose_cfg([f"model={preset}", *FAST, f"init_ckpt={ckpt}", "quant=int8"], output_dir=out))
    plain = build_module([f"model={preset}", "model/lora=none"]).model
    assert metrics["model/lora_params"] == 0  # merged before quantizing
    assert metrics["quant/layers"] == len(linear_names(plain))
    assert metrics["quant/avg_weight_bits"] == 8
    # Every weight of the merged model trains (QAT); nothing is left frozen.
    assert metrics["params/trainable"] == metrics["params/total"]


@pytest.mark.parametrize(
    ("preset", "feature"),
    [(p, f) for f in ("prune=l1_0.5", "compress=int8_l1_0.5", "quant=mxint8_packed") for p in FAMILIES],
)
def test_family_compression_presets(preset, feature, compose_cfg, caplog):
    with caplog.at_level(logging.INFO):
        metrics = run(compose_cfg([f"model={preset}", *FAST, feature]))
    plain = build_module([f"model={preset}", "model/lora=none"]).model
    # every linear except the head: the presets' ``exclude: [classifier]`` is a regex searched in the names, so it
    # also skips DistilBERT's pre_classifier and the two linears of RoBERTa's and ELECTRA's classifier
    body = [n for n in linear_names(plain) if "classifier" not in n]
    if feature == "quant=mxint8_packed":
        assert metrics["mxint8/packed_layers"] == len(body)
        assert metrics["mxint8/bits_per_weight"] < 8.5
        return
    # Local L1 pruning at 0.5: half of each pruned layer's weights are zero.
    assert re.search(rf"(prune|compress): {len(body)} layers, weight sparsity", caplog.text), caplog.text[
        -2000:
    ]
    assert metrics["prune/weight_sparsity"] == pytest.approx(0.5, abs=0.01)
    if feature.startswith("compress"):
        assert metrics["quant/avg_weight_bits"] == 8


@pytest.mark.parametrize("preset", FAMILIES)
def test_family_compile_aot_eager_reports_graph_breaks(preset, compose_cfg):
    torch._dynamo.reset()
    try:
        metrics = run(compose_cfg([f"model={preset}", *FAST, "compile=aot_eager", "test=false"]))
    finally:
        torch._dynamo.reset()
    assert metrics["compile/graphs"] > 0
    print(f"{preset}: compile/graph_breaks={metrics['compile/graph_breaks']}")
    assert metrics["compile/graph_breaks"] == 0


@pytest.mark.parametrize("preset", FAMILIES)
def test_family_export_round_trip(preset, fine_tuned, tmp_path):
    _, ckpt = fine_tuned(preset)
    module = build_module([f"model={preset}"])
    module.load_state_dict(torch.load(ckpt, map_location="cpu", weights_only=True)["state_dict"])
    merge_lora(module)
    model = module.model.eval()
    ids = example_inputs(["input_ids"], vocab_size=model.config.vocab_size, seed=3)["input_ids"]
    with torch.inference_mode():
        merged = model(input_ids=ids).logits
    assert export_main([f"ckpt={ckpt}", f"out={tmp_path / 'hf'}", "format=hf", f"model={preset}"]) == 0
    reloaded = AutoModelForSequenceClassification.from_pretrained(tmp_path / "hf").eval()
    assert type(reloaded) is type(model)
    with torch.inference_mode():
        assert torch.equal(reloaded(input_ids=ids).logits, merged)
    assert export_main([f"ckpt={ckpt}", f"out={tmp_path / 'packed'}", f"model={preset}"]) == 0
    pack_for_export(model)  # the packed model built here, independently of the command
    with torch.inference_mode():
        expected = model(input_ids=ids).logits
        assert torch.equal(load_packed(tmp_path / "packed")(input_ids=ids).logits, expected)
    assert not torch.equal(expected, merged)  # the packing did change the weights


@pytest.mark.parametrize("preset", FAMILIES)
def test_family_graph_capture_and_remove_dropout_keep_eval_logits(preset):
    torch.manual_seed(0)
    model = build_module([f"model={preset}", "model/lora=none", "model.fast_dropout=false"]).model.eval()
    names = ["input_ids", "attention_mask"]
    probe = example_inputs(names, vocab_size=model.config.vocab_size, seed=7)
    graph_module = capture(model, names)
    with CountDropoutCalls() as counter, torch.no_grad():
        eager = model(**probe).logits
    with torch.no_grad():
        assert torch.equal(graph_module(**probe).logits, eager)
    nodes = len(graph_module.graph.nodes)
    assert len(dropout_nodes(graph_module)) == counter.count > 0
    remove_dropout(graph_module)
    assert nodes - len(graph_module.graph.nodes) == counter.count
    with torch.no_grad():
        assert torch.equal(graph_module(**probe).logits, eager)


def test_family_mixed_precision_search_of_two_trials(tmp_path, tiny_imdb_dir, cache_dir):
    # no test pass in the trials: what is checked is each trial's space and quantized layers (12 trials' worth)
    base = [
        *tiny_run(tiny_imdb_dir, cache_dir),
        "search=mixed_precision",
        "hydra.sweeper.n_trials=2",
        "test=false",
    ]
    run_studies([[*base, f"model={p}", f"hydra.sweep.dir={tmp_path / p / 'sweep'}"] for p in FAMILIES])
    for preset in FAMILIES:
        study = load_study(tmp_path / preset, "mixed_precision-integer-acc-tpe")
        plain = build_module([f"model={preset}", "model/lora=none"]).model
        layers = set(linear_names(plain))
        assert [t.state.name for t in study.trials] == ["COMPLETE", "COMPLETE"]
        for trial in study.trials:
            assert {k.split("/")[0] for k in trial.params} == layers
            quantized = sum(trial.params[f"{n}/format"] == "integer" for n in layers)
            assert trial.user_attrs["metrics"]["quant/layers"] == quantized


@pytest.mark.parametrize("preset", FAMILIES)
def test_family_presets_take_peft_defaults_where_peft_has_them(preset):
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as PEFT_DEFAULTS

    module = build_module([f"model={preset}"])
    model_type = FAMILIES[preset][0]
    targets = module.model.peft_config["default"].target_modules
    if model_type == "bert":  # the BERT presets adapt every encoder linear (the measured MiniLM recipe)
        assert targets == {"query", "key", "value", "output.dense", "intermediate.dense"}
    elif model_type in PEFT_DEFAULTS:
        assert targets == set(PEFT_DEFAULTS[model_type])
    else:  # written in the preset: the family's query and value, as PEFT's defaults of the others
        assert targets == {"distilbert": {"q_lin", "v_lin"}, "albert": {"query", "value"}}[model_type]


@pytest.mark.parametrize(
    ("preset", "overrides", "message"),
    [
        # BERT's default LoRA on DistilBERT: nothing matches (PEFT's own error is a traceback)
        (
            "tiny_distilbert",
            ["model/lora=default"],
            "intermediate.dense, key, output.dense, query, value match",
        ),
        # BERT's names on DeBERTa: the FFN matches, q/k/v would silently stay without adapters
        ("tiny_deberta", ["model/lora=default"], "key, query, value match no layer of this deberta-v2 model"),
        ("tiny_roberta", ["model.lora.target_modules=[query,qkv]"], "qkv matches no layer"),
        (
            "tiny_distilbert",
            ["model.lora.modules_to_save=[pooler,classifier]"],
            "model.lora.modules_to_save: pooler",
        ),
        ("tiny_albert", ["model.lora.target_modules=null"], "PEFT has no default for albert models"),
        # BERT's q/v names on DistilBERT, as a user types them: every DistilBERT linear listed, in order. The same
        # command line through train.py (one line, exit code 2, no run folder) is
        # tests/test_bad_input_early.py's lora-target-of-another-family case.
        (
            "tiny_distilbert",
            ["model.lora.target_modules=[query,value]"],
            "model.lora.target_modules: query, value match no layer of this distilbert model (its linear layers: "
            "attention.q_lin, attention.k_lin, attention.v_lin, attention.out_lin, ffn.lin1, ffn.lin2",
        ),
    ],
)
def test_family_lora_targets_that_match_nothing_are_one_line(preset, overrides, message, compose_cfg):
    from adls_lightning.build import build
    from adls_lightning.errors import ConfigError

    cfg = compose_cfg([f"model={preset}", *overrides])
    with pytest.raises(ConfigError, match="model.lora") as err:
        build(cfg.model, "model", _convert_="partial")
    assert message in str(err.value)
    plain = build_module([f"model={preset}", "model/lora=none"]).model
    # the model's linear names are listed, as valid target_modules entries (PEFT matches name suffixes)
    listed = str(err.value).split("linear layers: ")[1].rstrip(")").split(", ")
    for name in linear_names(plain):
        assert any(name.endswith(entry) for entry in listed), name
