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


def _from_module(node: ast.ImportFrom, package: str) -> str:
    """The module a ``from ... import`` reads from, relative imports resolved in ``package``."""
    if not node.level:
        return node.module or ""
    pkg = package.split(".")
    base = ".".join(pkg[: len(pkg) - node.level + 1])
    return f"{base}.{node.module}" if node.module else base


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
            base = _from_module(node, package)
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


def _private_uses(name: str, path: pathlib.Path, known: set[str]) -> list[str]:
    """Private names (``_x``) of other kvcache modules that ``name`` imports or reads as
    ``module._x``; private submodules (``from . import _core``) are the package's own."""
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    bound: dict[str, str] = {}                   # local name -> kvcache module it names
    out: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = _from_module(node, package)
            if not base.startswith("kvcache"):
                continue
            for a in node.names:
                full = f"{base}.{a.name}"
                if full in known:
                    bound[a.asname or a.name] = full
                elif a.name.startswith("_") and not a.name.startswith("__") and base != name:
                    out.append(f"{name} imports {full}")
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name in known and a.asname:
                    bound[a.asname] = a.name
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id in bound and node.attr.startswith("_")
                and not node.attr.startswith("__")):
            full = f"{bound[node.value.id]}.{node.attr}"
            if full not in known and bound[node.value.id] != name:
                out.append(f"{name} reads {full}")
    return out


def test_no_module_uses_another_modules_private_names():
    # a private name one module needs from another becomes public there (or moves)
    mods = _modules()
    known = set(mods) | {"kvcache._core"}
    uses = sorted(u for m, p in mods.items() for u in _private_uses(m, p, known))
    assert uses == []


def test_the_private_name_finder_finds_them(tmp_path):
    src = tmp_path / "m.py"
    known = {"kvcache.store.entry", "kvcache.quant", "kvcache._core"}
    src.write_text("from ..store.entry import _decode, encode\nfrom .. import quant as q, _core\n"
                   "x = q._k4_scale + q.k4_values + _core.attend\n")
    assert sorted(_private_uses("kvcache.runner.m", src, known)) == [
        "kvcache.runner.m imports kvcache.store.entry._decode",
        "kvcache.runner.m reads kvcache.quant._k4_scale"]


def test_no_module_is_over_900_lines():
    # a module that outgrows this is split by job (docs/architecture.md, the module map)
    long = sorted(f"{m}: {n}" for m, p in _modules().items()
                  if (n := len(p.read_text(encoding="utf-8").splitlines())) > 900)
    assert long == []
