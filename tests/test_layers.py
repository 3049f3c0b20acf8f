"""One walker, one naming: quantization, pruning and MXINT8 packing list the same layers under the same names."""

from __future__ import annotations

import re

import pytest
from peft import LoraConfig, TaskType, get_peft_model
from torch import nn

from adls_lightning.layers import name_filter
from adls_lightning.mxint8 import packable_linear_layers
from adls_lightning.prune import find_prune_targets
from adls_lightning.quant import find_linear_layers, quantize_model

EXCLUDE = r"attention\.self\.(query|key)$|classifier"


@pytest.fixture
def plain_and_lora(tiny_bert):
    plain = tiny_bert()
    expected = [
        name for name, m in plain.named_modules() if isinstance(m, nn.Linear)
    ]  # the plain model's paths
    lora = get_peft_model(
        tiny_bert(), LoraConfig(task_type=TaskType.SEQ_CLS, r=2, target_modules=["query", "value"])
    )
    return expected, lora


def _names(model, exclude=None):
    return {
        "quant": [layer.name for layer in find_linear_layers(model, name_filter(exclude=exclude))],
        "prune": [target.name for target in find_prune_targets(model, exclude=exclude)],
        # MXINT8 also packs PEFT's unused copy of the classifier (so it stops holding float weights)
        "mxint8": [
            name
            for name, _ in packable_linear_layers(model, exclude=exclude or ())
            if "original_module" not in name
        ],
    }


def test_quant_prune_and_mxint8_name_the_lora_models_layers_alike(plain_and_lora):
    expected, lora = plain_and_lora
    assert (
        len(expected) == 2 * 6 + 2
    )  # q, k, v, attention output, intermediate, output per layer; pooler, classifier
    assert _names(lora) == {"quant": expected, "prune": expected, "mxint8": expected}
    kept = [name for name in expected if not re.search(EXCLUDE, name)]
    assert len(kept) == len(expected) - 5  # 2 queries, 2 keys, the classifier
    assert _names(lora, [EXCLUDE]) == {"quant": kept, "prune": kept, "mxint8": kept}


def test_names_survive_quantization(plain_and_lora):
    expected, lora = plain_and_lora
    quantized = quantize_model(
        lora, {"by": "type", "linear": {"config": {"name": "integer", "weight_width": 8, "data_in_width": 8}}}
    )
    assert quantized == expected
    # MXINT8 cannot merge a LoRA update into a fake-quantized base, so it leaves those layers (query, value) alone
    unmerged = [name for name in expected if not name.endswith(("query", "value"))]
    assert _names(lora) == {"quant": expected, "prune": expected, "mxint8": unmerged}
