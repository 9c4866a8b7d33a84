"""Import arrows of the entry points (see ARCHITECTURE.md): only `mmserve.frontend` imports
`preprocess`, so the entry points reach images only through the frontend."""

from __future__ import annotations

import ast
from pathlib import Path

import mmserve

PACKAGE = Path(mmserve.__file__).parent


def imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


def test_only_the_frontend_imports_preprocess():
    importers = {
        path.relative_to(PACKAGE).as_posix()
        for path in PACKAGE.rglob("*.py")
        if any(name == "preprocess" or name.startswith("preprocess.") for name in imported_modules(path))
    }
    assert importers, "the frontend must still import preprocess (the scan found nothing)"
    assert all(name.startswith("frontend/") for name in importers), sorted(importers)
