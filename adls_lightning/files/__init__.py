"""Writing files so that a killed run never leaves a half-written one that looks whole.

- :mod:`.atomic`: atomic writes of bytes and JSON (a temporary file beside the target, renamed over it). Imports
  neither torch nor Lightning, so the pre-flight check, the study sweeper and the reports can use it cheaply.
- :mod:`.lightning_io`: Lightning's checkpoint writer and CSV logger over those writes (imports torch).
- :mod:`.earlier_outputs`: a tool's earlier outputs under ``overwrite=true``, set aside while the new run writes and
  put back when it fails (no torch).

This package's ``__init__`` imports nothing, so ``adls_lightning.files.atomic`` stays torch-free.
"""
