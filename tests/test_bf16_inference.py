"""Inference with the weights cast to bfloat16 once (adls_lightning.precision.bf16_inference_model and
``model.eval_precision``): the labels and logits of the cast model against the fp32 model's, this project's layers
kept fp32 at their edge, the training weights untouched, and a run's evaluation through train.py's path."""

from __future__ import annotations

import logging
import re

import pytest
import torch
from peft import LoraConfig, get_peft_model
from torch import nn
from torch.nn.utils import parametrize

from adls_lightning import precision
from adls_lightning.errors import ConfigError
from tests.helpers import FORMAT_PARAMS, train_run


def _relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).norm() / b.norm())


# bf16 keeps 8 significant bits; two layers of a tiny BERT end to end stay within a few per cent of fp32
BF16_TOLERANCE = 0.05


@pytest.mark.parametrize(
    ("value", "trainer_precision", "on_cpu", "expected"),
    [
        ("auto", "bf16-mixed", True, "bf16"),  # trainer.precision=auto took bf16 on this CPU
        ("auto", "bf16-true", True, "bf16"),
        ("auto", "32-true", True, "trainer"),  # auto kept fp32 (AVX2, or measured no faster): unchanged
        ("auto", "bf16-mixed", False, "trainer"),  # a GPU preset keeps its autocast
        ("bf16", "32-true", True, "bf16"),
        ("32-true", "bf16-mixed", True, "32-true"),
    ],
)
def test_eval_precision_follows_the_trainers_resolved_precision(value, trainer_precision, on_cpu, expected):
    assert precision.eval_precision(value, trainer_precision, on_cpu) == expected


def test_bad_eval_precision_is_one_line_listing_the_valid_values():
    with pytest.raises(ConfigError, match=r"model.eval_precision='fp16': must be one of auto, bf16, 32-true"):
        precision.eval_precision("fp16", "32-true")


def _lora_bert(tiny_bert):
    model = tiny_bert(seed=0)
    config = LoraConfig(
        r=4, target_modules=["query", "value"], modules_to_save=["classifier"], init_lora_weights=False
    )
    return get_peft_model(model, config).eval()


def test_cast_model_predicts_the_fp32_labels_within_bf16_tolerance(tiny_bert):
    model = _lora_bert(tiny_bert)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ids = torch.randint(0, 100, (64, 24), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[::3, 16:] = 0  # some padded rows
    with torch.inference_mode():
        reference = model(input_ids=ids, attention_mask=mask).logits
        cast = precision.bf16_inference_model(model)
        logits = cast(input_ids=ids, attention_mask=mask).logits
    # the weights are bfloat16 (LoRA adapters and the saved head included), once, in the copy only
    dtypes = {name: p.dtype for name, p in cast.named_parameters()}
    assert set(dtypes.values()) == {torch.bfloat16}, dtypes
    assert any(".lora_A." in name for name in dtypes) and any("classifier" in name for name in dtypes)
    assert logits.dtype == torch.bfloat16
    for key, value in model.state_dict().items():  # the fp32 model is untouched: training goes on with it
        assert value.dtype == before[key].dtype and torch.equal(value, before[key]), key
    assert _relative_error(logits, reference) < BF16_TOLERANCE
    # labels agree wherever fp32's margin exceeds the largest logit error bf16 made
    error = float((logits.float() - reference).abs().max())
    margin = (reference[:, 0] - reference[:, 1]).abs()
    decided = margin > 2 * error
    assert decided.sum() >= 32  # enough rows for the comparison to mean something
    assert torch.equal(logits.argmax(-1)[decided], reference.argmax(-1)[decided])


def test_in_place_cast_of_an_evaluation_only_model(tiny_bert):
    model = tiny_bert(seed=2)
    ids = torch.randint(0, 100, (8, 16), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        reference = model(input_ids=ids).logits
        same = precision.bf16_inference_model(model, copy=False)
        logits = model(input_ids=ids).logits
    assert same is model and model.bert.encoder.layer[0].attention.self.query.weight.dtype == torch.bfloat16
    assert _relative_error(logits, reference) < BF16_TOLERANCE


def _custom_layers():
    """A model with each of this project's own layers between plain linears: a fake-quantized linear (int8),
    an MXINT8 packed linear, a pruning mask (torch parametrization)."""
    from adls_lightning.mxint8.qlinear import QLinearPacked
    from adls_lightning.prune.masks import WeightMask
    from adls_lightning.quant import make_quantizer
    from adls_lightning.quant.linear import QuantLinear

    torch.manual_seed(0)
    name = "integer" if "integer" in FORMAT_PARAMS else sorted(FORMAT_PARAMS)[0]
    weight_q, input_q = (make_quantizer(name, **FORMAT_PARAMS[name]) for _ in range(2))
    weight_q.bind((64, 64))
    input_q.bind(None)
    pruned = nn.Linear(64, 64)
    parametrize.register_parametrization(pruned, "weight", WeightMask(torch.rand(64, 64) > 0.5))
    return nn.Sequential(
        nn.Linear(32, 64),
        QuantLinear(nn.Linear(64, 64), input_q, weight_q),
        nn.GELU(),
        QLinearPacked.from_linear(nn.Linear(64, 64)),
        pruned,
        nn.LayerNorm(64),
        nn.Linear(64, 8),
    ).eval()


def test_custom_layers_keep_fp32_and_cast_at_their_edge():
    model = _custom_layers()
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        reference = model(x)
        cast = precision.bf16_inference_model(model)
        out = cast(x.bfloat16())
    quantized, packed, pruned = cast[1], cast[3], cast[4]
    # the plain layers are bfloat16 (the pruned linear's bias too: torch's parametrized class), the project's own
    # layers keep every floating tensor fp32 (the quantized linear's weight is quantized from fp32, not bf16)
    assert cast[0].weight.dtype == cast[5].weight.dtype == cast[6].weight.dtype == torch.bfloat16
    for layer in (quantized, packed):
        floats = [t for t in [*layer.parameters(), *layer.buffers()] if t.is_floating_point()]
        assert floats and all(t.dtype == torch.float32 for t in floats), type(layer).__name__
    assert pruned.parametrizations.weight[0].mask.dtype == model[4].parametrizations.weight[0].mask.dtype
    # the masked weight is still exactly zero where pruned, in bf16
    assert torch.all(pruned.weight[~model[4].parametrizations.weight[0].mask.bool()] == 0)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out.float()).all()
    assert _relative_error(out, reference) < 0.08  # the quantizer's rounding decisions flipped by bf16 inputs


def test_compiled_in_place_model_is_copied_to_run_eager():
    model = nn.Sequential(nn.Linear(8, 8)).eval()
    model.compile()  # nn.Module.compile: a compiled call bound to the fp32 module
    cast = precision.bf16_inference_model(model)
    assert cast._compiled_call_impl is None
    with torch.inference_mode():
        assert cast(torch.randn(2, 8).bfloat16()).dtype == torch.bfloat16


# --- a run's evaluation (train.py's path) ------------------------------------------------------------------------


def test_run_evaluates_with_bf16_weights_and_keeps_training_fp32(tmp_path, tiny_imdb_dir, cache_dir, caplog):
    """trainer.precision=bf16-mixed (what auto takes on a bf16 CPU) with the default eval_precision=auto: validation
    and test run the bf16 copy, logged once; the saved weights stay fp32."""
    with caplog.at_level(logging.INFO, logger="adls_lightning.module"):
        train_run(
            tmp_path, ["trainer.precision=bf16-mixed", "trainer.max_epochs=2"], tiny_imdb_dir, cache_dir
        )
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Evaluation:")]
    assert lines == [
        "Evaluation: weights cast to bf16 once per pass (model.eval_precision=auto, trainer.precision=bf16-mixed)"
    ]
    for ckpt in (tmp_path / "checkpoints").glob("*.ckpt"):
        state = torch.load(ckpt, map_location="cpu", weights_only=False)["state_dict"]
        floats = {k: v.dtype for k, v in state.items() if v.is_floating_point()}
        assert floats and set(floats.values()) == {torch.float32}, (ckpt, floats)
        assert not [k for k in state if k.startswith("_eval_model")], ckpt


@pytest.mark.parametrize("eval_precision", ["bf16", "32-true"])
def test_ptq_checkpoint_holds_the_model_once(eval_precision, fine_tuned, tmp_path, tiny_imdb_dir, cache_dir):
    """A PTQ run saves its evaluated model (compressed.ckpt) during the test pass, while the evaluation's model (a
    bf16 copy, or the model itself) is set: the checkpoint holds the model's weights under their own names only."""
    overrides = ["train=false", f"init_ckpt={fine_tuned}", "quant=int8_scaled", "quant.mode=ptq"]
    train_run(tmp_path, [*overrides, f"model.eval_precision={eval_precision}"], tiny_imdb_dir, cache_dir)
    state = torch.load(tmp_path / "checkpoints" / "compressed.ckpt", map_location="cpu", weights_only=False)
    names = list(state["state_dict"])
    assert names and all(name.startswith("model.") for name in names), [
        n for n in names if n[:6] != "model."
    ][:5]


def test_bf16_evaluation_of_a_checkpoint_matches_fp32(fine_tuned, tmp_path, tiny_imdb_dir, cache_dir):
    """train=false on a fine-tuned checkpoint (it separates the reviews): the bf16-cast evaluation's test/acc is
    the fp32 evaluation's within a review or two of 200."""
    common = ["train=false", f"ckpt_path={fine_tuned}", "model/lora=none"]
    runs = {
        value: train_run(
            tmp_path / value,
            [*common, "trainer.precision=bf16-mixed", f"model.eval_precision={value}"],
            tiny_imdb_dir,
            cache_dir,
        )
        for value in ("auto", "32-true")
    }
    assert runs["32-true"]["test/acc"] >= 0.9  # a working model: the comparison means something
    assert abs(runs["auto"]["test/acc"] - runs["32-true"]["test/acc"]) <= 0.01
    assert (
        abs(runs["auto"]["test/loss"] - runs["32-true"]["test/loss"]) <= 0.05 * runs["32-true"]["test/loss"]
    )


def test_exported_folder_evaluates_in_bf16_where_the_run_would(fine_tuned, tmp_path, caplog):
    """adls-evaluate on an HF export: trainer.precision=bf16-mixed (auto's choice on a bf16 CPU) casts the loaded
    weights once and says so; its accuracy is the fp32 evaluation's (model.eval_precision=32-true) within a review."""
    from adls_lightning.tools import evaluate as export_evaluate
    from adls_lightning.tools.export import main as export_main
    from tests.helpers import call

    code, _, stderr = call(export_main, f"ckpt={fine_tuned}", f"out={tmp_path / 'hf'}", "format=hf")
    assert code == 0, stderr[-3000:]
    accuracies = {}
    for value in ("auto", "32-true"):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="adls_lightning.precision"):
            code, stdout, stderr = call(
                export_evaluate.main,
                str(tmp_path / "hf"),
                "trainer.precision=bf16-mixed",
                f"model.eval_precision={value}",
            )
        assert code == 0, stderr[-3000:]
        [line] = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Inference:")]
        assert line.startswith(
            "Inference: weights cast to bf16 once" if value == "auto" else "Inference: fp32"
        )
        accuracies[value] = float(
            re.search(r"test/acc ([0-9.]+), test/f1 \S+ on (\d+) texts", stdout).group(1)
        )
    assert accuracies["32-true"] >= 0.9
    assert abs(accuracies["auto"] - accuracies["32-true"]) <= 0.01


def test_a_checkpoint_keeps_the_precision_and_gemm_its_run_resolved_and_later_loads_compute_in_them(
    fine_tuned, tmp_path
):
    """trainer.precision=auto is measured on the machine a run ran on; its checkpoint keeps the answer, so an
    evaluation or export elsewhere (or later, under another load) computes as the run's own test pass did."""
    import json
    import shutil

    from adls_lightning.checkpoints import RESOLVED_KEY
    from adls_lightning.export.recipe import RECIPE_FILE
    from adls_lightning.runs.loading import load_checkpoint_model
    from adls_lightning.tools.export import main as export_main
    from tests.helpers import call

    state = torch.load(fine_tuned, weights_only=False)
    # resolved, never "auto"
    assert state[RESOLVED_KEY]["trainer.precision"] in ("32-true", "bf16-mixed")
    assert state[RESOLVED_KEY]["runtime.gemm"] in ("aten", "onednn")
    # the same run as if its machine had measured bf16 faster
    run = tmp_path / "run"
    shutil.copytree(fine_tuned.parent.parent, run)
    ckpt = run / "checkpoints" / fine_tuned.name
    state[RESOLVED_KEY] = {"trainer.precision": "bf16-mixed", "runtime.gemm": "onednn"}
    torch.save(state, ckpt)
    loaded = load_checkpoint_model(ckpt, [])
    assert loaded.config.trainer.precision == "bf16-mixed" and loaded.config.runtime.gemm == "onednn"
    assert {"trainer.precision=bf16-mixed", "runtime.gemm=onednn"} <= set(loaded.recipe.run_overrides)
    # a precision the caller gives wins
    assert load_checkpoint_model(ckpt, ["trainer.precision=32-true"]).config.trainer.precision == "32-true"
    # the export's folder evaluates in it (adls-evaluate composes the folder's recorded overrides)
    out = tmp_path / "hf"
    code, _, stderr = call(export_main, f"ckpt={ckpt}", f"out={out}", "format=hf", "check=none")
    assert code == 0, stderr[-3000:]
    recorded = json.loads((out / RECIPE_FILE).read_text())["run_overrides"]
    assert {"trainer.precision=bf16-mixed", "runtime.gemm=onednn"} <= set(recorded)
