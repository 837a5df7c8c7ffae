"""No import circles in tideserve/: every module can be read, tested and replaced below the ones that use it.

The graph is read from the source with ``ast``, not by importing: an edge runs from a module to each
tideserve module it imports, at module level or inside a function (a deferred import still ties the two
together), except under ``if TYPE_CHECKING:``, which never runs. ``from package import name`` points at
the submodule ``package.name`` when there is one, else at the package (its ``__init__``), and a package
that imports its submodules to re-export them points at each of them. A strongly connected component of
more than one module is a circle.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parents[1] / "tideserve"


def module_names(package_dir: Path = PACKAGE_DIR) -> dict[str, Path]:
    """Dotted name -> source file of every module under ``package_dir`` (a package is its ``__init__``)."""
    root = package_dir.parent
    names = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(node: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement below ``node`` that can run: the bodies of ``if TYPE_CHECKING:`` are left out
    (their ``else`` branches are kept)."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child
        elif isinstance(child, ast.If) and _is_type_checking(child.test):
            for stmt in child.orelse:
                yield from _imports(ast.Module(body=[stmt], type_ignores=[]))
        else:
            yield from _imports(child)


def _resolve(importer: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute module a ``from ... import`` names, relative levels included."""
    if not node.level:
        return node.module or ""
    base = importer.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def import_graph(package_dir: Path = PACKAGE_DIR) -> dict[str, set[str]]:
    """Module -> the tideserve modules it imports."""
    modules = module_names(package_dir)
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        for node in _imports(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                source = _resolve(name, is_package, node)
                targets = [f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules else source
                           for alias in node.names]
            graph[name].update(t for t in targets if t in modules and t != name)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            for nxt in successors:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def _describe(graph: dict[str, set[str]], component: list[str]) -> str:
    members = set(component)
    edges = [f"{a} -> {b}" for a in component for b in sorted(graph[a] & members)]
    return "circle of " + ", ".join(component) + ": " + "; ".join(edges)


def test_no_module_imports_itself_back() -> None:
    graph = import_graph()
    assert len(graph) > 100  # the whole package was read
    found = circles(graph)
    assert not found, "\n".join(_describe(graph, c) for c in found)


def test_the_reader_sees_a_circle_through_a_deferred_import(tmp_path: Path) -> None:
    """A circle closed by a function-level import, or by a package re-exporting its submodule, is found;
    one closed only under TYPE_CHECKING is not."""
    package = tmp_path / "tideserve"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("from tideserve.sub.b import B\n")
    (package / "a.py").write_text("def f():\n    from tideserve.sub import b\n")
    (package / "sub" / "b.py").write_text("import tideserve.a\nB = 1\n")
    (package / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                  "    from tideserve import d\n")
    (package / "d.py").write_text("from . import c\n")
    graph = import_graph(package)
    assert circles(graph) == [["tideserve.a", "tideserve.sub.b"]]
    assert graph["tideserve.sub"] == {"tideserve.sub.b"}
    assert graph["tideserve.d"] == {"tideserve.c"} and graph["tideserve.c"] == set()
