"""An exported ``format=hf`` folder computes what the run's own model computed in its test (issue 57 acceptance 2).

A SmoothQuant run and an LSQ run (QAT on the tiny model) export from their checkpoint alone; the folder, loaded as
``adls-evaluate`` and ``adls-predict`` load it (:func:`~adls_lightning.export.folder.load_folder` with its recipe,
nothing else done to it), gives the logits the run's model gave on every test batch, in the run's order (recorded
during the run's test, not rebuilt); ``adls-evaluate`` prints the run's ``test/acc``; the export's self-check
reports full agreement. The folder's static activation scales are loaded state, not running statistics: evaluating
does not change them (new quantizer modules start in training mode, where a static scale follows each batch's
range, as QAT's does).
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors.torch import load_file

from adls_lightning.export.folder import load_folder
from adls_lightning.export.recipe import ACTIVATION_STATE_FILE, ExportRecipe
from adls_lightning.tools import evaluate as export_evaluate
from adls_lightning.tools.export import main as export_main
from tests.helpers import SHORT_RUN, call, recorded_run

CASES = {
    "smoothquant": ["quant=int8_scaled", "quant.smoothquant.alpha=0.5", "quant.calibration.batches=2"],
    "lsq": ["quant=int8_lsq", "quant.calibration.batches=2"],
}
#: logits of the folder vs the run's: the same values multiplied (weights baked from the run's quantizers)
LOGIT_ATOL = 1e-4


@pytest.fixture(scope="module", params=list(CASES))
def exported(request, tmp_path_factory, tiny_imdb_dir, cache_dir, fine_tuned):
    """(case, the run's metrics, its recorded test logits, the exported folder)."""
    case = request.param
    out = tmp_path_factory.mktemp(f"fidelity_{case}")
    overrides = [
        *SHORT_RUN,
        "model/lora=none",
        f"init_ckpt={fine_tuned}",
        "model.optimizer.lr=1e-4",
        *CASES[case],
    ]
    monkeypatch = pytest.MonkeyPatch()
    try:
        metrics, recorder = recorded_run(out / "run", overrides, tiny_imdb_dir, cache_dir, monkeypatch)
    finally:
        monkeypatch.undo()
    ckpt = next((out / "run" / "checkpoints").glob("best-*.ckpt"))
    code, _, stderr = call(export_main, f"ckpt={ckpt}", f"out={out / 'hf'}", "format=hf", "check=agreement")
    assert code == 0, stderr[-3000:]
    return case, metrics, recorder, out / "hf"


def test_folder_as_evaluate_loads_it_computes_the_run_test_logits(exported):
    case, _, recorder, folder = exported
    model = load_folder(folder, ExportRecipe.read(folder), export_evaluate.USAGE)
    saved = load_file(str(folder / ACTIVATION_STATE_FILE))
    assert recorder.batches, "the run recorded no test batch"
    with torch.inference_mode():
        for index, (inputs, expected) in enumerate(zip(recorder.batches, recorder.logits, strict=True)):
            torch.testing.assert_close(
                model(**inputs).logits, expected, rtol=0, atol=LOGIT_ATOL, msg=f"{case}: test batch {index}"
            )
    # every batch above ran with the saved activation state, which evaluating left as it was
    state = model.state_dict()
    for key, value in saved.items():
        assert torch.equal(state[key], value), f"{case}: {key} changed while evaluating"
    assert not any(module.training for module in model.modules()), f"{case}: loaded in training mode"


def test_evaluate_prints_the_run_test_accuracy(exported):
    case, metrics, _, folder = exported
    code, stdout, stderr = call(export_evaluate.main, str(folder))
    assert code == 0, stderr[-3000:]
    accuracy = float(re.search(r"test/acc ([0-9.]+), test/f1 \S+ on 40 texts", stdout).group(1))
    assert accuracy == pytest.approx(metrics["test/acc"], abs=5e-5), (case, stdout, metrics)


def test_export_self_check_agrees_with_the_run_model(exported):
    case, _, _, folder = exported
    check = json.loads((folder / "export.json").read_text())
    assert check["rows"] == 40, check
    assert check["agreement"] == 1.0, (case, check)
    assert check["max_logit_diff"] <= LOGIT_ATOL, (case, check)
