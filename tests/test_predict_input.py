"""What ``adls-predict`` and ``predict()`` take as texts, on a tiny IMDb export: input that is not UTF-8 is one
line naming the line, a TAB line for IMDb (single texts, although its export records ``text_pair: null``) is
refused saying so, texts of both kinds for a task whose export does not say are refused truly, an empty text or
half of a pair is refused by the command and the library alike; a folder whose only graph is ``model_int8.onnx``
says that it runs it."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from adls_lightning.errors import ConfigError
from adls_lightning.export.folder import INPUTS_KEY
from adls_lightning.export.predict import SINGLE_TEXT_TASKS, predict, read_texts
from adls_lightning.runs.loading import PROJECT_ROOT
from tests.helpers import ENV, TINY, assert_one_line_error, run_export, trained_checkpoint

# the export's data: conftest's tiny IMDb, short texts
OVERRIDES = [*TINY, "data.max_length=32", "data.val_size=100"]


@pytest.fixture(scope="module")
def exports(tmp_path_factory, tiny_imdb_dir) -> dict[str, Path]:
    """A tiny IMDb checkpoint exported as ``hf`` and as ``onnx int8=true`` with its ``model.onnx`` removed."""
    base = tmp_path_factory.mktemp("predict_input")
    cache = base / "cache"
    overrides = [*OVERRIDES, f"data.data_dir={tiny_imdb_dir}", f"paths.cache_dir={cache}"]
    ckpt = base / "tiny.ckpt"
    trained_checkpoint(ckpt, overrides)
    for name, options in {"hf": ["format=hf"], "onnx": ["format=onnx", "int8=true"]}.items():
        result = run_export(f"ckpt={ckpt}", f"out={base / name}", *options, *overrides)
        assert result.returncode == 0, result.stderr[-3000:]
    (base / "onnx" / "model.onnx").unlink()
    return {"hf": base / "hf", "int8_only": base / "onnx"}


def run_predict(*args: str, stdin: bytes = b"") -> subprocess.CompletedProcess:
    """``adls-predict ARGS`` as documented, stdin given as bytes (the terminal's or a pipe's, any encoding)."""
    command = [sys.executable, "-m", "adls_lightning.export.predict", *args]
    return subprocess.run(command, input=stdin, capture_output=True, env=ENV, cwd=PROJECT_ROOT, timeout=600)


def text_result(result: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    return subprocess.CompletedProcess(
        result.args, result.returncode, result.stdout.decode(), result.stderr.decode()
    )


def refused(result: subprocess.CompletedProcess) -> str:
    """The one error line of a refused command (exit code 2, nothing on stdout, no traceback)."""
    result = text_result(result)
    line = assert_one_line_error(result)
    assert result.stdout == "" and result.stderr.strip() == line, result.stderr
    return line


def with_inputs(exports: dict[str, Path], tmp_path: Path, **inputs) -> Path:
    """A copy of the hf export whose config.json records ``inputs`` for how the run fed its texts."""
    folder = tmp_path / "recorded"
    shutil.copytree(exports["hf"], folder)
    config = json.loads((folder / "config.json").read_text())
    config[INPUTS_KEY].update(inputs)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_input_that_is_not_utf8_is_one_line_naming_the_line(exports, tmp_path):
    latin1 = "a great film\ncafé and croissants\n".encode("latin-1")  # é is 0xe9, alone: no UTF-8
    line = refused(run_predict(str(exports["hf"]), stdin=latin1))
    assert line == "error: stdin line 2: not UTF-8 (its byte 4 is 0xe9); valid: UTF-8 text, one text per line"
    reviews = tmp_path / "reviews.txt"
    reviews.write_bytes(latin1)
    line = refused(run_predict(str(exports["hf"]), f"file={reviews}"))
    assert line == (
        f"error: file={reviews} line 2: not UTF-8 (its byte 4 is 0xe9); valid: UTF-8 text, one text per line"
    )
    # the same texts in UTF-8, with Windows line ends and a BOM, are read as the texts themselves
    utf8 = "\ufeffa great film\r\ncafé and croissants\r\n".encode()
    result = text_result(run_predict(str(exports["hf"]), stdin=utf8))
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    assert rows == predict(exports["hf"], ["a great film", "café and croissants"])


def test_a_tab_line_for_imdb_is_refused_as_a_pair_for_a_task_of_single_texts(exports):
    config = json.loads((exports["hf"] / "config.json").read_text())
    assert config[INPUTS_KEY]["task"] == "imdb" and config[INPUTS_KEY]["text_pair"] is None
    expected = (
        f"error: {exports['hf']}: imdb takes single texts, text {{}} is a pair (a TAB made it one); give each "
        "text without a TAB"
    )
    assert refused(run_predict(str(exports["hf"]), stdin=b"good\tfilm\n")) == expected.format(1)
    # the first line no longer decides: a single text then a pair names the pair
    assert refused(run_predict(str(exports["hf"]), stdin=b"bad film\na great\tfilm\n")) == expected.format(2)
    assert refused(run_predict(str(exports["hf"]), stdin=b"a great\tfilm\nbad film\n")) == expected.format(1)
    with pytest.raises(ConfigError, match=r"imdb takes single texts, text 1 is a pair"):
        predict(exports["hf"], [("good", "film")])


def test_imdb_is_known_as_a_task_of_single_texts():
    from adls_lightning.data.datamodule import IMDbDataModule

    assert IMDbDataModule.TASK_NAME in SINGLE_TEXT_TASKS


def test_texts_of_both_kinds_for_a_task_the_export_does_not_describe_are_refused_truly(exports, tmp_path):
    folder = with_inputs(exports, tmp_path, task="folder", text_pair=None)
    line = refused(run_predict(str(folder), stdin=b"a great\tfilm\nbad film\n"))
    assert line == (
        f"error: {folder}: text 1 is a pair, text 2 a single text; its export does not record whether folder "
        "takes pairs or single texts: give every text as a pair (two texts and a TAB) or every text as a single one"
    )
    # one kind throughout is taken, whichever it is
    assert len(predict(folder, [("a great", "film"), ("bad", "film")])) == 2
    assert len(predict(folder, ["a great film", "bad film"])) == 2


EMPTY_LINES = [
    ("", "empty"),
    ("   ", "empty"),
    ("a great film\t", "a pair whose second text is empty"),
    ("\ta great film", "a pair whose first text is empty"),
    ("\t ", "empty"),
]


@pytest.mark.parametrize(("line", "what"), EMPTY_LINES)
def test_an_empty_text_or_half_of_a_pair_is_refused_by_the_reader_and_predict(exports, tmp_path, line, what):
    # a task of pairs, so that a half-empty pair is refused for its emptiness, not for being a pair
    folder = with_inputs(exports, tmp_path, task="glue/mrpc", text_pair=True)
    needs = "a text holds more than spaces (a pair: two such texts and a TAB)"
    with pytest.raises(ConfigError) as refusal:
        read_texts(f"the film was great\ta great film\n{line}\n".encode(), "stdin")
    assert str(refusal.value) == f"stdin line 2: {what}; one text per line, {needs}"
    text = tuple(line.split("\t")) if "\t" in line else line
    with pytest.raises(ConfigError, match=rf"^text 2: {what}; "):
        predict(folder, [("a", "b"), text])


@pytest.mark.parametrize(("line", "what"), [EMPTY_LINES[0], EMPTY_LINES[2]])
def test_an_empty_text_or_half_of_a_pair_is_refused_by_the_command(exports, tmp_path, line, what):
    # the command's two ways in (stdin, arguments), for an empty line and a half-empty pair: the reader above
    folder = with_inputs(exports, tmp_path, task="glue/mrpc", text_pair=True)
    needs = "a text holds more than spaces (a pair: two such texts and a TAB)"
    stdin = f"the film was great\ta great film\n{line}\n".encode()
    assert refused(run_predict(str(folder), stdin=stdin)) == (
        f"error: stdin line 2: {what}; one text per line, {needs}"
    )
    assert refused(run_predict(str(folder), "a\tb", "--", line)) == f"error: text 2: {what}; {needs}"


def test_an_empty_text_is_refused_for_a_task_of_single_texts(exports):
    needs = "a text holds more than spaces (a pair: two such texts and a TAB)"
    assert refused(run_predict(str(exports["hf"]), "a great film", "")) == f"error: text 2: empty; {needs}"
    with pytest.raises(ConfigError, match=r"^text 1: empty; "):
        predict(exports["hf"], [""])


def test_a_folder_whose_only_graph_is_int8_says_so(exports):
    folder = exports["int8_only"]
    assert sorted(p.name for p in folder.glob("*.onnx")) == ["model_int8.onnx"]
    result = text_result(run_predict(str(folder), "a great film", "bad film"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stderr.strip().splitlines() == [
        f"note: {folder}: runs model_int8.onnx (no model.onnx in it)"
    ]
    assert [json.loads(line) for line in result.stdout.splitlines()] == predict(
        folder / "model_int8.onnx", ["a great film", "bad film"]
    )
    # the graph named: nothing to say
    named = text_result(run_predict(str(folder / "model_int8.onnx"), "a great film"))
    assert named.returncode == 0 and named.stderr.strip() == "", named.stderr[-3000:]
