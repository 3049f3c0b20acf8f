"""scripts/plot_lab1_sparsity.py on fake multirun folders."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "plot_lab1_sparsity.py"


@pytest.fixture(scope="module")
def plot_script():
    spec = importlib.util.spec_from_file_location("plot_lab1_sparsity", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def fake_job(root: Path, num: int, method: str | None, sparsity: float, acc: float | None) -> None:
    job = root / str(num)
    (job / ".hydra").mkdir(parents=True)
    prune = {} if method is None else {"_target_": "x", "weight": {"method": method, "sparsity": sparsity}}
    (job / ".hydra" / "config.yaml").write_text(json.dumps({"prune": prune, "seed": 42}))  # JSON is YAML
    metrics = {"val/acc": 0.5}
    if acc is not None:
        metrics["test/acc"] = acc
    if method is not None:
        metrics["prune/weight_sparsity"] = sparsity
    (job / "metrics.json").write_text(json.dumps(metrics))


def test_reads_groups_averages_and_plots(plot_script, tmp_path, capsys):
    sweep = tmp_path / "multiruns" / "2025-01-01_00-00-00"
    fake_job(sweep, 0, None, 0.0, 0.86)
    fake_job(sweep, 1, "l1", 0.5, 0.84)
    fake_job(sweep, 2, "l1", 0.9, 0.70)
    fake_job(sweep, 3, "random", 0.5, 0.60)
    fake_job(sweep, 4, "random", 0.5, 0.64)  # a second seed at the same sparsity: averaged
    fake_job(sweep, 5, "random", 0.9, 0.50)
    fake_job(sweep, 6, "l1", 0.3, None)  # failed before testing: skipped
    points = plot_script.read_points([sweep])
    assert len(points) == 6
    curves = plot_script.curves(points)
    assert curves == {"l1": [(0.5, 0.84), (0.9, 0.70)], "random": [(0.5, pytest.approx(0.62)), (0.9, 0.5)]}

    out = tmp_path / "fig.png"
    assert plot_script.main([str(sweep), "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    printed = capsys.readouterr()
    assert "| sparsity | l1 | random |" in printed.out
    assert "| 0.500 | 0.8400 | 0.6200 |" in printed.out
    assert "dense test/acc: 0.8600" in printed.out
    assert "no test/acc" in printed.err


def test_other_metric_and_no_pruned_runs(plot_script, tmp_path, capsys):
    fake_job(tmp_path, 0, "l1", 0.5, 0.8)
    points = plot_script.read_points([tmp_path], metric="val/acc")
    assert [(p.method, p.accuracy) for p in points] == [("l1", 0.5)]
    empty = tmp_path / "empty"
    fake_job(empty, 0, None, 0.0, 0.9)
    assert plot_script.main([str(empty), "--out", str(tmp_path / "x.png")]) == 2
    assert "no pruned run" in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()
