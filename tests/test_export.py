"""``python -m adls_lightning.export``: packed (MXINT8) and Hugging Face folders, reloaded in a fresh process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from adls_lightning.export import CONFIG_FILE, WEIGHTS_FILE, load_packed, pack_for_export
from adls_lightning.export.folder import HF_CONFIG_FILE
from adls_lightning.tools.export import main
from tests.helpers import ENV, TINY, call, merged_model, run_export, trained_checkpoint

LOGITS_SCRIPT = """
import sys, torch
from adls_lightning.export import load_packed
from transformers import AutoModelForSequenceClassification
jobs, out = sys.argv[1], sys.argv[2]
logits = {}
for name, (folder, kind, batches) in torch.load(jobs).items():
    model = load_packed(folder) if kind == "mxint8" else AutoModelForSequenceClassification.from_pretrained(folder).eval()
    with torch.inference_mode():
        logits[name] = [model(input_ids=ids).logits for ids in batches]
    del model
torch.save(logits, out)
"""

# A BERT-base-shaped classifier (12 layers, hidden 768, random weights) built from config
BERT_BASE = [
    *TINY,
    "model.backbone.hidden_size=768",
    "model.backbone.num_hidden_layers=12",
    "model.backbone.num_attention_heads=12",
    "model.backbone.intermediate_size=3072",
]
# (rows, tokens) of the batches each folder is reloaded on
SHAPES = {
    "tiny": [(3, 12)],
    "tiny_embeddings": [(3, 12)],
    "tiny_hf": [(3, 12)],
    "bert_base": [(2, 64)],
    # the fused kernel (16 rows) and dequantize + matmul (128 rows)
    "minilm": [(1, 16), (2, 64)],
    "minilm_embeddings": [(1, 16), (2, 64)],
}


def input_ids(vocab: int, rows: int = 3, tokens: int = 12) -> torch.Tensor:
    return torch.randint(0, vocab, (rows, tokens), generator=torch.Generator().manual_seed(1))


def batches(name: str, vocab: int) -> list[torch.Tensor]:
    return [input_ids(vocab, rows=rows, tokens=tokens) for rows, tokens in SHAPES[name]]


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("ckpt") / "tiny.ckpt"
    trained_checkpoint(path, TINY)
    return path


@pytest.fixture(scope="module")
def minilm_ckpt(tmp_path_factory) -> Path:
    ckpt = tmp_path_factory.mktemp("minilm") / "minilm.ckpt"
    trained_checkpoint(ckpt, [])
    return ckpt


@pytest.fixture(scope="module")
def exports(tmp_path_factory, tiny_ckpt, minilm_ckpt) -> dict[str, dict]:
    """Every folder this file reloads, written once, then all reloaded in ONE fresh process (not the one that
    exported them): ``{name: {"folder", "stdout", "ckpt", "logits"}}``. One export of each kind runs as the user's
    command (the default packed one, ``format=hf``, MiniLM's default timed self-check); the exports that differ from
    those only by an option run through the command's ``main`` here, and one reloading process serves them all:
    each command or reloading process costs ~10 CPU-s of imports, and what the tests check is the folders."""
    root = tmp_path_factory.mktemp("exports")
    bert_base_ckpt = root / "base.ckpt"
    trained_checkpoint(bert_base_ckpt, BERT_BASE)
    runs = {
        # name: (ckpt, as a command?, the command's options)
        "tiny": (tiny_ckpt, True, [*TINY]),
        "tiny_embeddings": (tiny_ckpt, False, ["pack_embeddings=true", *TINY]),
        "tiny_hf": (tiny_ckpt, True, ["format=hf", *TINY]),
        # check=none: the round trip is the check; the self-check's timing of a BERT-base is minutes under load
        "bert_base": (bert_base_ckpt, False, ["check=none", *BERT_BASE]),
        # the user's default command (a timed self-check) once; timing the packed embeddings too would add a minute
        # of MiniLM forward passes that measure the same kernels, and their agreement on 40 rows runs the same code
        # path as on the default 200
        "minilm": (minilm_ckpt, True, ["check=full"]),
        "minilm_embeddings": (
            minilm_ckpt,
            False,
            ["pack_embeddings=true", "check=agreement", "check_rows=40"],
        ),
    }
    out: dict[str, dict] = {}
    jobs = {}
    for name, (ckpt, command, options) in runs.items():
        folder = root / name
        args = [f"ckpt={ckpt}", f"out={folder}", *options]
        if command:
            result = run_export(*args)
            code, stdout, stderr = result.returncode, result.stdout, result.stderr
        else:
            code, stdout, stderr = call(main, *args)
        assert code == 0, (name, stderr[-3000:])
        vocab = json.loads((folder / HF_CONFIG_FILE).read_text())["vocab_size"]
        kind = "hf" if name == "tiny_hf" else "mxint8"
        jobs[name] = (str(folder), kind, batches(name, vocab))
        out[name] = {"folder": folder, "stdout": stdout, "ckpt": ckpt}
    torch.save(jobs, root / "jobs.pt")
    command = [sys.executable, "-c", LOGITS_SCRIPT, str(root / "jobs.pt"), str(root / "logits.pt")]
    result = subprocess.run(command, capture_output=True, text=True, env=ENV, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    for name, logits in torch.load(root / "logits.pt").items():
        out[name]["logits"] = logits
    return out


@pytest.mark.slow
@pytest.mark.parametrize("pack_embeddings", [False, True])
def test_packed_export_reloads_in_a_fresh_process_with_identical_logits(tiny_ckpt, exports, pack_embeddings):
    export = exports["tiny_embeddings" if pack_embeddings else "tiny"]
    out = export["folder"]
    assert "linear layers packed" in export["stdout"]

    model = merged_model(tiny_ckpt, TINY)
    ids = input_ids(model.config.vocab_size)
    with torch.inference_mode():
        fp32 = model(input_ids=ids).logits
    linear_names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and "classifier" not in n]
    packed = pack_for_export(model, pack_embeddings=pack_embeddings)
    with torch.inference_mode():
        expected = model(input_ids=ids).logits
    assert torch.equal(export["logits"][0], expected)
    assert (expected - fp32).abs().max() < 0.05 and not torch.equal(expected, fp32)

    config = json.loads((out / CONFIG_FILE).read_text())
    assert config["packed_linear"] == linear_names == packed.linear
    tensors = load_file(str(out / WEIGHTS_FILE))
    for name in linear_names:
        assert tensors[f"{name}.weight_mantissa"].dtype == torch.int8
        assert tensors[f"{name}.weight_scale"].dtype == torch.uint8
        assert f"{name}.weight" not in tensors
    word = "bert.embeddings.word_embeddings"
    assert (f"{word}.weight_mantissa" in tensors) == pack_embeddings == (f"{word}.weight" not in tensors)
    assert tensors["classifier.weight"].dtype == torch.float32


@pytest.mark.slow
def test_hf_export_is_the_merged_model(tiny_ckpt, exports):
    out = exports["tiny_hf"]["folder"]
    model = merged_model(tiny_ckpt, TINY)
    ids = input_ids(model.config.vocab_size)
    with torch.inference_mode():
        expected = model(input_ids=ids).logits
    (reloaded,) = exports["tiny_hf"]["logits"]
    torch.testing.assert_close(reloaded, expected, rtol=0, atol=1e-6)
    assert not any(".lora_" in key for key in load_file(str(out / WEIGHTS_FILE)))


@pytest.mark.slow
def test_packed_folder_is_smaller_than_save_pretrained(tiny_ckpt, exports, tmp_path):
    model = merged_model(tiny_ckpt, TINY)
    model.save_pretrained(tmp_path / "fp32")
    linear_weights = sum(
        m.weight.numel()
        for n, m in model.named_modules()
        if isinstance(m, nn.Linear) and "classifier" not in n
    )
    # the default export (the command with no options but ckpt, out and the model)
    saved = (tmp_path / "fp32" / WEIGHTS_FILE).stat().st_size - (
        exports["tiny"]["folder"] / WEIGHTS_FILE
    ).stat().st_size
    # Each packed weight goes from 4 bytes to 1 + 1/32; safetensors headers differ by a few KB.
    assert abs(saved - linear_weights * (4 - 1 - 1 / 32)) < 20_000


def test_load_packed_names_a_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match=CONFIG_FILE):
        load_packed(tmp_path)


@pytest.mark.parametrize(
    "args, key",
    [
        (["out=X"], "ckpt: required"),
        (["ckpt=/nonexistent.ckpt", "out=X"], "ckpt=/nonexistent.ckpt: no such checkpoint file"),
        (["ckpt=CKPT", "out=FILE"], "is a file, expected a folder"),
        (["ckpt=CKPT", "out=X", "format=onnx2"], "format=onnx2: must be one of mxint8, hf, onnx"),
        (["ckpt=CKPT", "out=FULL"], "folder is not empty"),
        (["ckpt=CKPT", "out=X", "group_size=abc"], "group_size=abc: must be a positive integer"),
        (["ckpt=CKPT", "out=X", "pack_embeddings=maybe"], "pack_embeddings=maybe: must be true or false"),
        (["ckpt=CKPT", "out=X", "group_size=5", *TINY], "group_size=5: group_size=5 does not divide"),
        (["ckpt=CKPT", "out=X", "model=no_such_model"], "model=no_such_model: no such preset; valid: "),
        (["ckpt=CKPT", "out=X"], "its weights do not fit the model"),
        (["ckpt"], "'ckpt': expected key=value"),
    ],
)
def test_bad_input_is_one_line_exit_2_nothing_written(tiny_ckpt, tmp_path, capsys, args, key):
    (tmp_path / "FILE").write_text("keep me")
    (tmp_path / "FULL").mkdir()
    (tmp_path / "FULL" / "earlier.txt").write_text("keep me")
    paths = {
        "CKPT": str(tiny_ckpt),
        "X": str(tmp_path / "X"),
        "FILE": str(tmp_path / "FILE"),
        "FULL": str(tmp_path / "FULL"),
    }
    args = [
        a.split("=", 1)[0] + "=" + paths.get(a.split("=", 1)[1], a.split("=", 1)[1]) if "=" in a else a
        for a in args
    ]
    assert main(args) == 2
    # Library warnings (transformers' deprecations) may precede it; the error itself is one line.
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: ") and key in err[-1] and "Traceback" not in "\n".join(err)
    assert not (tmp_path / "X").exists()
    assert (tmp_path / "FILE").read_text() == "keep me" and os.listdir(tmp_path / "FULL") == ["earlier.txt"]


@pytest.mark.slow
def test_bad_input_from_the_command_line_has_no_traceback(tmp_path):
    result = run_export(f"ckpt={tmp_path / 'missing.ckpt'}", f"out={tmp_path / 'out'}")
    assert result.returncode == 2
    assert (
        result.stderr.strip()
        == f"error: ckpt={tmp_path / 'missing.ckpt'}: no such checkpoint file (give a .ckpt path)"
    )


@pytest.mark.slow
def test_bert_base_shaped_model_round_trip(exports):
    """A BERT-base-shaped classifier (12 layers, hidden 768, random weights) built from config."""
    export = exports["bert_base"]
    assert not (export["folder"] / "export.json").exists()  # check=none
    print(export["stdout"])
    model = merged_model(export["ckpt"], BERT_BASE)
    pack_for_export(model)
    ids = input_ids(model.config.vocab_size, rows=2, tokens=64)
    with torch.inference_mode():
        expected = model(input_ids=ids).logits
    assert torch.equal(export["logits"][0], expected)
    assert len(json.loads((export["folder"] / CONFIG_FILE).read_text())["packed_linear"]) == 12 * 6 + 1


@pytest.mark.slow
@pytest.mark.parametrize("pack_embeddings", [False, True])
def test_minilm_round_trip(minilm_ckpt, exports, pack_embeddings):
    """The pretrained MiniLM + LoRA classifier (the default model), exported packed and reloaded in a fresh
    process: identical logits at 16 rows (the fused kernel) and at 128 rows (dequantize + matmul)."""
    name = "minilm_embeddings" if pack_embeddings else "minilm"
    export = exports[name]
    print(export["stdout"])
    model = merged_model(minilm_ckpt, [])
    packed = pack_for_export(model, pack_embeddings=pack_embeddings)
    assert len(packed.linear) == 6 * 6 + 1 and bool(packed.embeddings) == pack_embeddings
    for shape, ids, logits in zip(SHAPES[name], batches(name, model.config.vocab_size), export["logits"]):
        with torch.inference_mode():
            expected = model(input_ids=ids).logits
        assert torch.equal(logits, expected), shape
