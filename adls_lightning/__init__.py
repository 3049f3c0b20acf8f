"""adls-lightning: Lightning + Hydra framework for compressing BERT-class models (the Imperial ADLS labs)."""

__version__ = "0.1.0"
from adls_lightning import mxint8  # noqa: E402,F401  (registers torch.ops.adls.mxint8_*; loads the native kernels if built)
from adls_lightning.data import tasks  # noqa: E402,F401  (registers the config resolver task_main_metric)
