"""The commands apart from the library (issue 57): ``adls_lightning.tools`` holds them, over one option parser
(``adls_lightning.tools.options``); the documented ``python -m`` spellings still run them; the import rules keep the
library from importing a tool, and the check that says so can fail."""

from __future__ import annotations

import ast
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import ENV, assert_one_line_error

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("import_graph", ROOT / "scripts" / "import_graph.py")
import_graph = importlib.util.module_from_spec(spec)
spec.loader.exec_module(import_graph)

#: the documented spelling -> the tool it runs (its docstring is the usage `--help` prints)
SPELLINGS = {
    "adls_lightning.soup": "adls_lightning.tools.soup",
    "adls_lightning.reports.sweep": "adls_lightning.tools.report",
    "adls_lightning.reports.table": "adls_lightning.tools.results_table",
    "adls_lightning.reports.study": "adls_lightning.tools.study_report",
    "adls_lightning.export": "adls_lightning.tools.export",
    "adls_lightning.export.evaluate": "adls_lightning.tools.evaluate",
    "adls_lightning.export.predict": "adls_lightning.tools.predict",
}
#: the console scripts of the application (pyproject.toml); every other one is a tool
APP_SCRIPTS = {"adls-train", "adls-search"}


@pytest.mark.parametrize("spelling", sorted(SPELLINGS))
def test_the_documented_spelling_runs_the_tool(spelling, tmp_path):
    tool = importlib.import_module(SPELLINGS[spelling])
    helped = subprocess.run(
        [sys.executable, "-m", spelling, "--help"], cwd=tmp_path, env=ENV, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert helped.returncode == 0, helped.stderr[-2000:]
    assert helped.stdout.strip() == tool.__doc__.strip()
    refused = subprocess.run(
        [sys.executable, "-m", spelling, "no_such_option=1", "out=x"], cwd=tmp_path, env=ENV,
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert refused.returncode == 2, refused.stderr[-2000:]
    assert refused.stderr.strip().splitlines()[-1].startswith("error: ")
    assert not (tmp_path / "x").exists()


#: what takes seconds to import (torch alone 2-3 s on the 2-core machine, Lightning 10 s)
HEAVY_MODULES = ("torch", "transformers", "datasets", "lightning", "optuna")


def _imported_after(code: str, cwd: Path) -> tuple[str, list[str]]:
    """Run ``code`` in a fresh interpreter; return its last printed line and the heavy modules it imported."""
    probe = f"{code}\nimport sys\nprint(sorted(m for m in {HEAVY_MODULES!r} if m in sys.modules))"
    proc = subprocess.run(
        [sys.executable, "-c", probe], cwd=cwd, env=ENV, capture_output=True, text=True, timeout=300
    )
    lines = proc.stdout.strip().splitlines()
    assert proc.returncode == 0 and lines, proc.stderr[-2000:]
    return "\n".join(lines[:-1]), ast.literal_eval(lines[-1])


@pytest.mark.parametrize(
    ("tool", "bad"),
    [
        ("export", ["no_such_option=1", "out=x"]),
        ("evaluate", ["--no-such-flag", "x"]),
        ("predict", ["x", "a text", "batch_size=0"]),  # a text may hold "=": predict's bad option is a value
    ],
)
def test_help_and_a_bad_option_answer_before_torch_is_imported(tool, bad, tmp_path):
    """``adls-export``, ``adls-evaluate`` and ``adls-predict`` (their console entry, ``tools.<tool>:main``) print
    their usage and refuse a bad option without importing torch or the model's libraries."""
    code = f"from adls_lightning.tools.{tool} import main\nprint([main(['--help']) == 0, main({bad!r})])"
    printed, heavy = _imported_after(code, tmp_path)
    assert printed.splitlines()[-1] == "[True, 2]"
    assert heavy == []
    assert not (tmp_path / "x").exists()


#: damaged export folders as (files written, what the refusal names); each is seen without loading a model
#: a safetensors file of no tensors: its header's length (8 bytes, little-endian), then the header
NO_TENSORS = (2).to_bytes(8, "little") + b"{}"
DAMAGED_FOLDERS = {
    "cut-weights": (
        {"config.json": b"{}", "model.safetensors": NO_TENSORS[:9]},
        "not a readable safetensors",
    ),
    "pickled-weights": ({"config.json": b"{}", "pytorch_model.bin": b"x"}, "a pickle (pytorch_model.bin)"),
    "graph-without-config": ({"model.onnx": b"x"}, "without config.json"),
    "damaged-recipe": (
        {"config.json": b"{}", "model.safetensors": NO_TENSORS, "compression.json": b"{"},
        "damaged export recipe",
    ),
}


@pytest.mark.parametrize("case", DAMAGED_FOLDERS)
def test_a_damaged_folder_is_refused_before_torch_is_imported(case, tmp_path):
    """``adls-predict`` and ``adls-evaluate`` name what is wrong with a damaged export folder in one line without
    importing torch or the model's libraries (seconds), as they answer a bad option."""
    files, message = DAMAGED_FOLDERS[case]
    folder = tmp_path / "export"
    folder.mkdir()
    for name, content in files.items():
        (folder / name).write_bytes(content)
    code = (
        "import contextlib, io\n"
        "from adls_lightning.tools import evaluate, predict\n"
        "for main, argv in ((predict.main, [DIR, 'a text']), (evaluate.main, [DIR])):\n"
        "    err = io.StringIO()\n"
        "    with contextlib.redirect_stderr(err):\n"
        "        code = main(argv)\n"
        "    print(code, err.getvalue().strip())"
    ).replace("DIR", repr(str(folder)))
    printed, heavy = _imported_after(code, tmp_path)
    for line in printed.splitlines():
        assert line.startswith("2 error: ") and message in line, line
    assert len(printed.splitlines()) == 2
    assert heavy == []


@pytest.mark.parametrize(
    ("bad", "names", "imported"),
    [
        ("data.batch_size=-3", "data.batch_size=-3", []),
        ("callback_order=[callbacks,qaunt]", "callback_order: 'qaunt' is not a config node", []),
        # a single run's input files: its local data are read as the run reads them (Hugging Face datasets), and
        # nothing to resume in the checkpoint folders, the callbacks' configured dirpaths
        ("ckpt_path=last", "ckpt_path=last: nothing to resume, no last*.ckpt in ", ["datasets"]),
    ],
)
def test_a_refused_train_py_imports_neither_torch_nor_optuna(bad, names, imported, tmp_path, tiny_imdb_dir):
    """``train.py`` refusing a bad value in its pre-flight check loads neither torch nor Lightning (they come with
    the run), nor Optuna (it only opens a study's storage)."""
    argv = [str(ROOT / "train.py"), "model=tiny_random", f"data.data_dir={tiny_imdb_dir}", "data.val_size=20"]
    code = (
        "import runpy, sys\n"
        "sys.stderr = sys.stdout\n"
        f"sys.argv = {[*argv, bad, 'hydra.run.dir=run']!r}\n"
        "try:\n"
        f"    runpy.run_path({str(ROOT / 'train.py')!r}, run_name='__main__')\n"
        "except SystemExit as stop:\n"
        "    print(stop.code)"
    )
    printed, heavy = _imported_after(code, tmp_path)
    *_, error, exit_code = printed.splitlines()
    assert exit_code == "2"
    assert error.startswith("error: ") and names in error, error
    assert heavy == imported
    assert not (tmp_path / "run").exists()


def test_a_preset_typo_to_a_hydra_tool_names_the_presets(tmp_path):
    """``python -m adls_lightning.graph model=...`` (a command composed by Hydra, as train.py) answers a misspelt
    preset with the group's presets and the closest ones in one line, not Hydra's dump of its config search path."""
    refused = subprocess.run(
        [sys.executable, "-m", "adls_lightning.graph", "model=tiny_bertt", "out=x"], cwd=tmp_path, env=ENV,
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    line = assert_one_line_error(
        refused, starts="error: model=tiny_bertt: no such preset; valid: albert_base, "
    )
    assert line.endswith("(did you mean tiny_bert, tiny_albert or tiny_roberta?)"), line
    assert not (tmp_path / "x").exists()


def test_the_tools_parse_with_one_parser():
    """Every tool module takes its ``key=value`` parsing from ``tools.options``; no other module of the package
    defines a ``key=value`` splitter."""
    package = ROOT / "adls_lightning"
    definers = []
    for path in package.rglob("*.py"):
        tree = ast.parse(path.read_text())
        names = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
        if names & {"split_options", "report_arguments", "parse_args"}:
            definers.append(path.relative_to(ROOT).as_posix())
    assert definers == ["adls_lightning/tools/options.py"]
    for path in (package / "tools").glob("*.py"):
        if path.name in ("__init__.py", "options.py", "graph.py"):  # graph: Hydra's own command line
            continue
        imported = {
            node.module for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.ImportFrom)
        }
        assert "adls_lightning.tools.options" in imported, path.name


def test_the_import_rules_refuse_a_library_module_importing_a_tool():
    graph = {
        "adls_lightning.soup": {"adls_lightning.tools.options"},
        "adls_lightning.quant.sensitivity": {"adls_lightning.export.__main__"},
        "adls_lightning.export.evaluate": {"adls_lightning.tools.options"},
        "adls_lightning.callbacks.pruning": {"adls_lightning.tools.soup"},
        # allowed: a tool on the library, a `python -m` shim on its tool
        "adls_lightning.tools.soup": {"adls_lightning.soup", "adls_lightning.tools.options"},
        "adls_lightning.graph.__main__": {"adls_lightning.tools.graph"},
        "adls_lightning.export.__main__": {"adls_lightning.tools.export"},
    }
    assert import_graph.rule_breaks(graph) == [
        "adls_lightning.callbacks.pruning: imports adls_lightning.tools.soup",
        "adls_lightning.export.evaluate: imports adls_lightning.tools.options",
        "adls_lightning.quant.sensitivity: imports adls_lightning.export.__main__",
        "adls_lightning.soup: imports adls_lightning.tools.options",
    ]


def test_a_main_block_is_no_import_edge():
    """``if __name__ == "__main__":`` runs only as the program: the library's spelling of a tool is no edge."""
    source = "import json\nif __name__ == '__main__':\n    from adls_lightning.tools.soup import main\n"
    tree = ast.parse(source)
    assert [import_graph._main_block(s) for s in tree.body] == [False, True]
    assert not import_graph._main_block(ast.parse("if __name__ == 'x':\n    pass\n").body[0])


def test_every_console_script_is_a_tool():
    """pyproject.toml's console scripts (and the installed ones: a stale install points elsewhere) resolve to a
    ``main`` in ``adls_lightning.tools``, except the application's two."""
    import sysconfig
    from importlib.metadata import distributions

    import tomllib

    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert {"adls-export", "adls-evaluate", "adls-predict", "adls-budget", "adls-table"} <= set(declared)
    # the environment's own install (a build folder's *.egg-info in the checkout is no install)
    installed = [
        dist
        for dist in distributions(path=[sysconfig.get_paths()["purelib"]])
        if dist.metadata["Name"] == "adls-lightning"
    ]
    for dist in installed:  # pip install -e . after a change of [project.scripts]
        scripts = {ep.name: ep.value for ep in dist.entry_points if ep.group == "console_scripts"}
        assert scripts == declared
    for name, target in declared.items():
        if name in APP_SCRIPTS:
            assert target.startswith("adls_lightning.app."), (name, target)
            continue
        module, _, function = target.partition(":")
        assert module.startswith("adls_lightning.tools.") and function == "main", (name, target)
        assert importlib.import_module(module).main.__module__ == module


def test_only_tools_define_a_command_main():
    """The commands' ``main`` functions live in ``adls_lightning.tools``: a library module keeps verbs (its
    ``python -m`` spelling is an ``if __name__ == "__main__":`` block calling the tool)."""
    defined = sorted(
        path.relative_to(ROOT).as_posix()
        for path in (ROOT / "adls_lightning").rglob("*.py")
        if any(
            isinstance(node, ast.FunctionDef) and node.name == "main"
            for node in ast.parse(path.read_text()).body
        )
    )
    assert defined and all(path.startswith("adls_lightning/tools/") for path in defined), defined
    for module in ("export", "evaluate", "predict", "budget"):
        assert f"adls_lightning/tools/{module}.py" in defined


def test_the_import_graph_has_no_allowance(tmp_path):
    """The script passes on the package as it is, with no module exempted from the layers: a library module
    that imported a tool, any of those that were commands, would be a break."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "import_graph.py")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert proc.stdout.rstrip().endswith("rule breaks: none")
    assert not [name for name in vars(import_graph) if "ALIAS" in name or "NOT_YET" in name]
    graph = import_graph.import_graph()
    former_commands = [
        "adls_lightning.export.evaluate",
        "adls_lightning.export.predict",
        "adls_lightning.export.compressed",
        "adls_lightning.export.from_checkpoint",
        "adls_lightning.search.budget_run",
    ]
    for module in former_commands:
        assert module in graph, module
        graph[module] = graph[module] | {"adls_lightning.tools.options"}
    assert import_graph.rule_breaks(graph) == [
        f"{module}: imports adls_lightning.tools.options" for module in sorted(former_commands)
    ]
