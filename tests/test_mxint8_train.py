"""quant=mxint8_packed through train.py's runner, and the memory report script, on the tiny configs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from adls_lightning.app.training import run
from adls_lightning.errors import ConfigError
from adls_lightning.models import build_from_config, packaged_model_dir
from tests.helpers import linear_layers

# every test here starts training runs or processes (minutes in all): `make test-fast` skips them
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent


def test_train_with_mxint8_packed_records_packed_metrics(compose_cfg, tmp_path):
    metrics = run(compose_cfg(["quant=mxint8_packed", "trainer.max_epochs=2"]))
    # tiny_random + LoRA, merged before packing (model.merge_lora_before_compress, on by default): 2 layers
    # x 6 encoder linears + the pooler (PEFT's merge leaves one copy of it)
    assert metrics["mxint8/packed_layers"] == 13
    assert metrics["mxint8/bits_per_weight"] == 8.25
    assert metrics["mxint8/linear_weight_saving"] == pytest.approx((32 - 8.25) / 32)
    # the storage every run records is the packed model's: the 13 packed layers at 8.25 bits, the classifier (left
    # out) at 32, weighted by their weights (hidden 32, intermediate 64: tiny_random's hand-written shapes)
    sizes = linear_layers(hidden=32, intermediate=64, layers=2)
    packed = sum(n for name, n in sizes.items() if name != "classifier")
    expected_bits = (8.25 * packed + 32 * sizes["classifier"]) / sum(sizes.values())
    assert metrics["quant/avg_weight_bits"] == pytest.approx(expected_bits)
    saved = (32 - 8.25) / 8 * packed  # bytes the packing saves against float32 weights
    assert metrics["quant/weight_bytes"] == pytest.approx(4 * metrics["params/total"] - saved)
    assert 0 < metrics["mxint8/model_saving"] < metrics["mxint8/linear_weight_saving"]
    # the final validation is the packed model's, and it stays close to the float model's score
    assert metrics["val/acc"] == metrics["mxint8/val_acc_packed"]
    assert abs(metrics["mxint8/val_acc_packed"] - metrics["mxint8/val_acc_float"]) <= 0.05
    assert (tmp_path / "run" / "metrics.json").is_file()


def test_evaluation_only_run_reports_a_float_score(compose_cfg, tmp_path):
    """train=false: no fit whose validation gives the float score, so it is measured before packing (issue 56:
    it was nan); the run's val/acc is the packed model's."""
    metrics = run(compose_cfg(["quant=mxint8_packed", "train=false"]))
    assert 0 <= metrics["mxint8/val_acc_float"] <= 1  # a number: nan fails both comparisons
    assert metrics["val/acc"] == metrics["mxint8/val_acc_packed"]
    assert abs(metrics["mxint8/val_acc_packed"] - metrics["mxint8/val_acc_float"]) <= 0.05


def test_indivisible_group_size_fails_before_training(compose_cfg, tmp_path):
    with pytest.raises(
        ConfigError, match=r"quant.group_size=48: group_size=48 does not divide in_features=32"
    ):
        run(compose_cfg(["quant=mxint8_packed", "quant.group_size=48"]))
    assert not (tmp_path / "run" / "checkpoints").exists(), "nothing may train"


def test_memory_report_script(tmp_path, tiny_imdb_dir):
    # a folder fine-tuned on another task (one output, as an exported STS-B model): --model loads as train.py's
    # model.backbone.name_or_path does, with a new two-way head
    model_dir = tmp_path / "tiny_bert"
    tokenizer = AutoTokenizer.from_pretrained(packaged_model_dir())
    build_from_config(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_labels=1
    ).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    command = [
        sys.executable, "scripts/mxint8_memory_report.py", "--model", str(model_dir),
        "--data", str(tiny_imdb_dir / "test.parquet"), "--samples", "16", "--max-length", "32",
    ]  # fmt: skip
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    # 2 layers x 6 linears + pooler = 13 layers; 2 x (4 x 64x64 + 2 x 64x128) + 64x64 = 69,632 weights
    assert "13 layers, 69,632 weights" in out
    assert f"fp32   {69632 * 4 / 1e6:10.3f} MB" in out
    assert f"MXINT8 {69632 * 8.25 / 8 / 1e6:10.3f} MB  (8.25 bits/weight)" in out
    assert "saving      74.2%" in out
    assert "accuracy MXINT8" in out and "caveat: the classification head is untrained" in out


def test_memory_report_from_config_reads_only_the_tokenizer_from_model(tmp_path):
    # a folder with a tokenizer and no weights is enough for --from-config (as on a machine the weights can't reach)
    tokenizer_dir = tmp_path / "tokenizer_only"
    AutoTokenizer.from_pretrained(packaged_model_dir()).save_pretrained(tokenizer_dir)
    assert not list(tokenizer_dir.glob("*.safetensors"))
    command = [
        sys.executable, "scripts/mxint8_memory_report.py", "--from-config", "bert-base",
        "--model", str(tokenizer_dir),
    ]  # fmt: skip
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    # BERT-base: 12 layers x (4 x 768x768 + 2 x 768x3072) + the pooler's 768x768
    weights = 12 * (4 * 768 * 768 + 2 * 768 * 3072) + 768 * 768
    assert f"73 layers, {weights:,} weights" in result.stdout
    assert "bert-base from config (random weights)" in result.stdout
    assert f"tokenizer: {tokenizer_dir}" in result.stdout


@pytest.mark.parametrize("from_config", [True, False], ids=["from-config", "pretrained"])
def test_memory_report_refuses_a_model_it_cannot_load_in_one_line(tmp_path, from_config):
    missing = tmp_path / "no_such_model"
    command = [sys.executable, "scripts/mxint8_memory_report.py", "--model", str(missing)]
    command += ["--from-config", "bert-base"] if from_config else []
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr
    assert lines[0].startswith(f"error: --model={missing}: cannot load")
