"""The layout shows the architecture, and the arrows between its parts point one way.

cli, serve  ->  api  ->  the loop  ->  io
the loop, bottom up: kernels -> target, drafters -> cache -> decode (sampling.py: a leaf they share)
train, bench, convert, distributed: tools beside the loop, which never imports them

A part is a folder of the package (or one of the few modules at its root); the rules below
name parts, never files, so a new file is judged by the folder it is put in.
"""

import ast
import tomllib
from pathlib import Path

ROOT = Path(__file__).parent.parent
PACKAGE = ROOT / "dflash_mlx"

# the decode loop's parts, each importing only parts listed before it (and io)
LOOP = ["sampling", "kernels", "target", "drafters", "cache", "decode"]
TOOLS = {"train", "bench", "convert", "serve", "distributed"}
ENTRY = {"api", "cli"}
ROOT_MODULES = {"__init__", "cli", "sampling"}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}


def imports_of(path: Path) -> set[str]:
    """Package modules `path` imports anywhere (lazy imports inside functions included)."""
    name = module_name(path)
    package = name.split(".") if path.stem == "__init__" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package[: len(package) - node.level + 1]
            target = ".".join(base + ([node.module] if node.module else []))
            candidates = [f"{target}.{a.name}" for a in node.names] + [target]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("dflash_mlx"):
            candidates = [f"{node.module}.{a.name}" for a in node.names] + [node.module]
        elif isinstance(node, ast.Import):
            candidates = [a.name for a in node.names if a.name.startswith("dflash_mlx")]
        else:
            continue
        found.update(c for c in candidates if c in MODULES and c != name)
    return found


GRAPH = {name: imports_of(path) for name, path in MODULES.items()}


def part(module: str) -> str:
    """The top-level part a module belongs to: 'engine', 'drafters', 'train', ..."""
    return (module.split(".") + [""])[1]


def test_the_import_graph_has_no_cycles():
    state = {}

    def visit(name, stack):
        if state.get(name) == "done":
            return
        assert state.get(name) != "open", " -> ".join(stack + [name])
        state[name] = "open"
        for dep in sorted(GRAPH[name]):
            if dep != "dflash_mlx":  # a package's own __init__ re-exports; not an arrow back
                visit(dep, stack + [name])
        state[name] = "done"

    for name in sorted(GRAPH):
        visit(name, [])


def test_the_loop_never_imports_tools_or_entry_points():
    for name, deps in GRAPH.items():
        if part(name) in LOOP:
            wrong = sorted(d for d in deps if part(d) in TOOLS | ENTRY)
            assert not wrong, f"{name} (the decode loop) imports {wrong}"


def test_each_part_of_the_loop_imports_only_the_parts_below_it():
    for name, deps in GRAPH.items():
        if part(name) in LOOP:
            below = set(LOOP[: LOOP.index(part(name))]) | {"io", part(name)}
            wrong = sorted(d for d in deps if part(d) and part(d) not in below)
            assert not wrong, f"{name} ({part(name)}) imports {wrong}, above it or beside it in the loop"


def test_the_package_root_holds_folders_and_a_few_modules():
    assert {p.stem for p in PACKAGE.glob("*.py")} == ROOT_MODULES
    assert set(LOOP) | TOOLS | ENTRY | {"io"} >= {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}


def test_io_imports_nothing_else_of_the_package():
    for name, deps in GRAPH.items():
        if part(name) == "io":
            assert all(part(d) == "io" for d in deps), f"{name} imports {deps}"


def test_nothing_imports_the_command_line():
    assert not [n for n, deps in GRAPH.items() if "dflash_mlx.cli" in deps]


def test_subpackages_import_each_other_one_way():
    arrows = {(part(a), part(b)) for a, deps in GRAPH.items() for b in deps if part(a) != part(b) and part(b)}
    both_ways = sorted((a, b) for a, b in arrows if (b, a) in arrows and a < b)
    assert not both_ways, f"parts importing each other: {both_ways}"


def test_every_subpackage_is_packaged():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    on_disk = {module_name(p) for p in PACKAGE.rglob("__init__.py")}
    assert on_disk | {"dflash_mlx.metal", "dflash_mlx.cpu", "dflash_mlx.weights"} == set(config["packages"])


def test_shipped_weights_are_package_data():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    patterns = config["package-data"]["dflash_mlx.weights"]
    shipped = [p for p in (PACKAGE / "weights").rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    assert shipped
    assert all(any(p.relative_to(PACKAGE / "weights").match(pattern) for pattern in patterns) for p in shipped)
