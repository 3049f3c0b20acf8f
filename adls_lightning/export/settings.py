"""The export tools' settings, checked before anything heavy is imported: what :mod:`adls_lightning.tools.export`
parses its command line into (:class:`ExportSettings`, with the self-check's :class:`CheckSettings`), the error an
export whose runtime misses PyTorch raises (:class:`ExportCheckError`) and ``adls-predict``'s usage line. Imports
nothing beyond the standard library and :mod:`adls_lightning.errors`, so ``adls-export --help`` and a bad option
answer at once; the verbs are :mod:`adls_lightning.export.from_checkpoint`, :mod:`adls_lightning.export.selfcheck`
and :mod:`adls_lightning.export.predict`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from adls_lightning.errors import ConfigError

PREDICT_USAGE = "adls-predict DIR [TEXT ...] [file=PATH] [batch_size=32]"


class ExportCheckError(RuntimeError):
    """The exported model's ONNX Runtime logits differ from PyTorch's beyond the stated tolerance."""


CHECK_MODES = ("full", "agreement", "none")
#: the export command's options of the check, with their defaults
OPTIONS = {
    "check": "full",
    "check_rows": "200",
    "check_threads": "1",
    "check_tokens": "128",
    "check_batches": "1,8",
    "check_rounds": "5",
}


@dataclass(frozen=True)
class CheckSettings:
    """How :func:`self_check` measures (the export command's ``check*`` options)."""

    mode: str = "full"
    rows: int = 200
    threads: int = 1
    tokens: int = 128
    batches: tuple[int, ...] = (1, 8)
    rounds: int = 5

    @classmethod
    def from_options(cls, options: dict[str, Any]) -> CheckSettings:
        """The settings of ``options`` (the command's strings).

        Raises:
            ConfigError: naming the first bad key and what would be valid.
        """
        mode = str(options.get("check", "full"))
        if mode not in CHECK_MODES:
            raise ConfigError(f"check={mode}: must be one of {', '.join(CHECK_MODES)}")

        def positive(key: str) -> int:
            value = str(options.get(key, OPTIONS[key]))
            try:
                number = int(value)
            except ValueError:
                number = 0
            if number <= 0:
                raise ConfigError(f"{key}={value}: must be a positive integer, e.g. {OPTIONS[key]}")
            return number

        text = str(options.get("check_batches", OPTIONS["check_batches"]))
        try:
            batches = tuple(int(b) for b in text.split(","))
        except ValueError:
            batches = ()
        if not batches or min(batches) <= 0:
            raise ConfigError(
                f"check_batches={text}: must be positive batch sizes separated by commas, e.g. 1,8"
            )
        return cls(
            mode,
            positive("check_rows"),
            positive("check_threads"),
            positive("check_tokens"),
            batches,
            positive("check_rounds"),
        )


FORMATS = ("mxint8", "hf", "onnx")


@dataclass(frozen=True)
class ExportSettings:
    """What to export and how (the export command's options, checked)."""

    ckpt: Path
    out: Path
    format: str = "mxint8"
    group_size: int = 32
    #: regexes of linear layer names left float (``format=mxint8``)
    exclude: tuple[str, ...] = ("classifier",)
    pack_embeddings: bool = False
    #: ``format=onnx``: True (ONNX Runtime's dynamic int8 beside the float graph), ``"scaled"`` (the run's int8),
    #: ``"auto"`` (the int8 runtime measured fastest on this CPU kind: :func:`choose_int8_runtime`)
    int8: bool | str = False
    #: ``int8=scaled``'s runtime: ``auto`` (the one measured faster on this CPU kind at the run's own codes:
    #: :func:`scaled_int8_runtime`), ``onnx`` (ONNX Runtime's QDQ graph) or ``pt2e`` (an AOTInductor package)
    int8_runtime: str = "auto"
    #: ``format=onnx``: True (GPTQ 4-bit codes as ``MatMulNBits``), ``"int8_inputs"`` (inputs quantized per block)
    int4: bool | str = False
    check: CheckSettings = field(default_factory=CheckSettings)
    #: ``out`` may hold files: an earlier export's are replaced (:func:`~adls_lightning.export.from_checkpoint.
    #: replace_earlier_export`), anything else stays
    overwrite: bool = False
    #: the calling tool's own keys, named when an override sets a key the run's config lacks
    tool_keys: tuple[str, ...] = ()
