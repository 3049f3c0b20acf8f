"""GPTQ (``quant=w4_gptq``): the Cholesky, lazy-block solver against a direct implementation of the paper's update
(inverse Hessian downdated column by column, in float64), its reconstruction error against round to nearest, the
fixed grid it leaves in the quantizer, and a PTQ run with its one-line errors."""

from __future__ import annotations

import logging

import pytest
import torch

from adls_lightning.app.training import run
from adls_lightning.errors import ConfigError
from adls_lightning.quant import make_quantizer
from adls_lightning.quant.gptq import GPTQConfig, column_rounding, gptq_weight
from tests.helpers import layer_problem


def hessian(x: torch.Tensor) -> torch.Tensor:
    return 2 * x.T @ x / x.shape[0]


def direct_gptq(weight, h, round_column, damp):
    """The paper's update without the Cholesky reformulation or lazy blocks: quantize column i, subtract
    ``err * Hinv[i, j] / Hinv[i, i]`` from the later columns j, then remove i from ``Hinv`` by Gaussian elimination."""
    w = weight.double().clone()
    h = h.double().clone()
    h += damp * h.diagonal().mean() * torch.eye(h.shape[0], dtype=torch.float64)
    inverse = torch.linalg.inv(h)
    q = torch.zeros_like(w)
    for i in range(w.shape[1]):
        q[:, i] = round_column(w[:, i].float(), i).double()
        error = (w[:, i] - q[:, i]) / inverse[i, i]
        w[:, i + 1 :] -= error[:, None] * inverse[i, i + 1 :][None, :]
        inverse -= inverse[:, i : i + 1] @ inverse[i : i + 1, :] / inverse[i, i]
    return q.float()


def rtn(quantizer, weight):
    return quantizer(weight)


def output_error(weight, q, x):
    return float(((x @ weight.T) - (x @ q.T)).square().sum())


def test_solver_equals_the_papers_direct_update():
    weight, x = layer_problem(6, 16, 200)
    quantizer = make_quantizer("scaled_integer", width=4, granularity="channel").eval()
    rounding = column_rounding(quantizer, weight)
    config = GPTQConfig(act_order=False, block_size=4, damp=0.01)  # 4 lazy blocks of 4 columns
    ours = gptq_weight(weight, hessian(x), rounding, config)
    expected = direct_gptq(weight, hessian(x), rounding, 0.01)
    torch.testing.assert_close(ours, expected, rtol=0, atol=1e-5)
    assert not torch.equal(ours, rtn(quantizer, weight))  # the error feedback moved some codes


@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("params", [{"granularity": "group", "group_size": 16}, {"granularity": "channel"}])
def test_reconstruction_error_is_below_round_to_nearest(act_order, params):
    weight, x = layer_problem(32, 64, 512, seed=1)
    quantizer = make_quantizer("scaled_integer", width=4, **params).eval()
    nearest = rtn(quantizer, weight)
    solved = gptq_weight(
        weight, hessian(x), column_rounding(quantizer, weight), GPTQConfig(act_order=act_order)
    )
    assert output_error(weight, solved, x) < 0.7 * output_error(weight, nearest, x)
    # the grid is fixed in the quantizer: it reproduces GPTQ's codes exactly
    assert torch.equal(quantizer(solved), solved)


def test_elementwise_formats_round_their_columns():
    weight, x = layer_problem(8, 32, 256, seed=2)
    quantizer = make_quantizer("integer", width=4, frac_width=2)
    solved = gptq_weight(weight, hessian(x), column_rounding(quantizer, weight), GPTQConfig())
    assert torch.equal(quantizer(solved), solved)
    assert output_error(weight, solved, x) < output_error(weight, quantizer(weight), x)


def test_block_formats_are_refused():
    with pytest.raises(ConfigError, match=r"^quant.gptq: format 'mxint8' does not round elementwise"):
        column_rounding(make_quantizer("mxint8"), torch.randn(4, 32))


def test_fixed_grid_survives_a_state_dict_round_trip():
    weight, _ = layer_problem(4, 32, 8)
    quantizer = make_quantizer("scaled_integer", width=4, granularity="group", group_size=8).eval()
    quantizer.fix(*quantizer.grid(weight * 0.5))
    fresh = make_quantizer("scaled_integer", width=4, granularity="group", group_size=8).eval()
    fresh.load_state_dict(quantizer.state_dict())
    assert fresh.fixed_scale.shape == (16,)
    assert torch.equal(fresh(weight), quantizer(weight))


def test_ptq_run_solves_every_layer_and_keeps_its_grid(compose_cfg, tmp_path, caplog):
    caplog.set_level(logging.INFO)
    metrics = run(
        compose_cfg(
            ["quant=w4_gptq", "quant.gptq.batches=2", "quant.config.default.weight.params.group_size=16"]
        )
    )
    assert "GPTQ chose the weights of 14 layers from 2 training batches" in caplog.text
    assert metrics["quant/avg_weight_bits"] == pytest.approx(4 + 32 / 16)
    assert metrics["quant/avg_act_bits"] == 32


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["quant.mode=qat"], "quant.gptq: GPTQ is post-training quantization; give quant.mode=ptq"),
        (["quant.gptq.damp=2"], "quant.gptq.damp=2: must be a number in (0, 1)"),
        (["+quant.gptq.order=1"], "quant.gptq.order: unknown key"),
    ],
)
def test_bad_gptq_settings_are_one_line(compose_cfg, overrides, message):
    from hydra.utils import instantiate

    with pytest.raises(ConfigError) as error:
        instantiate(compose_cfg(["quant=w4_gptq", *overrides]).quant, _convert_="partial")
    assert str(error.value).startswith(message)


def test_gptq_weights_are_what_validation_and_test_evaluate(compose_cfg, tmp_path):
    """``train.py`` validates then tests the best checkpoint: the test's reload of the float weights must not undo
    GPTQ (the solved weights go back in after every load)."""
    import lightning as L
    from hydra.utils import instantiate

    cfg = compose_cfg(
        [
            "model/lora=none",
            "quant=w4_gptq",
            "quant.gptq.batches=2",
            "quant.config.default.weight.params.group_size=16",
        ]
    )
    model = instantiate(cfg.model, _convert_="partial")
    callback = instantiate(cfg.quant, _convert_="partial")
    datamodule = instantiate(cfg.data)
    trainer = L.Trainer(
        callbacks=[callback], max_epochs=1, limit_train_batches=2, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False,
    )  # fmt: skip
    trainer.fit(model, datamodule=datamodule)
    ckpt = tmp_path / "float.ckpt"
    trainer.save_checkpoint(ckpt)
    float_weight = torch.load(ckpt, weights_only=True)["state_dict"][
        "model.bert.encoder.layer.0.output.dense.weight"
    ]
    trainer.validate(model, datamodule=datamodule, ckpt_path=ckpt, verbose=False)
    layer = model.model.bert.encoder.layer[0].output.dense
    solved = layer.linear.weight.detach().clone()
    assert not torch.equal(solved, float_weight)
    assert torch.equal(layer.weight_quantizer(solved), solved)  # on its fixed grid
    trainer.test(model, datamodule=datamodule, ckpt_path=ckpt, verbose=False)
    assert torch.equal(layer.linear.weight, solved)
