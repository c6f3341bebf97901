"""Data flows one way: no module of the package imports one that imports it back."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).parent.parent / "dflash_mlx"


def imports_of(path: Path) -> set[str]:
    """Package modules `path` imports anywhere (lazy imports inside functions included)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            if node.module:
                found.add(node.module.split(".")[0])
            else:
                found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("dflash_mlx."):
            found.add(node.module.split(".")[1])
    return found


def test_the_import_graph_has_no_cycles():
    modules = {p.stem: p for p in PACKAGE.glob("*.py") if p.stem != "__init__"}
    graph = {name: imports_of(path) & set(modules) for name, path in modules.items()}
    state = {}

    def visit(name, stack):
        if state.get(name) == "done":
            return
        assert state.get(name) != "open", " -> ".join(stack + [name])
        state[name] = "open"
        for dep in sorted(graph[name]):
            visit(dep, stack + [name])
        state[name] = "done"

    for name in sorted(graph):
        visit(name, [])
    assert "cli" not in set().union(*graph.values())  # nothing imports the command line
