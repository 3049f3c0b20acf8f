"""The house's rules, read from the source: the import graph of adls_lightning has no circle; layers go app ->
callbacks -> library, and the library imports neither Hydra's runtime nor the Trainer."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

from tests.helpers import ROOT

spec = importlib.util.spec_from_file_location("import_graph", ROOT / "scripts" / "import_graph.py")
import_graph = importlib.util.module_from_spec(spec)
spec.loader.exec_module(import_graph)


def test_import_graph_has_no_circle_and_keeps_the_direction():
    graph = import_graph.import_graph()
    assert import_graph.find_cycles(import_graph.project_edges(graph)) == []
    assert import_graph.rule_breaks(graph) == []
    # the ground floor (the error messages) imports only leaf modules, which import nothing of the project;
    # the application imports the library, never the reverse
    edges = import_graph.project_edges(graph)
    assert {m: edges[m] for m in edges["adls_lightning.errors"]} == dict.fromkeys(
        edges["adls_lightning.errors"], set()
    )
    assert "adls_lightning.build" in graph["adls_lightning.app.training"]


def test_cycle_finder_finds_the_circle_it_is_given():
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert import_graph.find_cycles(edges) == [["a", "b", "c"]]
    assert import_graph.find_cycles({"a": {"b"}, "b": set()}) == []


def test_rule_breaks_name_a_library_module_that_imports_the_application():
    graph = {"adls_lightning.quant.recipe": {"adls_lightning.app.training", "hydra.core.hydra_config"}}
    assert import_graph.rule_breaks(graph) == [
        "adls_lightning.quant.recipe: imports adls_lightning.app.training",
        "adls_lightning.quant.recipe: imports hydra.core.hydra_config",
    ]


def test_rule_breaks_keep_the_callbacks_between_the_application_and_the_library():
    graph = {
        "adls_lightning.callbacks.pruning": {"adls_lightning.prune", "adls_lightning.app.training"},
        "adls_lightning.prune.pruner": {"adls_lightning.callbacks.calibration"},
        "adls_lightning.export.folder": {"callbacks.pruning"},  # the callbacks' old top-level home
        "adls_lightning.app.training": {"adls_lightning.callbacks.pruning"},
    }
    assert import_graph.rule_breaks(graph) == [
        "adls_lightning.callbacks.pruning: imports adls_lightning.app.training",
        "adls_lightning.export.folder: imports callbacks.pruning",
        "adls_lightning.prune.pruner: imports adls_lightning.callbacks.calibration",
    ]


def test_script_prints_the_graph():
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "import_graph.py")], capture_output=True, text=True, cwd=ROOT
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "adls_lightning.app.cli -> " in result.stdout
    assert "circles: none" in result.stdout


def test_callback_order_is_the_configs(compose_cfg):
    import pytest

    from adls_lightning.app.training import instantiate_callbacks
    from adls_lightning.callbacks.pruning import OncePruning, PruningCallback
    from adls_lightning.callbacks.quantization import QuantizationCallback
    from adls_lightning.errors import ConfigError

    def compression_order(overrides):
        callbacks = instantiate_callbacks(compose_cfg(["quant=int8", "prune=l1_0.5", *overrides]))
        return [type(c) for c in callbacks if isinstance(c, (QuantizationCallback, PruningCallback))]

    # prune=l1_0.5 builds the once-pruning mode of PruningCallback
    assert compression_order([]) == [QuantizationCallback, OncePruning]  # conf/train.yaml: quantize first
    assert compression_order(["callback_order=[prune,quant]"]) == [OncePruning, QuantizationCallback]
    with pytest.raises(ConfigError, match=r"callback_order: 'qaunt' is not a config node"):
        instantiate_callbacks(compose_cfg(["callback_order=[callbacks,qaunt]"]))
