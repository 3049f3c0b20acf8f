"""Quantization: fake quantizers for every format of the ADLS labs, ``QuantLinear``, typed recipes, ``quantize_model``.

.. code-block:: python

    from adls_lightning.quant import LayerRecipe, make_quantizer, quantize_model, quantization_report

    make_quantizer("integer", width=8, frac_width=4)(x)  # fake-quantized x, STE gradient
    quantize_model(model, LayerRecipe.uniform("integer", width=8, frac_width=4))  # typed recipe
    quantize_model(model, {"by": "type", "linear": {"config": {"name": "integer", ...}}})  # the labs' dict
    quantize_model(model, "lab_integer.toml")  # a lab config file ([passes.quantize])
    quantization_report(model)  # quant/avg_weight_bits, quant/avg_act_bits, quant/weight_bytes
    weight_storage(model)  # quant/avg_weight_bits, quant/weight_bytes (packed MXINT8 layers too)
    quantize_model(model, QuantRecipe(softmax={"data_in": ...}, gelu=...))  # the encoder's points (points.py)

See ``docs/quantization.md``.
"""

from adls_lightning.lab_config import load_lab_config
from adls_lightning.quant import formats  # noqa: F401  (registers the built-in formats, in order, before scaled)
from adls_lightning.quant.linear import SLOTS, QuantLinear
from adls_lightning.quant.mase import from_mase, to_recipe
from adls_lightning.quant.points import find_points, quantized_points
from adls_lightning.quant.quantizers import QUANTIZERS, Quantizer, make_quantizer, register_format
from adls_lightning.quant.recipe import LayerRecipe, OperandRecipe, QuantRecipe
from adls_lightning.quant.scaled import (
    ScaledIntegerQuantizer,
    calibrate,
    calibrating,
    init_learned_steps,
)
from adls_lightning.quant.transform import (
    check_recipe_fits,
    find_linear_layers,
    quantization_report,
    quantize_model,
    quantized_layers,
    weight_storage,
)

__all__ = [
    "QUANTIZERS",
    "SLOTS",
    "LayerRecipe",
    "OperandRecipe",
    "QuantLinear",
    "QuantRecipe",
    "Quantizer",
    "ScaledIntegerQuantizer",
    "calibrate",
    "init_learned_steps",
    "calibrating",
    "check_recipe_fits",
    "find_linear_layers",
    "find_points",
    "from_mase",
    "load_lab_config",
    "make_quantizer",
    "quantization_report",
    "quantize_model",
    "quantized_layers",
    "quantized_points",
    "register_format",
    "to_recipe",
    "weight_storage",
]
