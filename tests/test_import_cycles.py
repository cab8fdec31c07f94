"""No import cycles between the package's modules (streamrl/, workers/ as streamrl.workers,
launcher/ as streamrl.launcher), read from the source with ``ast`` (nothing is imported).

Imports under ``if TYPE_CHECKING:`` are skipped: they never run. Two graphs are checked:

* module-level imports only: a cycle there makes import order matter; none is allowed;
* every import, also those inside functions: hiding one edge of a cycle in a function does not
  untangle the two modules, so such cycles fail too.
"""
from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ROOTS = {"streamrl": "streamrl", "workers": "streamrl.workers", "launcher": "streamrl.launcher"}

def package_modules() -> dict[str, tuple[Path, bool]]:
    """``{dotted module name: (file, is_package)}`` for every .py file under the roots."""
    mods = {}
    for folder, package in ROOTS.items():
        for path in sorted((REPO / folder).rglob("*.py")):
            parts = [package, *path.relative_to(REPO / folder).with_suffix("").parts]
            is_package = parts[-1] == "__init__"
            mods[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return mods


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return getattr(test, "id", None) == "TYPE_CHECKING" or getattr(test, "attr", None) == "TYPE_CHECKING"


def _imports(body: list[ast.stmt], into_functions: bool):
    """Import statements of ``body`` that run: module level (through if/try/with blocks), and
    with ``into_functions`` also those in function and class bodies; never TYPE_CHECKING ones."""
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If):
            if not _is_type_checking(node):
                yield from _imports(node.body, into_functions)
            yield from _imports(node.orelse, into_functions)
        elif isinstance(node, ast.Try):
            for block in (node.body, node.orelse, node.finalbody, *(h.body for h in node.handlers)):
                yield from _imports(block, into_functions)
        elif isinstance(node, (ast.With, ast.For, ast.While)):
            yield from _imports(node.body, into_functions)
        elif isinstance(node, ast.ClassDef):
            yield from _imports(node.body, into_functions)
        elif into_functions and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield from _imports(node.body, into_functions)


def import_graph(into_functions: bool) -> dict[str, set[str]]:
    """``{module: modules of the package it imports}``; ``from pkg import name`` counts as an
    import of ``pkg.name`` when that is a module, else of ``pkg``."""
    mods = package_modules()

    def owner(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for mod, (path, is_package) in mods.items():
        deps = set()
        for node in _imports(ast.parse(path.read_text()).body, into_functions):
            if isinstance(node, ast.Import):
                deps |= {owner(alias.name) for alias in node.names}
                continue
            base = mod if is_package else mod.rpartition(".")[0]
            for _ in range(node.level - 1):
                base = base.rpartition(".")[0]
            source = (base + ("." + node.module if node.module else "")) if node.level else node.module
            deps |= {f"{source}.{a.name}" if f"{source}.{a.name}" in mods else owner(source) for a in node.names}
        graph[mod] = deps - {None, mod}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each as one cycle path."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while (w := stack.pop()) != v:
                component.append(w)
            if component:
                found.append(_path_through(graph, {v, *component}, v))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _path_through(graph: dict[str, set[str]], component: set[str], start: str) -> list[str]:
    """A shortest import path start -> ... -> start inside ``component`` (breadth first)."""
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & component):
                if w == start:
                    return paths[v] + [start]
                if w not in paths:
                    paths[w] = paths[v] + [w]
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no cycle through {start}")


def _report(found: list[list[str]]) -> str:
    return "import cycles:\n" + "\n".join("  " + " -> ".join(c) for c in found)


def test_no_module_level_import_cycle():
    found = cycles(import_graph(into_functions=False))
    assert not found, _report(found)


def test_no_import_cycle_through_function_level_imports():
    found = [c for c in cycles(import_graph(into_functions=True))]
    assert not found, _report(found)


def test_graph_sees_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c", "a"]]
