"""Quantization: fake quantizers for every format of the ADLS labs, ``QuantLinear`` and ``quantize_model``.

.. code-block:: python

    from adls_lightning.quant import make_quantizer, quantize_model, quantization_report

    make_quantizer("integer", width=8, frac_width=4)(x)  # fake-quantized x, STE gradient
    quantize_model(model, {"by": "type", "linear": {"config": {"name": "integer", ...}}})
    quantization_report(model)  # quant/avg_weight_bits, quant/avg_act_bits, quant/weight_bytes

See ``docs/quantization.md``.
"""

from adls_lightning.quant.linear import SLOTS, QuantLinear
from adls_lightning.quant.quantizers import QUANTIZERS, Quantizer, make_quantizer, register_format
from adls_lightning.quant.transform import (
    QuantConfig,
    find_linear_layers,
    quantization_report,
    quantize_model,
    quantized_layers,
)

__all__ = [
    "QUANTIZERS",
    "SLOTS",
    "QuantConfig",
    "QuantLinear",
    "Quantizer",
    "find_linear_layers",
    "make_quantizer",
    "quantization_report",
    "quantize_model",
    "quantized_layers",
    "register_format",
]
