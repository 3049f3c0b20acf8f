"""adls-lightning: Lightning + Hydra framework for compressing BERT-class models (the Imperial ADLS labs).

Importing the package imports no torch: a refused command line (the pre-flight checks) answers in about a second.
``torch.ops.adls.*`` are registered by ``adls_lightning.mxint8`` (and ``adls_lightning.dropout``), which every
module that uses them imports.
"""

import logging

__version__ = "0.1.0"


def _torchao_import_notice(record: logging.LogRecord) -> bool:
    """False for the lines importing torchao (PEFT imports it wherever it is installed) prints on every command,
    which say nothing about this project's use of it: a CUDA kernel library that does not load (mxfp8, cutlass:
    never on a CPU-only torch; the PT2E flow does not use them) and torch 2.13 deprecating torchao 0.18's
    registration of its enums."""
    message = record.getMessage()
    return not (
        (message.startswith("Failed to load") and ".so" in message)
        or "is an Enum subclass and is now natively supported" in message
    )


for _name in ("torchao", "torch.utils._pytree"):
    logging.getLogger(_name).addFilter(_torchao_import_notice)

from adls_lightning.data import tasks  # noqa: E402,F401  (registers the config resolver task_main_metric)
