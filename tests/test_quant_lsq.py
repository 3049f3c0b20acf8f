"""LSQ (``scaled_integer`` with ``lsq: true``, ``quant=int8_lsq``): the step's gradient against the paper's formula
computed here in float64, the input's straight-through gradient, values equal to the fixed-scale quantizer, the
start from calibration, and QAT runs that train the steps, keep them in the checkpoint and refuse bad settings."""

from __future__ import annotations

import math

import pytest
import torch

from adls_lightning.app.training import run
from adls_lightning.errors import ConfigError
from adls_lightning.quant import LayerRecipe, OperandRecipe, make_quantizer, quantize_model
from adls_lightning.quant.scaled import init_learned_steps, scaled_quantizers


def learned(shape, **params):
    quantizer = make_quantizer("scaled_integer", lsq=True, **params)
    quantizer.bind(shape)
    return quantizer


def paper_step_gradient(x: torch.Tensor, s: torch.Tensor, qmin: int, qmax: int) -> torch.Tensor:
    """Esser et al. eq. 3 per element, summed per row, times g = 1/sqrt(n qmax), in float64."""
    x, s = x.double(), s.double()[:, None]
    v = x / s
    inside = torch.round(v) - v
    per_element = torch.where(v <= qmin, float(qmin), torch.where(v >= qmax, float(qmax), inside))
    g = 1 / math.sqrt(x.shape[1] * qmax)
    return per_element.sum(dim=1) * g


@pytest.mark.parametrize("width", [8, 4])
def test_step_gradient_is_the_papers_per_channel(width):
    torch.manual_seed(0)
    w = torch.randn(5, 48) * torch.linspace(0.2, 2, 5)[:, None]
    q = learned(tuple(w.shape), width=width, granularity="channel")
    q.init_step(w)
    with torch.no_grad():
        q.step.mul_(0.7)  # some values now clip: both branches of the formula are exercised
    q(w).sum().backward()
    expected = paper_step_gradient(w, q.step.detach(), q.qmin, q.qmax)
    assert torch.allclose(q.step.grad.double(), expected, rtol=1e-5, atol=1e-6)
    clipped = (w / q.step.detach()[:, None]).abs() > q.qmax
    assert clipped.any() and not clipped.all()


def test_input_gradient_is_straight_through_inside_and_zero_when_clipped():
    x = torch.linspace(-3, 3, 61).reshape(1, -1).requires_grad_(True)
    q = learned(None, granularity="tensor", width=4)  # qmax 7
    with torch.no_grad():
        q.step.fill_(0.25)  # the grid ends at +-1.75
    q.learned_ready.fill_(True)
    q(x).sum().backward()
    assert torch.equal(x.grad, (x.detach().abs() <= 1.75).float())


def test_values_equal_the_quantizer_with_the_same_fixed_steps():
    torch.manual_seed(1)
    w = torch.randn(7, 64)
    q = learned(tuple(w.shape), granularity="group", group_size=16)
    q.init_step(w)
    with torch.no_grad():
        q.step.mul_(torch.rand(q.step.shape) + 0.5)
    plain = make_quantizer("scaled_integer", granularity="group", group_size=16).eval()
    plain.fix(q.step.detach(), torch.zeros_like(q.step))
    assert torch.equal(q(w), plain(w))
    assert q.step.shape == (7 * 64 // 16,)


def test_steps_start_from_the_observer_and_the_calibrated_range(tiny_bert):
    model = tiny_bert()
    recipe = LayerRecipe(
        data_in=OperandRecipe("scaled_integer", {"granularity": "tensor", "lsq": True}),
        weight=OperandRecipe("scaled_integer", {"granularity": "channel", "lsq": True}),
    )
    quantize_model(model, recipe)
    with pytest.raises(ValueError, match="starts from calibrated ranges"):
        init_learned_steps(model)
    for q in scaled_quantizers(model):  # a calibrated range, as calibrate() leaves it
        q.min_val.fill_(-2.0)
        q.max_val.fill_(3.0)
        q.batches_observed.fill_(1)
    assert init_learned_steps(model) == 2 * 14
    layer = model.classifier
    assert torch.allclose(layer.data_in_quantizer.step, torch.tensor([3.0 / 127]))
    expected = layer.linear.weight.detach().abs().amax(dim=1) / 127
    assert torch.allclose(layer.weight_quantizer.step.detach(), expected)
    assert init_learned_steps(model) == 0  # started steps are kept (a resumed run's)


@pytest.mark.parametrize(
    "params, key",
    [
        ({"symmetric": False}, "lsq=true: needs symmetric=true"),
        ({"granularity": "token"}, "lsq=true: granularity token"),
    ],
)
def test_bad_lsq_settings_name_the_key(params, key):
    with pytest.raises(ConfigError, match=key):
        make_quantizer("scaled_integer", lsq=True, **params)


def test_lsq_on_per_channel_activations_is_refused_before_the_model_changes(tiny_bert):
    model = tiny_bert()
    recipe = LayerRecipe(data_in=OperandRecipe("scaled_integer", {"granularity": "channel", "lsq": True}))
    with pytest.raises(ConfigError, match=r"data_in\.params\.lsq=true with granularity channel"):
        quantize_model(model, recipe)
    assert not scaled_quantizers(model)


def test_qat_run_trains_the_steps_and_keeps_them_in_the_checkpoint(compose_cfg, tmp_path):
    metrics = run(compose_cfg(["quant=int8_lsq", "quant.calibration.batches=2", "trainer.max_epochs=1"]))
    assert metrics["quant/avg_act_bits"] == 8
    checkpoint = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", weights_only=False)
    state = checkpoint["state_dict"]
    steps = {k: v for k, v in state.items() if k.endswith("_quantizer.step")}
    assert len(steps) == 2 * 14
    # every activation step moved away from where calibration started it (max / 127 of the recorded range)
    for key, step in steps.items():
        if "data_in" not in key:
            continue
        prefix = key.removesuffix("step")
        start = torch.maximum(-state[prefix + "min_val"], state[prefix + "max_val"]) / 127
        assert bool(state[prefix + "learned_ready"])
        assert not torch.allclose(step, start.reshape(1), rtol=1e-4, atol=0), key


def test_lsq_activations_without_calibration_are_refused(compose_cfg):
    with pytest.raises(ConfigError, match=r"^quant.calibration.batches=0: LSQ activation steps"):
        run(compose_cfg(["quant=int8_lsq", "quant.calibration.batches=0", "trainer.max_epochs=1"]))
