"""Structured pruning + int8 in one artifact, made fast (issue 58): the ``format=onnx int8=scaled`` graph of a
structurally pruned, scaled-int8 model, in the session the project runs it in (``onnx_session``: full graph
optimization less ``SkipLayerNormFusion``) still computes the fake-quantized model's logits; the optimized graph has the kernels the speed-up comes from; and
``benchmarks/bench_deploy.py --tiny`` runs as documented."""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

from adls_lightning.export import int8 as int8_export
from adls_lightning.export import onnx as onnx_export
from adls_lightning.export.compressed import _quant_recipe
from adls_lightning.prune import StructuredPruner
from adls_lightning.quant import quantize_model
from adls_lightning.quant.scaled import calibrate
from tests.helpers import SHORT_RUN, TINY, compose_config, train_run

ROOT = Path(__file__).resolve().parent.parent
LAYERS, HEADS, FFN = 2, 4, 128
# 2 layers x (query, key, value, attention output, intermediate, output) + pooler + classifier
LINEARS = 6 * LAYERS + 2
# as tests/test_export_int8.py: the same integer grid, only float summation order differs (|Δ| ~1e-9 measured)
TIGHT = 1e-5


@pytest.fixture(scope="module")
def compound(tiny_bert, tmp_path_factory):
    """A tiny BERT with half its heads and FFN neurons removed, quantized by ``quant=int8_scaled``'s recipe and
    calibrated, and its int8 graph."""
    model = tiny_bert(seed=1, num_attention_heads=HEADS, intermediate_size=FFN, hidden_size=64)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if parameter.dim() == 2 and "embeddings" not in name:
                parameter.normal_(0, parameter.shape[1] ** -0.5)
    StructuredPruner(heads=0.5, neurons=0.5, method="l1").prune(model)
    cfg = compose_config("train", [*TINY, "quant=int8_scaled"])
    quantize_model(model, _quant_recipe(cfg.quant.config, "quant.config"))
    generator = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, model.config.vocab_size, (4, 20), generator=generator) for _ in range(3)]
    calibrate(model, batches, lambda ids: model(input_ids=ids), len(batches))
    model.eval()
    folder = tmp_path_factory.mktemp("compound")
    path = folder / int8_export.INT8_SCALED_FILE
    int8_export.export_int8_graph(model, path)
    return model, path


def test_pruned_sizes_reach_the_graph(compound):
    model, path = compound
    layer = model.bert.encoder.layer[0]
    # half of 4 heads of 16 dims, half of 128 neurons: the int8 weights hold the pruned shapes
    assert layer.attention.self.query.linear.weight.shape == (HEADS // 2 * 16, 64)
    assert layer.intermediate.dense.linear.weight.shape == (FFN // 2, 64)
    stored = {init.name: tuple(init.dims) for init in onnx.load(str(path)).graph.initializer}
    assert stored["int8.bert.encoder.layer.0.intermediate.dense.w"] == (64, FFN // 2)  # MatMul's [in, out]
    assert stored["int8.bert.encoder.layer.0.attention.self.query.w"] == (64, HEADS // 2 * 16)


def test_optimized_session_computes_the_fake_quantized_logits(compound):
    model, path = compound
    session = onnx_export.onnx_session(path)
    generator = torch.Generator().manual_seed(5)
    for rows, tokens in [(1, 9), (8, 32), (3, 17)]:
        ids = torch.randint(0, model.config.vocab_size, (rows, tokens), generator=generator)
        mask = torch.ones_like(ids)
        mask[1:, tokens // 3 :] = 0  # padded rows: the mask reaches the graph's attention
        inputs = {"input_ids": ids, "attention_mask": mask}
        with torch.inference_mode():
            expected = model(**inputs).logits.numpy()  # the fake-quantized model, SDPA attention
        actual = onnx_export.onnx_logits(session, inputs)
        np.testing.assert_allclose(actual, expected, rtol=0, atol=TIGHT, err_msg=f"{rows}x{tokens}")
    # and the export's own self-check agrees
    assert int8_export.check_int8(path, model).max_abs_diff < TIGHT


def ops(path: Path) -> Counter:
    return Counter(node.op_type for node in onnx.load(str(path)).graph.node)


def test_session_runs_integer_kernels_and_plain_layer_norm(compound, tmp_path):
    _, path = compound
    optimized = tmp_path / "optimized.onnx"
    onnx_export.onnx_session(path, optimized_path=optimized)
    kernels = ops(optimized)
    assert kernels["MatMulIntegerToFloat"] + kernels["QGemm"] == LINEARS
    assert kernels["DequantizeLinear"] == 0
    # SkipLayerNormFusion is off: every LayerNorm (embeddings + 2 per layer) stays LayerNormalization
    assert kernels["SkipLayerNormalization"] == 0
    assert kernels["LayerNormalization"] == 1 + 2 * LAYERS
    # ONNX Runtime's defaults would fuse them: the setting is what keeps them apart
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / "default.onnx")
    options.log_severity_level = 3
    ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    assert ops(tmp_path / "default.onnx")["SkipLayerNormalization"] == 2 * LAYERS


def test_bench_deploy_tiny_prints_each_ratio():
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    command = [sys.executable, str(ROOT / "benchmarks" / "bench_deploy.py"), "--tiny", "--repeats", "2"]
    result = subprocess.run(
        [*command, "--rows", "0"], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert "avx" in out.split("\n")[0] or "flags:" in out.split("\n")[0]
    assert "Machine limit" in out and "int8 (torch._int_mm)" in out
    for batch in (1, 8):
        assert f"structured + int8 artifact vs torch eager fp32 (unpruned), batch {batch}: " in out
    assert "artifact: 14 int8 linears" in out


def test_bench_deploy_measures_a_compound_runs_artifact(tmp_path, fine_tuned, tiny_imdb_dir, cache_dir):
    """The compound run as documented (``prune=structured_0.5 quant=int8_scaled prune.distill=true`` from a
    fine-tuned model), then ``bench_deploy.py --ckpt``: the artifact's accuracy on the run's test reviews is the
    run's own ``test/acc`` (same integers; only float summation order differs)."""
    compound = ["model/lora=none", f"init_ckpt={fine_tuned}", "model.optimizer.lr=1e-4"]
    compound += ["prune=structured_0.5", "quant=int8_scaled", "prune.distill=true"]
    metrics = train_run(tmp_path / "run", [*SHORT_RUN, *compound], tiny_imdb_dir, cache_dir)
    ckpt = next((tmp_path / "run" / "checkpoints").glob("best-*.ckpt"))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    command = [sys.executable, str(ROOT / "benchmarks" / "bench_deploy.py"), "--ckpt", str(ckpt)]
    command += ["--dense", str(fine_tuned), "--batch", "1", "--tokens", "16", "--repeats", "2"]
    command += ["--rows", "40", "--agree-rows", "40"]  # SHORT_RUN's test split
    result = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    line = next(x for x in result.stdout.splitlines() if x.startswith("accuracy on 40 test reviews"))
    artifact = float(line.split("artifact ")[1].split()[0])
    assert artifact == pytest.approx(metrics["test/acc"], abs=1 / 40 + 1e-9), line
    assert "label on 100.0% of the first 40" in line
