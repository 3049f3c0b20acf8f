"""adls-lightning: Lightning + Hydra framework for compressing BERT-class models (the Imperial ADLS labs).

Importing the package imports no torch: a refused command line (the pre-flight checks) answers in about a second.
``torch.ops.adls.*`` are registered by ``adls_lightning.mxint8`` (and ``adls_lightning.dropout``), which every
module that uses them imports.
"""

__version__ = "0.1.0"
from adls_lightning.data import tasks  # noqa: E402,F401  (registers the config resolver task_main_metric)
