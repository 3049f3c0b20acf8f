"""The task-head helpers live beside the models (``adls_lightning.models``); their old names in
``adls_lightning.data.tasks`` still resolve, and the models no longer import the data's task module for them."""

from __future__ import annotations

import ast

import pytest
import torch

from adls_lightning import models
from adls_lightning.data import tasks
from tests.helpers import ROOT


def test_the_helpers_split_a_state_dict_at_its_head():
    state = {
        "model.bert.encoder.layer.0.output.dense.weight": torch.zeros(4, 4),
        "model.pre_classifier.weight": torch.zeros(4, 4),
        "model.classifier.weight": torch.zeros(3, 4),
        "model.classifier.bias": torch.zeros(3),
    }
    assert list(models.without_task_head(state)) == ["model.bert.encoder.layer.0.output.dense.weight"]
    assert models.head_outputs(state) == 3
    assert models.head_outputs({"model.bert.pooler.dense.weight": torch.zeros(4, 4)}) is None


@pytest.mark.parametrize(
    "name", ["TASK_HEAD_MODULES", "is_task_head_key", "without_task_head", "head_outputs"]
)
def test_the_old_names_resolve_to_the_same_objects(name):
    assert getattr(tasks, name) is getattr(models, name)
    with pytest.raises(AttributeError):
        tasks.not_a_helper  # noqa: B018


def test_models_do_not_import_the_task_module():
    tree = ast.parse((ROOT / "adls_lightning" / "models.py").read_text())
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert not any(module and module.startswith("adls_lightning.data") for module in imported)
