"""``benchmarks/bench_inference.py --tiny``, smallest sizes, in a subprocess (as a user runs it): every variant has
a row, and the fp32 variants (torch eager, ours, ONNX Runtime) predict the same labels on the test reviews -- ONNX
Runtime's is a separate runtime executing the exported graph, so this checks the benchmark compares like with like.
``--ckpt`` of a run's checkpoint scores it on the run's recorded test split: the run's own ``test/acc``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import TINY_OVERRIDES, train_run

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "bench_inference.py"
FAKE_QUANT, SCALED_INT8 = "fake-quant int8 (scaled)", "ours int8 (scaled, static)"
VARIANTS = (
    "torch eager fp32",
    "ours fp32",
    "torch bf16",
    "torch int8 (dynamic)",
    "ORT fp32",
    "ORT int8",
    "MXINT8 packed",
    FAKE_QUANT,
    SCALED_INT8,
)
FP32 = ("torch eager fp32", "ours fp32", "ORT fp32")
ROWS = 60  # enough reviews that a tiny random model's labels are mixed (it is tuned to give input-dependent ones)


def test_tiny_run_has_every_variant_and_fp32_agrees(tmp_path, tiny_imdb_dir, cache_dir):
    out = tmp_path / "result.json"
    figure = tmp_path / "inference.png"
    command = [sys.executable, str(SCRIPT), "--tiny", "--batch", "2", "--tokens", "16", "--threads", "1"]
    command += ["--repeats", "2", "--accuracy-rows", str(ROWS), "--data-dir", str(tiny_imdb_dir)]
    command += ["--cache-dir", str(cache_dir), "--json", str(out), "--figure", str(figure)]
    result = subprocess.run(command, capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]

    table = [line for line in result.stdout.splitlines() if line.startswith("| ")]
    assert table[0].startswith("| variant | b2×16 t1 ms (×) | acc (60) | agree |")
    for name in VARIANTS:
        assert sum(line.startswith(f"| {name}") for line in table) == 1, name
    assert "GEMM 384->1536 forward, 32 rows, 1 thread(s): aten" in result.stdout
    assert "peak estimate" in result.stdout
    assert figure.stat().st_size > 0

    data = json.loads(out.read_text())
    variants = {v["name"]: v for v in data["variants"]}
    assert set(variants) == set(VARIANTS)
    assert data["accuracy_rows"] == ROWS
    for name in VARIANTS:
        assert variants[name]["ms"]["b2×16 t1"] > 0
    for name in FP32:
        assert variants[name]["agree"] == 1.0, name  # same label as torch eager on every review
        assert variants[name]["accuracy"] == variants["torch eager fp32"]["accuracy"]
    # the labels are input-dependent, else "agree" would hold trivially
    assert variants["torch eager fp32"]["top_label_share"] < 1.0
    # the int8 graph computes on the fake-quantized model's integer grid (logits within ~1e-6 on this model,
    # tests/test_export_int8.py): the same label on every review, so the same accuracy
    against = data["int8_vs_fake_quant"]
    assert against["accuracy_difference"] == 0.0 and against["agree"] == 1.0
    assert 0 <= against["median_abs_logit_difference"] <= against["max_abs_logit_difference"] < 1e-5
    assert variants[SCALED_INT8]["accuracy"] == variants[FAKE_QUANT]["accuracy"]
    assert (
        f"{SCALED_INT8} vs {FAKE_QUANT}: accuracy +0.00 pt, same label on 100.0% of the {ROWS} reviews"
        in (result.stdout)
    )


def test_a_runs_checkpoint_is_scored_on_the_runs_own_test_split(tmp_path, tiny_imdb_dir, cache_dir):
    """--ckpt in a run folder, no --overrides: the accuracy is on the run's recorded test split (its 40 rows of 24
    tokens of the tiny data), so it is the run's test/acc -- not experiment=cpu's data (256 tokens of IMDb)."""
    run = tmp_path / "run"
    overrides = [
        "model/lora=none",
        "trainer.max_epochs=1",
        "trainer.precision=32-true",
        "data.train_size=48",
        "data.val_size=16",
        "data.test_size=40",
        "data.max_length=24",
    ]
    metrics = train_run(run, overrides, tiny_imdb_dir, cache_dir)
    # the record Hydra writes beside a train.py run (train_run runs in this process, without Hydra's job)
    recorded = [*TINY_OVERRIDES, f"data.data_dir={tiny_imdb_dir}", f"paths.cache_dir={cache_dir}", *overrides]
    (run / ".hydra").mkdir(exist_ok=True)
    (run / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in recorded))
    ckpt = next((run / "checkpoints").glob("best-*.ckpt"))
    out = tmp_path / "bench.json"
    command = [
        sys.executable,
        str(SCRIPT),
        "--ckpt",
        str(ckpt),
        "--batch",
        "1",
        "--tokens",
        "16",
        "--threads",
        "1",
    ]
    command += ["--repeats", "1", "--accuracy-rows", "40", "--quant-overrides", "--json", str(out)]
    result = subprocess.run(command, capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    variants = {v["name"]: v for v in json.loads(out.read_text())["variants"]}
    for name in ("torch eager fp32", "ORT fp32"):
        assert variants[name]["accuracy"] == pytest.approx(metrics["test/acc"], abs=1e-6), name
