"""The largest classes and functions of the project's packages, by lines (issue 57's "before and after" sizes).

``python scripts/code_sizes.py [TOP]`` walks ``adls_lightning/`` and ``hydra_plugins/`` with
``ast`` and prints the ``TOP`` (default 10) largest classes and the ``TOP`` largest functions (methods and nested
functions included), each as lines (``end_lineno - lineno + 1``, decorators excluded), ``path:line`` and
qualified name.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("adls_lightning", "hydra_plugins")


def definitions(path: Path) -> list[tuple[str, int, str, int]]:
    """``(kind, lines, qualified name, first line)`` of every class and function defined in ``path``."""
    found = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                kind = "class" if isinstance(child, ast.ClassDef) else "function"
                name = f"{prefix}{child.name}"
                found.append((kind, child.end_lineno - child.lineno + 1, name, child.lineno))
                visit(child, name + ".")
            else:
                visit(child, prefix)

    visit(ast.parse(path.read_text(), filename=str(path)), "")
    return found


def main(argv: list[str]) -> int:
    top = int(argv[0]) if argv else 10
    rows = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            relative = path.relative_to(ROOT)
            rows += [
                (kind, lines, f"{relative}:{line}", name) for kind, lines, name, line in definitions(path)
            ]
    for kind, title in (("class", "classes"), ("function", "functions")):
        largest = sorted((r for r in rows if r[0] == kind), key=lambda r: -r[1])[:top]
        print(f"largest {title} (lines) in {', '.join(PACKAGES)}:")
        for _, lines, where, name in largest:
            print(f"{lines:6d}  {name}  ({where})")
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
