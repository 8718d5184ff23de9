"""The shape of the packages (issue #14): no import circles, small public doors, typed keys."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {
    "tokcap_core": ROOT / "packages/tokcap-core/src/tokcap_core",
    "tokcap_tq": ROOT / "packages/tokcap-tq/src/tokcap_tq",
    "tokcap_vllm": ROOT / "packages/tokcap-vllm/src/tokcap_vllm",
    "tokcap_ray": ROOT / "packages/tokcap-ray/src/tokcap_ray",
    "tokcap_trl": ROOT / "packages/tokcap-trl/src/tokcap_trl",
    "tokcap": ROOT / "src/tokcap",
}


def _module_name(package: str, folder: Path, path: Path) -> str:
    parts = list(path.relative_to(folder).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join([package, *parts])


def _imports(package: str, module: str, path: Path) -> set[str]:
    """Modules of ``package`` that ``module`` imports (TYPE_CHECKING imports included)."""
    is_package = path.name == "__init__.py"
    base = module.split(".") if is_package else module.split(".")[:-1]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = base[: len(base) - node.level + 1]
                target = ".".join([*anchor, *(node.module.split(".") if node.module else [])])
            else:
                target = node.module or ""
            if target.split(".")[0] != package:
                continue
            out.add(target)
            for alias in node.names:  # `from . import _x` names a module
                out.add(f"{target}.{alias.name}")
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.split(".")[0] == package)
    return out


def _graph(package: str, folder: Path) -> dict[str, set[str]]:
    modules = {_module_name(package, folder, p): p for p in folder.rglob("*.py")}
    return {m: _imports(package, m, p) & set(modules) - {m} for m, p in modules.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        state[node] = 2
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def _only_reexports(path: Path) -> bool:
    """Whether a module holds nothing but a docstring, imports and ``__all__`` (a door)."""
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue
        if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == [
            "__all__"
        ]:
            continue
        return False
    return True


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_no_import_circle_inside_a_package(package: str) -> None:
    """Among a package's modules that hold code, no module imports itself back through others.

    Doors (``__init__`` and the public submodules that only gather other modules) are left
    out: they import everything and nothing imports them back.
    """
    folder = PACKAGES[package]
    graph = _graph(package, folder)
    paths = {_module_name(package, folder, p): p for p in folder.rglob("*.py")}
    code = {m for m, p in paths.items() if p.name != "__init__.py" and not _only_reexports(p)}
    inner = {m: deps & code for m, deps in graph.items() if m in code}
    assert _cycle(inner) is None, f"import circle: {' -> '.join(_cycle(inner) or [])}"


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_a_public_module_that_only_reexports_gathers_several_modules(package: str) -> None:
    """No echo modules: a public module re-exporting one module (a private one, or a room's
    door) would be that module."""
    folder = PACKAGES[package]
    graph = _graph(package, folder)
    for path in folder.rglob("*.py"):
        module = _module_name(package, folder, path)
        if path.name.startswith("_") or not _only_reexports(path):
            continue
        assert len(graph[module]) >= 2, (module, sorted(graph[module]))


def test_the_cycle_finder_finds_a_circle() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_the_core_top_level_holds_at_most_40_documented_names() -> None:
    import tokcap_core

    assert len(tokcap_core.__all__) <= 40
    for name in tokcap_core.__all__:
        value = getattr(tokcap_core, name)
        assert (getattr(value, "__doc__", None) or "").strip(), name


@pytest.mark.parametrize(
    ("public", "private"),
    [
        ("ledger", ["_events", "_ledger", "_manifest"]),
        ("staged", ["_staged", "_staged_json"]),
        ("receipts", ["_receipt", "_verify"]),
        ("rows", ["_rows", "_reassembly", "_group"]),
        ("rpc", ["_rpc", "_policy"]),
    ],
)
def test_every_gathering_core_submodule_exports_its_private_modules(
    public: str, private: list[str]
) -> None:
    """A name added to a private module reaches users through the public module gathering it."""
    module = importlib.import_module(f"tokcap_core.{public}")
    for source in private:
        names = set(importlib.import_module(f"tokcap_core.{source}").__all__)
        assert names <= set(module.__all__), (public, sorted(names - set(module.__all__)))


def test_clearing_training_keys_from_the_staging_partition_fails_type_checking(
    tmp_path: Path,
) -> None:
    snippet = tmp_path / "mixup.py"
    snippet.write_text(
        "from tokcap_core import MemorySink, TrainingRow\n\n\n"
        "async def free(sink: MemorySink, rows: list[TrainingRow]) -> None:\n"
        "    await sink.clear([row.key for row in rows])\n",
        encoding="utf-8",
    )
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--no-incremental", str(snippet)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=False,
    )
    assert result.returncode == 1, result.stdout
    assert "TrainingKey" in result.stdout
    assert "StagingKey" in result.stdout
