"""Model soups (``python -m adls_lightning.soup``): the mean of runs' weights, a checkpoint train.py and the export read."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import ROOT, assert_one_line_error, train_run

# full fine-tuning (LoRA factors cannot be averaged), a few batches: two runs that differ only in their seed
SMALL = [
    "model/lora=none",
    "trainer.max_epochs=1",
    "debug=limit",
]
pytestmark = pytest.mark.slow  # every test here needs the two training runs of the fixture


def run_soup(*args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "adls_lightning.soup", *args]
    return subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=600)


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory, tiny_imdb_dir, cache_dir) -> list[Path]:
    """The best checkpoints of two tiny full fine-tunes that differ only in ``seed``."""
    base = tmp_path_factory.mktemp("soup_runs")
    checkpoints = []
    for seed in (1, 2):
        out = base / f"seed{seed}"
        train_run(out, [*SMALL, f"seed={seed}"], tiny_imdb_dir, cache_dir)
        checkpoints.extend(sorted((out / "checkpoints").glob("best*.ckpt")))
    assert len(checkpoints) == 2
    return checkpoints


def test_soup_is_the_mean_of_the_runs_and_evaluates_and_exports(two_runs, tmp_path, tiny_imdb_dir, cache_dir):
    soup_path = tmp_path / "soup.ckpt"
    run_folders = [p.parent.parent for p in two_runs]  # a run folder stands for its best checkpoint
    proc = run_soup(f"ckpts={run_folders[0]},{run_folders[1]}", f"out={soup_path}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Averaged 2 checkpoints" in proc.stdout

    first, second = (torch.load(p, map_location="cpu", weights_only=True)["state_dict"] for p in two_runs)
    soup = torch.load(soup_path, map_location="cpu", weights_only=True)
    assert "optimizer_states" not in soup and soup["soup"] == [str(p) for p in two_runs]
    assert set(soup["state_dict"]) == set(first)
    floats = [k for k, v in first.items() if v.is_floating_point()]
    assert any(not torch.equal(first[k], second[k]) for k in floats)  # the seeds gave different models
    for name, value in soup["state_dict"].items():
        if value.is_floating_point():
            torch.testing.assert_close(value, (first[name] + second[name]) / 2, rtol=0, atol=1e-7)
        else:
            assert torch.equal(value, first[name])

    # train.py evaluates the soup as any checkpoint of the recipe
    out = tmp_path / "eval"
    train_run(out, [*SMALL, "train=false", f"ckpt_path={soup_path}"], tiny_imdb_dir, cache_dir)
    assert (out / "metrics.json").is_file()

    # and the export writes the soup's weights (LoRA-free: the folder's weights are the state's own)
    folder = tmp_path / "hf"
    command = [
        sys.executable,
        "-m",
        "adls_lightning.export",
        f"ckpt={soup_path}",
        f"out={folder}",
        "format=hf",
    ]
    command += ["model=tiny_random", "model/lora=none"]
    proc = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    from transformers import AutoModelForSequenceClassification

    exported = AutoModelForSequenceClassification.from_pretrained(folder).state_dict()
    name = "bert.encoder.layer.0.attention.self.query.weight"
    torch.testing.assert_close(exported[name], soup["state_dict"][f"model.{name}"], rtol=0, atol=0)


def _variant(path: Path, out: Path, change) -> Path:
    checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    change(checkpoint["state_dict"])
    torch.save(checkpoint, out)
    return out


def _bad_cases(two_runs: list[Path], tmp: Path) -> dict[str, tuple[list[str], str]]:
    a, b = two_runs
    classifier = next(
        k for k in torch.load(a, weights_only=True)["state_dict"] if k.endswith("classifier.weight")
    )
    lora_key = "model.bert.encoder.layer.0.attention.self.query.lora_A.default.weight"
    lora = _variant(b, tmp / "lora.ckpt", lambda s: s.__setitem__(lora_key, torch.zeros(4, 32)))
    three = _variant(b, tmp / "three.ckpt", lambda s: s.__setitem__(classifier, torch.zeros(3, 32)))
    mask_key = "model.bert.encoder.layer.0.output.dense.parametrizations.weight.0.mask"
    mask_a = _variant(a, tmp / "mask_a.ckpt", lambda s: s.__setitem__(mask_key, torch.tensor([1.0, 0.0])))
    mask_b = _variant(b, tmp / "mask_b.ckpt", lambda s: s.__setitem__(mask_key, torch.tensor([0.0, 1.0])))
    extra = _variant(b, tmp / "extra.ckpt", lambda s: s.__setitem__("model.extra", torch.zeros(1)))
    not_ckpt = tmp / "notes.ckpt"
    not_ckpt.write_text("not a checkpoint")
    return {
        "one checkpoint": ([f"ckpts={a}"], "ckpts: give at least two"),
        "no out": ([f"ckpts={a},{b}"], "out: required"),
        "lora": ([f"ckpts={a},{lora}"], f"ckpts={lora}: a LoRA checkpoint"),
        "another task": ([f"ckpts={a},{three}"], f"ckpts={three}: key {classifier} is (3, 32)"),
        "masks differ": ([f"ckpts={mask_a},{mask_b}"], f"ckpts={mask_b}: pruning mask {mask_key} differs"),
        "keys differ": ([f"ckpts={a},{extra}"], f"ckpts={extra}: key model.extra is in one of"),
        "folder without one": ([f"ckpts={a},{tmp}"], f"ckpts={tmp}: a folder with no checkpoints/best*.ckpt"),
        "not a checkpoint": ([f"ckpts={a},{not_ckpt}"], f"ckpts={not_ckpt}: not a checkpoint"),
        "unknown option": ([f"ckpts={a},{b}", "decay=0.9"], "decay: unknown option (valid: ckpts, out"),
        "bad overwrite": ([f"ckpts={a},{b}", "overwrite=maybe"], "overwrite=maybe: must be true or false"),
    }


def soup_in_process(capsys, *args: str) -> subprocess.CompletedProcess:
    """The command's ``main`` in this process (no interpreter start per case), as a finished process."""
    from adls_lightning.tools.soup import main

    code = main(list(args))
    captured = capsys.readouterr()
    return subprocess.CompletedProcess(args, code, captured.out, captured.err)


def test_bad_input_is_one_line_and_writes_nothing(two_runs, tmp_path, capsys):
    cases = _bad_cases(two_runs, tmp_path)
    for case, (args, starts) in cases.items():
        out = tmp_path / f"{case.replace(' ', '_')}.soup.ckpt"
        args = [*args, *([f"out={out}"] if case != "no out" else [])]
        # one case as users meet it, from the command line (no traceback); the rest in this process
        proc = run_soup(*args) if case == "lora" else soup_in_process(capsys, *args)
        assert_one_line_error(proc, starts=f"error: {starts}")
        assert not out.exists(), case
    assert not list(tmp_path.glob(".*.tmp")), "a temporary file was left behind"


def test_an_existing_soup_is_not_overwritten_unless_asked(two_runs, tmp_path, capsys):
    out = tmp_path / "soup.ckpt"
    out.write_bytes(b"an earlier soup")
    proc = soup_in_process(capsys, f"ckpts={two_runs[0]},{two_runs[1]}", f"out={out}")
    assert_one_line_error(proc, starts=f"error: out={out}: exists (give another path, or overwrite=true)")
    assert out.read_bytes() == b"an earlier soup"
    proc = soup_in_process(capsys, f"ckpts={two_runs[0]},{out}", f"out={out}", "overwrite=true")
    assert_one_line_error(proc, starts=f"error: out={out}: is one of the checkpoints to average")
    assert (
        soup_in_process(
            capsys, f"ckpts={two_runs[0]},{two_runs[1]}", f"out={out}", "overwrite=true"
        ).returncode
        == 0
    )
    assert "state_dict" in torch.load(out, weights_only=True)
