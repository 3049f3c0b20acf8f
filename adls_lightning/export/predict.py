"""Labels of texts from an exported folder, the folder alone: the verbs behind ``adls-predict``
(:mod:`adls_lightning.tools.predict`, also ``python -m adls_lightning.export.predict``).

:func:`predict` (``predict(folder, texts, batch_size=32)``; a text of a pair task is a ``(first, second)`` tuple)
gives ``{"label": NAME, "scores": {NAME: probability, ...}}`` per text (a regression: the value for both), in
order; :class:`Predictor` keeps the model loaded between calls. The folder is any export (``hf``, ``mxint8``,
``onnx``, mixed): its ``config.json`` (label names, how the run truncated its texts), its tokenizer and its
weights; no run, data or network. :func:`read_texts` turns the bytes of a file or of stdin into texts, one per
line (a TAB makes a pair). Refusals (not an export, damaged, no tokenizer, input that is not UTF-8, an empty text or
half of a pair, texts that do not fit the task) are a ConfigError naming them.
"""

from __future__ import annotations

# python -m adls_lightning.export.predict: the command runs before this module's own imports (torch: seconds)
if __name__ == "__main__":
    import sys

    from adls_lightning.tools.predict import main

    sys.exit(main())

import codecs
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from adls_lightning.data.inputs import MODEL_INPUTS
from adls_lightning.errors import ConfigError
from adls_lightning.export.folder import INPUTS_KEY, check_folder, load_folder
from adls_lightning.export.recipe import ExportRecipe
from adls_lightning.export.settings import PREDICT_USAGE as USAGE

#: what a folder holds when the export saved its tokenizer (one of them is enough for ``AutoTokenizer``)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt")
PAIR_SEPARATOR = "\t"
#: tasks whose export may record ``text_pair: null`` (their labels are given, so the export read no data) although
#: their texts are known to be single: IMDb's reviews (``IMDbDataModule.TASK_NAME``, not imported here: the data
#: modules take seconds to import, and a test keeps the two equal)
SINGLE_TEXT_TASKS = ("imdb",)
#: what a text is, said by every refusal of an empty one
TEXT_NEEDS = "a text holds more than spaces (a pair: two such texts and a TAB)"

Text = str | tuple[str, str]


class Predictor:
    """An exported folder loaded once, turning texts into labels and scores (:meth:`__call__`).

    Raises:
        ConfigError: ``path`` is not an export, is damaged, or holds no tokenizer.
    """

    def __init__(self, path: str | Path, usage: str = USAGE) -> None:
        export = check_folder(Path(path), usage)
        self.path = Path(path)
        self.config = export.config
        self.inputs: dict[str, Any] = self.config.get(INPUTS_KEY) or {}
        labels = self.config.get("id2label") or {}
        self.regression = (
            self.config.get("problem_type") == "regression" or self.config.get("num_labels") == 1
        )
        self.labels = [labels.get(str(i), labels.get(i, str(i))) for i in range(len(labels))]
        self.tokenizer = _tokenizer(export.folder)
        self.tokenizer.truncation_side = self.inputs.get("truncation_side", self.tokenizer.truncation_side)
        positions = self.config.get("max_position_embeddings") or self.tokenizer.model_max_length
        self.max_length = int(
            self.inputs.get("max_length") or min(positions, self.tokenizer.model_max_length)
        )
        self.model = load_folder(self.path, ExportRecipe.read(export.folder), usage)
        if isinstance(self.model, torch.nn.Module):
            self.model.eval()

    @property
    def takes_pairs(self) -> bool | None:
        """True: the run's task gives pairs of texts; False: single texts; None: the export does not say."""
        recorded = self.inputs.get("text_pair")
        if recorded is None and self.inputs.get("task") in SINGLE_TEXT_TASKS:
            return False
        return recorded

    def check_texts(self, texts: Sequence[Text]) -> bool:
        """Whether ``texts`` are pairs; ConfigError naming the first text that is empty (or half of a pair is) or
        does not fit the task."""
        if not texts:
            raise ConfigError(f"no texts to predict ({USAGE}; or one text per line on stdin)")
        pairs = [isinstance(text, tuple | list) for text in texts]
        for row, (text, is_pair) in enumerate(zip(texts, pairs, strict=True), start=1):
            if is_pair and (len(text) != 2 or not all(isinstance(part, str) for part in text)):
                raise ConfigError(f"text {row}: a pair is two strings, got {len(text)} items")
            if not is_pair and not isinstance(text, str):
                raise ConfigError(
                    f"text {row}: a {type(text).__name__}, expected a string or a pair of strings"
                )
            empty = empty_part(text)
            if empty:
                raise ConfigError(f"text {row}: {empty}; {TEXT_NEEDS}")
        task = self.inputs.get("task", "the run's task")
        expected = self.takes_pairs
        if expected is None:
            # the export does not say which the task takes: the texts are all of one kind, whichever it is
            if all(pairs) or not any(pairs):
                return pairs[0]
            pair, single = pairs.index(True) + 1, pairs.index(False) + 1
            raise ConfigError(
                f"{self.path}: text {pair} is a pair, text {single} a single text; its export does not record "
                f"whether {task} takes pairs or single texts: give every text as a pair (two texts and a TAB) or "
                "every text as a single one"
            )
        for row, is_pair in enumerate(pairs, start=1):
            if is_pair != expected:
                what = (
                    f"{task} takes pairs of texts, text {row} is a single text; give each pair as two texts "
                    "separated by a TAB"
                    if expected
                    else f"{task} takes single texts, text {row} is a pair (a TAB made it one); give each text "
                    "without a TAB"
                )
                raise ConfigError(f"{self.path}: {what}")
        return expected

    def batches(self, texts: Sequence[Text], batch_size: int = 32) -> Iterator[list[dict[str, Any]]]:
        """The rows of :meth:`__call__`, a batch at a time (every text checked before the first is run)."""
        if batch_size < 1:
            raise ConfigError(f"batch_size={batch_size}: must be a positive integer, e.g. 32")
        pairs = self.check_texts(texts)
        for start in range(0, len(texts), batch_size):
            chunk = texts[start : start + batch_size]
            encoded = self.tokenizer(
                [text[0] for text in chunk] if pairs else list(chunk),
                [text[1] for text in chunk] if pairs else None,
                truncation=True,
                max_length=self.max_length,
                padding=True,
                return_tensors="pt",
            )
            # single texts take token type 0 everywhere, what the model substitutes (and the run's data omits)
            names = MODEL_INPUTS if pairs else MODEL_INPUTS[:2]
            with torch.inference_mode():
                logits = self.model(**{k: encoded[k] for k in names if k in encoded}).logits.float()
            yield [self.row(scores) for scores in logits]

    def row(self, logits: torch.Tensor) -> dict[str, Any]:
        if self.regression:
            value = float(logits[0])
            return {"label": value, "scores": value}
        probabilities = torch.softmax(logits, -1).tolist()
        names = (
            self.labels
            if len(self.labels) == len(probabilities)
            else [str(i) for i in range(len(probabilities))]
        )
        return {
            "label": names[int(logits.argmax())],
            "scores": dict(zip(names, probabilities, strict=True)),
        }

    def __call__(self, texts: Sequence[Text], batch_size: int = 32) -> list[dict[str, Any]]:
        return [row for batch in self.batches(texts, batch_size) for row in batch]


def predict(folder: str | Path, texts: Sequence[Text], batch_size: int = 32) -> list[dict[str, Any]]:
    """``{"label": name, "scores": {name: probability}}`` per text (a regression: the value for both), in order,
    from the exported ``folder`` alone; a text of a pair task is a ``(first, second)`` tuple.

    Raises:
        ConfigError: the folder is not an export or is damaged, or the texts do not fit its task.
    """
    return Predictor(folder)(list(texts), batch_size)


def _tokenizer(folder: Path):
    from transformers import AutoTokenizer

    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise ConfigError(
            f"{folder}: no tokenizer ({', '.join(TOKENIZER_FILES)}); export the checkpoint again where its "
            "tokenizer loads (the export saves it beside the model)"
        )
    try:
        return AutoTokenizer.from_pretrained(str(folder))
    except Exception as error:  # noqa: BLE001 - transformers raises OSError, ValueError or its tokenizers' own
        raise ConfigError(
            f"{folder}: its tokenizer does not load ({type(error).__name__}: {str(error).splitlines()[0][:200]})"
        ) from None


def parse_text(line: str, where: str = "text") -> Text:
    """One text of the command line or of a line of input: a TAB makes it a pair.

    Raises:
        ConfigError: naming ``where``: more than one TAB, as in a row of a TSV file (GLUE's own files have five
            columns), which is no pair of texts.
    """
    fields = line.split(PAIR_SEPARATOR)
    if len(fields) > 2:
        raise ConfigError(
            f"{where}: {len(fields)} TAB-separated fields; a pair is two texts separated by one TAB "
            "(from a TSV file, cut its two text columns first)"
        )
    return (fields[0], fields[1]) if len(fields) == 2 else line


def empty_part(text: Text) -> str | None:
    """What of ``text`` is empty or only spaces, as a refusal says it (``empty``, ``a pair whose second text is
    empty``); None when nothing is."""
    parts = (text,) if isinstance(text, str) else tuple(text)
    empty = [index for index, part in enumerate(parts) if not part.strip()]
    if not empty:
        return None
    if len(empty) == len(parts):
        return "empty"
    return f"a pair whose {('first', 'second')[empty[0]]} text is empty"


def read_texts(data: bytes, source: str) -> list[Text]:
    """The bytes of a file or of stdin as texts: UTF-8 (a leading BOM dropped), one text per line (ended by LF or
    CRLF; no other character splits a text), a TAB making a pair.

    Raises:
        ConfigError: naming ``source`` and the line: not UTF-8, empty (or half of a pair is), more than one TAB.
    """
    lines = data.removeprefix(codecs.BOM_UTF8).split(b"\n")
    if lines[-1] == b"":  # the last line's end
        lines.pop()
    texts = []
    for number, raw in enumerate(lines, start=1):
        where = f"{source} line {number}"
        try:
            line = raw.decode("utf-8").removesuffix("\r")
        except UnicodeDecodeError as error:
            raise ConfigError(
                f"{where}: not UTF-8 (its byte {error.start + 1} is 0x{raw[error.start]:02x}); valid: UTF-8 "
                "text, one text per line"
            ) from None
        text = parse_text(line, where)
        empty = empty_part(text)
        if empty:
            raise ConfigError(f"{where}: {empty}; one text per line, {TEXT_NEEDS}")
        texts.append(text)
    return texts
