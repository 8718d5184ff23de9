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


def test_the_loop_room_and_the_example_trainer_do_not_import_the_demo() -> None:
    """``tokcap train`` stands on `tokcap.compose`, `tokcap.tiny` and `tokcap.train`, as a
    user's trainer does (issue 32): the demo's harness and reports are the demo's own."""

    def imports_demo(path: Path, package: str) -> bool:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom):
                module = node.module or ""
                if node.level:  # relative: resolve against ``package``
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    module = ".".join([*base, *([module] if module else [])])
                names = [module, *(f"{module}.{a.name}" for a in node.names)]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            if any(n == "tokcap.demo" or n.startswith("tokcap.demo.") for n in names):
                return True
        return False

    loop = sorted((PACKAGE / "loop").glob("*.py"))
    assert loop
    offenders = [p.name for p in loop if imports_demo(p, "tokcap.loop")]
    assert offenders == []
    assert not imports_demo(ROOT / "examples" / "custom_trainer.py", "examples")
    assert imports_demo(PACKAGE / "demo" / "_pipeline.py", "tokcap.demo")  # the check sees one
