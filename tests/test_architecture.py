"""The package's shape holds: no import cycles, nothing imports the CLI, spec/ is torch-free,
a small top level and small modules (docs/architecture.md describes the layout).

The import graph is read from the source (AST), not by importing it, so it sees every
import a module can run: at module level and inside functions, where the lazy imports
that keep `disttrain --help` fast live. Imports under `if TYPE_CHECKING:` are left out:
they never run, so they cannot form a cycle at run time. Imports by name at run time
(`importlib.import_module`, the CLI's verb table) are not seen.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from functools import cache
from itertools import pairwise
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "src" / "disttrain"
MAX_TOP_LEVEL_MODULES = 8
MAX_MODULE_LINES = 500


def _module_name(path: Path) -> str:
    parts = ("disttrain", *path.relative_to(PKG).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@cache
def _modules() -> dict[str, Path]:
    """Every module of the package: dotted name -> file."""
    return {_module_name(p): p for p in sorted(PKG.rglob("*.py")) if "__pycache__" not in p.parts}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_nodes(node: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement under `node`, at any depth, except `if TYPE_CHECKING:` bodies."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and _is_type_checking(child.test):
            for sub in child.orelse:
                yield from _import_nodes_of(sub)
            continue
        yield from _import_nodes_of(child)


def _import_nodes_of(node: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    if isinstance(node, ast.Import | ast.ImportFrom):
        yield node
    yield from _import_nodes(node)


def _base_of(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    """The absolute module a `from X import ...` names, relative imports resolved."""
    if not node.level:
        return node.module or ""
    package = module if is_package else module.rpartition(".")[0]
    for _ in range(node.level - 1):
        package = package.rpartition(".")[0]
    return f"{package}.{node.module}" if node.module else package


def _imported(path: Path, module: str) -> Iterator[tuple[str, int]]:
    """(module, line) of every import in `path`; `from pkg import sub` names pkg.sub when
    sub is a submodule, else pkg itself."""
    known = _modules()
    for node in _import_nodes(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
            continue
        base = _base_of(node, module, path.name == "__init__.py")
        for alias in node.names:
            sub = f"{base}.{alias.name}"
            yield (sub if sub in known else base), node.lineno


@cache
def _graph() -> dict[str, dict[str, int]]:
    """disttrain module -> {imported disttrain module: line of the first such import}."""
    known = _modules()
    graph: dict[str, dict[str, int]] = {}
    for module, path in known.items():
        edges: dict[str, int] = {}
        for target, line in _imported(path, module):
            while target and target not in known and "." in target:
                target = target.rpartition(".")[0]  # `import disttrain.x.Name`-style leftovers
            if target in known and target != module:
                edges.setdefault(target, line)
        graph[module] = edges
    return graph


def _cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """One cycle (a -> b -> ... -> a) per strongly connected component that has one."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's algorithm; the graph has ~100 nodes
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
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
                components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [_cycle_in(graph, set(c), c[0]) for c in components]


def _cycle_in(graph: dict[str, dict[str, int]], members: set[str], start: str) -> list[str]:
    """A shortest path start -> ... -> start inside one component (breadth first)."""
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v]):
                if w == start:
                    return [*paths[v], start]
                if w in members and w not in paths:
                    paths[w] = [*paths[v], w]
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no cycle through {start}")  # pragma: no cover


def _describe(graph: dict[str, dict[str, int]], cycle: list[str]) -> str:
    hops = [f"{a} (line {graph[a][b]})" for a, b in pairwise(cycle)]
    return " -> ".join([*hops, cycle[-1]])


def test_the_graph_is_read() -> None:
    """Guards the other tests against a parser that finds nothing: known edges are seen,
    lazy (function-level) and `from pkg import submodule` ones included."""
    graph = _graph()
    assert len(graph) > 50
    assert "disttrain.k8s.labels" in graph["disttrain.k8s.client"]
    assert "disttrain.k8s.hami" in graph["disttrain.k8s.render"]  # from disttrain.k8s import hami
    assert "disttrain.diagnose.preflight" in graph["disttrain.cli.doctor_cmd"]  # inside a function


def test_cycle_finder_finds_and_prints_a_cycle() -> None:
    graph = {"a": {"b": 1}, "b": {"c": 2}, "c": {"a": 3, "d": 4}, "d": {}}
    (cycle,) = _cycles(graph)
    assert cycle == ["a", "b", "c", "a"]
    assert _describe(graph, cycle) == "a (line 1) -> b (line 2) -> c (line 3) -> a"
    assert _cycles({"a": {"b": 1}, "b": {}}) == []


def test_no_import_cycles() -> None:
    graph = _graph()
    cycles = [_describe(graph, c) for c in _cycles(graph)]
    assert not cycles, "import cycles between disttrain modules:\n" + "\n".join(cycles)


def test_nothing_imports_the_cli() -> None:
    """The CLI is the outermost shell: library code that imports it would drag click in and
    invert the layering. Only cli/ itself (and a `__main__` entry) may."""
    offenders = [f"{m} (line {line}) imports {t}" for m, edges in _graph().items()
                 for t, line in edges.items()
                 if (t == "disttrain.cli" or t.startswith("disttrain.cli."))
                 and not (m == "disttrain.cli" or m.startswith("disttrain.cli."))
                 and not m.endswith(".__main__")]
    assert not offenders, "\n".join(offenders)


def test_spec_imports_no_torch() -> None:
    """A job spec is loaded, validated and rendered where torch is not installed (a laptop
    rendering manifests), and without paying torch's import time. Checked over spec/ and
    every disttrain module it imports, at any depth, module- and function-level alike."""
    graph, modules = _graph(), _modules()
    seen = {m for m in modules if m == "disttrain.spec" or m.startswith("disttrain.spec.")}
    todo = sorted(seen)
    while todo:
        for target in graph[todo.pop()]:
            if target not in seen:
                seen.add(target)
                todo.append(target)
    offenders = [f"{m} (line {line}) imports {t}" for m in sorted(seen)
                 for t, line in _imported(modules[m], m) if t == "torch" or t.startswith("torch.")]
    assert not offenders, "spec/ reaches torch:\n" + "\n".join(offenders)


def test_top_level_stays_small() -> None:
    """Folders carry the architecture; the top level keeps only the package-wide contracts."""
    top = sorted(p.name for p in PKG.glob("*.py"))
    assert len(top) <= MAX_TOP_LEVEL_MODULES, f"{len(top)} top-level modules: {top}"


def test_no_module_over_500_lines() -> None:
    long = {m: n for m, p in _modules().items()
            if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not long, f"modules over {MAX_MODULE_LINES} lines (split them by job): {long}"


# Imports that run up the layers (issue 21): the loop knows tasks, not the built-in examples;
# starting ranks and the loop never need the diagnosis tools (a lint engine, doctor's rules).
FORBIDDEN = {
    "disttrain.train": ("disttrain.examples", "disttrain.diagnose"),
    "disttrain.launch": ("disttrain.diagnose",),
}


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _upward_imports(graph: dict[str, dict[str, int]]) -> list[str]:
    return [f"{m} (line {line}) imports {t}" for m, edges in sorted(graph.items())
            for t, line in edges.items()
            for package, banned in FORBIDDEN.items()
            if _within(m, package) and any(_within(t, b) for b in banned)]


def test_the_import_direction_rule_catches_an_upward_import() -> None:
    """The rule below finds an edge of each forbidden kind, and not an allowed one."""
    graph = {"disttrain.train.build": {"disttrain.examples.workload": 76},
             "disttrain.launch.own_workers": {"disttrain.diagnose.lint_ctx": 25},
             "disttrain.train.trainer": {"disttrain.diagnose.system": 3, "disttrain.pysource": 4},
             "disttrain.diagnose.lint": {"disttrain.train.task": 9}}
    assert _upward_imports(graph) == [
        "disttrain.launch.own_workers (line 25) imports disttrain.diagnose.lint_ctx",
        "disttrain.train.build (line 76) imports disttrain.examples.workload",
        "disttrain.train.trainer (line 3) imports disttrain.diagnose.system"]


def test_no_upward_imports() -> None:
    """train/ imports neither examples/ nor diagnose/, launch/ not diagnose/."""
    offenders = _upward_imports(_graph())
    assert not offenders, "imports against the layering:\n" + "\n".join(offenders)
