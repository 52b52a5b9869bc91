"""The package's import graph, read from the source: no module of npqwen takes part in an import
cycle (function-level imports included), nothing imports the server's app but the `serve`
command, and no file of the server is over SERVER_MAX_LINES lines."""
import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "npqwen"
APP, SERVE = "npqwen.server.api_server", "npqwen.cli.serve"
SERVER_MAX_LINES = 450


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports(name: str, path: Path, known: dict) -> set[str]:
    """The npqwen modules that `name` imports anywhere in its file (at the top or inside a function);
    `from package import name` counts as importing the submodule when `name` is one."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:   # relative: up level - 1 packages from this module's package
                parent = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:   # a module outside npqwen (json, numpy) comes to ""
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """One cycle through each strongly connected component of more than one module (Tarjan's)."""
    index, low, stack, on_stack, components = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
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
                components.append(set(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return [cycle_in(edges, component) for component in components]


def cycle_in(edges: dict[str, set[str]], component: set[str]) -> list[str]:
    """A shortest cycle through the component's first module, as [a, b, ..., a]."""
    start = min(component)
    paths, seen = [[start]], {start}
    while paths:
        path = paths.pop(0)
        for w in sorted(edges[path[-1]] & component):
            if w == start:
                return path + [start]
            if w not in seen:
                seen.add(w)
                paths.append(path + [w])
    raise AssertionError(f"no cycle in {component}")


def test_the_graph_is_read_as_python_resolves_imports():
    edges = graph()
    assert "npqwen.engine" in edges["npqwen.server.engine_loop"]   # from ..engine import Request (a name)
    assert "npqwen.server.parsers" in edges["npqwen.server.serving_chat"]   # from .parsers import ...
    assert APP in edges[SERVE]                                             # a function-level import
    assert {"npqwen.moe", "npqwen.ops"} <= edges["npqwen.model"]           # from . import moe, ops: submodules
    assert "npqwen" in edges["npqwen.server.http"]                         # from .. import __version__: a name
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]


def test_no_import_cycles():
    found = cycles(graph())
    assert not found, "import cycles:\n" + "\n".join(" -> ".join(c) for c in found)


def test_nothing_imports_the_app_but_the_serve_command():
    importers = sorted(name for name, targets in graph().items() if APP in targets)
    assert importers == [SERVE], f"{APP} is imported by {importers}; only {SERVE} may (handlers go in serving_*.py)"


def test_no_server_file_is_long():
    lengths = {p.name: len(p.read_text().splitlines()) for p in sorted((PACKAGE / "server").glob("*.py"))}
    long = {name: n for name, n in lengths.items() if n > SERVER_MAX_LINES}
    assert not long, f"npqwen/server/ files over {SERVER_MAX_LINES} lines (split them by what each part does): {long}"
