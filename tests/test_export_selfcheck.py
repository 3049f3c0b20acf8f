"""Every export checks itself (``export.json``: agreement with the run's own model, max logit difference, speedup
per batch size) and GPTQ 4-bit runs export to ONNX Runtime's ``MatMulNBits`` with the run's own codes and steps.

Expectations are computed here, another way: the packing against a numpy matmul of the dequantized weights, the
int4 graph against the logits the run itself computed on its test batches (recorded during the run), agreement
by counting labels of a tampered folder against those recorded logits."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper
from safetensors.torch import load_file, save_file

from adls_lightning.export import selfcheck
from adls_lightning.export.int4 import INT4_FILE, NBitsLayer, matmul_nbits_node, pack_4bit
from adls_lightning.export.onnx import onnx_session
from adls_lightning.runs.loading import load_checkpoint_model
from adls_lightning.tools.export import main
from tests.helpers import SHORT_RUN, call, recorded_run, train_run

GPTQ = ["model/lora=none", "model.optimizer.lr=1e-4", "quant=w4_gptq", "quant.gptq.batches=2"]
# tiny_random: 2 layers x 6 linear layers, the pooler and the classifier, all 4-bit
TINY_LINEARS = 14
# the self-check at test scale: a few tokens, two batch sizes, one round
FAST_CHECK = ["check_tokens=16", "check_batches=1,2", "check_rounds=1"]
# The int4 graph multiplies the same float weights (codes x steps) as the fake-quantized model; only the order of
# float sums differs (ONNX Runtime's blocked kernel, fused LayerNorm and attention): a few float32 ulps.
TIGHT = 1e-5


def test_pack_4bit_puts_the_first_code_in_the_low_nibble_offset_by_8():
    codes = np.array([[-7, 7, 0, 1] + [0] * 12, [3, -3] + [-1] * 14], dtype=np.int8)
    packed = pack_4bit(codes, 16)
    assert packed.shape == (2, 1, 8) and packed.dtype == np.uint8
    # (-7 + 8) = 1 low, (7 + 8) = 15 high -> 0xF1; (0 + 8) = 8 low, (1 + 8) = 9 high -> 0x98
    assert packed[0, 0, :3].tolist() == [0xF1, 0x98, 0x88]
    assert packed[1, 0, :2].tolist() == [(5 << 4) | 11, (7 << 4) | 7]


@pytest.mark.parametrize("block", [16, 32, 64])
def test_matmul_nbits_node_computes_the_dequantized_matmul(block):
    rng = np.random.default_rng(block)
    n, k = 24, 128
    codes = rng.integers(-7, 8, (n, k)).astype(np.int8)
    scales = rng.uniform(0.01, 0.1, (n, k // block)).astype(np.float32)
    bias = rng.normal(size=n).astype(np.float32)
    graph = helper.make_graph(
        [],
        "one_layer",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, None, k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
    )
    graph.initializer.append(onnx.numpy_helper.from_array(bias, "bias"))
    layer = NBitsLayer("layer", torch.from_numpy(codes), torch.from_numpy(scales), block)
    graph.node.append(matmul_nbits_node("layer", "x", "y", layer, "bias", graph))
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)]
    )
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    x = rng.normal(size=(3, 5, k)).astype(np.float32)
    weights = codes.astype(np.float64) * np.repeat(scales.astype(np.float64), block, axis=1)
    expected = x.astype(np.float64) @ weights.T + bias
    assert np.abs(session.run(None, {"x": x})[0] - expected).max() < 1e-5


def test_verdict_names_mask_only_pruning_slow_artifacts_and_formats_without_a_runtime():
    fast = {"speed": {"1": {"speedup": 2.0}, "8": {"speedup": 1.5}}}
    slow = {"speed": {"1": {"speedup": 1.04}, "8": {"speedup": 2.0}}}
    assert selfcheck.verdict(fast, [], 0, False, False) == []
    mask = selfcheck.verdict(fast, [], 12, False, False)
    assert len(mask) == 1 and mask[0].startswith("mask-only pruning: 12 layers") and "structured" in mask[0]
    assert selfcheck.verdict(fast, [], 12, True, False) == []  # structured: the layers are smaller
    (not_faster,) = selfcheck.verdict(slow, [], 0, False, False)
    assert "1.04x at batch 1" in not_faster and "batch 8" not in not_faster and "int8=scaled" in not_faster
    assert "prune=structured_0.5" in not_faster
    # the advice leaves out what the artifact already is: an int8=scaled graph, a structurally pruned run
    (int8_graph,) = selfcheck.verdict(slow, [], 0, False, True, int8_scaled=True)
    assert "int8" not in int8_graph.split("faster: ")[1] and "prune=structured_0.5" in int8_graph
    (mask_int8,) = selfcheck.verdict(fast, [], 12, False, True, int8_scaled=True)
    assert "int8" not in mask_int8.split("faster: ")[1] and "prune=structured_0.5" in mask_int8
    (pruned,) = selfcheck.verdict(slow, [], 0, True, False)
    assert "structured" not in pruned.split("faster: ")[1] and "int8=scaled" in pruned
    assert selfcheck.verdict(slow, [], 0, True, True, int8_scaled=True) == [
        "not faster than torch eager fp32 (1.04x at batch 1)"
    ]
    (minifloat,) = selfcheck.verdict(fast, ["minifloat_ieee"], 0, False, False)
    assert minifloat.startswith("minifloat_ieee: no runtime here") and "format=hf" in minifloat
    (int4,) = selfcheck.verdict(fast, ["scaled_integer 4-bit"], 0, False, False)
    assert "int4=true" in int4
    assert selfcheck.verdict(fast, ["scaled_integer 4-bit"], 0, False, True) == []


@pytest.mark.parametrize(
    ("arg", "key"),
    [
        ("check=fast", "check=fast: must be one of full, agreement, none"),
        ("check_rows=0", "check_rows=0: must be a positive integer"),
        ("check_batches=1,x", "check_batches=1,x: must be positive batch sizes"),
        ("check_threads=-1", "check_threads=-1: must be a positive integer"),
        ("int4=maybe", "int4=maybe: must be true, false or int8_inputs"),
        ("int4=true", "int4=true: only with format=onnx and int8=false"),
    ],
)
def test_bad_check_options_are_one_line_exit_2_nothing_written(tmp_path, arg, key):
    ckpt = tmp_path / "x.ckpt"
    ckpt.write_bytes(b"")
    code, stdout, stderr = call(main, f"ckpt={ckpt}", f"out={tmp_path / 'out'}", "format=hf", arg)
    assert code == 2 and stdout == ""
    assert stderr.startswith(f"error: {key}") and stderr.count("\n") == 1
    assert not (tmp_path / "out").exists()


@pytest.fixture(scope="module")
def gptq_run(tmp_path_factory, tiny_imdb_dir, cache_dir, fine_tuned):
    """A GPTQ run from the fine-tuned tiny model, with the logits its own model computed on each test batch."""
    out = tmp_path_factory.mktemp("gptq")
    monkeypatch = pytest.MonkeyPatch()
    try:
        overrides = [*SHORT_RUN, f"init_ckpt={fine_tuned}", *GPTQ]
        _, recorder = recorded_run(out / "run", overrides, tiny_imdb_dir, cache_dir, monkeypatch)
    finally:
        monkeypatch.undo()
    return out / "run" / "checkpoints" / "compressed.ckpt", recorder


def test_gptq_exports_to_matmul_nbits_with_the_runs_logits(gptq_run, tmp_path):
    ckpt, recorder = gptq_run
    out = tmp_path / "int4"
    code, stdout, stderr = call(main, f"ckpt={ckpt}", f"out={out}", "format=onnx", "int4=true", *FAST_CHECK)
    assert code == 0, stderr[-3000:]
    graph = onnx.load(str(out / INT4_FILE))
    nbits = [node for node in graph.graph.node if node.op_type == "MatMulNBits"]
    assert len(nbits) == TINY_LINEARS
    # the group size of w4_gptq (conf/quant/w4_gptq.yaml): 32 inputs per step
    assert {helper.get_attribute_value(a) for n in nbits for a in n.attribute if a.name == "block_size"} == {
        32
    }
    assert not [
        node for node in graph.graph.node if node.op_type in ("MatMul", "Gemm") and "classifier" in node.name
    ]
    session = onnx_session(out / INT4_FILE)
    for batch, logits in zip(recorder.batches, recorder.logits, strict=True):
        feed = {"input_ids": batch["input_ids"].numpy(), "attention_mask": batch["attention_mask"].numpy()}
        assert np.abs(session.run(None, feed)[0] - logits.numpy()).max() < TIGHT
    report = json.loads((out / selfcheck.EXPORT_JSON).read_text())
    rows = sum(len(logits) for logits in recorder.logits)
    assert report["artifact"] == INT4_FILE and report["rows"] == rows and report["agreement"] == 1.0
    assert report["max_logit_diff"] < TIGHT and "test split" in report["held"]
    assert set(report["speedup"]) == {"1", "2"} and all(v > 0 for v in report["speedup"].values())
    assert report["timing"]["threads"] == 1 and report["timing"]["tokens"] == 16
    assert "agreement 1.0000" in stdout and "self-check" in stdout


def test_agreement_of_a_tampered_folder_is_the_share_of_labels_it_keeps(gptq_run, tmp_path):
    from transformers import AutoModelForSequenceClassification

    ckpt, recorder = gptq_run
    out = tmp_path / "hf"
    code, stdout, stderr = call(main, f"ckpt={ckpt}", f"out={out}", "format=hf", "check=agreement")
    assert code == 0, stderr[-3000:]
    report = json.loads((out / selfcheck.EXPORT_JSON).read_text())
    assert report["agreement"] == 1.0 and report["max_logit_diff"] < TIGHT and report["speedup"] is None
    # a fake-quantized folder runs as float: said so, with the runtime that executes 4-bit weights
    assert any("scaled_integer 4-bit weights run as float" in note for note in report["verdict"])
    # tamper: lower label 1's bias by the median margin of the rows the run labelled 1, so about half of them flip
    reference = torch.cat(recorder.logits)
    margin = reference[:, 1] - reference[:, 0]
    weights = load_file(str(out / "model.safetensors"))
    weights["classifier.bias"][1] -= float(margin[margin > 0].median())
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    tampered = AutoModelForSequenceClassification.from_pretrained(out).eval()
    with torch.inference_mode():
        labels = torch.cat([tampered(**b).logits.argmax(-1) for b in recorder.batches])
    expected = float((labels == reference.argmax(-1)).float().mean())
    assert 0 < expected < 1
    # the check run again on the tampered folder, against the run's model as the export reads it
    loaded = load_checkpoint_model(ckpt, [], keep_quantized=True)
    settings = selfcheck.CheckSettings(mode="agreement")
    result = selfcheck.self_check(out, out, loaded.model, loaded.config, settings)
    assert result["rows"] == len(reference) and result["agreement"] == pytest.approx(expected)
    assert json.loads((out / selfcheck.EXPORT_JSON).read_text())["agreement"] == pytest.approx(expected)


def test_int8_inputs_writes_accuracy_level_4_and_reports_its_agreement(gptq_run, tmp_path):
    ckpt, recorder = gptq_run
    out = tmp_path / "int4_int8"
    code, stdout, stderr = call(
        main, f"ckpt={ckpt}", f"out={out}", "format=onnx", "int4=int8_inputs", "check=agreement"
    )
    assert code == 0, stderr[-3000:]
    nodes = [n for n in onnx.load(str(out / INT4_FILE)).graph.node if n.op_type == "MatMulNBits"]
    levels = {helper.get_attribute_value(a) for n in nodes for a in n.attribute if a.name == "accuracy_level"}
    assert len(nodes) == TINY_LINEARS and levels == {4}
    # the kernel rounds each block of inputs to int8: no longer the float inputs' logits, but near them
    session = onnx_session(out / INT4_FILE)
    batch, logits = recorder.batches[0], recorder.logits[0]
    feed = {"input_ids": batch["input_ids"].numpy(), "attention_mask": batch["attention_mask"].numpy()}
    difference = np.abs(session.run(None, feed)[0] - logits.numpy()).max()
    assert TIGHT < difference < 0.25
    report = json.loads((out / selfcheck.EXPORT_JSON).read_text())
    assert report["max_logit_diff"] >= difference - TIGHT and report["speedup"] is None


def test_mask_only_pruning_is_named_in_export_json(tmp_path, tiny_imdb_dir, cache_dir, fine_tuned):
    overrides = [
        *SHORT_RUN,
        "model/lora=none",
        f"init_ckpt={fine_tuned}",
        "model.optimizer.lr=1e-4",
        "prune=l1_0.5",
    ]
    train_run(tmp_path / "run", overrides, tiny_imdb_dir, cache_dir)
    ckpt = next((tmp_path / "run" / "checkpoints").glob("best-*.ckpt"))
    out = tmp_path / "hf"
    code, stdout, stderr = call(main, f"ckpt={ckpt}", f"out={out}", "format=hf", *FAST_CHECK)
    assert code == 0, stderr[-3000:]
    report = json.loads((out / selfcheck.EXPORT_JSON).read_text())
    # the folder computes the run's model (masks baked, activation pruning in its recipe), at full size
    assert report["agreement"] == 1.0 and report["max_logit_diff"] < TIGHT
    (mask_only,) = [note for note in report["verdict"] if note.startswith("mask-only pruning")]
    # the layers the checkpoint holds masks for (torch.nn.utils.parametrize's keys), counted here
    state = torch.load(ckpt, weights_only=False)["state_dict"]
    masked = sum(key.endswith(".parametrizations.weight.0.mask") for key in state)
    assert masked > 0 and mask_only.startswith(f"mask-only pruning: {masked} layers")
    assert "prune=structured_0.5" in mask_only
    assert f"note: {mask_only}" in stdout


def test_mxint8_folder_is_checked_against_the_float_model_it_was_packed_from(tmp_path, fine_tuned):
    """Packing replaces the loaded model's layers in place; the self-check must still compare the packed folder
    with the float model (it once compared the folder with itself: agreement 1, difference 0)."""
    from adls_lightning.export import load_packed

    out = tmp_path / "mx"
    code, stdout, stderr = call(main, f"ckpt={fine_tuned}", f"out={out}", "format=mxint8", "check=agreement")
    assert code == 0, stderr[-3000:]
    report = json.loads((out / selfcheck.EXPORT_JSON).read_text())
    # the same held rows, compared here between the folder reloaded from disk and a fresh load of the float run
    loaded = load_checkpoint_model(fine_tuned, [])
    batches, _ = selfcheck.held_batches(loaded.config, report["rows"], loaded.model.config.vocab_size, 16)
    expected = selfcheck.agreement(load_packed(out), loaded.model.eval(), batches)
    assert report["rows"] == expected["rows"]
    assert report["max_logit_diff"] > 0
    assert report["max_logit_diff"] == pytest.approx(expected["max_logit_diff"], rel=1e-4)
    assert report["agreement"] == pytest.approx(expected["agreement"])
