"""The compression record (``adls_lightning.compression_record``): what each compression callback writes into its
checkpoints, and the export that rebuilds the run's evaluated model from the checkpoint alone.

The methods the export refused before the record (GPTQ, SmoothQuant, LSQ, structured pruning + int8, calibrated
PTQ) each run on the tiny model, export with ``format=hf`` from their checkpoint alone, and the folder with its
recipe computes the logits the run's own model computed in its test (recorded during the test, not rebuilt), so
``export.evaluate`` prints the run's ``test/acc``. A checkpoint written without a record (as before it existed)
still exports through the run's config.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from adls_lightning.compression_record import (
    CHECKPOINT_KEY,
    COMPRESSED_CHECKPOINT,
    RECORD_VERSION,
    CompressionRecord,
    PruningRecord,
    QuantizationRecord,
    merge_into,
)
from adls_lightning.errors import ConfigError
from adls_lightning.export.folder import load_folder
from adls_lightning.export.recipe import ExportRecipe
from adls_lightning.runs.loading import load_checkpoint_model
from adls_lightning.tools import evaluate as export_evaluate
from adls_lightning.tools.export import main
from tests.helpers import SHORT_RUN, call, recorded_run, train_run

NO_LORA = ["model/lora=none"]
FROM_FINE_TUNED = ["model.optimizer.lr=1e-4"]
CASES = {
    # PTQ: the evaluated model is saved after the test as compressed.ckpt
    "gptq": ["quant=w4_gptq", "quant.gptq.batches=2"],
    "ptq_calibrated": ["quant=int8_scaled", "quant.mode=ptq", "quant.calibration.batches=2"],
    "smoothquant_ptq": [
        "quant=int8_scaled",
        "quant.mode=ptq",
        "quant.smoothquant.alpha=0.5",
        "quant.calibration.batches=2",
    ],
    # QAT: the fit's best checkpoint holds it all
    "smoothquant": ["quant=int8_scaled", "quant.smoothquant.alpha=0.5", "quant.calibration.batches=2"],
    "lsq": ["quant=int8_lsq", "quant.calibration.batches=2"],
    "structured_int8": ["prune=structured_0.5", "quant=int8_scaled", "prune.distill=true"],
    # a LoRA run (merged before it is quantized): its evaluated model is the merged, quantized one
    "gptq_lora": ["quant=w4_gptq", "quant.gptq.batches=2"],
}
PTQ = ("gptq", "ptq_calibrated", "smoothquant_ptq", "gptq_lora")


def run_checkpoint(run: Path) -> Path:
    """The checkpoint a user exports: the evaluated model of a PTQ run, else the fit's best."""
    compressed = run / "checkpoints" / COMPRESSED_CHECKPOINT
    return compressed if compressed.is_file() else next((run / "checkpoints").glob("best-*.ckpt"))


@pytest.fixture(scope="module", params=list(CASES))
def exported(request, tmp_path_factory, tiny_imdb_dir, cache_dir, fine_tuned):
    """(case, the run folder, its metrics, its recorded test logits, the exported folder, export's stdout)."""
    case = request.param
    out = tmp_path_factory.mktemp(case)
    monkeypatch = pytest.MonkeyPatch()
    try:
        # LoRA runs start from the random tiny model (their logits still tell), the others from the fine-tuned one
        start = [] if case.endswith("_lora") else [*NO_LORA, f"init_ckpt={fine_tuned}", *FROM_FINE_TUNED]
        overrides = [*SHORT_RUN, *start, *CASES[case]]
        metrics, recorder = recorded_run(out / "run", overrides, tiny_imdb_dir, cache_dir, monkeypatch)
    finally:
        monkeypatch.undo()
    # the checkpoint alone: no model= or quant= given, the run's record next to it tells the model and data
    code, stdout, stderr = call(main, f"ckpt={run_checkpoint(out / 'run')}", f"out={out / 'hf'}", "format=hf")
    assert code == 0, stderr[-3000:]
    return case, out / "run", metrics, recorder, out / "hf", stdout


def test_ptq_runs_save_their_evaluated_model_with_the_record(exported):
    case, run, _, _, _, _ = exported
    compressed = run / "checkpoints" / COMPRESSED_CHECKPOINT
    assert compressed.is_file() == (case in PTQ)
    checkpoint = torch.load(run_checkpoint(run), weights_only=False)
    record = CompressionRecord.from_checkpoint(checkpoint, "test")
    assert record is not None and record.version == RECORD_VERSION
    quantization = record.quantization
    # 14 linear layers in tiny_random (2 x 6 in the encoder, the pooler, the classifier), all quantized
    assert quantization is not None and quantization.applied and len(quantization.layers) == 14
    assert quantization.mode == ("ptq" if case in PTQ else "qat")
    assert quantization.gptq == case.startswith("gptq")
    assert quantization.lsq == (case == "lsq")
    # SmoothQuant's paper scope: query/key/value and the FFN input of each of the 2 layers (LayerNorm-fed)
    assert len(quantization.smoothed) == (8 if case.startswith("smoothquant") else 0)
    if case == "structured_int8":
        # tiny_random: 2 heads and 64 FFN neurons per layer, half of each kept
        assert record.pruning is not None and record.pruning.structured == {
            "heads": [1, 1],
            "intermediate": [32, 32],
        }
    else:
        assert record.pruning is None
    if case in PTQ:
        # the fit's checkpoints hold the weights before PTQ: recorded as such
        best = torch.load(next((run / "checkpoints").glob("best-*.ckpt")), weights_only=False)
        assert best[CHECKPOINT_KEY]["quantization"]["applied"] is False


def test_checkpoint_alone_rebuilds_the_model_the_run_tested(exported):
    """The model rebuilt from the checkpoint and its record (quantized layers kept) computes exactly the run's test
    logits; the exported folder (weights baked, activations by its recipe) the same up to float rounding: scaled
    integers multiply in int8 inside the run, the baked weights in float."""
    case, run, _, recorder, folder, _ = exported
    rebuilt = load_checkpoint_model(run_checkpoint(run), [], keep_quantized=True).model
    model = load_folder(folder, ExportRecipe.read(folder))
    assert recorder.batches, "the run recorded no test batch"
    with torch.inference_mode():
        for inputs, expected in zip(recorder.batches, recorder.logits, strict=True):
            torch.testing.assert_close(rebuilt(**inputs).logits, expected, rtol=0, atol=0, msg=case)
            torch.testing.assert_close(model(**inputs).logits, expected, rtol=1e-4, atol=1e-3, msg=case)


def test_evaluate_prints_the_run_test_accuracy(exported):
    case, _, metrics, _, folder, _ = exported
    code, stdout, stderr = call(export_evaluate.main, str(folder))
    assert code == 0, stderr[-3000:]
    accuracy = float(re.search(r"test/acc ([0-9.]+), test/f1 \S+ on 40 texts", stdout).group(1))
    assert accuracy == pytest.approx(metrics["test/acc"], abs=5e-5), (case, stdout, metrics)


@pytest.mark.parametrize("exported", ["structured_int8"], indirect=True)
def test_structured_and_int8_export_the_smaller_layers(exported):
    _, _, _, _, folder, _ = exported
    config = json.loads((folder / "config.json").read_text())
    assert config["structured_pruning"] == {"heads": [1, 1], "intermediate": [32, 32]}
    model = load_folder(folder, ExportRecipe.read(folder))
    assert model.bert.encoder.layer[0].intermediate.dense.out_features == 32


@pytest.mark.parametrize("exported", ["ptq_calibrated"], indirect=True)
def test_ptq_fit_checkpoint_names_the_evaluated_one(exported, tmp_path):
    """The fit's checkpoint of a calibrated PTQ run holds no calibration: refused in one line naming the one that
    does."""
    _, run, _, _, _, _ = exported
    best = next((run / "checkpoints").glob("best-*.ckpt"))
    code, stdout, stderr = call(main, f"ckpt={best}", f"out={tmp_path / 'hf'}", "format=hf")
    assert code == 2 and stdout == ""
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and "calibration" in lines[0], stderr
    assert str(run / "checkpoints" / COMPRESSED_CHECKPOINT) in lines[0]


@pytest.fixture(scope="module")
def legacy_run(tmp_path_factory, tiny_imdb_dir, cache_dir, fine_tuned):
    """A QAT + pruned run whose checkpoint is saved as before the record existed: without its key."""
    out = tmp_path_factory.mktemp("legacy")
    overrides = [
        *SHORT_RUN,
        *NO_LORA,
        f"init_ckpt={fine_tuned}",
        *FROM_FINE_TUNED,
        "quant=int8",
        "prune=l1_0.5",
    ]
    metrics = train_run(out / "run", overrides, tiny_imdb_dir, cache_dir)
    ckpt = next((out / "run" / "checkpoints").glob("best-*.ckpt"))
    checkpoint = torch.load(ckpt, weights_only=False)
    assert set(checkpoint[CHECKPOINT_KEY]) == {"quantization", "pruning", "packing", "version"}
    with_record = ckpt.with_name("with-record.ckpt.bak")
    torch.save(checkpoint, with_record)
    del checkpoint[CHECKPOINT_KEY]
    torch.save(checkpoint, ckpt)
    return ckpt, with_record, metrics


def test_checkpoint_without_record_exports_through_the_run_config(legacy_run, tmp_path):
    ckpt, with_record, metrics = legacy_run
    assert CHECKPOINT_KEY not in torch.load(ckpt, weights_only=False)
    code, stdout, stderr = call(main, f"ckpt={ckpt}", f"out={tmp_path / 'hf'}", "format=hf")
    assert code == 0, stderr[-3000:]
    assert "compression: 14 quantized and 13 pruned layers" in stdout, stdout
    code, stdout, stderr = call(export_evaluate.main, str(tmp_path / "hf"))
    assert code == 0, stderr[-3000:]
    accuracy = float(re.search(r"test/acc ([0-9.]+), test/f1 \S+ on 40 texts", stdout).group(1))
    assert accuracy == pytest.approx(metrics["test/acc"], abs=5e-5)
    # the two readers (config, record) rebuild the same model from the same weights
    old = load_checkpoint_model(ckpt, [])
    new = load_checkpoint_model(with_record, [])
    assert old.recipe.baked == new.recipe.baked and old.recipe.activation_prune == new.recipe.activation_prune
    for (name, a), (_, b) in zip(old.model.state_dict().items(), new.model.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


def test_record_round_trips_and_merges():
    checkpoint: dict = {}
    merge_into(checkpoint, pruning=PruningRecord(weight={"sparsity": 0.5, "method": "l1"}, seed=3))
    quantization = QuantizationRecord(
        layers={"classifier": {"weight": {"format": "integer", "params": {"width": 8, "frac_width": 4}}}},
        mode="ptq",
        gptq=True,
    )
    merge_into(checkpoint, quantization=quantization)
    # plain data only: what torch.load(weights_only=True) and JSON both read
    data = json.loads(json.dumps(checkpoint[CHECKPOINT_KEY]))
    record = CompressionRecord.from_dict(data)
    assert record.pruning == PruningRecord(weight={"sparsity": 0.5, "method": "l1"}, seed=3)
    assert record.quantization == quantization and record.packing is None
    recipe = record.quantization.recipe()
    assert recipe.layers["classifier"].weight.params == {"width": 8, "frac_width": 4}


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"version": 99}, "compression record version 99; this project reads 1"),
        ({"version": 1, "quantization": {"layers": {}, "bits": 3}}, "damaged compression record"),
        ([1, 2], "damaged compression record (not a mapping)"),
    ],
)
def test_record_from_another_version_or_damaged_is_one_line(data, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        CompressionRecord.from_checkpoint({CHECKPOINT_KEY: data}, "ckpt=x.ckpt")


def test_export_matches_no_callback_class_by_name():
    export = Path(__file__).resolve().parents[1] / "adls_lightning" / "export"
    names = ("QuantizationCallback", "PruningCallback", "CompressionCallback", "MXInt8PackedEvaluation")
    found = [
        f"{path.name}: {name}" for path in export.glob("*.py") for name in names if name in path.read_text()
    ]
    assert found == []


@pytest.mark.parametrize(
    "exported", ["smoothquant", "smoothquant_ptq", "lsq", "structured_int8"], indirect=True
)
def test_int8_graph_carries_the_run_codes_and_scales(exported, tmp_path):
    """``format=onnx int8=scaled`` of SmoothQuant (the input divided by its factors, the codes of ``w · s``), LSQ
    (the learned steps) and structured + int8 runs: ONNX Runtime's logits on the run's test batches are the run's
    own, up to float summation order."""
    import onnx

    from adls_lightning.export.int8 import INT8_SCALED_FILE
    from adls_lightning.export.onnx import onnx_logits, onnx_session

    case, run, _, recorder, _, _ = exported
    out = tmp_path / "int8"
    code, stdout, stderr = call(
        main, f"ckpt={run_checkpoint(run)}", f"out={out}", "format=onnx", "int8=scaled"
    )
    assert code == 0, stderr[-3000:]
    assert "14 linear layers on the run's int8 grid" in stdout, stdout
    graph = onnx.load(str(out / INT8_SCALED_FILE)).graph
    divisions = [node for node in graph.node if node.op_type == "Div" and node.output[0].startswith("int8.")]
    assert len(divisions) == (8 if case.startswith("smoothquant") else 0)
    session = onnx_session(out / INT8_SCALED_FILE)
    for inputs, expected in zip(recorder.batches, recorder.logits, strict=True):
        logits = onnx_logits(session, inputs)
        np.testing.assert_allclose(logits, expected.numpy(), rtol=1e-4, atol=1e-3, err_msg=case)


@pytest.mark.parametrize("exported", ["structured_int8"], indirect=True)
def test_structured_qat_checkpoint_is_not_resumed(exported, tiny_imdb_dir, cache_dir):
    """Its quantized layers have the pruned sizes, which no model has before the checkpoint loads: one line, not
    a shape mismatch deep in the load."""
    _, run, _, _, _, _ = exported
    overrides = [*SHORT_RUN, *NO_LORA, *CASES["structured_int8"], "ckpt_path=last", "trainer.max_epochs=2"]
    with pytest.raises(
        ConfigError, match=r"^prune.structured with quant.mode=qat: a checkpoint of such a run"
    ):
        train_run(run, overrides, tiny_imdb_dir, cache_dir)
