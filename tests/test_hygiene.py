"""The test suite's own shape: test modules share code through ``tests/conftest.py`` (fixtures) and helper modules
(``tests/helpers.py`` and its siblings), never by importing one another, and a helper module is imported by one
spelling, ``from tests.<module> import ...``."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def local_imports(path: Path) -> list[tuple[int, str]]:
    """``(line, module)`` of every import (top-level or nested) in ``path`` of a module that lives in ``tests/``, by
    the name as written (``tests.helpers``, ``helpers``, ``test_search``, ...)."""
    local = {p.stem for p in TESTS.glob("*.py")}
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            modules = [node.module]
            if node.module == "tests":  # from tests import helpers
                modules = [f"tests.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        else:
            continue
        for module in modules:
            parts = module.split(".")
            if parts[0] in local or (parts[0] == "tests" and len(parts) > 1 and parts[1] in local):
                found.append((node.lineno, module))
    return found


def offending(path: Path) -> list[str]:
    problems = []
    for line, module in local_imports(path):
        name = module.removeprefix("tests.")
        if name.startswith("test_") or name == "conftest":
            problems.append(f"{path.name}:{line} imports {module} (move what it shares to tests/helpers.py)")
        elif not module.startswith("tests."):
            problems.append(f"{path.name}:{line} imports {module} (spell it tests.{module})")
    return problems


def test_no_test_module_imports_another_and_helpers_have_one_spelling():
    problems = [problem for path in sorted(TESTS.glob("*.py")) for problem in offending(path)]
    assert problems == []


def test_the_check_finds_each_kind_of_offence(tmp_path):
    # the check itself, on a module written here: each kind of import it must refuse, and the one it accepts
    module = tmp_path / "test_example.py"
    module.write_text(
        "from tests.test_search import tiny_run\n"
        "import tests.test_export\n"
        "from conftest import ROOT\n"
        "from helpers import ok\n"
        "def f():\n    from test_nas import expected_param_count\n"
        "from tests.helpers import ok\n"
        "from tests import helpers\n"
    )
    assert [problem.split(" imports ")[1].split(" ")[0] for problem in offending(module)] == [
        "tests.test_search",
        "tests.test_export",
        "conftest",
        "helpers",
        "test_nas",
    ]
