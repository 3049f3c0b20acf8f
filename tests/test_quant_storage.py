"""``weight_storage``: the storage every run records (``quant/avg_weight_bits``, ``quant/weight_bytes``), of float,
quantized and packed MXINT8 models alike, and the ``quant=mxint8_packed`` callback reporting it of the packed model."""

from __future__ import annotations

import lightning as L
import peft
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from adls_lightning.callbacks.mxint8_packed import MXInt8PackedEvaluation
from adls_lightning.mxint8 import QEmbeddingPacked, QLinearPacked, pack_linear_layers
from adls_lightning.quant import quantization_report, quantize_model, weight_storage
from tests.helpers import linear_layers

# tiny_bert's shapes (hidden 32, intermediate 64, 2 layers): weight elements of each linear layer
SIZES = linear_layers(hidden=32, intermediate=64, layers=2)


def stored_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def test_float_model_is_32_bits_and_4_bytes_per_parameter(tiny_bert):
    model = tiny_bert()
    storage = weight_storage(model)
    assert storage == {
        "quant/avg_weight_bits": 32.0,
        "quant/weight_bytes": 4.0 * sum(p.numel() for p in model.parameters()),
    }


def test_packed_model_counts_its_packed_tensors(tiny_bert):
    model = tiny_bert()
    pack_linear_layers(model, group_size=32, exclude=("classifier",))
    packed = [m for m in model.modules() if isinstance(m, QLinearPacked)]
    assert len(packed) == len(SIZES) - 1
    # independently: the int8 mantissas and uint8 exponents as stored, the classifier's float32 weight
    packed_bytes = stored_bytes(t for m in packed for t in (m.weight_mantissa, m.weight_scale))
    packed_weights = sum(m.weight_mantissa.numel() for m in packed)
    classifier = model.classifier.weight.numel()
    expected_bits = (8 * packed_bytes + 32 * classifier) / (packed_weights + classifier)
    # every parameter (biases, embeddings, norms, the classifier) at its dtype, plus the packed weights' buffers
    expected_bytes = stored_bytes(model.parameters()) + packed_bytes

    storage = weight_storage(model)
    assert storage["quant/avg_weight_bits"] == pytest.approx(expected_bits)
    assert storage["quant/weight_bytes"] == expected_bytes
    # the same as the hand-written shapes give: 8 + 8/32 bits for a packed weight, 32 for the classifier's
    packed_sizes = sum(n for name, n in SIZES.items() if name != "classifier")
    assert storage["quant/avg_weight_bits"] == pytest.approx(
        (8.25 * packed_sizes + 32 * SIZES["classifier"]) / sum(SIZES.values())
    )
    # the full report gives the same two numbers
    report = quantization_report(model)
    assert {key: report[key] for key in storage} == storage


def test_group_size_sets_the_shared_exponent_bits(tiny_bert):
    model = tiny_bert()
    pack_linear_layers(model, group_size=16, exclude=("classifier", "pooler"))
    packed_sizes = sum(n for name, n in SIZES.items() if name not in ("classifier", "bert.pooler.dense"))
    float_sizes = SIZES["classifier"] + SIZES["bert.pooler.dense"]
    assert weight_storage(model)["quant/avg_weight_bits"] == pytest.approx(
        ((8 + 8 / 16) * packed_sizes + 32 * float_sizes) / sum(SIZES.values())
    )


def test_packed_embedding_table_counts_at_its_packed_bytes(tiny_bert):
    model = tiny_bert()
    embeddings = model.bert.embeddings
    table = embeddings.word_embeddings
    packed = QEmbeddingPacked.from_embedding(table, group_size=32)
    embeddings.word_embeddings = packed
    storage = weight_storage(model)
    assert storage["quant/avg_weight_bits"] == 32.0  # an embedding is no linear layer
    assert storage["quant/weight_bytes"] == stored_bytes(model.parameters()) + stored_bytes(
        (packed.weight_mantissa, packed.weight_scale)
    )


def test_quantized_layers_count_at_their_quantizers_widths(tiny_bert):
    model = tiny_bert()
    quantize_model(model, {"linear": {"config": {"name": "mxint8"}}, "classifier": {"bias_name": None}})
    assert weight_storage(model)["quant/avg_weight_bits"] == 8.25


def test_lora_adapters_count_and_peft_copies_do_not(tiny_bert):
    model = peft.get_peft_model(
        tiny_bert(),
        peft.LoraConfig(
            task_type="SEQ_CLS", r=4, target_modules=["query", "value"], modules_to_save=["classifier"]
        ),
    )
    adapters = sum(p.numel() for name, p in model.named_parameters() if "lora_" in name)
    storage = weight_storage(model)
    assert storage["quant/avg_weight_bits"] == 32.0
    assert storage["quant/weight_bytes"] == 4.0 * (
        sum(p.numel() for p in tiny_bert().parameters()) + adapters
    )


class RecordsPackedStorage(L.LightningModule):
    """Validates the tiny BERT, noting :func:`weight_storage` of itself while its layers are packed."""

    def __init__(self, bert: nn.Module) -> None:
        super().__init__()
        self.model = bert
        self.packed_storage: dict[str, float] = {}

    def validation_step(self, batch, batch_idx):
        ids, labels = batch
        if any(isinstance(m, QLinearPacked) for m in self.modules()):
            self.packed_storage = weight_storage(self)
        logits = self.model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
        self.log("val/acc", (logits.argmax(-1) == labels).float().mean())


def test_callback_reports_the_verb_of_the_packed_model(tmp_path, tiny_bert):
    module = RecordsPackedStorage(tiny_bert())
    callback = MXInt8PackedEvaluation(group_size=32)
    trainer = L.Trainer(
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[callback],
        default_root_dir=tmp_path,
    )
    data = TensorDataset(
        torch.randint(0, 100, (8, 10), generator=torch.Generator().manual_seed(4)), torch.arange(8) % 2
    )
    trainer.validate(module, dataloaders=DataLoader(data, batch_size=8), verbose=False)

    report = callback.report()
    assert module.packed_storage  # validated while packed
    assert {key: report[key] for key in module.packed_storage} == module.packed_storage
    assert report["quant/avg_weight_bits"] < 32.0
    assert not any(isinstance(m, QLinearPacked) for m in module.modules())  # restored afterwards
