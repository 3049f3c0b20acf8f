"""Helpers shared by the int8 export tests (tests/test_export_int8*.py): a tiny BERT on the ``quant=int8_scaled``
preset's grid, the input ranges its calibration must record, and a QAT run's checkpoint holding calibrated
ranges."""

from __future__ import annotations

from pathlib import Path

import torch

from adls_lightning.export.compressed import _quant_recipe
from adls_lightning.quant import quantize_model
from adls_lightning.quant.linear import QuantLinear
from tests.helpers import TINY, compose_config

# the tiny data set (tests/conftest.py: 400 training reviews) with a run's sizes that fit it
SMALL_DATA = ["data.train_size=64", "data.val_size=16", "data.test_size=40", "data.max_length=32"]
PTQ = ["quant=int8_scaled", "quant.mode=ptq"]
# tiny_bert: 2 layers x (query, key, value, attention output, intermediate, output) + pooler + classifier
TINY_LINEARS = 14
CALIBRATION_BATCHES = 3


def quantize_as_preset(model, preset: str) -> None:
    """``model`` quantized in place by the ``quant=<preset>`` preset's own recipe (composed from conf/)."""
    cfg = compose_config("train", [*TINY, f"quant={preset}"])
    quantize_model(model, _quant_recipe(cfg.quant.config, "quant.config"))


def int8_scaled_model(tiny_bert, seed: int = 0, preset: str = "int8_scaled"):
    """A tiny BERT quantized by the ``quant=<preset>`` preset's own recipe (composed from conf/), with weights
    of std 1/sqrt(fan_in) so its labels depend on the input, and random calibration batches of token ids."""
    model = tiny_bert(seed=seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if parameter.dim() == 2 and "embeddings" not in name:
                parameter.normal_(0, parameter.shape[1] ** -0.5)
    quantize_as_preset(model, preset)
    generator = torch.Generator().manual_seed(seed)
    batches = [torch.randint(0, model.config.vocab_size, (4, 12), generator=generator) for _ in range(5)]
    return model.eval(), batches


def record_input_ranges(model, batches) -> dict[str, float]:
    """max |input| of every quantized layer over ``batches`` of the float model (the quantizers passing through,
    as in calibration), by forward pre-hooks: the range min-max calibration must have recorded."""
    ranges: dict[str, float] = {}
    layers = {name: m for name, m in model.named_modules() if isinstance(m, QuantLinear)}

    def hook(name):
        def record(module, args):
            ranges[name] = max(ranges.get(name, 0.0), float(args[0].abs().max()))

        return record

    handles = [layer.register_forward_pre_hook(hook(name)) for name, layer in layers.items()]
    saved = {name: layer.data_in_quantizer for name, layer in layers.items()}
    try:
        for layer in layers.values():
            layer.data_in_quantizer = None  # calibration passes inputs through unquantized
        with torch.no_grad():
            for ids in batches:
                model(input_ids=ids)
    finally:
        for name, layer in layers.items():
            layer.data_in_quantizer = saved[name]
        for handle in handles:
            handle.remove()
    return ranges


def calibrated_run_checkpoint(run: Path, preset: str):
    """A run folder ``run`` whose ``checkpoints/qat.ckpt`` holds a tiny merged model on ``quant=<preset>``'s recipe
    with every static scale calibrated (as a QAT run's checkpoint holds them) and whose Hydra record names the
    preset; returns the checkpoint and the module saved."""
    import lightning
    import yaml

    from adls_lightning.lora import merge_lora
    from adls_lightning.quant.scaled import calibrate
    from tests.helpers import build_module

    torch.manual_seed(1)
    module = build_module(TINY)
    merge_lora(module)
    quantize_as_preset(module.model, preset)
    ids = [torch.randint(0, module.model.config.vocab_size, (2, 10)) for _ in range(2)]
    calibrate(module.model.eval(), ids, lambda batch: module.model(input_ids=batch), 2)
    (run / "checkpoints").mkdir(parents=True)
    (run / ".hydra").mkdir()
    (run / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump([*TINY, f"quant={preset}"]))
    ckpt = run / "checkpoints" / "qat.ckpt"
    torch.save({"state_dict": module.state_dict(), "pytorch-lightning_version": lightning.__version__}, ckpt)
    return ckpt, module
