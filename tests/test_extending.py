"""A researcher's own number format and pruning method, in a module of their own (docs/extending.md).

The toy module is written to a temporary directory: nothing in the repository is edited to use it. It is named in
configs through ``quant.plugins`` and allowed by ``ADLS_EXTRA_TARGETS``, as a user's package would be.
"""

from __future__ import annotations

import os
import sys
import textwrap

import pytest
import torch
from optuna.trial import TrialState

from adls_lightning.app.training import run
from adls_lightning.prune import PRUNE_METHODS, Pruner
from adls_lightning.quant import QUANTIZERS, make_quantizer
from tests.helpers import TOY_PLUGIN_SOURCE, linear_layers, load_study, ok

TOY_MODULE = "adls_toy_format"
TOY_PRESET = """
defaults: [_base]
plugins: [adls_toy_format]
config:
  linear:
    config: {name: toy_step, data_in_step_bits: 3, weight_step_bits: 1}
"""


@pytest.fixture
def toy_plugin(tmp_path, monkeypatch):
    """The toy module and a conf dir with its quant preset, both outside the repository; unregistered after."""
    package_dir = tmp_path / "plugin"
    package_dir.mkdir()
    (package_dir / f"{TOY_MODULE}.py").write_text(textwrap.dedent(TOY_PLUGIN_SOURCE))
    conf_dir = tmp_path / "plugin_conf"
    (conf_dir / "quant").mkdir(parents=True)
    (conf_dir / "quant" / "toy.yaml").write_text(TOY_PRESET)
    monkeypatch.syspath_prepend(str(package_dir))
    monkeypatch.setenv("ADLS_EXTRA_TARGETS", f"{TOY_MODULE}.*")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(package_dir), os.environ.get("PYTHONPATH", "")]))
    yield conf_dir
    QUANTIZERS.unregister("toy_step")
    PRUNE_METHODS.unregister("toy_largest")
    sys.modules.pop(TOY_MODULE, None)


@pytest.mark.slow
def test_toy_format_trains_through_a_quant_preset_of_its_own(toy_plugin, compose_cfg):
    cfg = compose_cfg(["quant=toy", f"hydra.searchpath=[file://{toy_plugin}]"])
    metrics = run(cfg)
    # every linear layer (tiny_random: 2 layers x 6 + pooler + classifier) is stored in the toy's 4 bits
    assert metrics["quant/layers"] == 14
    assert metrics["quant/avg_weight_bits"] == 4.0
    # the registered class is the one the config built: its grid is the parameter's (2^-1 steps)
    q = make_quantizer("toy_step", step_bits=1)
    assert q(torch.tensor([0.2, 0.3, 1.74])).tolist() == [0.0, 0.5, 1.5]


def test_toy_pruning_method_is_usable_by_name(toy_plugin):
    __import__(TOY_MODULE)
    layer = torch.nn.Linear(4, 2)
    with torch.no_grad():
        layer.weight.copy_(torch.tensor([[1.0, -4.0, 2.0, 3.0], [-0.5, 0.1, 5.0, 0.2]]))
    model = torch.nn.Sequential(layer)
    Pruner(weight={"sparsity": 0.5, "method": "toy_largest"}, exclude=None).prune(model)
    # the largest half of the layer's weights (5, -4, 3, 2) is gone; l1 would remove the smallest
    assert layer.weight.tolist() == [
        [1.0, 0.0, 0.0, 0.0],
        [-0.5, pytest.approx(0.1), 0.0, pytest.approx(0.2)],
    ]


def test_toy_format_is_searched_by_mixed_precision(toy_plugin, search, tmp_path):
    ok(
        search(
            "search=mixed_precision",
            "search.precision=toy_step",
            "model=tiny_random",
            "search/objective=acc_bits",
            "hydra.sweeper.n_trials=2",
            f"quant.plugins=[{TOY_MODULE}]",
        )
    )
    study = load_study(tmp_path, "mixed_precision-toy_step-acc_bits-tpe")
    sizes = linear_layers(hidden=32, intermediate=64, layers=2)
    assert [t.state for t in study.trials] == [TrialState.COMPLETE] * 2
    for t in study.trials:
        toy = [n for n in sizes if t.params[f"{n}/format"] == "toy_step"]
        assert all(t.params[f"{n}/toy_step.step_bits"] in (1, 2) for n in toy)  # the format's default space
        expected = sum((4 if n in toy else 32) * sizes[n] for n in sizes) / sum(sizes.values())
        assert t.values[1] == pytest.approx(expected)
        assert t.user_attrs["metrics"]["quant/layers"] == len(toy)
