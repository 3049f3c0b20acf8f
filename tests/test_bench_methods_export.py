"""``benchmarks/bench_methods_export.py`` on two tiny runs, in a subprocess as a user runs it: a PTQ ``int8_scaled``
run (its int8 ONNX graph) and an ``l1_0.5`` run (its HF folder). Each table row must carry the numbers of that
method's own ``export.json`` and the size of the file on disk that the self-check ran; ``l1_0.5`` must be named
mask-only, with the count of masked layers taken from its checkpoint here."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import ENV, SHORT_RUN, train_run

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "bench_methods_export.py"
FROM_FINE_TUNED = ["model/lora=none", "model.optimizer.lr=1e-4"]
RUNS = {
    "int8_scaled": ["quant=int8_scaled", "quant.mode=ptq", "quant.calibration.batches=2"],
    "l1_0.5": ["prune=l1_0.5"],
}
# the self-check at test scale: few tokens and one round, at the table's two batch sizes
FAST_CHECK = ["check_tokens=16", "check_batches=1,8", "check_rounds=1"]
COLUMNS = ["method", "format", "agreement", "max_diff", "b1", "b8", "size", "acc", "load", "verdict"]


def table_rows(stdout: str) -> dict[str, dict[str, str]]:
    """The markdown table's body rows by method (split on unescaped ``|``)."""
    rows = {}
    for line in stdout.splitlines():
        if not line.startswith("| ") or line.startswith("| method") or line.startswith("|---"):
            continue
        cells = [cell.strip() for cell in line.replace("\\|", "¦").strip("|").split(" | ")]
        assert len(cells) == len(COLUMNS), line
        rows[cells[0]] = dict(zip(COLUMNS, cells, strict=True))
    return rows


def run_script(*args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, str(SCRIPT), *args]
    return subprocess.run(command, capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=600)


@pytest.fixture(scope="module")
def tiny_runs(tmp_path_factory, tiny_imdb_dir, cache_dir, fine_tuned) -> dict[str, Path]:
    """The two methods' run folders, both from the same fine-tuned tiny model."""
    folders = {}
    for method, overrides in RUNS.items():
        out = tmp_path_factory.mktemp(method)
        train_run(
            out,
            [*SHORT_RUN, *FROM_FINE_TUNED, f"init_ckpt={fine_tuned}", *overrides],
            tiny_imdb_dir,
            cache_dir,
        )
        folders[method] = out
    return folders


def test_table_rows_are_each_export_json_and_l1_is_mask_only(tiny_runs, tmp_path):
    out = tmp_path / "exports"
    args = [f"--run={method}={folder}" for method, folder in tiny_runs.items()]
    result = run_script(*args, "--out", str(out), *(f"--export-arg={arg}" for arg in FAST_CHECK))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert "CPU: " in result.stdout and "load average: " in result.stdout
    rows = table_rows(result.stdout)
    assert sorted(rows) == sorted(RUNS)
    for method, row in rows.items():
        report = json.loads((out / method / "export.json").read_text())
        assert row["agreement"] == f"{report['agreement']:.4f}"
        assert row["max_diff"] == f"{report['max_logit_diff']:.3g}"
        assert row["b1"] == f"{report['speedup']['1']:.2f}×" and row["b8"] == f"{report['speedup']['8']:.2f}×"
        assert row["load"] == str(report["timing"]["load_average"][0])
        metrics = json.loads((tiny_runs[method] / "metrics.json").read_text())
        # SHORT_RUN's test rows and tokens, as the run's .hydra/config.yaml records them
        assert row["acc"] == f"{metrics['test/acc']:.4f} (40×24)"
    # the int8 row is the ONNX int8 graph the check ran, sized as that file on disk
    int8_report = json.loads((out / "int8_scaled" / "export.json").read_text())
    assert int8_report["artifact"] == "model_int8_scaled.onnx"
    assert "`model_int8_scaled.onnx`" in rows["int8_scaled"]["format"]
    onnx_mb = (out / "int8_scaled" / "model_int8_scaled.onnx").stat().st_size / 1e6
    assert rows["int8_scaled"]["size"] == f"{onnx_mb:.1f}"
    assert "mask-only" not in rows["int8_scaled"]["verdict"]
    # the l1 row: the HF folder's weights, named mask-only with the masked layers counted from the checkpoint
    hf_mb = (out / "l1_0.5" / "model.safetensors").stat().st_size / 1e6
    assert rows["l1_0.5"]["size"] == f"{hf_mb:.1f}" and rows["l1_0.5"]["format"].startswith("HF folder")
    ckpt = next((tiny_runs["l1_0.5"] / "checkpoints").glob("best-*.ckpt"))
    state = torch.load(ckpt, weights_only=False)["state_dict"]
    masked = sum(key.endswith(".parametrizations.weight.0.mask") for key in state)
    assert masked > 0
    assert rows["l1_0.5"]["verdict"].startswith(f"mask-only pruning: {masked} layers hold zeros")
    # each row's export was the documented command, printed before the table
    assert f"python -m adls_lightning.export ckpt={ckpt} out={out / 'l1_0.5'} format=hf" in result.stdout

    # --table-only re-reads the same folders and prints the same rows, exporting nothing
    again = run_script(*args, "--out", str(out), "--table-only")
    assert again.returncode == 0, again.stderr[-3000:]
    assert table_rows(again.stdout) == rows


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--run=awq=x.ckpt"],
            "--run: 'awq=x.ckpt': must be METHOD=CHECKPOINT, METHOD one of fp32, int8_scaled",
        ),
        (
            ["--run=lsq=/no/such.ckpt"],
            "--run: lsq=/no/such.ckpt: /no/such.ckpt is no checkpoint file or run folder",
        ),
    ],
)
def test_bad_run_is_one_line_exit_2(tmp_path, args, message):
    result = run_script(*args, "--out", str(tmp_path / "out"))
    assert result.returncode == 2
    assert result.stderr.startswith(f"error: argument {message}") and result.stderr.count("\n") == 1
    assert not (tmp_path / "out").exists()
