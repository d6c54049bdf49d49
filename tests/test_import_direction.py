"""The package's import arrows (docs/architecture.md), checked instead of argued."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "traceproxy"

# package -> traceproxy subpackages it may import
ALLOWED = {
    "lifecycle": set(),
    "proxy": {"lifecycle", "config", "reason_phrases"},  # config: the typed, frozen settings only
    "sim": {"hostnames", "ports"},  # leaf modules of the standard library only (checked below)
    "observe": {"lifecycle", "allocator", "reason_phrases"},  # allocator: the exporter's idle heap trim
}
STDLIB_ONLY = {"lifecycle"}


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against the file's package
                parts = path.relative_to(PACKAGE).parts[:-1]
                base = list(parts[: len(parts) - node.level + 1])
                names.add(".".join(["traceproxy", *base, *(node.module.split(".") if node.module else [])]))
            else:
                names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


@pytest.mark.parametrize("module", ["hostnames.py", "allocator.py", "reason_phrases.py", "ports.py"])
def test_the_leaf_modules_import_only_the_standard_library(module):
    import sys

    for name in _imports(PACKAGE / module):
        assert name == "__future__" or name.split(".")[0] in sys.stdlib_module_names, name


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_package_imports_only_what_its_arrow_allows(package):
    for path in (PACKAGE / package).rglob("*.py"):
        for name in _imports(path):
            if name.startswith("traceproxy."):
                target = name.split(".")[1]
                assert target == package or target in ALLOWED[package], f"{path.name} imports {name}"
            elif package in STDLIB_ONLY:
                root = name.split(".")[0]
                assert root == "__future__" or root in __import__("sys").stdlib_module_names, f"{path.name}: {name}"
