"""Every command in the docs' shell blocks composes and validates as a run would, without training.

README.md and every page under docs/ (docs/notes/ included: the site's pages, ``mkdocs.yml``'s nav) are read; each line of a fenced ``bash``/``sh``/``shell``/``console`` block (``\\``
continuations joined, comments dropped) that runs ``train.py``, ``search.py``, ``adls-train``/``adls-search`` or
``python -m adls_lightning.<entry>`` is one command. Placeholders (``CKPT``, ``DIR``, ``OUT``, ``$FP``, ``N``,
``...``) are filled from fixtures, tiny-data overrides are appended, and the command's config is composed and
checked by the same function the entry point runs first (:func:`adls_lightning.app.preflight.check_composed_config`:
every ``_target_`` allowed, every key known, every value checked, the output folder usable). A command that
needs a GPU is composed and checked except for the accelerator it names. A new command in the docs is covered
without touching this test; a documented command that no longer composes fails it.
"""

from __future__ import annotations

import csv
import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser

from adls_lightning.app.preflight import check_composed_config
from adls_lightning.build import build, check_config_targets
from adls_lightning.errors import ConfigError
from tests.helpers import CONF_DIR, ROOT

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
BLOCK = re.compile(r"^```(?:bash|sh|shell|console)[^\n]*\n(.*?)^```", re.S | re.M)
ENTRIES = {
    "train.py": "train",
    "search.py": "search",
    "adls-train": "train",
    "adls-search": "search",
    "adls-table": "reports.table",
    "adls-export": "export",
    "adls-evaluate": "export.evaluate",
    "adls-predict": "export.predict",
}
MODULE = re.compile(r"^adls_lightning(\.[\w.]+)?$")
# what a shell line may hold after the command's own arguments
SHELL_END = {"&", "&&", ";", "|", "||", ">", ">>", "2>&1", "done", "wait"}


@dataclass(frozen=True)
class DocCommand:
    file: str
    line: str
    entry: str  # train | search | graph | export | export.evaluate
    args: tuple[str, ...]

    def __str__(self) -> str:
        return f"{self.file}: {self.line}"


def _shell_lines(text: str) -> list[str]:
    """The lines of a page's shell blocks, ``\\`` continuations joined."""
    return [line for block in BLOCK.findall(text) for line in block.replace("\\\n", " ").splitlines()]


def _commands() -> list[DocCommand]:
    found = []
    for doc in DOCS:
        for line in _shell_lines(doc.read_text()):
            try:
                tokens = shlex.split(line, comments=True)
            except ValueError:
                continue
            for i, token in enumerate(tokens):
                name = Path(token).name
                entry = ENTRIES.get(name)
                start = i + 1
                if entry is None and token == "-m" and i + 1 < len(tokens) and MODULE.match(tokens[i + 1]):
                    entry, start = tokens[i + 1].removeprefix("adls_lightning."), i + 2
                if entry is None:
                    continue
                args = []
                for arg in tokens[start:]:
                    if arg in SHELL_END or arg.startswith((">", "2>")):
                        break
                    args.append(arg)
                found.append(
                    DocCommand(
                        doc.relative_to(ROOT).as_posix(), line.split("#")[0].strip(), entry, tuple(args)
                    )
                )
                break
    return found


COMMANDS = _commands()


@pytest.fixture(scope="module")
def placeholders(tmp_path_factory, tiny_imdb_dir):
    """The docs' placeholders, filled: a checkpoint file, output folders, a lab TOML, numbers."""
    folder = tmp_path_factory.mktemp("doc_placeholders")
    ckpt = folder / "best.ckpt"
    torch.save({"state_dict": {}, "pytorch-lightning_version": "2.5.0"}, ckpt)
    (folder / "lab_integer.toml").write_text(
        '[passes.quantize]\nby = "type"\n[passes.quantize.default.config]\nname = "NA"\n'
        '[passes.quantize.linear.config]\nname = "integer"\ndata_in_width = 8\nweight_width = 8\n'
    )
    return {
        "CKPT": str(ckpt),
        "$QAT": str(ckpt),
        "$FP": str(ckpt),
        "N": "64",
        "L": "32",
        "E": "1",
        "S": "0",
        "lab_integer.toml": str(folder / "lab_integer.toml"),
        "_folder": folder,
        "_data": str(tiny_imdb_dir),
    }


def _fill(arg: str, values: dict, out: Path) -> str:
    """One argument with the docs' placeholders replaced."""
    key, sep, value = arg.partition("=")
    if not sep:
        return arg
    placeholder = (
        "$(ls" in value or value.endswith(".ckpt") or value in ("CKPT", "$QAT", "$FP", "$BEST", "...")
    )
    if placeholder and key in ("init_ckpt", "ckpt_path", "ckpt"):
        value = values["CKPT"]
    value = values.get(value, value)
    if value in ("OUT", "DIR") or key in ("hydra.run.dir", "hydra.sweep.dir", "out"):
        value = str(out)
    return f"{key}={value}"


# Commands whose config needs something only the user has (their own package, a stored study): composed with
# that part left out, and said so here, one reason each.
NEEDS_THE_USERS = {
    "quant.plugins=[mylab.formats]": "a format package of the user's own (docs/extending.md)",
    "hydra.searchpath=[file:///path/to/mylab/conf]": "a config folder of the user's own (docs/extending.md)",
    "quant=toy": "the user's own preset in that folder (docs/extending.md)",
    "search.precision=toy_step": "the user's own format (docs/extending.md)",
    "data.plugins=[mylab.metrics]": "a metric package of the user's own (docs/extending.md)",
    "data.plugins=[mylab.pruning]": "a pruning-method package of the user's own (docs/extending.md)",
}


def _compose_and_check(command: DocCommand, values: dict, out: Path) -> str:
    """Compose and validate a train/search/graph command; returns what was done ("validated"/"composed")."""
    args = [_fill(a, values, out) for a in command.args if a not in ("-m", "--multirun")]
    args = [a for a in args if a not in NEEDS_THE_USERS and not a.startswith("init_from_study=")]
    if any(
        a in NEEDS_THE_USERS for a in command.args
    ):  # the user's format's / metric's keys need their package
        args = [
            a
            for a in args
            if not any(name in a for name in ("toy_step", "toy_largest", "balanced_acc"))
            and a != "~quant.config.linear"
        ]
    parsed = OverridesParser.create().parse_overrides(args)
    overrides = [o.input_line for o in parsed if not o.is_sweep_override()]
    sweeps = len(overrides) < len(parsed)
    root = {"train": "train", "search": "search", "graph": "graph"}[command.entry]
    tiny = [f"data.data_dir={values['_data']}", f"paths.cache_dir={values['_folder'] / 'cache'}"]
    if root == "graph":
        tiny = []
    run_dir = "hydra.sweep.dir" if root == "search" or "-m" in command.args else "hydra.run.dir"
    if not any(o.startswith(f"{run_dir}=") for o in overrides):
        tiny.append(f"{run_dir}={out}")
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR)):
        cfg = compose(root, [*overrides, *tiny], return_hydra_config=True)
    check_config_targets(cfg)
    if root == "graph":
        return "validated"
    multirun = root == "search" or "-m" in command.args
    try:
        check_composed_config(cfg, multirun, sweeps)
    except ConfigError as err:
        if "no CUDA GPU" in str(err):
            return "composed (needs a GPU)"
        raise
    # the compression callbacks check their own values when built (no model needed), as the run builds them first
    for key in ("quant", "prune", "compress"):
        if cfg.get(key) and not (key == "quant" and NEEDS_THE_USERS.keys() & set(command.args)):
            build(cfg[key], key, _convert_="partial")
    return "validated"


def _check_export(command: DocCommand, values: dict, out: Path) -> str:
    from adls_lightning.tools.export import check_options, parse_arguments

    args = [_fill(a, values, out) for a in command.args if not (a.startswith("[") and a.endswith("]"))]
    options, _ = parse_arguments(args)
    check_options(options)
    return "validated"


def _check_report(command: DocCommand, values: dict, out: Path) -> str:
    import importlib

    from adls_lightning.tools.options import check_out_dir

    tool = {"reports.sweep": "report", "reports.study": "study_report"}[command.entry]
    module = importlib.import_module(f"adls_lightning.tools.{tool}")
    args = module.parse_command([_fill(a, values, out) for a in command.args])
    check_out_dir(args["out"])
    return "arguments checked (needs a study or sweep)"


def _check_sensitivity(command: DocCommand, values: dict, out: Path) -> str:
    from adls_lightning.tools.sensitivity import parse_arguments

    options, overrides = parse_arguments([_fill(a, values, out) for a in command.args])
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR)):
        cfg = compose("train", [f"quant={options['quant']}", *overrides], return_hydra_config=True)
    check_config_targets(cfg)
    build(cfg.quant, "quant", _convert_="partial")
    return "preset composed and built (needs a trained checkpoint)"


def _check_soup(command: DocCommand, values: dict, out: Path) -> str:
    from adls_lightning.soup import USAGE
    from adls_lightning.tools.options import split_options
    from adls_lightning.tools.soup import OPTIONS, check_options

    options, extra = split_options([_fill(a, values, out) for a in command.args], OPTIONS, USAGE)
    assert not extra, extra
    ckpts, _ = check_options(options)
    assert len(ckpts) >= 2, ckpts
    return "arguments checked (needs the runs' checkpoints)"


def _check_table(command: DocCommand, values: dict, out: Path) -> str:
    from adls_lightning.tools.options import check_writable
    from adls_lightning.tools.results_table import parse_command

    sources, table_out = parse_command([_fill(a, values, out) for a in command.args])
    assert sources, command
    if table_out is not None:
        check_writable(table_out, "out")
    return "arguments checked (needs finished runs)"


def _written_by_the_page(folder: str) -> bool:
    """A folder a page's own earlier command writes (``out=outputs/...``: docs/tutorial.md's export)."""
    return folder.startswith("outputs/") and ".." not in folder


def _check_evaluate(command: DocCommand, values: dict, out: Path) -> str:
    folders = [a for a in command.args if "=" not in a]
    # an export folder, or one of an ONNX export's graphs (DIR/model_int8.onnx)
    exported = ("DIR", "...")
    assert folders and all(
        f.strip("[]") in exported or re.fullmatch(r"DIR/\w+\.onnx", f) or _written_by_the_page(f)
        for f in folders
    ), folders
    overrides = [a for a in command.args if "=" in a]
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR)):
        check_config_targets(compose("train", overrides, return_hydra_config=True))
    return "composed (needs an export folder)"


def _check_predict(command: DocCommand) -> str:
    from adls_lightning.tools.predict import split_command_line

    options, bare = split_command_line(list(command.args))
    assert bare and (bare[0] == "DIR" or bare[0].startswith("DIR/") or _written_by_the_page(bare[0])), bare
    assert int(options["batch_size"]) > 0, command
    return "arguments checked (needs an export folder)"


@pytest.mark.parametrize("command", COMMANDS, ids=[f"{c.file}:{i}" for i, c in enumerate(COMMANDS)])
def test_documented_command_composes_and_validates(command, placeholders, tmp_path, monkeypatch):
    monkeypatch.delenv("ADLS_EXTRA_TARGETS", raising=False)
    out = tmp_path / "out"
    if command.entry in ("train", "search", "graph"):
        _compose_and_check(command, placeholders, out)
    elif command.entry == "export":
        _check_export(command, placeholders, out)
    elif command.entry == "export.evaluate":
        _check_evaluate(command, placeholders, out)
    elif command.entry in ("reports.sweep", "reports.study"):
        _check_report(command, placeholders, out)
    elif command.entry == "quant.sensitivity":
        _check_sensitivity(command, placeholders, out)
    elif command.entry == "soup":
        _check_soup(command, placeholders, out)
    elif command.entry == "reports.table":
        _check_table(command, placeholders, out)
    elif command.entry == "export.predict":
        _check_predict(command)
    else:
        pytest.fail(f"{command}: python -m adls_lightning.{command.entry} is not known to this test")
    assert not out.exists() or not any(out.iterdir()), "validation writes nothing"


def test_the_docs_hold_the_commands_this_test_covers():
    entries = {c.entry for c in COMMANDS}
    assert {
        "train",
        "search",
        "graph",
        "export",
        "export.evaluate",
        "export.predict",
        "reports.sweep",
        "reports.study",
        "soup",
    } <= entries
    # 193 commands before the README became a guide (2026-11-28); moving text between pages must not lose any
    assert len(COMMANDS) >= 200, len(COMMANDS)
    # the pages the README's commands and the investigation logs moved to are read, and hold commands
    by_file = {c.file for c in COMMANDS}
    moved = {
        "docs/training.md",
        "docs/results.md",
        "docs/notes/pruning-movement.md",
        "docs/notes/glue-transfer.md",
    }
    assert {"README.md", *moved} <= by_file
    # the guide shows the two commands, each lab's runs and a whole study: fine-tune, compress, search, compare, export
    readme = {c.entry for c in COMMANDS if c.file == "README.md"}
    assert {
        "train",
        "search",
        "graph",
        "reports.sweep",
        "reports.study",
        "export",
        "export.evaluate",
    } <= readme
    print(f"{len(COMMANDS)} documented commands found in {len(by_file)} files")


def test_every_page_of_the_site_is_read():
    """The site's nav (mkdocs.yml) and the pages read here are the same set: a page added to one is in the other."""
    nav = set(
        re.findall(r"^\s*-\s*(?:[^:\n]+:\s*)?([\w./-]+\.md)\s*$", (ROOT / "mkdocs.yml").read_text(), re.M)
    )
    read = {d.relative_to(ROOT / "docs").as_posix() for d in DOCS if d.parent != ROOT}
    assert nav == read, (sorted(nav - read), sorted(read - nav))


def test_the_readme_is_a_guide():
    """At most 250 lines, with the two commands that set up a fresh machine (issue 57)."""
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 250
    first_block = BLOCK.search(text).group(1)
    assert "make train" in first_block and "make test" in first_block


def test_a_changed_command_that_does_not_compose_fails(placeholders, tmp_path):
    broken = DocCommand("README.md", "python train.py quant=int9", "train", ("quant=int9",))
    with pytest.raises(Exception, match="quant"):
        _compose_and_check(broken, placeholders, tmp_path / "out")
    stale = DocCommand(
        "README.md", "python train.py quant.mode=qta", "train", ("quant=int8", "quant.mode=qta")
    )
    with pytest.raises(Exception, match="qta"):
        _compose_and_check(stale, placeholders, tmp_path / "out")


# docs/tutorial.md runs as written, at test scale: each train.py command gets these appended (a tiny random BERT
# without LoRA, two epochs: what is checked is the chain of commands and what each writes, not the accuracy) and the
# tiny data of the composing test above
TUTORIAL = ROOT / "docs" / "tutorial.md"
TUTORIAL_TINY = [
    "model=tiny_random",
    "model/lora=none",
    "trainer.max_epochs=2",
    "logger=none",
    "callbacks.rich_progress_bar=null",
    "data.max_length=64",
    "data.val_size=100",
    "data.batch_size=16",
]


def _tutorial_script(tiny: list[str]) -> str:
    """The tutorial's shell block as one bash script: ``python train.py`` is this interpreter and checkout's
    train.py, with ``tiny`` appended."""
    lines = ["set -euo pipefail"]
    for line in _shell_lines(TUTORIAL.read_text()):
        if line.startswith("python train.py"):
            line = f"{shlex.quote(sys.executable)} {shlex.quote(str(ROOT / 'train.py'))}{line[len('python train.py') :]}"
            line += " " + " ".join(shlex.quote(o) for o in tiny)
        lines.append(line)
    return "\n".join(lines) + "\n"


@pytest.mark.slow
def test_the_tutorial_runs_as_written_at_tiny_scale(tiny_imdb_dir, cache_dir, tmp_path):
    tiny = [*TUTORIAL_TINY, f"data.data_dir={tiny_imdb_dir}", f"paths.cache_dir={cache_dir}"]
    bin_dir = str(Path(sys.executable).parent)  # adls-table, adls-export, ... as installed with the project
    env = {**os.environ, "PATH": os.pathsep.join([bin_dir, os.environ["PATH"]]), "OMP_NUM_THREADS": "1"}
    env.pop("ADLS_EXTRA_TARGETS", None)
    proc = subprocess.run(
        ["bash", "-c", _tutorial_script(tiny)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    study = tmp_path / "outputs" / "tutorial"

    # the table: one row per method, n = 3, each mean the mean of its three runs' metrics.json (read here)
    with open(study / "table" / "table.csv") as handle:
        rows = {row["quant"]: row for row in csv.DictReader(handle)}
    assert set(rows) == {"none", "int8", "int8_scaled"}
    jobs = {"none": (0, 1, 2), "int8": (3, 4, 5), "int8_scaled": (6, 7, 8)}  # the page's job numbering
    for method, numbers in jobs.items():
        runs = [study / "methods" / str(n) for n in numbers]
        for run, seed in zip(runs, (1, 2, 3)):
            overrides = (run / ".hydra" / "overrides.yaml").read_text()
            assert f"quant={method}" in overrides and f"seed={seed}" in overrides
        accuracies = [json.loads((run / "metrics.json").read_text())["test/acc"] for run in runs]
        assert int(rows[method]["test/acc n"]) == 3
        assert float(rows[method]["test/acc mean"]) == pytest.approx(sum(accuracies) / 3, abs=1e-4)
    assert "| int8_scaled | 3 |" in proc.stdout
    # every run records its storage: the uncompressed row is priced beside the compressed ones
    assert float(rows["none"]["quant/avg_weight_bits mean"]) == 32.0
    assert float(rows["int8"]["quant/avg_weight_bits mean"]) == 8.0
    print("\n".join(line for line in proc.stdout.splitlines() if line.startswith("|")))  # the page shows it

    # the export: a deployable folder; predict prints one JSON line per text with one of its labels
    config = json.loads((study / "export" / "config.json").read_text())
    labels = set(config["id2label"].values())
    assert "test/acc " in proc.stdout
    predictions = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith('{"label"')]
    assert len(predictions) == 2
    for prediction in predictions:
        assert prediction["label"] in labels and set(prediction["scores"]) == labels
        assert sum(prediction["scores"].values()) == pytest.approx(1.0, abs=1e-4)
