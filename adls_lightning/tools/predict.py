"""Labels of texts from an exported folder: ``adls-predict DIR [TEXT ...] [file=PATH] [batch_size=32]`` (also
``python -m adls_lightning.export.predict``).

``DIR`` is a folder written by ``python -m adls_lightning.export`` in any format (``hf``, ``mxint8``, ``onnx``;
an ONNX folder runs ``model.onnx``, or give the path of its other graph, e.g. ``DIR/model_int8.onnx``). The
folder alone is read: its ``config.json`` (label names, how the run truncated its texts), its tokenizer and its
weights; no run, data or network. Texts come from the arguments, else from ``file=PATH``, else from stdin, one per
line, UTF-8; for a task of pairs (MRPC, MNLI, ...) a TAB separates the two texts of a pair. An argument spelt like an
option (``name=value``, no space) that is not one is refused; every argument after ``--`` is a text as written
(``adls-predict DIR -- "x=1"``), and so is every line of a file or stdin. Prints one JSON line per
text, in order: ``{"label": NAME, "scores": {NAME: probability, ...}}`` (a regression:
``{"label": value, "scores": value}``). ``batch_size``: texts per forward pass.

Bad input (an unknown option, a path that is not an export, a damaged config or weights, no tokenizer in the
folder, single texts for a task of pairs or pairs for one of single texts (IMDb's), an empty text or half of a
pair, a line that is not UTF-8): one ``error:`` line on stderr naming it, exit code 2, nothing printed on stdout.
A folder whose graph is not ``model.onnx`` says on stderr which one runs. ``--help``: this text.

The library verb is :func:`adls_lightning.export.predict.predict` (``predict(folder, texts, batch_size=32)``; a
text of a pair task is a ``(first, second)`` tuple); :class:`~adls_lightning.export.predict.Predictor` keeps the
model loaded between calls.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from adls_lightning.errors import ConfigError
from adls_lightning.export.settings import PREDICT_USAGE as USAGE
from adls_lightning.logs import configure_tool
from adls_lightning.tools.options import HELP_FLAGS, run_tool, split_options

OPTIONS = {"file": None, "batch_size": "32"}


#: a token spelt as an option, ``name=value`` with no space: a misspelt option (``btach_size=4``), not a text
OPTION_LIKE = re.compile(r"[A-Za-z_]\w*=\S*")
#: after it every token is ``DIR`` or a text, as written (a text spelt like an option: ``-- "x=1"``)
END_OF_OPTIONS = "--"


def split_command_line(argv: Sequence[str]) -> tuple[dict[str, Any], list[str]]:
    """This command's options (``file=``, ``batch_size=``, ``--help``) and its bare arguments, ``DIR`` then the
    texts. A text may hold ``=`` and spaces; one spelt like an option (``name=value``, no space) is refused unless
    it comes after ``--``, and so is an unknown ``--flag``. ``DIR`` may be named like an option (a sweep's
    ``lr=0.1`` folder): a first bare argument that exists is ``DIR``.

    Raises:
        HelpRequested: ``--help`` / ``-h`` before ``--``.
        ConfigError: an unknown option, naming it, the valid ones and ``--``.
    """
    option_tokens, bare = [], []
    for index, token in enumerate(argv):
        if token == END_OF_OPTIONS:
            bare.extend(argv[index + 1 :])
            break
        key = token.partition("=")[0]
        if key in OPTIONS and "=" in token or token in HELP_FLAGS:
            option_tokens.append(token)
        elif token.startswith("--") or (OPTION_LIKE.fullmatch(token) and (bare or not Path(token).exists())):
            raise ConfigError(
                f"{key}: unknown option (valid: {', '.join(f'{k}=' for k in OPTIONS)}; usage: {USAGE}); "
                f"to predict a text spelt like an option, put it after --: adls-predict DIR -- {token!r}"
            )
        else:
            bare.append(token)
    options, _ = split_options(option_tokens, OPTIONS, USAGE, overrides=False)
    return options, bare


def predict_command(argv: Sequence[str]) -> None:
    """The command (for :func:`main`): every text read and checked, then printed a batch at a time."""
    options, bare = split_command_line(argv)
    if not bare:
        raise ConfigError(f"DIR: expected an exported folder ({USAGE})")
    try:
        batch_size = int(options["batch_size"])
    except ValueError:
        batch_size = 0
    if batch_size < 1:
        raise ConfigError(f"batch_size={options['batch_size']}: must be a positive integer, e.g. 32")
    folder, arguments = bare[0], bare[1:]
    if arguments and options["file"]:
        raise ConfigError(f"file={options['file']}: texts come from the arguments or a file, not both")
    # the folder before any input is read, and before torch is imported (seconds): a wrong one is refused at once
    from adls_lightning.export.folder import check_folder
    from adls_lightning.export.recipe import ExportRecipe

    export = check_folder(Path(folder), USAGE)
    ExportRecipe.read(export.folder)
    from adls_lightning.export.predict import Predictor, parse_text, read_texts

    predictor = Predictor(folder)
    if arguments:
        texts = [parse_text(text, f"text {number}") for number, text in enumerate(arguments, start=1)]
    elif options["file"]:
        path = Path(options["file"])
        try:
            data = path.read_bytes()
        except OSError as error:
            raise ConfigError(f"file={path}: cannot be read ({str(error).splitlines()[0][:200]})") from None
        texts = read_texts(data, f"file={path}")
    else:
        # bytes, so that a line that is not UTF-8 is refused by its number (a StringIO in tests has no buffer)
        stdin = getattr(sys.stdin, "buffer", None)
        texts = read_texts(
            stdin.read() if stdin else sys.stdin.read().encode("utf-8", "surrogateescape"), "stdin"
        )
    predictor.check_texts(texts)
    note = export.graph_note(folder)
    if note is not None:
        print(note, file=sys.stderr)
    for batch in predictor.batches(texts, batch_size):
        sys.stdout.write("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in batch))
    sys.stdout.flush()


def main(argv: Sequence[str] | None = None) -> int:
    """``adls-predict`` and ``python -m adls_lightning.export.predict``."""
    configure_tool()
    argv = sys.argv[1:] if argv is None else argv
    return run_tool(lambda: predict_command(argv), __doc__)


if __name__ == "__main__":
    sys.exit(main())
