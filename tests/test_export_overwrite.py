"""``adls-export overwrite=true`` into an earlier export's folder replaces that export's files (and only those), and
the self-check fails, marking the folder (or putting the earlier export back, under overwrite=true), when the
folder's readers would run something else than what the export wrote or when an exact format's read-back misses the
run's logits.

Expectations are set here, independently of the export: the folder's file names listed before and after, a user's
file and its bytes, the weights tampered by hand."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
from safetensors.torch import load_file, save_file

from adls_lightning.errors import ConfigError
from adls_lightning.export import selfcheck
from adls_lightning.export.folder import EXPORT_JSON, FAILED_KEY, check_folder
from adls_lightning.export.from_checkpoint import EARLIER_EXPORT_DIR, fp32_tolerance
from adls_lightning.export.settings import ExportCheckError
from adls_lightning.runs.loading import load_checkpoint_model
from adls_lightning.tools.export import main
from tests.helpers import ENV, ROOT, call

AGREEMENT = ["check=agreement", "check_rows=40"]


@pytest.fixture
def onnx_export(tmp_path, fine_tuned):
    """An ``onnx int8=true`` export of the fine-tuned run, with a file of the user's beside it."""
    out = tmp_path / "out"
    code, _, stderr = call(main, f"ckpt={fine_tuned}", f"out={out}", "format=onnx", "int8=true", *AGREEMENT)
    assert code == 0, stderr[-3000:]
    assert {"model.onnx", "model_int8.onnx", "config.json", EXPORT_JSON} <= {p.name for p in out.iterdir()}
    (out / "notes.txt").write_text("mine\n")
    return out


def test_overwrite_replaces_the_earlier_exports_files_and_keeps_the_users(onnx_export, fine_tuned):
    out = onnx_export
    code, stdout, stderr = call(
        main, f"ckpt={fine_tuned}", f"out={out}", "format=hf", "overwrite=true", *AGREEMENT
    )
    assert code == 0, stderr[-3000:]
    names = {p.name for p in out.iterdir()}
    # no graph of the earlier export is left to be run instead of the new weights
    assert not {n for n in names if n.endswith(".onnx")}, names
    assert {"model.safetensors", "config.json", EXPORT_JSON, "notes.txt"} <= names
    assert (out / "notes.txt").read_text() == "mine\n"
    assert check_folder(out).kind == "hf"
    report = json.loads((out / EXPORT_JSON).read_text())
    assert report["artifact"] == "model.safetensors" and report["agreement"] == 1.0
    assert FAILED_KEY not in report
    assert "overwrite=true: removed the earlier export's" in stdout and "model_int8.onnx" in stdout


def test_overwrite_is_refused_when_the_export_reads_from_the_folder(onnx_export, fine_tuned):
    out = onnx_export
    before = {p.name: p.stat().st_size for p in out.iterdir()}
    code, stdout, stderr = call(
        main,
        f"ckpt={fine_tuned}",
        f"out={out}",
        "format=hf",
        "overwrite=true",
        f"data.data_dir={out}",
        *AGREEMENT,
    )
    assert code == 2 and stdout == ""
    assert stderr.strip().splitlines() == [
        f"error: overwrite=true: data.data_dir={out} is read by this export from {out}, whose earlier export's files "
        "it would remove; valid: another out=, or copy it elsewhere first"
    ]
    assert {p.name: p.stat().st_size for p in out.iterdir()} == before


def test_self_check_fails_when_another_graph_would_run_and_the_earlier_export_comes_back(
    onnx_export, fine_tuned
):
    """A graph no export writes (the user's) stays; an hf export beside it would be read as that graph: refused
    by the self-check, in one line, exit code 1, in the command as the user types it; the earlier export, set aside
    by overwrite=true, is put back byte for byte in place of the failed one's files."""
    out = onnx_export
    shutil.copy(out / "model.onnx", out / "user.onnx")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    command = [sys.executable, "-m", "adls_lightning.export", f"ckpt={fine_tuned}", f"out={out}", "format=hf"]
    proc = subprocess.run(
        [*command, "overwrite=true", *AGREEMENT],
        capture_output=True,
        text=True,
        env=ENV,
        cwd=ROOT,
        timeout=600,
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    restored, line = proc.stderr.strip().splitlines()
    assert line.startswith(
        f"error: {out / EXPORT_JSON}: self-check failed: the folder's readers run user.onnx, "
    )
    assert (
        restored
        == f"overwrite=true: this export failed; the earlier export's {len(before) - 2} files are back in {out}"
    )
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # no safetensors, no failed export.json
    assert FAILED_KEY not in json.loads((out / EXPORT_JSON).read_text())

    # an export killed before its self-check leaves the earlier files set aside: the next one does not guess
    (out / EARLIER_EXPORT_DIR).mkdir()
    code, stdout, stderr = call(main, f"ckpt={fine_tuned}", f"out={out}", "format=hf", "overwrite=true")
    assert code == 2 and stdout == ""
    assert stderr.strip().splitlines() == [
        f"error: overwrite=true: {out / EARLIER_EXPORT_DIR} holds the files of an earlier export, kept there by an "
        f"export that was stopped before its self-check; valid: move them back into {out} (or delete "
        f"{out / EARLIER_EXPORT_DIR}), then export"
    ]


def test_self_check_fails_beyond_an_exact_formats_tolerance(tmp_path, fine_tuned):
    out = tmp_path / "hf"
    code, _, stderr = call(main, f"ckpt={fine_tuned}", f"out={out}", "format=hf", "check=none")
    assert code == 0, stderr[-3000:]
    weights = load_file(str(out / "model.safetensors"))
    weights["classifier.bias"][1] += 5.0  # every row's label-1 logit off by 5: far beyond 1e-4
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    loaded = load_checkpoint_model(fine_tuned, [])
    settings = selfcheck.CheckSettings(mode="agreement", rows=40)
    # reported as an approximation (no bound): the check passes and says what it measured
    result = selfcheck.self_check(out, out, loaded.model, loaded.config, settings)
    assert result["max_logit_diff"] == pytest.approx(5.0, abs=1e-3)
    check_folder(out)
    # held to the fp32 bound of an hf folder: refused, and the folder marked so that no reader runs it
    with pytest.raises(
        ExportCheckError, match=r"model.safetensors read back disagrees .*\(max \|Δlogit\| 5 "
    ):
        selfcheck.self_check(out, out, loaded.model, loaded.config, settings, tolerance=fp32_tolerance())
    report = json.loads((out / EXPORT_JSON).read_text())
    assert report["within_tolerance"] is False and "disagrees" in report[FAILED_KEY]
    with pytest.raises(ConfigError, match="its export failed its self-check"):
        check_folder(out)
