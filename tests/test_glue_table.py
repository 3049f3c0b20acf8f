"""scripts/glue_table.sh at tiny scale: two GLUE tasks x the four methods as Hydra multiruns, the markdown table's
cells equal to the runs' own metrics.json, the figure written, and PLOT_ONLY=1 redrawing without running."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.glue_layouts import write_glue_task

ROOT = Path(__file__).resolve().parents[1]


def test_table_command_runs_tasks_by_methods_and_redraws(tmp_path, cache_dir):
    data = tmp_path / "glue"
    for task in ("rte", "stsb"):
        write_glue_task(data, task)
    out, fig, md = tmp_path / "table", tmp_path / "fig.png", tmp_path / "table.md"
    extra = [
        "model=tiny_random", f"data.data_dir={data}", f"paths.cache_dir={cache_dir}", "data.val_size=20",
        "data.max_length=64", "callbacks.rich_progress_bar=null", "logger=none", "+trainer.limit_train_batches=2",
        "trainer.max_epochs=1",
    ]  # fmt: skip
    env = {
        **os.environ, "PY": sys.executable, "OUT": str(out), "FIG": str(fig), "MD": str(md), "TASKS": "rte stsb",
        "EXTRA": " ".join(extra), "PYTHONPATH": str(ROOT),
    }  # fmt: skip
    proc = subprocess.run(
        ["bash", "scripts/glue_table.sh"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]

    runs = {p.parent.name: json.loads(p.read_text()) for p in out.rglob("metrics.json")}
    assert sorted(runs) == sorted(
        ["rte", "stsb"] + [f"{t}-{m}" for t in ("rte", "stsb") for m in ("int8_qat", "l1_ft", "mxint8")]
    )
    rows = {
        line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
        for line in md.read_text().splitlines()[2:]
    }
    assert list(rows) == ["full precision", "int8 QAT", "L1 50 % + fine-tune", "MXINT8 packed"]
    # columns in GLUE's order (CoLA, SST-2, MRPC, STS-B, QQP, MNLI, QNLI, RTE, WNLI)
    assert md.read_text().splitlines()[0] == "| method | stsb (pearson) | rte (acc) | average | size (MB) |"
    for label, method in zip(rows, ("", "-int8_qat", "-l1_ft", "-mxint8")):
        rte, stsb = runs[f"rte{method}"]["test/acc"], runs[f"stsb{method}"]["test/pearson"]
        assert rows[label][:3] == [f"{100 * stsb:.1f}", f"{100 * rte:.1f}", f"{100 * (rte + stsb) / 2:.1f}"]
    sizes = {label: float(cells[3]) for label, cells in rows.items()}
    assert sizes["int8 QAT"] < sizes["full precision"] and sizes["MXINT8 packed"] < sizes["full precision"]
    assert (
        runs["rte-l1_ft"]["prune/weight_sparsity"] > 0.45 and runs["rte-mxint8"]["mxint8/packed_layers"] > 0
    )
    assert fig.stat().st_size > 0

    # PLOT_ONLY=1 redraws from the stored runs and runs nothing
    stamps = {p: p.stat().st_mtime_ns for p in out.rglob("metrics.json")}
    fig.unlink()
    md.unlink()
    proc = subprocess.run(
        ["bash", "scripts/glue_table.sh"],
        cwd=ROOT,
        env={**env, "PLOT_ONLY": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert fig.is_file() and md.is_file() and "MXINT8 packed" in proc.stdout
    assert {p: p.stat().st_mtime_ns for p in out.rglob("metrics.json")} == stamps
