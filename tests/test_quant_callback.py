"""QuantizationCallback in real Lightning runs: QAT with LoRA, full QAT, PTQ before/after, resume, presets, errors."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
from hydra.utils import instantiate
from lightning.pytorch.callbacks import ModelCheckpoint

from adls_lightning.app.training import run
from adls_lightning.callbacks.quantization import QuantizationCallback
from adls_lightning.errors import ConfigError
from adls_lightning.quant import QUANTIZERS, QuantLinear, quantize_model, quantized_layers
from tests.helpers import TINY_LINEARS

ROOT = Path(__file__).resolve().parent.parent
PRESET_DIR = ROOT / "conf" / "quant"


def build(compose_cfg, overrides, **trainer_kwargs):
    cfg = compose_cfg(overrides)
    # the model's random init from a fixed seed, not from whatever the tests before left in torch's generator (the
    # PTQ test's 4 epochs learn the keywords from this init; from others they sometimes stayed at chance)
    L.seed_everything(cfg.seed, verbose=False)
    model = instantiate(cfg.model, _convert_="partial")
    callback = instantiate(cfg.quant, _convert_="partial")
    datamodule = instantiate(cfg.data)
    defaults = dict(max_epochs=1, logger=False, enable_progress_bar=False, enable_model_summary=False)
    trainer = L.Trainer(
        callbacks=[callback, *trainer_kwargs.pop("callbacks", [])], **(defaults | trainer_kwargs)
    )
    return model, callback, datamodule, trainer


# LoRA kept unmerged (the explicit option): adapters train over the frozen quantized base layers
UNMERGED = "model.merge_lora_before_compress=false"


@pytest.mark.slow
def test_qat_trains_lora_adapters_over_frozen_quantized_base(compose_cfg):
    model, callback, datamodule, trainer = build(
        compose_cfg,
        ["quant=int8", UNMERGED],
        enable_checkpointing=False,
        limit_train_batches=8,
        limit_val_batches=2,
    )
    base = {n: p.detach().clone() for n, p in model.named_parameters() if "base_layer" in n}
    trainer.fit(model, datamodule=datamodule)
    assert len(quantized_layers(model.model)) == TINY_LINEARS
    named = dict(model.named_parameters())
    for name, before in base.items():
        quantized_name = name.replace("base_layer.", "base_layer.linear.")
        assert torch.equal(named[quantized_name], before), f"{quantized_name} must stay frozen"
        assert not named[quantized_name].requires_grad
    assert all(torch.count_nonzero(p) > 0 for n, p in named.items() if "lora_B" in n), "adapters must train"
    optimized = {id(p) for group in trainer.optimizers[0].param_groups for p in group["params"]}
    assert optimized == {id(p) for p in model.parameters() if p.requires_grad}
    report = callback.report()
    assert report["quant/avg_weight_bits"] == 8.0 and report["quant/avg_act_bits"] == 8.0


@pytest.mark.slow
def test_train_base_unfreezes_the_quantized_weights(compose_cfg):
    model, _, datamodule, trainer = build(
        compose_cfg, ["quant=int8", "quant.train_base=true", UNMERGED], enable_checkpointing=False, limit_train_batches=4,
        limit_val_batches=1,
    )  # fmt: skip
    base = {n: p.detach().clone() for n, p in model.named_parameters() if "base_layer.weight" in n}
    trainer.fit(model, datamodule=datamodule)
    named = dict(model.named_parameters())
    changed = [
        n
        for n, v in base.items()
        if not torch.equal(named[n.replace("base_layer.", "base_layer.linear.")], v)
    ]
    assert len(changed) == len(base) == 12  # every LoRA-wrapped base layer trains (6 per layer)


@pytest.mark.slow
def test_ptq_quantizes_only_for_final_evaluation_and_reports_before_after(compose_cfg, tmp_path):
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", monitor="val/acc", mode="max")
    # full fine-tuning learns the keywords in 4 epochs
    learnable = ["model/lora=none", "model.optimizer.lr=1e-3"]
    model, callback, datamodule, trainer = build(
        compose_cfg, ["quant=int4", "quant.mode=ptq", *learnable], callbacks=[checkpoint], max_epochs=4
    )
    trainer.fit(model, datamodule=datamodule)
    assert not quantized_layers(model.model), "PTQ must train at full precision"
    best_state = torch.load(checkpoint.best_model_path, weights_only=True)["state_dict"]
    assert not any(".linear.weight" in key for key in best_state)
    trainer.validate(model, datamodule=datamodule, ckpt_path="best", verbose=False)
    assert len(quantized_layers(model.model)) == TINY_LINEARS
    report = callback.report()
    assert report["ptq/val_acc_before"] == pytest.approx(float(checkpoint.best_model_score))
    assert report["ptq/val_acc_before"] >= 0.8  # learned (chance is 0.5)
    assert report["ptq/val_acc_after"] == pytest.approx(float(trainer.callback_metrics["val/acc"]))
    assert report["ptq/val_acc_after"] < report["ptq/val_acc_before"] - 0.05  # int4 (frac 2) hurts
    # the best full-precision checkpoint loads into the quantized model again for the test run
    trainer.test(model, datamodule=datamodule, ckpt_path="best", verbose=False)
    query = model.model.bert.encoder.layer[0].attention.self.query
    assert torch.equal(
        query.linear.weight, best_state["model.bert.encoder.layer.0.attention.self.query.weight"]
    )

    # PTQ of that checkpoint in another trainer (an evaluation-only run, as a PTQ width sweep does):
    # "before" comes from the score stored in the checkpoint; 32-bit fixed point loses nothing here
    model, callback, datamodule, trainer = build(compose_cfg, ["quant=int32", "quant.mode=ptq", *learnable])
    trainer.validate(model, datamodule=datamodule, ckpt_path=checkpoint.best_model_path, verbose=False)
    assert callback.report()["ptq/val_acc_before"] == report["ptq/val_acc_before"]
    assert callback.report()["ptq/val_acc_after"] == report["ptq/val_acc_before"]
    assert callback.report()["quant/avg_weight_bits"] == 32.0


@pytest.mark.slow
def test_ptq_run_writes_before_and_after_to_metrics(compose_cfg, tmp_path):
    metrics = run(compose_cfg(["quant=int8", "quant.mode=ptq"]))
    best = next((tmp_path / "run" / "checkpoints").glob("best-*.ckpt"))
    states = torch.load(best, weights_only=True)["callbacks"]
    score = next(
        s["best_model_score"] for k, s in states.items() if k.startswith("ModelCheckpoint") and s["monitor"]
    )
    assert metrics["ptq/val_acc_before"] == pytest.approx(float(score))
    assert metrics["ptq/val_acc_after"] == metrics["val/acc"]
    assert metrics["quant/avg_weight_bits"] == 8.0 and metrics["quant/layers"] == TINY_LINEARS


@pytest.mark.slow
def test_resumed_qat_run_comes_back_quantized(compose_cfg, tmp_path):
    common = ["quant=int8", UNMERGED, "callbacks.last_checkpoint.every_n_train_steps=10"]
    run(compose_cfg([*common, "trainer.max_epochs=1"], output_dir=tmp_path / "a"))
    last = tmp_path / "a" / "checkpoints" / "last.ckpt"
    saved = torch.load(last, weights_only=True)
    key = "model.base_model.model.bert.encoder.layer.0.attention.self.query.base_layer.linear.weight"
    assert key in saved["state_dict"] and saved["callbacks"]["QuantizationCallback"]["quantized"] is True
    resumed = run(
        compose_cfg([*common, "trainer.max_epochs=2", f"ckpt_path={last}"], output_dir=tmp_path / "b")
    )
    assert resumed["quant/layers"] == TINY_LINEARS
    final = torch.load(tmp_path / "b" / "checkpoints" / "last.ckpt", weights_only=True)
    # the first run's last.ckpt is its end (one epoch); the resumed run trained exactly the second epoch
    assert (saved["epoch"], final["epoch"]) == (1, 2) and final["global_step"] == 2 * saved["global_step"]
    # frozen base weights came back from the checkpoint unchanged
    assert torch.equal(final["state_dict"][key], saved["state_dict"][key])


def test_every_format_has_a_preset_that_quantizes_every_linear_layer_with_it(compose_cfg, tiny_bert):
    presets = sorted(p.stem for p in PRESET_DIR.glob("[!_]*.yaml") if p.stem not in ("none", "mxint8_packed"))
    format_of = {cls: name for name, cls in QUANTIZERS.items()}
    formats_used = set()
    for preset in presets:
        callback = instantiate(compose_cfg([f"quant={preset}"]).quant, _convert_="partial")
        # GPTQ chooses weights after training: its preset is post-training, every other one QAT
        assert isinstance(callback, QuantizationCallback), preset
        assert callback.mode == ("ptq" if preset == "w4_gptq" else "qat"), preset
        model = tiny_bert()
        assert len(quantize_model(model, callback.recipe)) == TINY_LINEARS, preset
        weight_formats = {format_of[type(layer.weight_quantizer)] for layer in quantized_layers(model)}
        assert len(weight_formats) == 1, preset  # one format per preset, on every layer
        formats_used |= weight_formats
    assert formats_used == set(QUANTIZERS)  # each registered format is reachable as quant=<preset>
    assert not compose_cfg(["quant=none"]).quant  # empty: the runner builds no callback


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["quant=int8", "quant.config.default.weight.params.frac_width=65"],
         "quant.config.default.weight: frac_width=65: must be an integer in [0, 8]"),
        (["quant=int8", "quant.config.default.weight.format=int8"],
         "quant.config.default.weight: format='int8': unknown quantization format"),
        (["quant=int8", "quant.config.default.weight.format=integr"],
         "quant.config.default.weight: format='integr': unknown quantization format (valid: "),
        (["quant=int8", "quant.mode=qta"], "quant.mode='qta': must be one of qat, ptq"),
        (["quant=int8", "+quant.config.layers.bert.encoder.layer.9.output.dense={weight: {format: log, params: {width: 4}}}"],
         "quant.config.bert.encoder.layer.9.output.dense: matches no linear layer"),
        (["quant=block_fp", "quant.config.default.weight.params.width=0"],
         "quant.config.default.weight: width=0: must be an integer in [2, 32]"),
        (["quant=int8", "+quant.config.layers.classifier.weight.params.width=4"],
         "quant.config.classifier.weight={'params': {'width': 4}}: expected {format: ..., params: {...}} or null"),
    ]
)  # fmt: skip
def test_bad_configs_fail_before_training(compose_cfg, tmp_path, overrides, message):
    with pytest.raises(ConfigError) as info:
        run(compose_cfg(overrides))
    assert message in str(info.value)
    assert not (tmp_path / "run" / "checkpoints").exists(), "nothing may train"


def test_command_line_error_is_one_line(tiny_imdb_dir, cache_dir, tmp_path):
    command = [
        sys.executable, "train.py", "model=tiny_random", "logger=none", "trainer=cpu", f"data.data_dir={tiny_imdb_dir}",
        "data.val_size=100", "data.max_length=64", f"paths.cache_dir={cache_dir}", f"hydra.run.dir={tmp_path}", "quant=int8",
        "quant.config.default.data_in.params.frac_width=-1",
    ]  # fmt: skip
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert lines == [
        "error: quant.config.default.data_in: frac_width=-1: must be an integer in [0, 8] (width=8; frac_above_width: true for chop's grid inside (-1, 1))"
    ]


def test_quantize_method_and_state_dict_round_trip():
    callback = QuantizationCallback(
        {"linear": {"config": {"name": "integer", "data_in_width": 8, "weight_width": 8}}}
    )
    state = callback.state_dict()
    assert state == {"mode": "qat", "quantized": False, "val_acc_before": None, "val_acc_after": None}
    other = QuantizationCallback(
        {"linear": {"config": {"name": "integer", "data_in_width": 8, "weight_width": 8}}}
    )
    other.load_state_dict({**state, "val_acc_before": 0.8})
    assert other.val_acc_before == 0.8
    module = torch.nn.Sequential(torch.nn.Linear(4, 4))
    callback.quantize(module)
    assert isinstance(module[0], QuantLinear) and callback.quantized
    with pytest.raises(ConfigError, match="quant.train_base=true: only applies to quant.mode=qat"):
        QuantizationCallback({}, mode="ptq", train_base=True)


def test_a_misspelt_format_is_named_by_its_key_with_the_closest_formats():
    from adls_lightning.errors import ConfigError
    from adls_lightning.quant.quantizers import QUANTIZERS
    from adls_lightning.quant.recipe import OperandRecipe

    with pytest.raises(ConfigError) as info:
        OperandRecipe(format="integr")
    assert str(info.value) == (
        f"format='integr': unknown quantization format (valid: {', '.join(QUANTIZERS)}) "
        "(did you mean integer or scaled_integer?)"
    )
