"""Save a fine-tuned (or compressed) checkpoint as a folder that serves without the project's training setup.

Three formats (``python -m adls_lightning.export ckpt=PATH out=DIR [format=mxint8|hf|onnx]``):

* ``mxint8``: the Hugging Face model with its linear layers (LoRA merged first, the classifier excluded) packed
  as :class:`~adls_lightning.mxint8.QLinearPacked`, optionally its word embeddings as
  :class:`~adls_lightning.mxint8.QEmbeddingPacked`. ``model.safetensors`` holds the state dict as is (int8
  mantissas, uint8 scales, float tensors for what stays float); ``mxint8_config.json`` holds the Hugging Face
  config and which modules are packed with which group size. :func:`load_packed` rebuilds the model from the
  folder alone (``from_config``, no network, no checkpoint) and loads the tensors strictly.
* ``hf``: the merged model's ``save_pretrained`` (safetensors), loadable by ``transformers`` anywhere.
* ``onnx``: the merged model as ``model.onnx``, checked in ONNX Runtime (:mod:`adls_lightning.export.onnx`).

All also write ``config.json`` with the task's label names and how the run fed it texts, and the tokenizer when it
can be loaded offline: the folder predicts alone (:mod:`adls_lightning.export.folder`,
:mod:`adls_lightning.export.predict`).
"""

from __future__ import annotations

import importlib
from typing import Any

# The package's names live in adls_lightning.export.packed (torch, transformers and the MXINT8 layers: seconds to
# import) and are loaded on first use, so the export tools answer --help and refuse bad options at once.
_PACKED_NAMES = (
    "EXPORT_FORMATS",
    "CONFIG_FILE",
    "WEIGHTS_FILE",
    "FORMAT_VERSION",
    "PackedExport",
    "word_embedding_names",
    "pack_for_export",
    "save_packed",
    "load_packed",
    "folder_bytes",
)
__all__ = list(_PACKED_NAMES)


def __getattr__(name: str) -> Any:
    if name in _PACKED_NAMES:
        return getattr(importlib.import_module("adls_lightning.export.packed"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
