"""Every import of this project's own modules in bench/ and checks/ resolves, those inside
functions too: those run only on a GPU machine or in a long run, where a name that moved or
was renamed is found too late (the GPU check's services part once imported a helper by an
old name)."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

OWN = ("harness", "bench", "checks", "pagedkv", "cache_service", "model_service")


def own_imports() -> list[tuple[str, str, str | None]]:
    """(file, module, name or None) for each import of an own module, at any depth."""
    found = []
    for path in sorted([*(ROOT / "bench").rglob("*.py"), *(ROOT / "checks").rglob("*.py")]):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module.split(".")[0] in OWN:
                found += [(str(path.relative_to(ROOT)), node.module, alias.name) for alias in node.names]
            elif isinstance(node, ast.Import):
                found += [(str(path.relative_to(ROOT)), alias.name, None) for alias in node.names
                          if alias.name.split(".")[0] in OWN]
    return found


def test_the_finder_sees_imports_inside_functions():
    assert ("checks/gpu_check.py", "harness.processes", "start_cache_service") in own_imports()


@pytest.mark.parametrize("where, module, name", own_imports(), ids=lambda value: str(value))
def test_own_import_resolves(where, module, name):
    imported = importlib.import_module(module)
    if name is not None and not hasattr(imported, name):
        importlib.import_module(f"{module}.{name}")  # a submodule: `from package import module`
