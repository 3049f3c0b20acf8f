"""A researcher's plugin module that fails (docs/extending.md): one line naming the key and the module, exit 2, no
run folder; and ``trainer.precision`` values that need a package this machine lacks."""

from __future__ import annotations

import importlib.util
import json
import sys
import textwrap

import pytest

from adls_lightning.app.preflight import validate_trainer
from adls_lightning.data.tasks import METRICS
from adls_lightning.errors import ConfigError
from adls_lightning.precision import valid_precisions, validate
from adls_lightning.quant import QUANTIZERS
from adls_lightning.registry import import_config_plugins, import_plugins
from tests.helpers import ROOT, TOY_PLUGIN_SOURCE, assert_one_line_error, run_train

PACKAGE = "adls_plugin_errors"

BROKEN = "import os\n\nx = undefined_name\n"
SYNTAX = "def f(:\n    pass\n"
FAILING_IMPORT = "import adls_no_such_package_here\n"
TAKEN_FORMAT = """
from adls_lightning.quant.quantizers import Quantizer, register_format


@register_format
class MyInteger(Quantizer):
    format_name = "integer"

    def quantize(self, x, need_mask):
        return x, None
"""
TAKEN_METRIC = """
from torchmetrics.classification import MulticlassAccuracy

from adls_lightning.data.tasks import register_metric


@register_metric("acc")
def my_accuracy(num_labels):
    return MulticlassAccuracy(num_classes=num_labels)
"""
NEW_FORMAT = """
from adls_lightning.quant.quantizers import Quantizer, register_format


@register_format
class Doubled(Quantizer):
    format_name = "plugin_errors_doubled"

    def quantize(self, x, need_mask):
        return 2 * x, None
"""


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    """``plugin(name, source) -> module name``: a module of package :data:`PACKAGE` in ``tmp_path``, importable
    here and in a subprocess, allowed by ``ADLS_EXTRA_TARGETS``; forgotten after the test."""
    package = tmp_path / "plugins" / PACKAGE
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(package.parent))
    monkeypatch.setenv("ADLS_EXTRA_TARGETS", f"{PACKAGE}.*")

    def write(name: str, source: str) -> str:
        (package / f"{name}.py").write_text(textwrap.dedent(source))
        return f"{PACKAGE}.{name}"

    yield write
    for name in [m for m in sys.modules if m == PACKAGE or m.startswith(f"{PACKAGE}.")]:
        del sys.modules[name]


def test_a_plugin_whose_code_raises_is_one_line_and_no_run_folder(plugin, tiny_imdb_dir, cache_dir, tmp_path):
    module = plugin("broken", BROKEN)
    out = tmp_path / "run"
    proc = run_train(
        tiny_imdb_dir,
        cache_dir,
        out,
        "quant=_base",
        f"quant.plugins=[{module}]",
        env={"ADLS_EXTRA_TARGETS": f"{PACKAGE}.*", "PYTHONPATH": f"{tmp_path / 'plugins'}:{ROOT}"},
    )
    line = assert_one_line_error(proc)
    assert line == (
        f"error: quant.plugins[0]={module}: importing it raised NameError: name 'undefined_name' is not defined "
        "(broken.py:3)"
    )
    assert not (out / "train.log").exists()


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        (SYNTAX, "importing it raised SyntaxError: invalid syntax (bad.py:1)"),
        (
            FAILING_IMPORT,
            "importing it raised ModuleNotFoundError: No module named 'adls_no_such_package_here' (bad.py:1)",
        ),
    ],
)
def test_a_plugin_that_cannot_run_names_the_key_the_module_and_its_line(plugin, source, expected):
    module = plugin("bad", source)
    with pytest.raises(ConfigError) as refused:
        import_plugins([module], "data.plugins")
    assert str(refused.value) == f"data.plugins[0]={module}: {expected}"


def test_a_missing_plugin_module_is_still_named_as_not_importable(plugin):
    with pytest.raises(
        ConfigError, match=rf"^quant.plugins\[0\]={PACKAGE}.absent: cannot be imported \(No module"
    ):
        import_plugins([f"{PACKAGE}.absent"], "quant.plugins")


def test_a_plugin_taking_a_built_in_format_name_is_one_line_naming_both(plugin):
    fine, module = plugin("fine", ""), plugin("taken_format", TAKEN_FORMAT)
    builtin = QUANTIZERS["integer"]
    with pytest.raises(ConfigError) as refused:
        import_plugins([fine, module], "quant.plugins")
    assert str(refused.value) == (
        f"quant.plugins[1]={module}: quantization format 'integer' is already registered "
        f"({builtin.__module__}.{builtin.__qualname__}); register yours under another name"
    )
    assert QUANTIZERS["integer"] is builtin  # the built-in is not replaced


def test_a_plugin_taking_a_built_in_metric_name_is_one_line_naming_both(plugin):
    module = plugin("taken_metric", TAKEN_METRIC)
    builtin = METRICS["acc"]
    with pytest.raises(ConfigError) as refused:
        import_plugins([module], "data.plugins")
    assert str(refused.value) == (
        f"data.plugins[0]={module}: metric 'acc' is already registered "
        f"({builtin.build.__module__}.{builtin.build.__qualname__}); register yours under another name"
    )
    assert METRICS["acc"] is builtin


def test_every_project_node_s_plugins_are_imported_from_a_config(plugin):
    module = plugin("formats", NEW_FORMAT)
    job = {
        "trainer": {"_target_": "lightning.Trainer", "plugins": ["not.a.module"]},  # Lightning's: objects
        "quant": {
            "_target_": "adls_lightning.callbacks.quantization.QuantizationCallback",
            "plugins": [module],
        },
    }
    try:
        import_config_plugins(job)
        assert "plugin_errors_doubled" in QUANTIZERS
        job["quant"]["plugins"] = [module, f"{PACKAGE}.absent"]
        with pytest.raises(ConfigError, match=rf"^quant.plugins\[1\]={PACKAGE}.absent: cannot be imported"):
            import_config_plugins(job)
    finally:
        QUANTIZERS.unregister("plugin_errors_doubled")


ENGINE_INSTALLED = importlib.util.find_spec("transformer_engine") is not None


@pytest.mark.skipif(ENGINE_INSTALLED, reason="transformer_engine is installed here")
@pytest.mark.parametrize("value", ["transformer-engine", "transformer-engine-float16"])
def test_a_transformer_engine_precision_without_its_package_is_one_line(value):
    for check in (lambda: validate_trainer({"precision": value}), lambda: validate(value)):
        with pytest.raises(ConfigError) as refused:
            check()
        line = str(refused.value)
        assert line.startswith(f"trainer.precision={value}: needs NVIDIA Transformer Engine")
        assert "transformer-engine" not in line.partition("valid: ")[2]
    assert not any(v.startswith("transformer-engine") for v in valid_precisions())
    assert "bf16-mixed" in valid_precisions()


@pytest.mark.skipif(ENGINE_INSTALLED, reason="transformer_engine is installed here")
def test_train_py_refuses_transformer_engine_before_a_run_folder(tiny_imdb_dir, cache_dir, tmp_path):
    out = tmp_path / "run"
    proc = run_train(tiny_imdb_dir, cache_dir, out, "trainer.precision=transformer-engine")
    assert_one_line_error(
        proc, starts="error: trainer.precision=transformer-engine: needs NVIDIA Transformer"
    )
    assert not out.exists()


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (  # docs/extending.md section 2, the command line as written there
            [
                "quant=_base",
                f"quant.plugins=[{PACKAGE}.formats]",
                "++quant.config={_target_: adls_lightning.quant.QuantRecipe, default: {data_in: {format: toy_step, "
                "params: {step_bits: 3}}, weight: {format: toy_step, params: {step_bits: 1}}}}",
            ],
            {"quant/avg_weight_bits": 4.0, "quant/avg_act_bits": 4.0},
        ),
        (  # section 3
            [f"data.plugins=[{PACKAGE}.formats]", "prune=l1_0.5", "prune.weight.method=toy_largest"],
            {"prune/weight_sparsity": 0.5},
        ),
    ],
)
def test_the_documented_plugin_command_lines_run(
    plugin, tiny_imdb_dir, cache_dir, tmp_path, overrides, expected
):
    plugin("formats", TOY_PLUGIN_SOURCE)
    out = tmp_path / "run"
    proc = run_train(
        tiny_imdb_dir,
        cache_dir,
        out,
        "trainer.max_epochs=1",
        *overrides,
        env={"ADLS_EXTRA_TARGETS": f"{PACKAGE}.*", "PYTHONPATH": f"{tmp_path / 'plugins'}:{ROOT}"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = json.loads((out / "metrics.json").read_text())
    assert {k: metrics[k] for k in expected} == expected
