"""The root package's shape (issue 23): a few top-level modules, rooms, public doors only."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "tokcap"


def test_the_root_package_keeps_at_most_six_top_level_modules() -> None:
    modules = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(modules) <= 6, modules


def _private_tokcap_imports(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        names: list[str] = []
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        for name in names:
            parts = name.split(".")
            if parts[0] == "tokcap" and any(p.startswith("_") for p in parts[1:]):
                found.append(name)
    return found


def test_tests_benches_and_examples_import_only_public_tokcap_names() -> None:
    """Through the doors (`tokcap.tiny`, `tokcap.compose`, ...), never ``tokcap._x``."""
    offenders = {
        str(path.relative_to(ROOT)): names
        for folder in ("tests", "bench", "examples")
        for path in sorted((ROOT / folder).rglob("*.py"))
        if (names := _private_tokcap_imports(path))
    }
    assert offenders == {}
