"""The built-in number formats of the ADLS labs, one module per format family; importing this package registers them.

* :mod:`~adls_lightning.quant.formats.fixed_point`: ``integer`` (signed fixed point);
* :mod:`~adls_lightning.quant.formats.minifloat`: ``minifloat_ieee``, ``minifloat_denorm`` and ``log`` (elementwise
  sign + magnitude formats);
* :mod:`~adls_lightning.quant.formats.block`: ``block_fp``, ``block_minifloat``, ``block_log`` (a value shared
  per block of the last dimension);
* :mod:`~adls_lightning.quant.formats.binary`: ``binary``, ``binary_scaling``, ``binary_residual`` and
  ``ternary`` (one or two bits per element, weights by default);
* :mod:`~adls_lightning.quant.formats.mxint8`: ``mxint8`` (OCP Microscaling, the project's MXINT8 kernels);
* :mod:`~adls_lightning.quant.formats.float32_grid`: the float32 bit arithmetic that rounds to floating-point and
  logarithmic grids, shared by the minifloat and block families.

What every format shares (:class:`~adls_lightning.quant.quantizers.Quantizer`, the registry, the parameter
validators) is in :mod:`adls_lightning.quant.quantizers`; GPTQ, SmoothQuant, calibration and the scaled integer
are modules of :mod:`adls_lightning.quant` beside this package, not part of a format.

The imports below are the registration order, which is the order of
:data:`~adls_lightning.quant.quantizers.QUANTIZERS` (the mixed-precision search space, the docs and the tests
iterate it); :mod:`adls_lightning.quant` imports this package before :mod:`~adls_lightning.quant.scaled`, so
``scaled_integer`` comes last.
"""

# isort: off
from adls_lightning.quant.formats import fixed_point, minifloat, block, binary, mxint8

# isort: on

__all__ = ["fixed_point", "minifloat", "block", "binary", "mxint8"]
