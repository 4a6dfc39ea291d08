"""conveyor's modules import one another without cycles, and its packages import only down the layer picture.

Every import statement counts, module level or inside a function (a lazy import that closes a cycle is still a
cycle); only ``if TYPE_CHECKING:`` blocks do not, as they never run. Importing a submodule runs its package's
``__init__`` first, but that is Python's doing, not an edge of the graph.

Folded to packages (``conveyor.server.app`` -> ``server``; a top-level module such as ``conveyor/serve.py`` is a
package of its own, ``conveyor/__init__.py`` is ``conveyor``), the graph must follow the picture in
docs/architecture.md's "Layers" section, which is read from there: a package may import only packages drawn on
lower lines, never one on its own line or above.
"""

from __future__ import annotations

import ast
from pathlib import Path

import conveyor

PACKAGE_DIR = Path(conveyor.__file__).parent
ARCHITECTURE = PACKAGE_DIR.parent / "docs" / "architecture.md"


def module_names() -> dict[str, Path]:
    names = {}
    for path in PACKAGE_DIR.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _runtime_imports(tree: ast.AST):
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node):
            stack.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def _known(name: str, modules: dict[str, Path]) -> str | None:
    """The longest prefix of a dotted name that is one of our modules."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def import_graph() -> dict[str, set[str]]:
    modules = module_names()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in _runtime_imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                           for alias in node.names]
            for target in targets:
                known = _known(target, modules)
                if known is not None and known != name:
                    graph[name].add(known)
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def test_the_cycle_finder_finds_cycles():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert find_cycles(graph) == [["a", "b", "c"]]


def test_the_graph_sees_lazy_and_relative_imports_but_not_type_checking_ones():
    graph = import_graph()
    assert "conveyor.engine.llm_engine" in graph["conveyor.engine.llm"]  # module level
    assert "conveyor.models.flops" in graph["conveyor.engine.llm_engine"]  # inside a function
    assert "conveyor.core.sampling_params" in graph["conveyor"]


def test_no_import_cycles_in_conveyor():
    assert find_cycles(import_graph()) == []


# ---- packages ---------------------------------------------------------------------------------------------
def package_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "conveyor"


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The module graph folded to packages; an import within a package is no edge."""
    packages: dict[str, set[str]] = {package_of(m): set() for m in graph}
    for module, targets in graph.items():
        for target in targets:
            if package_of(target) != package_of(module):
                packages[package_of(module)].add(package_of(target))
    return packages


def diagram_tiers(text: str) -> list[set[str]]:
    """The layer picture of docs/architecture.md, top line first: each line starts with the packages it draws
    (``server/``, ``serve.py``, ``__init__.py`` for ``conveyor``; a parenthesised sub-package is skipped), then
    says what they are."""
    section = text.split("\n## Layers", 1)[1]
    picture = section.split("```", 2)[1]
    tiers = []
    for line in picture.splitlines()[1:]:  # [0]: the rest of the opening fence's line
        if not line.strip():
            continue
        names = set()
        for token in line.split():
            if token.startswith("(") and token.endswith(")"):
                continue
            if not token.endswith(("/", ".py")):
                break
            name = token.removesuffix("/").removesuffix(".py")
            names.add("conveyor" if name == "__init__" else name)
        assert names, f"a line of the layer picture names no package: {line!r}"
        tiers.append(names)
    return tiers


def rank_violations(packages: dict[str, set[str]], tiers: list[set[str]]) -> list[str]:
    """Every package import that does not point down the picture (up, or to a package on the same line)."""
    line_of = {name: i for i, tier in enumerate(tiers) for name in tier}
    return [f"{a} -> {b}: {b} is not drawn below {a}" for a in sorted(packages) for b in sorted(packages[a])
            if line_of[b] <= line_of[a]]


def test_no_package_cycles():
    assert find_cycles(package_graph(import_graph())) == []


def test_every_package_is_drawn_once_in_the_layer_picture():
    tiers = diagram_tiers(ARCHITECTURE.read_text())
    drawn = [name for tier in tiers for name in tier]
    assert len(drawn) == len(set(drawn)), drawn
    assert set(drawn) == set(package_graph(import_graph())), "docs/architecture.md's picture and conveyor/ differ"


def test_packages_import_only_down_the_layer_picture():
    tiers = diagram_tiers(ARCHITECTURE.read_text())
    assert rank_violations(package_graph(import_graph()), tiers) == []


def test_the_rank_check_refuses_upward_and_sideways_imports():
    tiers = diagram_tiers(ARCHITECTURE.read_text())
    packages = package_graph(import_graph())
    assert "server" in packages["distributed"] and "engine" in packages["server"]  # the real edges it checks
    for a, b in (("server", "distributed"), ("engine", "server"), ("core", "engine"), ("server", "bench")):
        bad = {**packages, a: packages[a] | {b}}
        assert rank_violations(bad, tiers) == [f"{a} -> {b}: {b} is not drawn below {a}"]
