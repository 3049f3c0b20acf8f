"""A per-layer mixed assignment as an export folder (adls_lightning/export/mixed.py): written, reloaded from the
folder alone with each layer in its runtime, recognised by the export's folder loading, and refused when damaged."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from adls_lightning.errors import ConfigError
from adls_lightning.export import WEIGHTS_FILE
from adls_lightning.export.folder import check_folder, load_folder
from adls_lightning.export.mixed import MIXED_CONFIG_FILE, load_mixed
from adls_lightning.export.mixed_save import save_mixed
from adls_lightning.search import cost

UP, DOWN = "bert.encoder.layer.0.intermediate.dense", "bert.encoder.layer.0.output.dense"


def every_choice(model) -> dict[str, str]:
    names = list(cost.linear_layers(model))
    return {
        "bert.encoder.layer.0.attention.self.query": "bf16",
        "bert.encoder.layer.0.attention.self.key": "int8",
        "bert.encoder.layer.0.attention.self.value": "mxint8",
        UP: "w50",
        DOWN: "w50",
        "bert.encoder.layer.1.intermediate.dense": "int8",
        names[-1]: "int8",  # the classifier
    }


def test_reloaded_folder_computes_what_the_mixed_model_computes(tiny_bert, tmp_path):
    model = tiny_bert(intermediate_size=64)
    assignment = every_choice(model)
    written = save_mixed(model, assignment, tmp_path / "mix", inputs={"task": "imdb", "max_length": 16})
    loaded = load_mixed(tmp_path / "mix")
    # each layer rebuilt in its runtime, a width at its smaller shape
    assert isinstance(loaded.get_submodule("bert.encoder.layer.0.attention.self.query"), cost.Bf16Linear)
    assert "quantized" in type(loaded.get_submodule("bert.encoder.layer.0.attention.self.key")).__module__
    assert type(loaded.get_submodule("bert.encoder.layer.0.attention.self.value")).__name__ == "QLinearPacked"
    assert loaded.get_submodule(UP).out_features == 32 and loaded.get_submodule(DOWN).in_features == 32
    ids = torch.randint(0, 100, (3, 12), generator=torch.Generator().manual_seed(1))
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    with torch.inference_mode():
        expected = written(**inputs).logits
        got = loaded(**inputs).logits
        reference = cost.apply_assignment(model, assignment)(**inputs).logits  # built again, another way
        fp32 = model(**inputs).logits
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    torch.testing.assert_close(got, reference, rtol=0, atol=0)
    assert not torch.equal(got, fp32)  # the mix is not the fp32 model
    config = json.loads((tmp_path / "mix" / MIXED_CONFIG_FILE).read_text())
    assert config["layers"][UP] == {"choice": "w50", "in_features": 32, "out_features": 32, "bias": True}
    assert json.loads((tmp_path / "mix" / "config.json").read_text())["adls_inputs"]["max_length"] == 16
    # int8 weights are stored as int8 (a quarter of fp32), bf16 as bfloat16
    tensors = load_file(str(tmp_path / "mix" / WEIGHTS_FILE))
    assert tensors["bert.encoder.layer.0.attention.self.key.weight_int8"].dtype == torch.int8
    assert tensors["bert.encoder.layer.0.attention.self.query.weight"].dtype == torch.bfloat16


def test_export_folder_loading_recognises_the_mixed_kind(tiny_bert, tmp_path):
    model = tiny_bert()
    save_mixed(model, {"classifier": "int8"}, tmp_path / "mix")
    assert check_folder(tmp_path / "mix").kind == "mixed"
    loaded = load_folder(tmp_path / "mix")
    assert "quantized" in type(loaded.get_submodule("classifier")).__module__


def test_damaged_mixed_folder_is_one_line(tiny_bert, tmp_path):
    model = tiny_bert()
    folder = tmp_path / "mix"
    save_mixed(model, {"classifier": "int8"}, folder)
    config = json.loads((folder / MIXED_CONFIG_FILE).read_text())
    config["layers"]["classifier"]["choice"] = "fp4"
    (folder / MIXED_CONFIG_FILE).write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=r"layer classifier: choice 'fp4' \(valid: fp32"):
        check_folder(folder)
    config["layers"]["classifier"]["choice"] = "int8"
    (folder / MIXED_CONFIG_FILE).write_text(json.dumps(config))
    tensors = load_file(str(folder / WEIGHTS_FILE))
    del tensors["classifier.weight_scale"]
    save_file(tensors, str(folder / WEIGHTS_FILE))
    with pytest.raises(ConfigError, match="no classifier.weight_scale for the int8 layer classifier"):
        load_mixed(folder)
    with pytest.raises(ConfigError, match="not a linear layer"):
        save_mixed(model, {"bert.nothing": "int8"}, tmp_path / "other")
