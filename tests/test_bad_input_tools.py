"""Bad input to the ``python -m adls_lightning.<tool>`` commands, as users type them: every case ends with exit code
2, one ``error:`` line naming the key or the file as stderr's last line, no traceback, nothing written (no output
folder or file created, an earlier one unchanged) and -- for a ``_target_`` or a pickle that would create a file if
it ran -- no such file. And each tool answers ``--help`` / ``-h`` with its usage, exit code 0.

Every case is a real subprocess, run side by side from one module fixture; none trains or reads data: the inputs
(a float checkpoint of the tiny random BERT, its packed and Hugging Face folders, damaged copies) are made here.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import lightning
import pytest
import torch
from hydra.core.global_hydra import GlobalHydra

from adls_lightning.build import build
from adls_lightning.errors import ConfigError
from adls_lightning.export import pack_for_export, save_packed
from adls_lightning.models import build_from_config
from tests.helpers import assert_one_line_error, compose_config

ROOT = Path(__file__).resolve().parent.parent
WORKERS = 3
TINY = "model=tiny_random"
#: a folder no file can be created in, even by root (``os.access`` would say yes there)
PROC = "/proc/adls-no-such-dir"
TOOLS = (
    "graph",
    "export",
    "export.evaluate",
    "export.predict",
    "soup",
    "quant.sensitivity",
    "reports.study",
    "reports.sweep",
)


class Hostile:
    """A pickle that creates ``path`` when it is loaded."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (str(self.path), "w"))


@dataclass(frozen=True)
class Case:
    id: str
    tool: str
    args: tuple[str, ...]
    contains: str  # what stderr's last line must hold (the key or the file, and what is wrong)
    absent: tuple[str, ...] = ()  # paths that must not exist afterwards (relative to the inputs' folder)


def _checkpoint(path: Path) -> None:
    """A float checkpoint of ``model=tiny_random`` as train.py's guarded reader reads it (weights only)."""
    GlobalHydra.instance().clear()
    try:
        module = build(compose_config("train", [TINY]).model, "model", _convert_="partial")
    finally:
        GlobalHydra.instance().clear()
    torch.save({"state_dict": module.state_dict(), "pytorch-lightning_version": lightning.__version__}, path)


def _inputs(base: Path) -> None:
    """Every input file of the cases, in ``base``."""
    _checkpoint(base / "tiny.ckpt")
    (base / "a_file").write_text("keep me\n")
    (base / "earlier").mkdir()
    (base / "earlier" / "sensitivity.csv").write_text("kept\n")
    torch.manual_seed(0)
    model = build_from_config(vocab_size=100).eval()
    model.save_pretrained(base / "hf")
    # damaged Hugging Face folders: a config that is not JSON; weights as a pickle that would create a file
    model.save_pretrained(base / "hf_config")
    (base / "hf_config" / "config.json").write_text('{"model_type": "bert", ')
    model.save_pretrained(base / "hf_pickle")
    (base / "hf_pickle" / "model.safetensors").unlink()
    (base / "hf_pickle" / "pytorch_model.bin").write_bytes(pickle.dumps(Hostile(base / "PWNED_BY_PICKLE")))
    packed = pack_for_export(model)
    for name in ("packed_cut", "packed_config"):
        save_packed(model, packed, base / name)
    weights = base / "packed_cut" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    (base / "packed_config" / "mxint8_config.json").write_text("not json at all\n")
    # what format=onnx wrote before exports held config.json: the graph alone (here not even a graph)
    (base / "onnx").mkdir()
    (base / "onnx" / "model.onnx").write_bytes(b"\x08\x07" + os.urandom(64))
    (base / "random.journal").write_bytes(os.urandom(4096))
    job = base / "sweep" / "0"
    (job / ".hydra").mkdir(parents=True)
    (job / ".hydra" / "overrides.yaml").write_text("- seed=1\n")
    (job / "metrics.json").write_text('{"val/acc": 0.5, "test/ac')  # cut while written by hand
    finished = base / "sweep_ok" / "0"
    (finished / ".hydra").mkdir(parents=True)
    (finished / ".hydra" / "overrides.yaml").write_text("- seed=1\n")
    (finished / "metrics.json").write_text('{"val/acc": 0.5, "test/acc": 0.25}')
    (base / "study_page").mkdir()  # a study report's page: not the sweep report's to redraw
    (base / "study_page" / "index.html").write_text(
        "<!DOCTYPE html>\n<html lang='en'><head><meta charset='utf-8'>"
        "<meta name='generator' content='adls_lightning.reports.study'><title>Study s</title></head></html>\n"
    )


def _cases(base: Path) -> list[Case]:
    ckpt = f"ckpt={base / 'tiny.ckpt'}"
    hostile = "{_target_: builtins.open, file: '" + str(base / "PWNED_BY_CALLBACK") + "', mode: w}"
    under_file = str(base / "a_file" / "out")
    return [
        # the graph command: the pre-flight of train.py (targets, hydra.callbacks included), typed flags, out
        Case(
            "graph hydra.callbacks",
            "graph",
            (TINY, f"out={base / 'g'}", f"+hydra.callbacks.evil={hostile}"),
            "hydra.callbacks.evil._target_=builtins.open: not an allowed target",
            ("g", "PWNED_BY_CALLBACK"),
        ),
        Case(
            "graph dynamic", "graph", (TINY, f"out={base / 'g'}", "dynamic=maybe"), "dynamic='maybe'", ("g",)
        ),
        Case("graph out in /proc", "graph", (TINY, f"out={PROC}"), f"out={PROC}: cannot write in /proc"),
        Case("graph out under a file", "graph", (TINY, f"out={under_file}"), f"{base / 'a_file'} is a file"),
        Case("graph unknown key", "graph", (TINY, "outt=x"), "Could not override 'outt'. (valid keys: out,"),
        # the export: out before the checkpoint is read, exclude against the model's layers, unknown keys
        Case("export out in /proc", "export", (ckpt, f"out={PROC}", TINY), f"out={PROC}: cannot write"),
        Case("export out under a file", "export", (ckpt, f"out={under_file}", TINY), "a_file is a file"),
        Case(
            "export exclude",
            "export",
            (ckpt, f"out={base / 'x'}", "exclude=classifier,classifer", TINY),
            "exclude=classifier,classifer: 'classifer' matches no linear layer of the model; valid:",
            ("x",),
        ),
        Case(
            "export packing option of another format",
            "export",
            (ckpt, f"out={base / 'x'}", "format=hf", "pack_embeddings=true", TINY),
            "pack_embeddings=true: only with format=mxint8 (an option of its packing); format=hf takes no",
            ("x",),
        ),
        Case(
            "export unknown key",
            "export",
            (ckpt, f"out={base / 'x'}", "formt=hf", TINY),
            "formt: unknown key; valid: this command's options (ckpt, out, format,",
            ("x",),
        ),
        # export.evaluate: every folder before the data
        Case(
            "evaluate cut safetensors",
            "export.evaluate",
            (str(base / "packed_cut"),),
            f"{base / 'packed_cut' / 'model.safetensors'}: not a readable safetensors file",
        ),
        Case(
            "evaluate packed config not json",
            "export.evaluate",
            (str(base / "packed_config"),),
            f"{base / 'packed_config' / 'mxint8_config.json'}: not a JSON file",
        ),
        Case(
            "evaluate hf config not json",
            "export.evaluate",
            (str(base / "hf"), str(base / "hf_config")),
            f"{base / 'hf_config' / 'config.json'}: not a JSON file",
        ),
        Case(
            "evaluate onnx folder without config",
            "export.evaluate",
            (str(base / "onnx"),),
            f"{base / 'onnx'}: an ONNX export (model.onnx) without config.json",
        ),
        # predict: the folder checks of export.evaluate, before any text is read
        Case(
            "predict onnx folder without config",
            "export.predict",
            (str(base / "onnx"), "a great film"),
            f"{base / 'onnx'}: an ONNX export (model.onnx) without config.json",
        ),
        Case(
            "predict cut safetensors",
            "export.predict",
            (str(base / "packed_cut"), "a great film"),
            f"{base / 'packed_cut' / 'model.safetensors'}: not a readable safetensors file",
        ),
        Case(
            "predict pickled weights",
            "export.predict",
            (str(base / "hf_pickle"), "a great film"),
            f"{base / 'hf_pickle'}: its weights are a pickle (pytorch_model.bin)",
            ("PWNED_BY_PICKLE",),
        ),
        Case(
            "predict not an export",
            "export.predict",
            (str(base / "earlier"), "a great film"),
            f"{base / 'earlier'}: no mxint8_config.json, config.json or *.onnx",
        ),
        Case(
            "predict unknown option",
            "export.predict",
            (str(base / "hf"), "--batch"),
            "--batch: unknown option (valid: file=, batch_size=;",
        ),
        Case(
            "predict misspelt option",
            "export.predict",
            (str(base / "hf"), "btach_size=4", "a great film"),
            "btach_size: unknown option (valid: file=, batch_size=; usage: adls-predict DIR",
        ),
        Case(
            "evaluate pickled weights",
            "export.evaluate",
            (str(base / "hf_pickle"),),
            f"{base / 'hf_pickle'}: its weights are a pickle (pytorch_model.bin)",
            ("PWNED_BY_PICKLE",),
        ),
        # the soup and the sensitivity command: out before any checkpoint is read or measured
        Case(
            "soup out in /proc",
            "soup",
            (f"ckpts={base / 'tiny.ckpt'},{base / 'tiny.ckpt'}", f"out={PROC}/soup.ckpt"),
            f"out={PROC}/soup.ckpt: cannot write",
        ),
        Case(
            "soup out under a file",
            "soup",
            (f"ckpts={base / 'tiny.ckpt'},{base / 'tiny.ckpt'}", f"out={under_file}.ckpt"),
            "a_file is a file",
        ),
        Case("soup unknown key", "soup", ("ckpts=a,b", "outt=x"), "outt: unknown option (valid: ckpts, out"),
        Case(
            "sensitivity out in /proc",
            "quant.sensitivity",
            (ckpt, f"out={PROC}", TINY),
            f"out={PROC}: cannot",
        ),
        Case(
            "sensitivity earlier output",
            "quant.sensitivity",
            (ckpt, f"out={base / 'earlier'}", TINY),
            f"out={base / 'earlier'}: already holds files",
        ),
        Case(
            "sensitivity calibration",
            "quant.sensitivity",
            (ckpt, f"out={base / 's'}", "quant=int8_scaled", "quant.calibration.batches=-1", TINY),
            "quant.calibration.batches=-1: must be an integer >= 0",
            ("s",),
        ),
        # the reports: damaged inputs
        Case(
            "study report random journal",
            "reports.study",
            (str(base / "random.journal"), f"out={base / 'r'}"),
            f"source={base / 'random.journal'}: not a readable Optuna storage",
            ("r",),
        ),
        Case(
            "sweep report cut metrics",
            "reports.sweep",
            (f"sweep={base / 'sweep'}", f"out={base / 'r'}"),
            f"{base / 'sweep' / '0' / 'metrics.json'}: damaged",
            ("r",),
        ),
        Case(
            "sweep report unknown metric",
            "reports.sweep",
            (f"sweep={base / 'sweep_ok'}", f"out={base / 'r'}", "metric=val/acuracy"),
            "metric=val/acuracy: no job of the sweep has it; valid: test/acc, val/acc",
            ("r",),
        ),
        # the reports' out: new, empty or their own earlier output, never another's
        Case(
            "sweep report out of another tool",
            "reports.sweep",
            (f"sweep={base / 'sweep_ok'}", f"out={base / 'earlier'}"),
            f"out={base / 'earlier'}: holds sensitivity.csv; valid: a new or empty folder, or one holding an "
            "earlier adls_lightning.reports.sweep output (index.html)",
        ),
        Case(
            "sweep report out of the study report",
            "reports.sweep",
            (f"sweep={base / 'sweep_ok'}", f"out={base / 'study_page'}"),
            f"out={base / 'study_page'}: holds index.html not written by adls_lightning.reports.sweep",
        ),
        Case(
            "study report out of another tool",
            "reports.study",
            (str(base / "random.journal"), f"out={base / 'earlier'}"),
            f"out={base / 'earlier'}: holds sensitivity.csv",
        ),
        Case(
            "table out of another tool",
            "reports.table",
            (str(base / "sweep_ok"), f"out={base / 'earlier'}"),
            f"out={base / 'earlier'}: holds sensitivity.csv; valid: a new or empty folder, or one holding an "
            "earlier adls-table output (table.md, table.csv, table.png)",
        ),
        # a misspelt option of the budget is named before the options are checked (it reaches them as an override)
        Case(
            "budget misspelt option",
            "tools.budget",
            (ckpt, "latncy=0.5"),
            "latncy: unknown key (did you mean latency?); valid: this command's options (ckpt, latency,",
        ),
        Case(
            "sweep report unknown key",
            "reports.sweep",
            ("sweep=x", "out=y", "colour=red"),
            "colour: unknown option",
        ),
    ]


def _run(tool: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", f"adls_lightning.{tool}", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=600,
    )


def _digests(base: Path) -> dict[str, str]:
    return {
        str(p.relative_to(base)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(base.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> tuple[Path, dict[str, tuple[Case, subprocess.CompletedProcess]], dict, dict]:
    base = tmp_path_factory.mktemp("tools")
    _inputs(base)
    before = _digests(base)
    cases = _cases(base)
    helps = [(tool, flag) for tool, flag in zip(TOOLS, ["--help", "-h"] * len(TOOLS))]
    with ThreadPoolExecutor(WORKERS) as pool:
        futures = {case.id: (case, pool.submit(_run, case.tool, *case.args)) for case in cases}
        help_futures = {tool: pool.submit(_run, tool, flag) for tool, flag in helps}
        done = {case_id: (case, future.result()) for case_id, (case, future) in futures.items()}
        shown = {tool: future.result() for tool, future in help_futures.items()}
    return base, done, shown, before


@pytest.mark.parametrize("case_id", [case.id for case in _cases(Path("/base"))])
def test_bad_input_is_one_line_exit_2_and_writes_nothing(results, case_id):
    base, done, _, before = results
    case, proc = done[case_id]
    assert_one_line_error(proc, contains=case.contains)
    for path in case.absent:
        assert not (base / path).exists(), path
    # no earlier file changed, no new file (the probe of a writable folder leaves nothing either)
    assert _digests(base) == before


@pytest.mark.parametrize("tool", TOOLS)
def test_every_tool_answers_help_with_its_usage(results, tool):
    proc = results[2][tool]
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert f"python -m adls_lightning.{tool}" in proc.stdout, proc.stdout[:500]


def test_the_sensitivity_command_and_train_py_refuse_calibration_batches_with_one_check(results):
    """train.py builds the preset's callback, whose constructor refuses the value; the sensitivity command builds
    the same node, so its line is that refusal word for word."""
    GlobalHydra.instance().clear()
    try:
        cfg = compose_config("train", [TINY, "quant=int8_scaled", "quant.calibration.batches=-1"])
    finally:
        GlobalHydra.instance().clear()
    with pytest.raises(ConfigError) as refused:
        build(cfg.quant, "quant")
    _, proc = results[1]["sensitivity calibration"]
    assert proc.stderr.strip().splitlines()[-1] == f"error: {refused.value}"


def test_export_exclude_takes_patterns_that_match_a_layer(tiny_bert):
    from adls_lightning.export.from_checkpoint import check_exclude

    model = tiny_bert()
    check_exclude(model, ("classifier", r"layer\.1\.attention"))
    with pytest.raises(ConfigError, match=r"'poolr' matches no linear layer .*bert\.pooler\.dense"):
        check_exclude(model, ("poolr",))


def test_split_options_is_one_parser_with_help_and_named_keys():
    from adls_lightning.tools.options import HelpRequested, split_options

    options, overrides = split_options(["a=1", "model=x"], {"a": None, "b": "2"}, "tool a=1")
    assert options == {"a": "1", "b": "2"} and overrides == ["model=x"]
    options, _ = split_options(["d1", "d2", "a=1"], {"a": None}, "tool", overrides=False, positional="dirs")
    assert options == {"a": "1", "dirs": ["d1", "d2"]}
    with pytest.raises(ConfigError, match=r"^c: unknown option \(valid: a, b; usage: tool a=1\)$"):
        split_options(["c=3"], {"a": None, "b": None}, "tool a=1", overrides=False)
    with pytest.raises(ConfigError, match="'bare': expected key=value"):
        split_options(["bare"], {"a": None}, "tool a=1")
    for flag in ("--help", "-h"):
        with pytest.raises(HelpRequested):
            split_options(["a=1", flag], {"a": None}, "tool a=1")
