"""The docs name what the tree holds: every module of the package is in how-it-works.md's file map."""

import re
from pathlib import Path

ROOT = Path(__file__).parent.parent
PACKAGE = ROOT / "dflash_mlx"


def file_map() -> set[str]:
    """Module paths (relative to dflash_mlx/) listed in the file map's code block."""
    text = (ROOT / "docs" / "how-it-works.md").read_text()
    block = text.split("## The file map", 1)[1].split("```", 2)[1]
    listed, folder = set(), None
    for line in block.splitlines():
        if m := re.match(r"^  (\w+)/\s*$", line):
            folder = m.group(1)
        elif m := re.match(r"^  (\w+\.py)\s", line):
            listed.add(m.group(1))
        elif m := re.match(r"^    (\w+\.py)\s", line):
            listed.add(f"{folder}/{m.group(1)}")
        elif not line.startswith("  "):
            folder = None  # a top-level entry (metal/, bench/, ...) ends the package's folders
    return listed


def modules() -> set[str]:
    """Every module but the subpackages' __init__.py files (the root's is listed)."""
    return {
        p.relative_to(PACKAGE).as_posix()
        for p in PACKAGE.rglob("*.py")
        if p.name != "__init__.py" or p.parent == PACKAGE
    }


def test_every_module_is_in_the_file_map():
    missing = sorted(modules() - file_map())
    assert not missing, f"add these to the file map in docs/how-it-works.md: {', '.join(missing)}"


def test_the_file_map_names_no_module_that_is_gone():
    gone = sorted(file_map() - modules())
    assert not gone, f"the file map in docs/how-it-works.md lists modules that no longer exist: {', '.join(gone)}"


def test_the_changelog_numbers_its_snapshots_below_the_package_version():
    import tomllib

    from packaging.version import Version

    package = Version(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"])
    headings = re.findall(r"^## \[([^\]]+)\]", (ROOT / "CHANGELOG.md").read_text(), flags=re.M)
    assert headings[0] == "Unreleased", "CHANGELOG.md starts with ## [Unreleased]"
    versions = [Version(h) for h in headings[1:]]
    assert versions == sorted(versions, reverse=True), "CHANGELOG.md's versions run newest first"
    assert versions[0] < package, f"CHANGELOG.md's newest version {versions[0]} is not below the package's {package}"
