"""scripts/glue_table.sh at tiny scale: two GLUE tasks x the four methods as Hydra multiruns, the markdown table's
cells equal to the runs' own metrics.json, the figure written, and PLOT_ONLY=1 redrawing without running."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

from tests.glue_layouts import write_glue_task
from tests.helpers import assert_one_line_error

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
    table = [line for line in md.read_text().splitlines()[2:] if line.startswith("|")]  # footnotes follow
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]] for line in table}
    assert list(rows) == ["full precision", "int8 QAT", "L1 50 % + fine-tune", "MXINT8 packed"]
    # columns in GLUE's order (CoLA, SST-2, MRPC, STS-B, QQP, MNLI, QNLI, RTE, WNLI)
    assert md.read_text().splitlines()[0] == "| method | stsb (pearson) | rte (acc) | average | size (MB) |"
    for label, method in zip(rows, ("", "-int8_qat", "-l1_ft", "-mxint8")):
        rte, stsb = runs[f"rte{method}"]["test/acc"], runs[f"stsb{method}"]["test/pearson"]
        # a tiny model's constant STS-B prediction has no Pearson correlation (nan): shown missing, not averaged
        numbers = [v for v in (stsb, rte) if math.isfinite(v)]
        average = f"{100 * sum(numbers) / len(numbers):.1f}" + (
            "" if len(numbers) == 2 else f" ({len(numbers)}/2)"
        )
        shown = [f"{100 * v:.1f}" if math.isfinite(v) else "–" for v in (stsb, rte)]
        assert [c.split(" [")[0] for c in rows[label][:2]] + [rows[label][2]] == [*shown, average], rows[
            label
        ]
        if not math.isfinite(stsb):  # the footnote names the run
            assert f"stsb{method} has test/pearson = nan; left out of the average." in md.read_text()
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


# --- the table script on its own: stored runs written here, no training ------------------------------------------


def write_run(root: Path, name: str, task: str, method: str, value) -> Path:
    """A finished run's folder as train.py leaves it: ``metrics.json`` and ``.hydra/config.yaml``."""
    run = root / name
    (run / ".hydra").mkdir(parents=True)
    key = "test/pearson" if task == "stsb" else "test/acc"
    (run / "metrics.json").write_text(json.dumps({"time/total_s": 1.0, key: value, "params/total": 1e6}))
    (run / ".hydra" / "config.yaml").write_text(f"data:\n  task: {task}\nmethod: {method}\n")
    return run


def table_script(*args, cwd=ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "scripts/glue_table.py", *map(str, args)],
        cwd=cwd,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_nan_score_is_shown_missing_named_and_not_averaged(tmp_path):
    """issue 56: the table averaged the nans of evaluation-only runs. A nan cell is shown as missing with a
    footnote naming the run, a warning names it on stderr, and the row's average is over the numbers, saying over
    how many."""
    runs = tmp_path / "runs"
    write_run(runs, "rte", "rte", "fp", 0.6)
    bad = write_run(runs, "stsb", "stsb", "fp", float("nan"))  # json.dumps writes NaN, as metrics.json does
    write_run(runs, "rte-mxint8", "rte", "mxint8", 0.55)
    write_run(runs, "stsb-mxint8", "stsb", "mxint8", 0.8)
    md = tmp_path / "table.md"
    proc = table_script(runs, "--out", tmp_path / "fig.png", "--md", md)
    assert proc.returncode == 0, proc.stderr
    lines = md.read_text().splitlines()
    assert lines[2] == "| full precision | – [1] | 60.0 | 60.0 (1/2) | 4.0 |"
    assert lines[3] == "| MXINT8 packed | 80.0 | 55.0 | 67.5 | 4.0 |"
    assert f"[1] not a number: {bad} has test/pearson = nan; left out of the average." in lines
    assert any(line.startswith("(n/N): the average over the n of the N tasks") for line in lines)
    assert "nan" not in "\n".join(lines[:4])
    assert f"warning: {bad} has test/pearson = nan" in proc.stderr


def test_table_refusals_are_one_line_and_write_nothing(tmp_path):
    """An unwritable output (checked before any output is written: the table used to be written, then the figure
    failed), a figure suffix matplotlib cannot write, a cut metrics.json: one error line, exit 2, no file."""
    runs = tmp_path / "runs"
    write_run(runs, "rte", "rte", "fp", 0.6)
    md, fig = tmp_path / "table.md", tmp_path / "fig.png"
    blocker = tmp_path / "a-file"
    blocker.write_text("")

    assert_one_line_error(table_script(runs, "--out", blocker / "fig.png", "--md", md), contains="--out=")
    assert_one_line_error(table_script(runs, "--out", fig, "--md", blocker / "t.md"), contains="--md=")
    assert_one_line_error(table_script(runs, "--out", tmp_path / "fig.txt"), contains=".png, .svg, .pdf")
    assert_one_line_error(table_script(runs, "--out", tmp_path, "--md", md), contains="is a folder")
    assert not md.exists() and not fig.exists()

    cut = runs / "rte" / "metrics.json"
    cut.write_text(cut.read_text()[:20])
    line = assert_one_line_error(table_script(runs, "--out", fig, "--md", md), contains=str(cut))
    assert "not readable JSON" in line
    assert not md.exists() and not fig.exists()
