"""Print the import graph of ``adls_lightning`` (every import, the ones inside functions too) and check its rules.

``python scripts/import_graph.py`` prints one line per module (``module -> what it imports of the project``), then
the circles (none expected) and the rule breaks; exit code 1 when there is either. The rules:

- no circle;
- layers, top down: the entry points -- the application (``adls_lightning.app``), the tools
  (``adls_lightning.tools``) and ``__main__`` modules --, the callbacks (``adls_lightning.callbacks``), the library
  (the rest). A module imports only from its own layer or one below: the callbacks import no entry point; the
  library imports neither, nor a top-level ``callbacks`` package (the callbacks' old home), nor a ``__main__``
  module. A module's ``if __name__ == "__main__":`` block (its ``python -m`` spelling calling a tool) runs only as
  the program, never on import: no edge of the graph;
- the library imports neither Hydra's runtime (``hydra`` beyond ``hydra.utils`` / ``hydra.errors``) nor
  Lightning's ``Trainer``, except the modules that :data:`HYDRA_COMPOSERS` names (listed, with the
  reason, in ``adls_lightning/app/__init__.py``).
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "adls_lightning"
APP = f"{PACKAGE}.app"
CALLBACKS = f"{PACKAGE}.callbacks"
TOOLS = f"{PACKAGE}.tools"
# Hydra's configuration helpers the guarded builder uses (instantiation, its exception): not Hydra's runtime.
HYDRA_LIBRARY_MODULES = ("hydra.utils", "hydra.errors")
# library modules that compose a run's recorded config with Hydra's compose API (the tools call them)
HYDRA_COMPOSERS = (f"{PACKAGE}.runs.loading",)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_modules(path: Path, modules: set[str]) -> Iterator[str]:
    """Every module ``path`` imports (absolute names); ``from pkg import sub`` names ``pkg.sub`` when it is one."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text(), filename=str(path))
    # `if __name__ == "__main__":` at module level runs only as the program: not an import of the module
    tree.body = [statement for statement in tree.body if not _main_block(statement)]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            for alias in node.names:
                child = f"{base}.{alias.name}"
                yield child if child in modules else base


def _main_block(statement: ast.stmt) -> bool:
    test = statement.test if isinstance(statement, ast.If) else None
    return (
        isinstance(test, ast.Compare)
        and isinstance(test.left, ast.Name)
        and test.left.id == "__name__"
        and any(isinstance(c, ast.Constant) and c.value == "__main__" for c in test.comparators)
    )


def import_graph() -> dict[str, set[str]]:
    """``module -> every module it imports``, for every module of the package (outside names included)."""
    paths = sorted((ROOT / PACKAGE).rglob("*.py"))
    modules = {module_name(p) for p in paths}
    return {module_name(p): set(imported_modules(p, modules)) for p in paths}


def project_edges(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    return {m: {t for t in targets if t in graph and t != m} for m, targets in graph.items()}


def find_cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The circles of the graph: one per strongly connected component with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(edges[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    sys.setrecursionlimit(10_000)
    for node in sorted(edges):
        if node not in index:
            visit(node)
    return cycles


def _inside(module: str, package: str) -> bool:
    return module == package or module.startswith(f"{package}.")


def rule_breaks(graph: dict[str, set[str]]) -> list[str]:
    """``module: imports X`` for each import the library may not make (see the module's docstring)."""
    breaks = []
    for module, targets in sorted(graph.items()):
        if _inside(module, APP) or _inside(module, TOOLS) or module.endswith(".__main__"):
            continue
        if _inside(module, CALLBACKS):
            breaks.extend(
                f"{module}: imports {target}"
                for target in sorted(targets)
                if _inside(target, APP) or _inside(target, TOOLS)
            )
            continue
        for target in sorted(targets):
            to_tool = _inside(target, TOOLS) or target.endswith(".__main__")
            to_app = _inside(target, APP) or to_tool
            to_callbacks = _inside(target, CALLBACKS) or _inside(target, "callbacks")
            hydra_runtime = (target == "hydra" or target.startswith("hydra.")) and not target.startswith(
                HYDRA_LIBRARY_MODULES
            )
            trainer = target in (
                "lightning.Trainer",
                "lightning.pytorch.Trainer",
                "lightning.pytorch.trainer",
            )
            if to_app or to_callbacks or trainer or (hydra_runtime and module not in HYDRA_COMPOSERS):
                breaks.append(f"{module}: imports {target}")
    return breaks


def main() -> int:
    if len(sys.argv) > 1:
        print(
            f"error: {sys.argv[1]}: import_graph.py takes no arguments (it reads {PACKAGE}/)", file=sys.stderr
        )
        return 2
    graph = import_graph()
    edges = project_edges(graph)
    for module in sorted(edges):
        print(f"{module} -> {', '.join(sorted(edges[module])) or '(nothing of the project)'}")
    cycles = find_cycles(edges)
    breaks = rule_breaks(graph)
    print(f"\n{len(edges)} modules, {sum(map(len, edges.values()))} imports of the project")
    print("circles: " + ("; ".join(" <-> ".join(c) for c in cycles) if cycles else "none"))
    print("rule breaks: " + ("; ".join(breaks) if breaks else "none"))
    return 1 if cycles or breaks else 0


if __name__ == "__main__":
    sys.exit(main())
