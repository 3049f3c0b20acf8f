"""Metrics are registry entries (``adls_lightning.data.tasks.METRICS``): the built-ins keep their behaviour, and a
metric registered from a module of the user's own -- the one docs/extending.md shows, taken from the page as
written -- is logged by a run that lists it in ``data.metrics``."""

from __future__ import annotations

import re
import sys

import pytest
import torch
from torchmetrics.classification import BinaryF1Score, MulticlassAccuracy

from adls_lightning.app.training import run
from adls_lightning.data.tasks import METRICS, build_metric, register_metric
from adls_lightning.errors import ConfigError
from tests.helpers import ROOT

PLUGIN = "adls_doc_metrics"  # the page's mylab/metrics.py, under a name no other test module uses


def page_module() -> str:
    """The ``# mylab/metrics.py`` block of docs/extending.md."""
    text = (ROOT / "docs" / "extending.md").read_text()
    (block,) = re.findall(r"```python\n# mylab/metrics\.py\n(.*?)```", text, re.S)
    return block


@pytest.fixture
def doc_metric(tmp_path, monkeypatch):
    """The page's metric module, importable and allowed as a user's package is; unregistered after."""
    (tmp_path / f"{PLUGIN}.py").write_text(page_module())
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("ADLS_EXTRA_TARGETS", f"{PLUGIN}.*")
    yield "balanced_acc"
    METRICS.unregister("balanced_acc")
    sys.modules.pop(PLUGIN, None)


def test_the_built_in_metrics_are_registry_entries_built_as_before():
    assert list(METRICS) == ["acc", "f1", "mcc", "pearson", "spearman"]
    acc = build_metric("acc", 3)
    assert isinstance(acc, MulticlassAccuracy) and acc.num_classes == 3 and acc.average == "micro"
    assert isinstance(build_metric("f1", 2), BinaryF1Score)
    assert type(build_metric("mcc", 3)).__name__ == "MulticlassMatthewsCorrCoef"
    assert type(build_metric("spearman", 1)).__name__ == "SpearmanCorrCoef"
    with pytest.raises(
        ConfigError, match=r"metric 'bal': unknown \(known: acc, f1, mcc, pearson, spearman\)"
    ):
        build_metric("bal", 2)
    with pytest.raises(ConfigError, match="metric acc: needs a classification task"):
        build_metric("acc", 1)
    with pytest.raises(ConfigError, match="metric f1: defined for two classes here"):
        build_metric("f1", 3)


def test_a_metric_registered_from_outside_is_built_by_name(doc_metric):
    __import__(PLUGIN)
    metric = build_metric(doc_metric, 2)
    # 6 of class 0 (4 right), 2 of class 1 (2 right): balanced accuracy (4/6 + 2/2) / 2, plain accuracy 6/8
    preds = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    labels = torch.tensor([0, 0, 0, 0, 0, 0, 1, 1])
    assert metric(preds, labels).item() == pytest.approx((4 / 6 + 2 / 2) / 2)


def test_a_run_logs_the_registered_metric(doc_metric, compose_cfg):
    cfg = compose_cfg(
        [
            f"data.plugins=[{PLUGIN}]",
            f"data.metrics=[acc,{doc_metric}]",
            "data.train_size=64",
            "data.val_size=32",
            "trainer.max_epochs=1",
        ]
    )
    metrics = run(cfg)
    # the tiny test split is balanced (100 reviews of each label): its balanced accuracy is its accuracy
    assert metrics["test/balanced_acc"] == pytest.approx(metrics["test/acc"], abs=1e-6)
    assert "val/balanced_acc" in metrics and "test/f1" not in metrics  # the listed metrics, no others


def test_an_unknown_metric_is_one_line_naming_the_key(compose_cfg):
    cfg = compose_cfg(["data.metrics=[acc,bal]"])
    with pytest.raises(ConfigError, match=r"data.metrics=\['acc', 'bal'\]: must be a non-empty list"):
        run(cfg)


def test_a_reimported_module_registers_its_metric_again_and_another_function_is_refused(doc_metric):
    __import__(PLUGIN)
    first = METRICS[doc_metric]
    sys.modules.pop(PLUGIN)
    __import__(PLUGIN)  # the module's code runs again: the same function, registered again
    assert METRICS[doc_metric].build.__qualname__ == first.build.__qualname__
    with pytest.raises(ValueError, match="'balanced_acc' is already registered"):
        register_metric(doc_metric)(lambda num_labels: MulticlassAccuracy(num_classes=num_labels))
