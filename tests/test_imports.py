"""The package's import graph has no cycle.

Every ``import`` and ``from ... import`` inside src/kvcache counts, at module level or inside a
function (a function-level import only hides a circle until the function runs), except those
under ``if TYPE_CHECKING:``, which never run.  ``from . import x`` is an edge to the submodule
``x`` when there is one; an import of a package is an edge to its ``__init__``.
"""

from __future__ import annotations

import ast
import pathlib

import kvcache

ROOT = pathlib.Path(kvcache.__file__).parent


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, pathlib.Path]:
    return {_module_name(p): p for p in ROOT.rglob("*.py")}


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                skip.update(id(n) for n in ast.walk(child))
    return skip


def _edges(name: str, path: pathlib.Path, known: set[str]) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    skip = _type_checking_nodes(tree)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
            base = None
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                pkg = package.split(".")
                base = ".".join(pkg[: len(pkg) - node.level + 1])
                base = f"{base}.{node.module}" if node.module else base
            else:
                base = node.module or ""
            targets = [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for t in targets:
            if t in known:                       # a submodule itself
                out.add(t)
            elif base is not None and base in known:
                out.add(base)                    # a name from a module
            elif t.rpartition(".")[0] in known:
                out.add(t.rpartition(".")[0])
    out.discard(name)
    return out


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def import_graph() -> dict[str, set[str]]:
    mods = _modules()
    known = set(mods) | {"kvcache._core"}
    graph = {name: _edges(name, path, known) for name, path in mods.items()}
    graph["kvcache._core"] = set()
    return graph


def test_the_import_graph_has_no_cycle():
    graph = import_graph()
    cycle = _cycle(graph)
    assert cycle is None, " -> ".join(cycle or [])


def test_the_cycle_finder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_leaf_modules_import_nothing_of_kvcache():
    graph = import_graph()
    for leaf in ("kvcache._validate", "kvcache._generation", "kvcache._progress",
                 "kvcache._windows", "kvcache._version", "kvcache.quant", "kvcache.modes"):
        assert graph[leaf] == set(), (leaf, graph[leaf])


def test_the_library_does_not_import_its_benchmark():
    graph = import_graph()
    users = {m for m, deps in graph.items()
             if not m.startswith("kvcache.bench") and m != "kvcache.__main__"
             and any(d.startswith("kvcache.bench") for d in deps)}
    assert users == set()
