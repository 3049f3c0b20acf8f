"""scripts/plot_lab1_width.py on fake run records (metrics.json + .hydra/config.yaml, as train.py -m writes them)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("plot_lab1_width", ROOT / "scripts" / "plot_lab1_width.py")
plot_lab1_width = importlib.util.module_from_spec(spec)
sys.modules["plot_lab1_width"] = plot_lab1_width  # dataclasses look their module up while the class is built
spec.loader.exec_module(plot_lab1_width)


def write_run(folder: Path, metrics: dict, quant: dict | None) -> None:
    folder.mkdir(parents=True)
    (folder / "metrics.json").write_text(json.dumps(metrics))
    if quant is not None:
        (folder / ".hydra").mkdir()
        (folder / ".hydra" / "config.yaml").write_text(yaml.safe_dump({"quant": quant, "seed": 42}))


def integer_quant(mode: str, width: int) -> dict:
    """The quant node a quant=int<width> run records: the preset's typed recipe."""
    operand = {"format": "integer", "params": {"width": width, "frac_width": width // 2}}
    return {
        "_target_": "callbacks.quantization.QuantizationCallback",
        "mode": mode,
        "config": {
            "_target_": "adls_lightning.quant.QuantRecipe",
            "default": dict.fromkeys(("data_in", "weight"), operand),
        },
    }


def test_width_is_read_from_a_typed_recipe_or_a_lab_dict():
    typed = integer_quant("qat", 6)
    lab = {"config": {"linear": {"config": {"name": "integer", "weight_width": 5, "weight_frac_width": 2}}}}
    log = {"config": {"default": {"weight": {"format": "log", "params": {"width": 8}}}}}
    assert plot_lab1_width._integer_width({"quant": typed}, {"quant/avg_weight_bits": 99.0}) == 6
    assert plot_lab1_width._integer_width({"quant": lab}, {}) == 5
    assert (
        plot_lab1_width._integer_width({"quant": log}, {"quant/avg_weight_bits": 8.0}) is None
    )  # not fixed point
    assert (
        plot_lab1_width._integer_width({}, {"quant/avg_weight_bits": 7.6}) == 8
    )  # no config: from the metric


def fake_sweep(root: Path) -> None:
    write_run(
        root / "0", {"test/acc": 0.60, "val/acc": 0.61, "quant/avg_weight_bits": 4.0}, integer_quant("ptq", 4)
    )
    write_run(
        root / "1", {"test/acc": 0.80, "val/acc": 0.79, "quant/avg_weight_bits": 4.0}, integer_quant("qat", 4)
    )
    write_run(
        root / "2", {"test/acc": 0.88, "val/acc": 0.87, "quant/avg_weight_bits": 8.0}, integer_quant("ptq", 8)
    )
    write_run(
        root / "3", {"test/acc": 0.89, "val/acc": 0.90, "quant/avg_weight_bits": 8.0}, integer_quant("qat", 8)
    )
    # two QAT runs at width 16: the better val/acc wins, although its test/acc is lower
    write_run(
        root / "4",
        {"test/acc": 0.90, "val/acc": 0.92, "quant/avg_weight_bits": 16.0},
        integer_quant("qat", 16),
    )
    write_run(
        root / "5",
        {"test/acc": 0.95, "val/acc": 0.85, "quant/avg_weight_bits": 16.0},
        integer_quant("qat", 16),
    )
    write_run(root / "6", {"test/acc": 0.91, "val/acc": 0.91}, {})  # quant=none: the full-precision baseline
    write_run(
        root / "7", {"val/acc": 0.5, "quant/avg_weight_bits": 12.0}, integer_quant("qat", 12)
    )  # died before test
    # a run whose Hydra config was not kept: mode and width come from the metrics
    write_run(
        root / "8",
        {"test/acc": 0.70, "val/acc": 0.7, "quant/avg_weight_bits": 12.0, "ptq/val_acc_after": 0.7},
        None,
    )
    mx = {"mode": "qat", "config": {"linear": {"config": {"name": "mxint8"}}}}
    write_run(
        root / "9", {"test/acc": 0.9, "val/acc": 0.9, "quant/avg_weight_bits": 8.25}, mx
    )  # not fixed point


def test_table_and_png_from_a_sweep(tmp_path, capsys):
    fake_sweep(tmp_path / "sweep")
    out = tmp_path / "fig" / "width.png"
    assert plot_lab1_width.main([str(tmp_path / "sweep"), "--out", str(out)]) == 0
    printed = capsys.readouterr()
    expected = "\n".join(
        [
            "| width | PTQ | QAT |",
            "|---|---|---|",
            "| 4 | 0.6000 | 0.8000 |",
            "| 8 | 0.8800 | 0.8900 |",
            "| 12 | 0.7000 |  |",
            "| 16 |  | 0.9000 |",
            "",
            "full precision test/acc: 0.9100",
        ]
    )
    assert expected in printed.out
    assert "no test/acc" in printed.err and "not a fixed-point" in printed.err
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000


def test_any_subset_of_the_sweep_works(tmp_path, capsys):
    write_run(
        tmp_path / "only" / "0",
        {"test/acc": 0.8, "val/acc": 0.8, "quant/avg_weight_bits": 8.0},
        integer_quant("ptq", 8),
    )
    assert (
        plot_lab1_width.main(
            [str(tmp_path / "only"), "--out", str(tmp_path / "a.png"), "--metric", "val/acc"]
        )
        == 0
    )
    assert "| width | PTQ |\n|---|---|\n| 8 | 0.8000 |" in capsys.readouterr().out
    write_run(tmp_path / "none" / "0", {"test/acc": 0.9, "val/acc": 0.9}, {})
    assert plot_lab1_width.main([str(tmp_path / "none"), "--out", str(tmp_path / "b.png")]) == 2
    assert not (tmp_path / "b.png").exists()


def test_quant_none_with_a_swept_mode_key_is_full_precision_and_best_run_prefers_lower_width(
    tmp_path, capsys
):
    sweep = tmp_path / "sweep"
    # `quant=none ++quant.mode=ptq` in a sweep leaves {mode: ptq} without a callback: full precision
    write_run(sweep / "0", {"test/acc": 0.87, "val/acc": 0.90}, {"mode": "ptq"})
    write_run(sweep / "1", {"test/acc": 0.85, "val/acc": 0.88}, integer_quant("qat", 8))
    write_run(sweep / "2", {"test/acc": 0.86, "val/acc": 0.90}, integer_quant("qat", 16))
    write_run(sweep / "3", {"test/acc": 0.88, "val/acc": 0.90}, integer_quant("qat", 12))
    write_run(sweep / "4", {"test/acc": 0.80, "val/acc": 0.95}, integer_quant("ptq", 32))
    runs = plot_lab1_width.read_runs([sweep])
    assert plot_lab1_width.full_precision(runs) == 0.87
    # best QAT val/acc is 0.90 at widths 12 and 16: the lower width wins; PTQ runs are not candidates
    assert plot_lab1_width.main([str(sweep), "--best-run"]) == 0
    assert capsys.readouterr().out.split() == [str(sweep / "3"), "12"]
    assert plot_lab1_width.main([str(tmp_path / "empty"), "--best-run"]) == 2
