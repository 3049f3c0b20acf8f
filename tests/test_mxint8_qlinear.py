"""QLinearPacked, pack_linear_layers and the quant=mxint8_packed callback."""

from __future__ import annotations

import io

import lightning as L
import peft
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from adls_lightning.callbacks.mxint8_packed import MXInt8PackedEvaluation
from adls_lightning.errors import ConfigError
from adls_lightning.mxint8 import (
    FUSED_MAX_ROWS,
    QLinearPacked,
    dequantize_reference,
    module_bytes,
    pack_linear_layers,
    quantize_reference,
    restore_layers,
)

LORA_TARGETS = ["query", "key", "value", "output.dense", "intermediate.dense"]


def tiny_lora_bert(bert: torch.nn.Module) -> peft.PeftModel:
    model = peft.get_peft_model(
        bert,
        peft.LoraConfig(
            task_type="SEQ_CLS", r=4, target_modules=LORA_TARGETS, modules_to_save=["classifier", "pooler"]
        ),
    )
    with torch.no_grad():  # B is zero-initialised: make the adapters matter
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.05)
    return model.eval()


def batch() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return {"input_ids": torch.randint(0, 100, (4, 12), generator=gen), "attention_mask": torch.ones(4, 12)}


def linear_layer(in_features=64, out_features=48, bias=True) -> nn.Linear:
    torch.manual_seed(2)
    return nn.Linear(in_features, out_features, bias=bias)


# ---------------------------------------------------------------------------------------------
# QLinearPacked


def test_packed_weight_is_the_only_non_bias_buffers_at_8_25_bits():
    packed = QLinearPacked.from_linear(nn.Linear(384, 1536), group_size=32)
    buffers = dict(packed.named_buffers())
    assert set(buffers) == {"weight_mantissa", "weight_scale"}
    assert buffers["weight_mantissa"].dtype == torch.int8 and buffers["weight_mantissa"].shape == (1536, 384)
    assert buffers["weight_scale"].dtype == torch.uint8 and buffers["weight_scale"].shape == (1536, 12)
    assert [name for name, _ in packed.named_parameters()] == ["bias"]
    stored_bits = 8 * sum(b.numel() * b.element_size() for b in buffers.values())
    assert stored_bits / (1536 * 384) == 8.25
    assert packed.packed_weight_bytes() * 8 / (1536 * 384) == 8.25


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_is_linear_with_the_dequantized_weight(dtype):
    """The dequantize + matmul route (more rows than the fused kernel takes) is F.linear bit for bit."""
    linear = linear_layer()
    packed = QLinearPacked.from_linear(linear)
    x = torch.randn(5, FUSED_MAX_ROWS // 4 + 1, 64).to(dtype)
    assert not packed.uses_fused_kernel(x)
    weight = dequantize_reference(*quantize_reference(linear.weight.detach(), 32), 32, dtype)
    expected = F.linear(x, weight, linear.bias.detach().to(dtype))
    out = packed(x)
    assert out.dtype == dtype
    assert torch.equal(out, expected)
    # and it is close to the float layer (MXINT8 error only)
    torch.testing.assert_close(packed(x.float()), linear(x.float()), atol=0.05, rtol=0.05)


def test_no_bias_and_input_gradients():
    packed = QLinearPacked.from_linear(linear_layer(bias=False))
    assert packed.bias is None
    x = torch.randn(3, 64, requires_grad=True)
    packed(x).sum().backward()
    expected = dequantize_reference(packed.weight_mantissa, packed.weight_scale, 32).sum(0)
    torch.testing.assert_close(x.grad, expected.expand(3, 64))


def test_to_linear_round_trip_is_lossless_after_the_first_quantization():
    packed = QLinearPacked.from_linear(linear_layer())
    linear = packed.to_linear()
    assert isinstance(linear, nn.Linear) and torch.equal(linear.bias, packed.bias)
    repacked = QLinearPacked.from_linear(linear)
    assert torch.equal(repacked.weight_mantissa, packed.weight_mantissa)
    assert torch.equal(repacked.weight_scale, packed.weight_scale)


def test_state_dict_save_and_load():
    packed = QLinearPacked.from_linear(linear_layer(), group_size=16)
    buffer = io.BytesIO()
    torch.save(packed.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    assert set(state) == {"weight_mantissa", "weight_scale", "bias"}
    fresh = QLinearPacked(64, 48, group_size=16)
    assert not torch.equal(fresh.weight_mantissa, packed.weight_mantissa)
    fresh.load_state_dict(state)
    x = torch.randn(2, 64)
    assert torch.equal(fresh(x), packed(x))
    with pytest.raises(RuntimeError, match="size mismatch"):
        QLinearPacked(64, 48, group_size=32).load_state_dict(state)


def test_group_size_must_divide_in_features():
    with pytest.raises(ValueError, match="group_size=32 must be a positive divisor of in_features=40"):
        QLinearPacked.from_linear(nn.Linear(40, 8))


def test_compiled_fullgraph_model_matches_eager():
    torch.manual_seed(3)
    model = nn.Sequential(
        QLinearPacked.from_linear(nn.Linear(64, 128)),
        nn.GELU(),
        QLinearPacked.from_linear(nn.Linear(128, 16)),
    )
    x = torch.randn(8, 64)
    compiled = torch.compile(model, fullgraph=True)
    torch.testing.assert_close(compiled(x), model(x))
    torch.testing.assert_close(compiled(x.bfloat16()), model(x.bfloat16()))


# ---------------------------------------------------------------------------------------------
# pack_linear_layers


def test_pack_linear_layers_swaps_every_linear_but_the_classifier_and_restores(tiny_bert):
    model = tiny_bert()
    inputs = batch()
    with torch.no_grad():
        before = model(**inputs).logits
    originals = {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    # 2 layers x (query, key, value, attention.output.dense, intermediate.dense, output.dense) + pooler + classifier
    assert len(originals) == 2 * 6 + 2
    swaps = pack_linear_layers(model, group_size=32)
    assert len(swaps) == 13
    assert isinstance(model.classifier, nn.Linear)
    assert sum(isinstance(m, nn.Linear) for m in model.modules()) == 1
    assert sum(isinstance(m, QLinearPacked) for m in model.modules()) == 13
    with torch.no_grad():
        after = model(**inputs).logits
    assert not torch.equal(after, before)
    torch.testing.assert_close(after, before, atol=0.02, rtol=0.02)
    restore_layers(swaps)
    assert {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)} == originals
    with torch.no_grad():
        assert torch.equal(model(**inputs).logits, before)


def test_pack_rejects_an_indivisible_layer_before_swapping_anything(tiny_bert):
    model = tiny_bert()
    with pytest.raises(ValueError, match="group_size=48 does not divide in_features=32 of layer"):
        pack_linear_layers(model, group_size=48)
    assert not any(isinstance(m, QLinearPacked) for m in model.modules())


def test_pack_merges_lora_and_leaves_the_peft_model_intact(tiny_bert):
    model = tiny_lora_bert(tiny_bert())
    inputs = batch()
    with torch.no_grad():
        before = model(**inputs).logits
    query = model.base_model.model.bert.encoder.layer[0].attention.self.query
    # the merged weight, computed by hand: W + scaling * B @ A
    merged = (
        query.base_layer.weight
        + (query.lora_B["default"].weight @ query.lora_A["default"].weight) * (query.scaling["default"])
    )
    expected_mantissa, expected_scale = quantize_reference(merged.detach(), 32)
    swaps = pack_linear_layers(model, group_size=32)
    assert not any(name.endswith(("lora_A", "lora_B")) for name, _ in model.named_modules())
    packed_query = model.base_model.model.bert.encoder.layer[0].attention.self.query
    assert isinstance(packed_query, QLinearPacked)
    assert torch.equal(packed_query.weight_mantissa, expected_mantissa)
    assert torch.equal(packed_query.weight_scale, expected_scale)
    # 2 x 6 LoRA-wrapped or plain encoder linears + the pooler's two copies (original and modules_to_save)
    assert len(swaps) == 14
    with torch.no_grad():
        torch.testing.assert_close(model(**inputs).logits, before, atol=0.02, rtol=0.02)
    restore_layers(swaps)
    assert model.base_model.model.bert.encoder.layer[0].attention.self.query is query
    assert not query.merged
    with torch.no_grad():
        assert torch.equal(model(**inputs).logits, before)


# ---------------------------------------------------------------------------------------------
# The callback (quant=mxint8_packed)


class TinyClassifier(L.LightningModule):
    """A LightningModule over the tiny BERT, shaped like adls_lightning.module.SequenceClassifier."""

    def __init__(self, bert: torch.nn.Module, lora: bool) -> None:
        super().__init__()
        self.model = (tiny_lora_bert(bert) if lora else bert).train()
        self.packed_during: dict[str, set[bool]] = {}

    def _note_layer(self, stage: str) -> None:
        query = next(m for n, m in self.model.named_modules() if n.endswith("layer.0.attention.self.query"))
        self.packed_during.setdefault(stage, set()).add(isinstance(query, QLinearPacked))

    def _loss_acc(self, batch):
        ids, labels = batch
        logits = self.model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
        return F.cross_entropy(logits, labels), (logits.argmax(-1) == labels).float().mean()

    def training_step(self, batch, batch_idx):
        self._note_layer("fit")
        return self._loss_acc(batch)[0]

    def validation_step(self, batch, batch_idx):
        self._note_layer(self.trainer.state.fn.value)
        self.log("val/acc", self._loss_acc(batch)[1])

    def test_step(self, batch, batch_idx):
        self._note_layer(self.trainer.state.fn.value)
        self.log("test/acc", self._loss_acc(batch)[1])

    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-3)


def loader() -> DataLoader:
    gen = torch.Generator().manual_seed(4)
    return DataLoader(
        TensorDataset(torch.randint(0, 100, (16, 10), generator=gen), torch.arange(16) % 2), batch_size=8
    )


@pytest.mark.slow
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_callback_packs_only_for_final_validate_and_test(tmp_path, lora, tiny_bert):
    module = TinyClassifier(tiny_bert(), lora)
    callback = MXInt8PackedEvaluation(group_size=32)
    checkpoint = ModelCheckpoint(dirpath=tmp_path, monitor="val/acc", mode="max")
    trainer = L.Trainer(
        max_epochs=1,
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[checkpoint, callback],
        default_root_dir=tmp_path,
    )
    trainer.fit(module, train_dataloaders=loader(), val_dataloaders=loader())
    float_bytes = module_bytes(module)
    trainer.validate(module, dataloaders=loader(), ckpt_path="best", verbose=False)
    trainer.test(module, dataloaders=loader(), ckpt_path="best", verbose=False)

    assert module.packed_during == {"fit": {False}, "validate": {True}, "test": {True}}
    assert not any(isinstance(m, QLinearPacked) for m in module.modules())  # restored afterwards
    assert module_bytes(module) == float_bytes

    report = callback.report()
    assert report["mxint8/packed_layers"] == (14 if lora else 13)
    assert report["mxint8/bits_per_weight"] == 8.25
    # the packed layers' float32 weights shrink by (32 - 8.25) / 32
    assert report["mxint8/linear_weight_saving"] == pytest.approx(1 - 8.25 / 32)
    assert report["mxint8/model_bytes_float"] == float_bytes
    assert 0 < report["mxint8/model_saving"] < report["mxint8/linear_weight_saving"]
    assert report["mxint8/val_acc_float"] == pytest.approx(float(checkpoint.best_model_score))
    assert 0 <= report["mxint8/val_acc_packed"] <= 1


def bare_trainer(tmp_path, callbacks=()) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=list(callbacks),
        default_root_dir=tmp_path,
    )


def test_evaluation_only_measures_the_float_score_before_packing(tmp_path, tiny_bert):
    """No fit, so no earlier validation to read: the float model is validated on the same data before packing,
    and ``mxint8/val_acc_float`` is its score (a number, not nan), the packed score the run's own validation."""

    class RecordsMode(TinyClassifier):
        def validation_step(self, batch, batch_idx):
            self.modes.add(self.model.training)
            return super().validation_step(batch, batch_idx)

    torch.manual_seed(0)
    module = RecordsMode(tiny_bert(), lora=False)
    module.modes = set()
    (float_only,) = bare_trainer(tmp_path / "float").validate(module, dataloaders=loader(), verbose=False)
    callback = MXInt8PackedEvaluation(group_size=32)
    trainer = bare_trainer(tmp_path / "packed", [callback])
    (packed,) = trainer.validate(module, dataloaders=loader(), verbose=False)

    report = callback.report()
    assert report["mxint8/val_acc_float"] == float_only["val/acc"]
    assert report["mxint8/val_acc_packed"] == packed["val/acc"]
    assert module.packed_during["validate"] == {False, True}  # the float pass, then the packed one
    assert module.modes == {False}  # both passes in eval mode: the bare Trainer left the loop's mode alone
    assert module.trainer is trainer  # handed back
    assert not any(isinstance(m, QLinearPacked) for m in module.modules())


def test_callback_rejects_bad_config_before_training(tiny_bert):
    with pytest.raises(ConfigError, match="quant.group_size=0"):
        MXInt8PackedEvaluation(group_size=0)
    with pytest.raises(ConfigError, match="quant.exclude='classifier'"):
        MXInt8PackedEvaluation(exclude="classifier")
    trainer = L.Trainer(accelerator="cpu", logger=False, max_epochs=1)
    with pytest.raises(
        ConfigError, match="quant.group_size=48: group_size=48 does not divide in_features=32"
    ):
        MXInt8PackedEvaluation(group_size=48).setup(trainer, TinyClassifier(tiny_bert(), lora=False), "fit")
