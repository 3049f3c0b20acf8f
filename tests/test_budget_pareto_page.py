"""The Pareto page of a study priced by the cost model (adls_lightning/reports/study.py): each Pareto point's export
command and, once it ran, the export's measured speed beside the prediction; the best-accuracy trial under each
latency budget."""

from __future__ import annotations

import html
import json
import re

import optuna
import yaml

from adls_lightning.reports.study import EXPORT_DIR, EXPORT_RESULT, study_page

# (val/acc, predicted ms, predicted x fp32) per trial; the fp32 model is predicted at 300 ms
TRIALS = [(0.85, 290.0), (0.84, 200.0), (0.80, 140.0), (0.83, 260.0), (0.70, 150.0)]
FP32_MS = 300.0


def text_of(page_html: str) -> str:
    return html.unescape(re.sub(r"<[^>]+>", " ", page_html))


def make_study(tmp_path, measured_trial: int | None = None):
    study = optuna.create_study(directions=["maximize", "minimize"])
    study.set_metric_names(["val/acc", "cost/latency_ms"])
    for number, (acc, ms) in enumerate(TRIALS):
        folder = tmp_path / f"trial_{number}"
        (folder / "checkpoints").mkdir(parents=True)
        (folder / "checkpoints" / "compressed.ckpt").write_bytes(b"x")
        (folder / ".hydra").mkdir()
        (folder / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump([f"model.seed={number}"]))
        (folder / ".hydra" / "config.yaml").write_text(
            yaml.safe_dump({"callbacks": {"cost_model": {"batch": 4, "tokens": 64, "threads": 1}}})
        )
        metrics = {"val/acc": acc, "test/acc": acc - 0.01, "cost/latency_x_fp32": FP32_MS / ms}
        study.add_trial(
            optuna.trial.create_trial(
                values=[acc, ms], user_attrs={"output_dir": str(folder), "metrics": metrics}
            )
        )
    if measured_trial is not None:
        export = tmp_path / f"trial_{measured_trial}" / EXPORT_DIR
        export.mkdir()
        result = {
            "measured_ms": 190.0,
            "measured_x_fp32": 1.55,
            "prediction_error_pct": 100 * (200.0 - 190.0) / 190.0,
            "metric": "acc",
            "test/acc": 0.8321,
        }
        (export / EXPORT_RESULT).write_text(json.dumps(result))
    return study


def test_each_pareto_point_has_its_export_command_and_the_budgets_their_best(tmp_path):
    study = make_study(tmp_path)
    text = text_of(study_page(study, "memory").html())
    assert "Pareto points as deployed (val/acc against cost/latency_ms)" in text
    # the Pareto front by hand: 0 (best acc), 1, 2 (fastest); 3 is dominated by 1, 4 by 2
    for number in (0, 1, 2):
        ckpt = tmp_path / f"trial_{number}" / "checkpoints" / "compressed.ckpt"
        out = tmp_path / f"trial_{number}" / EXPORT_DIR
        assert f"adls-budget ckpt={ckpt} assignment=deployed batch=4 tokens=64 threads=1 out={out}" in text
    assert f"ckpt={tmp_path / 'trial_3'}" not in text.split("Latency budget")[0]
    # best accuracy under each budget by hand: 0.5 x 300 = 150 ms -> trials 2 (0.80) and 4 (0.70): trial 2;
    # 0.7 -> 210 ms: trials 1, 2, 4: trial 1; 0.9 -> 270 ms: trials 1, 2, 3, 4: trial 1 (0.84)
    assert "Latency budget 0.5 of fp32's latency: best val/acc 0.8000 is trial 2" in text
    assert "Latency budget 0.7 of fp32's latency: best val/acc 0.8400 is trial 1" in text
    assert "Latency budget 0.9 of fp32's latency: best val/acc 0.8400 is trial 1" in text


def test_the_exports_measured_speed_appears_beside_the_prediction(tmp_path):
    study = make_study(tmp_path, measured_trial=1)
    page = study_page(study, "memory").html()
    table = page.split("id='pareto_exports'")[1].split("</table>")[0]
    rows = {}
    for row in re.findall(r"<tr>(.*?)</tr>", table)[1:]:
        cells = [html.unescape(re.sub(r"<[^>]+>", "", c)) for c in re.findall(r"<td[^>]*>(.*?)</td>", row)]
        rows[cells[0]] = cells
    assert set(rows) == {"0", "1", "2"}
    # columns: trial, val/acc, test acc, predicted ms, predicted x, measured ms, measured x, error, export acc, ...
    measured = rows["1"]
    assert measured[3].startswith("200") and measured[5].startswith("190") and measured[7] == "+5.3%"
    assert measured[8].startswith("0.8321")
    assert rows["0"][5] == "" and rows["2"][5] == ""  # not exported yet: nothing measured
