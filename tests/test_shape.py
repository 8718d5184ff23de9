"""The shape of the packages (issues #14, #32): no import circle of any kind, rooms behind
their doors, small modules, small public doors, typed keys."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
import types
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


def _modules(package: str, folder: Path) -> dict[str, Path]:
    return {_module_name(package, folder, p): p for p in folder.rglob("*.py")}


def _imports(package: str, module: str, path: Path) -> list[tuple[str, list[str]]]:
    """What ``module`` imports of ``package``: (module named, names taken from it), every
    import counted (``TYPE_CHECKING`` blocks and imports inside functions included)."""
    is_package = path.name == "__init__.py"
    base = module.split(".") if is_package else module.split(".")[:-1]
    out: list[tuple[str, list[str]]] = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = base[: len(base) - node.level + 1]
                target = ".".join([*anchor, *(node.module.split(".") if node.module else [])])
            else:
                target = node.module or ""
            if target.split(".")[0] == package:
                out.append((target, [alias.name for alias in node.names]))
        elif isinstance(node, ast.Import):
            out.extend((a.name, []) for a in node.names if a.name.split(".")[0] == package)
    return out


def _inside(module: str, path: Path, package: str) -> bool:
    """Whether ``module`` (at ``path``) lies in the package ``package`` (or is its door)."""
    own = module if path.name == "__init__.py" else module.rpartition(".")[0]
    return own == package or own.startswith(package + ".")


def _graph(package: str, folder: Path) -> dict[str, set[str]]:
    """Each module's imports of its package's modules, as Python runs them.

    Doors are modules too: ``from a.b._c import x`` runs the door ``a.b`` before ``a.b._c``
    unless the importer is inside ``a.b`` already (then its door is running or has run); an
    importer inside ``a.b`` that takes a name (not a submodule) from ``a.b`` reads the door.
    """
    modules = _modules(package, folder)
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        edges: set[str] = set()
        for target, names in _imports(package, module, path):
            parts = target.split(".")
            for i in range(1, len(parts)):
                door = ".".join(parts[:i])
                if door in modules and not _inside(module, path, door):
                    edges.add(door)
            submodules = {f"{target}.{n}" for n in names} & set(modules)
            if target in modules and (
                not _inside(module, path, target) or len(submodules) < len(names)
            ):
                edges.add(target)
            edges |= submodules
        graph[module] = edges - {module}
    return graph


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
    """No module of a package imports itself back through others: doors (``__init__``)
    included, type-only (``TYPE_CHECKING``) and function-level imports included."""
    cycle = _cycle(_graph(package, PACKAGES[package]))
    assert cycle is None, f"import circle: {' -> '.join(cycle or [])}"


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


def _write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text, encoding="utf-8")
    return root / "pkg"


def test_the_graph_sees_circles_through_doors_and_type_only_imports(tmp_path: Path) -> None:
    """The circle tokcap_vllm had (``_config`` -> the planning room's door -> its renderers
    -> ``_config``, the last import type-only) is found; a room importing its own
    modules is not a circle."""
    folder = _write(
        tmp_path,
        {
            "pkg/__init__.py": "from .room import Renderer\n",
            "pkg/_config.py": "from .room import MODES\n",
            "pkg/room/__init__.py": "from ._render import MODES, Renderer\n",
            "pkg/room/_render.py": (
                "from typing import TYPE_CHECKING\n"
                "from . import _splice\n"
                "if TYPE_CHECKING:\n    from .._config import Config\n"
            ),
            "pkg/room/_splice.py": "MODES = ()\n",
        },
    )
    graph = _graph("pkg", folder)
    assert graph["pkg.room._render"] == {"pkg._config", "pkg.room._splice"}
    assert _cycle(graph) == ["pkg.room", "pkg.room._render", "pkg._config", "pkg.room"]
    (folder / "_config.py").write_text("MODES = ()\n", encoding="utf-8")
    assert _cycle(_graph("pkg", folder)) is None


def _private_reaches(package: str, folder: Path) -> dict[str, list[str]]:
    """Imports of a private module (``_x``) from outside the package holding it."""
    modules = _modules(package, folder)
    found: dict[str, list[str]] = {}
    for module, path in modules.items():
        for target, names in _imports(package, module, path):
            for named in [target, *({f"{target}.{n}" for n in names} & set(modules))]:
                parts = named.split(".")
                for i in range(1, len(parts)):
                    holder = ".".join(parts[:i])
                    if parts[i].startswith("_") and not _inside(module, path, holder):
                        found.setdefault(module, []).append(".".join(parts[: i + 1]))
                        break
    return found


def test_a_private_module_reached_from_outside_its_room_is_found(tmp_path: Path) -> None:
    folder = _write(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/_config.py": "from .room._splice import MODES\nfrom .room import Renderer\n",
            "pkg/room/__init__.py": "from ._render import Renderer\n",
            "pkg/room/_render.py": "from . import _splice\nfrom .._config import Config\n",
            "pkg/room/_splice.py": "",
        },
    )
    assert _private_reaches("pkg", folder) == {"pkg._config": ["pkg.room._splice"]}


@pytest.mark.parametrize(
    "package",
    sorted(PACKAGES),
)
def test_rooms_import_each_other_only_through_their_doors(package: str) -> None:
    """A private module is imported only from inside the package that holds it: a room's
    ``_x`` from the room (and the rooms inside it), never from another room or the top."""
    assert _private_reaches(package, PACKAGES[package]) == {}


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_every_room_has_a_door_with_all(package: str) -> None:
    """Every folder of Python modules is a package whose ``__init__`` says what it exports."""
    folder = PACKAGES[package]
    for room in sorted({p.parent for p in folder.rglob("*.py")}):
        door = room / "__init__.py"
        assert door.is_file(), room
        assert "__all__" in importlib.import_module(_module_name(package, folder, door)).__dict__


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_no_module_is_over_450_lines(package: str) -> None:
    sizes = {
        str(p.relative_to(ROOT)): n
        for p in PACKAGES[package].rglob("*.py")
        if (n := len(p.read_text(encoding="utf-8").splitlines())) > 450
    }
    assert sizes == {}


def test_the_vllm_adapter_top_level_holds_at_most_12_entries() -> None:
    """Modules and rooms, ``__init__.py`` included: a reader finds a job by its folder."""
    folder = PACKAGES["tokcap_vllm"]
    entries = sorted(
        p.name
        for p in folder.iterdir()
        if (p.suffix == ".py" and p.is_file()) or (p / "__init__.py").is_file()
    )
    assert len(entries) <= 12, entries


def test_every_vllm_adapter_door_names_documented_things() -> None:
    """Each room's door (and the top level) resolves every name of its ``__all__``, each
    with a docstring (constants aside)."""
    folder = PACKAGES["tokcap_vllm"]
    for door in sorted(folder.rglob("__init__.py")):
        module = importlib.import_module(_module_name("tokcap_vllm", folder, door))
        for name in module.__all__:
            value = getattr(module, name)
            if isinstance(value, (type, types.FunctionType)):
                assert (value.__doc__ or "").strip(), (module.__name__, name)


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
        ("receipts", ["_receipt"]),
        ("rows", ["_rows", "_reassembly"]),
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
