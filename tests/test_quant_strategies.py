"""Quantization methods as strategies of the one ``QuantizationCallback`` (``adls_lightning/callbacks/quant_methods.py``):
each preset's settings choose its method's class, methods that decide the grid each their own way are refused
together, and the record a PTQ run writes equals the one built by hand from the run's settings and its saved state."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from adls_lightning.app.training import run
from adls_lightning.build import build
from adls_lightning.callbacks.quant_methods import GPTQ, LSQ, QUANT_METHODS, RoundToNearest, SmoothQuant
from adls_lightning.callbacks.quantization import QuantizationCallback
from adls_lightning.compression_record import CHECKPOINT_KEY, COMPRESSED_CHECKPOINT
from adls_lightning.errors import ConfigError
from adls_lightning.quant.recipe import OPERANDS
from tests.helpers import LAYER_NAMES, SHORT_RUN, assert_one_line_error, run_train

SMOOTHQUANT = ["quant.smoothquant.alpha=0.5", "quant.calibration.batches=2"]
CHOSEN = {
    "int8": (["quant=int8"], RoundToNearest),
    "int8_scaled": (["quant=int8_scaled"], RoundToNearest),
    "int8_scaled_ptq": (["quant=int8_scaled", "quant.mode=ptq"], RoundToNearest),
    "w4_gptq": (["quant=w4_gptq"], GPTQ),
    "w4_gptq_rtn": (["quant=w4_gptq", "quant.gptq=null"], RoundToNearest),
    "int8_scaled_smoothquant": (["quant=int8_scaled", *SMOOTHQUANT], SmoothQuant),
    "int8_lsq": (["quant=int8_lsq"], LSQ),
}


@pytest.mark.parametrize("case", list(CHOSEN))
def test_each_preset_chooses_its_method(compose_cfg, case):
    overrides, expected = CHOSEN[case]
    callback = build(compose_cfg(overrides).quant, "quant")
    assert isinstance(callback, QuantizationCallback)
    assert type(callback.method) is expected
    assert QUANT_METHODS[expected.name] is expected


def test_every_registered_method_is_chosen_by_some_preset():
    assert {cls for _, cls in CHOSEN.values()} == set(QUANT_METHODS.values())


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["quant=int8_lsq", *SMOOTHQUANT], r"^quant.smoothquant.alpha with lsq: true in quant.config: "),
        (
            ["quant=int8_lsq", "quant.mode=ptq", "quant.gptq={batches: 2}"],
            r"^quant.gptq with lsq: true in quant.config: ",
        ),
    ],
)
def test_lsq_with_another_grid_method_is_refused(compose_cfg, overrides, message):
    with pytest.raises(ConfigError, match=message):
        build(compose_cfg(overrides).quant, "quant")


def test_train_refuses_lsq_with_smoothquant_before_writing(tiny_imdb_dir, cache_dir, tmp_path):
    """The user's path: ``python train.py quant=int8_lsq quant.smoothquant.alpha=0.5 ...`` is one line, exit 2, and
    the run folder is not made."""
    out = tmp_path / "run"
    proc = run_train(tiny_imdb_dir, cache_dir, out, "quant=int8_lsq", *SMOOTHQUANT)
    assert_one_line_error(proc, "error: quant.smoothquant.alpha with lsq: true in quant.config")
    assert not out.exists()


PTQ_RUNS = {
    "round_to_nearest": ["quant=int8_scaled", "quant.mode=ptq", "quant.calibration.batches=2"],
    "smoothquant": ["quant=int8_scaled", "quant.mode=ptq", *SMOOTHQUANT],
    "gptq": ["quant=w4_gptq", "quant.gptq.batches=2"],
}


@pytest.mark.parametrize("case", list(PTQ_RUNS))
def test_ptq_record_is_the_one_built_from_the_settings(compose_cfg, tmp_path, case):
    """The record in the PTQ run's evaluated checkpoint, field by field, from what the user set (the composed
    ``quant`` settings) and what the saved state holds (SmoothQuant's wrapped quantizers), not from the method."""
    cfg = compose_cfg(["model/lora=none", *SHORT_RUN, *PTQ_RUNS[case]])
    run(cfg)
    checkpoint = torch.load(tmp_path / "run" / "checkpoints" / COMPRESSED_CHECKPOINT, weights_only=False)
    settings = OmegaConf.to_container(cfg.quant, resolve=True)
    default = settings["config"]["default"]
    operands = {operand: default.get(operand) for operand in OPERANDS}
    alpha = settings["smoothquant"]["alpha"]
    # a smoothed layer's input quantizer is SmoothQuant's wrapper: its state sits under ``inner.``
    wrapped = [f"model.{name}.data_in_quantizer.inner." for name in LAYER_NAMES]
    smoothed = sorted(
        name
        for name, prefix in zip(LAYER_NAMES, wrapped, strict=True)
        if any(key.startswith(prefix) for key in checkpoint["state_dict"])
    )
    expected = {
        "layers": {name: operands for name in LAYER_NAMES},
        "mode": "ptq",
        "applied": True,
        "smoothquant": None if alpha is None else {"alpha": alpha, "scope": settings["smoothquant"]["scope"]},
        "smoothed": smoothed,
        "gptq": settings["gptq"] is not None,
        "lsq": False,
        "calibrated": settings["calibration"]["batches"] > 0,
    }
    assert checkpoint[CHECKPOINT_KEY]["quantization"] == expected
    # SmoothQuant's paper scope: query, key, value and the FFN input of each of the 2 layers
    assert len(smoothed) == (8 if case == "smoothquant" else 0)
