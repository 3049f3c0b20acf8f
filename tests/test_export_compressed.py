"""Exporting compressed runs (``quant=`` QAT and PTQ, ``prune=`` with activation pruning, ``compress=``) from the
checkpoint alone: the Hugging Face folder loads with ``from_pretrained``, computes with its recipe exactly the logits
of the run's model rebuilt here (not by the export), and ``export.evaluate`` prints the run's own ``test/acc``."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForSequenceClassification

from adls_lightning.errors import ConfigError
from adls_lightning.export import WEIGHTS_FILE
from adls_lightning.export.compressed import run_overrides
from adls_lightning.export.folder import load_folder
from adls_lightning.export.recipe import RECIPE_FILE, ExportRecipe
from adls_lightning.lora import merge_lora
from adls_lightning.overrides import merge_overrides
from adls_lightning.prune import Pruner
from adls_lightning.quant import quantize_model
from adls_lightning.tools import evaluate as export_evaluate
from adls_lightning.tools.export import main
from tests.helpers import SHORT_RUN, build_module, call, train_run

TINY = ["model=tiny_random"]
# Tutorial 3's fixed point, as conf/quant/config/int8.yaml gives it to every linear layer
INT8 = {
    "name": "integer",
    **{f"{op}_{p}": v for op in ("data_in", "weight", "bias") for p, v in (("width", 8), ("frac_width", 4))},
}
L1_HALF = {"sparsity": 0.5, "method": "l1"}

NO_LORA = ["model/lora=none"]
# the labs' chain: compress a fine-tuned model (init_ckpt=), at a learning rate that keeps what it learned; and
# LoRA runs (no init: their accuracy stays at chance, their logits still tell) for the merge paths
CASES = {
    "qat": [*NO_LORA, "quant=int8"],
    "ptq": [*NO_LORA, "quant=int8", "quant.mode=ptq"],
    "pruned": [*NO_LORA, "prune=l1_0.5"],
    "compressed": [*NO_LORA, "compress=int8_l1_0.5", "compress.post_epochs=1"],
    "qat_lora": ["quant=int8"],
    "ptq_lora": ["quant=int8", "quant.mode=ptq"],
}
FROM_FINE_TUNED = ["model.optimizer.lr=1e-4"]


def rebuilt_run_model(case: str, ckpt: Path) -> torch.nn.Module:
    """The model the run evaluated, rebuilt from the library's parts as the callbacks shape it: LoRA merged
    (merge_lora_before_compress), layers quantized, masks as live parametrizations, activation pruning hooks."""
    module = build_module(TINY + ([] if case.endswith("_lora") else NO_LORA))
    state = torch.load(ckpt, weights_only=False)["state_dict"]
    pruner = Pruner(weight=L1_HALF, activation=L1_HALF) if case in ("pruned", "compressed") else None
    ptq = case.startswith("ptq")
    if not ptq:
        merge_lora(module)
    if case.startswith("qat") or case == "compressed":
        quantize_model(module.model, {"by": "type", "linear": {"config": INT8}})
    if pruner is not None:
        pruner.register_placeholders(module)
    module.load_state_dict(state, strict=True)
    merge_lora(module)
    if ptq:
        quantize_model(module.model, {"by": "type", "linear": {"config": INT8}})
    if pruner is not None:
        pruner.attach_activation(module)
    return module.model.eval()


@pytest.fixture(scope="module", params=list(CASES))
def exported(request, tmp_path_factory, tiny_imdb_dir, cache_dir, fine_tuned):
    """(case, the run's checkpoint, its metrics, the exported folder, export's stdout)."""
    case = request.param
    out = tmp_path_factory.mktemp(case)
    start = [] if case.endswith("_lora") else [f"init_ckpt={fine_tuned}", *FROM_FINE_TUNED]
    metrics = train_run(out / "run", [*SHORT_RUN, *start, *CASES[case]], tiny_imdb_dir, cache_dir)
    ckpt = next((out / "run" / "checkpoints").glob("best-*.ckpt"))
    # the checkpoint alone: no model= or quant= given, the run's record next to it tells them
    code, stdout, stderr = call(main, f"ckpt={ckpt}", f"out={out / 'hf'}", "format=hf")
    assert code == 0, stderr[-3000:]
    return case, ckpt, metrics, out / "hf", stdout


def test_folder_is_a_plain_hugging_face_model(exported):
    case, _, _, folder, stdout = exported
    model = AutoModelForSequenceClassification.from_pretrained(folder)
    assert not any("Quant" in type(m).__name__ for m in model.modules())
    recipe = ExportRecipe.read(folder)
    assert recipe is not None and "model=tiny_random" in recipe.run_overrides
    quantized = case != "pruned"
    pruned = case in ("pruned", "compressed")
    # 14 linear layers in tiny_random (2 x 6 in the encoder, the pooler, the classifier), all quantized by int8;
    # pruning leaves the classifier out
    assert recipe.baked == {"quantized_layers": 14 if quantized else 0, "pruned_layers": 13 if pruned else 0}
    assert len(recipe.activation_quant) == (14 if quantized else 0)
    assert (recipe.activation_prune is not None) == pruned
    assert re.search(rf"compression: {14 if quantized else 0} quantized and", stdout), stdout


def test_folder_with_its_recipe_computes_the_run_model_exactly(exported):
    case, ckpt, _, folder, _ = exported
    expected_model = rebuilt_run_model(case, ckpt)
    model = load_folder(folder, ExportRecipe.read(folder))
    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(0, expected_model.config.vocab_size, (4, 20), generator=generator)
    mask = torch.ones_like(ids)
    mask[1:, 12:] = 0
    plain = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    with torch.inference_mode():
        expected = expected_model(input_ids=ids, attention_mask=mask).logits
        got = model(input_ids=ids, attention_mask=mask).logits
        weights_alone = plain(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    # what acts on activations matters: the weights alone compute something else
    assert not torch.equal(weights_alone, expected)
    if case != "pruned":
        # the weights in the file are on the 8-bit fixed-point grid (step 1/16, |w| <= 127/16)
        weight = plain.bert.encoder.layer[0].output.dense.weight.detach()
        assert torch.equal(weight * 16, torch.round(weight * 16)) and weight.abs().max() <= 127 / 16


def test_evaluate_prints_the_run_test_accuracy(exported):
    case, _, metrics, folder, _ = exported
    code, stdout, stderr = call(export_evaluate.main, str(folder))
    assert code == 0, stderr[-3000:]
    accuracy = float(re.search(r"test/acc ([0-9.]+), test/f1 \S+ on 40 texts", stdout).group(1))
    assert accuracy == pytest.approx(metrics["test/acc"], abs=5e-5), (case, stdout, metrics)
    if case in ("qat", "ptq", "pruned"):
        # compressed from the fine-tuned model: not a constant prediction (which scores exactly 0.5 on the balanced
        # test split), so the two accuracies agree on which reviews each gets right, not by chance (int8 with half
        # of the weights and activations pruned, and the LoRA runs, predict one class on the tiny model: their
        # logits are checked exactly above)
        assert metrics["test/acc"] > 0.55, (case, metrics)


@pytest.mark.parametrize("exported", ["pruned"], indirect=True)
def test_evaluate_runs_on_the_chosen_gemm_backend(exported, caplog):
    """runtime.gemm reaches export.evaluate as it reaches the run's evaluation: oneDNN forced gives the run's own
    accuracy (fp32, summation order only), the run's resolved backend is the default, auto says what it took, and
    a bad value is one line."""
    _, _, metrics, folder, _ = exported
    for backend in ("onednn", "aten"):
        code, stdout, stderr = call(export_evaluate.main, str(folder), f"runtime.gemm={backend}")
        assert code == 0, stderr[-3000:]
        accuracy = float(re.search(r"test/acc ([0-9.]+), test/f1 \S+ on 40 texts", stdout).group(1))
        assert accuracy == pytest.approx(metrics["test/acc"], abs=5e-5), (backend, stdout, metrics)
    # without a value the folder computes on the backend its run resolved (recorded with the run's overrides)
    recorded = json.loads((folder / RECIPE_FILE).read_text())["run_overrides"]
    assert any(o in recorded for o in ("runtime.gemm=aten", "runtime.gemm=onednn")), recorded
    with caplog.at_level(logging.INFO, logger="adls_lightning.gemm"):
        code, _, stderr = call(export_evaluate.main, str(folder), "runtime.gemm=auto")
    assert code == 0, stderr[-3000:]
    assert any(r.getMessage().startswith("runtime.gemm=auto: ") for r in caplog.records), caplog.text
    code, stdout, stderr = call(export_evaluate.main, str(folder), "runtime.gemm=mkl")
    assert code == 2 and stdout == ""
    assert stderr.strip().splitlines() == ["error: runtime.gemm='mkl': must be one of auto, aten, onednn"], (
        stderr
    )
    # the model's settings as train.py refuses them (evaluate takes the run's overrides, and the user's on top)
    code, stdout, stderr = call(export_evaluate.main, str(folder), "model.regression_bias_init=median")
    assert code == 2 and stdout == ""
    assert stderr.strip().splitlines() == [
        "error: model.regression_bias_init='median': must be one of mean, zero"
    ]


@pytest.mark.parametrize("exported", ["qat"], indirect=True)
@pytest.mark.parametrize("format", ["onnx", "mxint8"])
def test_weights_only_formats_refuse_activation_compression_in_one_line(exported, tmp_path, format):
    _, ckpt, _, _, _ = exported
    out = tmp_path / "out"
    code, _, stderr = call(main, f"ckpt={ckpt}", f"out={out}", f"format={format}")
    assert code == 2
    # a fixed-point (integer) run: int8=scaled, which carries scaled_integer inputs only, is not offered
    assert stderr.strip().splitlines() == [
        f"error: format={format}: layer bert.encoder.layer.0.attention.self.query quantizes its data_in as integer, "
        f"which a {format} folder does not carry; valid: format=hf (its {RECIPE_FILE} carries it), or a run that "
        "quantizes weights only"
    ]
    assert not out.exists()


@pytest.mark.parametrize("exported", ["pruned"], indirect=True)
def test_activation_pruned_run_is_advised_only_what_exports_it(exported, tmp_path):
    """prune=l1_0.5 prunes activations: onnx is refused, and what the refusal advises works; the override the
    advice once named (prune.activation=null on the export) cannot unsay the checkpoint's record, nor is it named."""
    _, ckpt, _, _, _ = exported
    out = tmp_path / "out"
    for extra in ([], ["prune.activation=null"]):
        code, _, stderr = call(main, f"ckpt={ckpt}", f"out={out}", "format=onnx", *extra)
        assert code == 2 and not out.exists()
        assert stderr.strip().splitlines() == [
            "error: format=onnx: the run prunes input activations to 0.5, which a onnx folder does not carry; valid: "
            f"format=hf (its {RECIPE_FILE} carries it), or a run trained without activation pruning "
            "(prune.activation=null, or a weights-only preset: prune=wanda_0.5, sparsegpt_0.5, l1_2of4, "
            "movement_0.9, structured_0.5)"
        ]
    code, _, stderr = call(
        main, f"ckpt={ckpt}", f"out={out}", "format=hf", "check=agreement", "check_rows=40"
    )
    assert code == 0, stderr[-3000:]


SCALED_INT8 = {"format": "scaled_integer", "params": {"width": 8, "granularity": "tensor"}}


@pytest.mark.parametrize(
    "activation_quant, activation_prune, offered",
    [
        ({"l": {"data_in": SCALED_INT8, "data_out": None}}, None, True),  # quant=int8_scaled
        ({"l": {"data_in": {"format": "integer", "params": {"width": 8}}, "data_out": None}}, None, False),
        ({"l": {"data_in": {**SCALED_INT8, "params": {"width": 4}}, "data_out": None}}, None, False),
        ({"l": {"data_in": SCALED_INT8, "data_out": SCALED_INT8}}, None, False),
        ({"l": {"data_in": SCALED_INT8, "data_out": None}}, {"activation": {"sparsity": 0.5}}, False),
    ],
)
def test_int8_scaled_is_advised_only_to_runs_it_exports(activation_quant, activation_prune, offered):
    from adls_lightning.export.from_checkpoint import refuse_compression_beyond_weights
    from adls_lightning.runs.loading import LoadedRun

    recipe = ExportRecipe(
        activation_quant=activation_quant,
        activation_prune=activation_prune,
        baked={"quantized_layers": 1, "pruned_layers": 0},
    )
    with pytest.raises(ConfigError) as refused:
        refuse_compression_beyond_weights(LoadedRun(None, None, recipe, {}), "onnx")
    assert (
        "valid: int8=scaled (the run's int8 grid as an int8 graph), format=hf" in str(refused.value)
    ) is offered
    assert "format=hf (its compression.json carries it)" in str(refused.value)


def test_overrides_given_replace_the_runs_own():
    run_overrides = ["model=tiny_bert", "quant=int8", "data.batch_size=8", "+x.y=1"]
    assert merge_overrides(run_overrides, ["model=tiny_random", "data/batch_size=4", "~x.y"]) == [
        "quant=int8",
        "model=tiny_random",
        "data/batch_size=4",
        "~x.y",
    ]


def test_run_overrides_keep_what_the_model_is_not_where_it_started(tmp_path):
    # a run started from another task's checkpoint (init_ckpt=... init_head=new): the export rebuilds the model
    # from the run's model and data keys; where its weights came from is not part of that model
    (tmp_path / ".hydra").mkdir()
    (tmp_path / ".hydra" / "overrides.yaml").write_text(
        "- init_ckpt=/runs/stsb/best.ckpt\n- init_head=new\n- data.task=mrpc\n- hydra.run.dir=/x\n- quant=int8\n"
    )
    (tmp_path / "checkpoints").mkdir()
    assert run_overrides(tmp_path / "checkpoints" / "best.ckpt") == ["data.task=mrpc", "quant=int8"]


def test_run_overrides_read_a_relative_data_folder_where_the_run_started(tmp_path, monkeypatch):
    """A run trained with data.data_dir=data/imdb from /work/a: its export, and the folder's later adls-evaluate
    from any folder, read /work/a/data/imdb (Hydra's record names where the run started)."""
    started = tmp_path / "started"
    (started / "data" / "imdb").mkdir(parents=True)
    run = tmp_path / "run"
    (run / ".hydra").mkdir(parents=True)
    (run / ".hydra" / "overrides.yaml").write_text("- data.data_dir=data/imdb\n- model=tiny_random\n")
    (run / ".hydra" / "hydra.yaml").write_text(f"hydra:\n  runtime:\n    cwd: {started}\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert run_overrides(run / "checkpoints" / "best.ckpt") == [
        f"data.data_dir={started / 'data' / 'imdb'}",
        "model=tiny_random",
    ]
    # a record without the start folder: the value stays as typed (not guessed against this folder)
    (run / ".hydra" / "hydra.yaml").unlink()
    assert run_overrides(run / "checkpoints" / "best.ckpt")[0] == "data.data_dir=data/imdb"


def test_export_records_a_relative_data_folder_as_the_absolute_one_it_read(
    tmp_path, monkeypatch, fine_tuned, tiny_imdb_dir
):
    """data.data_dir given relative on the export's command line: compression.json records the folder it named
    there, so adls-evaluate of the export from another folder scores the same data."""
    monkeypatch.chdir(tiny_imdb_dir.parent)
    relative = f"data.data_dir={tiny_imdb_dir.name}"
    out = tmp_path / "hf"
    code, _, stderr = call(main, f"ckpt={fine_tuned}", f"out={out}", "format=hf", "check=none", relative)
    assert code == 0, stderr[-3000:]
    recorded = json.loads((out / RECIPE_FILE).read_text())["run_overrides"]
    assert f"data.data_dir={tiny_imdb_dir}" in recorded and relative not in recorded


def test_recipe_file_damaged_is_one_line(tmp_path):
    (tmp_path / RECIPE_FILE).write_text('{"run_overrides": [], "activation_quant": ')
    (tmp_path / WEIGHTS_FILE).write_bytes(b"")
    code, _, stderr = call(export_evaluate.main, str(tmp_path))
    assert code == 2
    assert (
        stderr.strip().splitlines()[-1].startswith(f"error: {tmp_path / RECIPE_FILE}: damaged export recipe")
    )


def test_recipe_round_trips_through_json(tmp_path):
    recipe = ExportRecipe(
        ["model=tiny_random"],
        {"a.b": {"data_in": {"format": "integer", "params": {"width": 8}}, "data_out": None}},
        None,
        {"quantized_layers": 1},
    )
    recipe.write(tmp_path, {})
    assert ExportRecipe.read(tmp_path) == recipe
    assert json.loads((tmp_path / RECIPE_FILE).read_text())["version"] == 1
